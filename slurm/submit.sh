#!/usr/bin/env bash
# Submit one experiment grid as ONE SLURM job array (no process stays behind to babysit it).
#
#   slurm/submit.sh <experiment> [hydra overrides...]      e.g. slurm/submit.sh table2 scale=paper
#
# Writes the job list (one line of shell-quoted Hydra overrides per job, from `python -m
# pipelines.grid`, finished runs left out) to results/slurm/<experiment>-<UTC time>/jobs.txt and
# runs `sbatch --array=0-(N-1)%K slurm/array.sbatch jobs.txt`. Resources come from environment
# variables; the defaults fit one Gemma-3-4B-pt job on one A100 (see slurm/README.md):
#   PRISM_SLURM_PARTITION  (cluster default)   PRISM_SLURM_ACCOUNT (none)   PRISM_SLURM_QOS (none)
#   PRISM_SLURM_GPUS=1  PRISM_SLURM_CPUS=8  PRISM_SLURM_MEM=64G  PRISM_SLURM_TIME=12:00:00
#   PRISM_SLURM_PARALLEL=16 (array tasks at once)  PRISM_SLURM_EXTRA="" (more sbatch flags)
#   PRISM_PYTHON=.venv/bin/python (the interpreter the array tasks run)
#   PRISM_SLURM_DIR=results/slurm (where submissions, job lists and logs go)
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: slurm/submit.sh <experiment: table2|table3|table4|table5> [hydra overrides...]" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
experiment=$1; shift
python=${PRISM_PYTHON:-$repo/.venv/bin/python}
command -v sbatch >/dev/null || { echo "sbatch not found: run this on a SLURM login node" >&2; exit 2; }

dir=${PRISM_SLURM_DIR:-$repo/results/slurm}/$experiment-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$dir/logs"
(cd "$repo" && "$python" -m pipelines.grid "$experiment" "$@" --pending) > "$dir/jobs.txt"
n=$(grep -c . "$dir/jobs.txt" || true)
if [[ $n -eq 0 ]]; then
  echo "nothing to submit: every run of $experiment is finished (force=true re-runs)"
  exit 0
fi

gpus=${PRISM_SLURM_GPUS:-1}
args=(--parsable --job-name="prism-$experiment" --chdir="$repo" --requeue
      --array="0-$((n - 1))%${PRISM_SLURM_PARALLEL:-16}"
      --output="$dir/logs/%A_%a.out" --open-mode=append
      --cpus-per-task="${PRISM_SLURM_CPUS:-8}" --mem="${PRISM_SLURM_MEM:-64G}"
      --time="${PRISM_SLURM_TIME:-12:00:00}" --export="ALL,PRISM_PYTHON=$python")
[[ $gpus != 0 ]] && args+=(--gres="gpu:$gpus")
[[ -n ${PRISM_SLURM_PARTITION:-} ]] && args+=(--partition="$PRISM_SLURM_PARTITION")
[[ -n ${PRISM_SLURM_ACCOUNT:-} ]] && args+=(--account="$PRISM_SLURM_ACCOUNT")
[[ -n ${PRISM_SLURM_QOS:-} ]] && args+=(--qos="$PRISM_SLURM_QOS")
# shellcheck disable=SC2206  # PRISM_SLURM_EXTRA is a list of flags on purpose
[[ -n ${PRISM_SLURM_EXTRA:-} ]] && args+=($PRISM_SLURM_EXTRA)

job_id=$(sbatch "${args[@]}" "$repo/slurm/array.sbatch" "$dir/jobs.txt")
job_id=${job_id%%;*}
echo "$job_id" > "$dir/job_id"
echo "submitted array $job_id: $n jobs of $experiment; list $dir/jobs.txt, logs $dir/logs/"
echo "progress: slurm/status.sh $experiment"
