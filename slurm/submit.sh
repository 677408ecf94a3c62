#!/usr/bin/env bash
# Submit one experiment grid as ONE SLURM job array (no process stays behind to babysit it).
#
#   slurm/submit.sh [--dry-run] <experiment> [hydra overrides...]   e.g. slurm/submit.sh table2 scale=paper
#
# Writes the job list (one line of shell-quoted Hydra overrides per job, from `python -m
# pipelines grid`, finished runs left out — also those another table's grid already trained, the
# run store is shared) to results/slurm/<experiment>-<UTC time>/jobs.txt and runs
# `sbatch --array=0-(N-1)%K slurm/array.sbatch jobs.txt`. `--dry-run` prints the job list and the
# sbatch command and writes nothing. A failed sbatch (dead controller, bad partition, ...) prints
# "0 of N submitted: <reason>", exits 1 and removes the submission folder it had just created, so
# slurm/status.sh keeps showing the latest successful submission.
# Resources come from environment variables; the defaults fit one Gemma-3-4B-pt job on one A100
# (see slurm/README.md):
#   PRISM_SLURM_PARTITION  (cluster default)   PRISM_SLURM_ACCOUNT (none)   PRISM_SLURM_QOS (none)
#   PRISM_SLURM_GPUS=1  PRISM_SLURM_CPUS=8  PRISM_SLURM_MEM=64G  PRISM_SLURM_TIME=12:00:00
#   PRISM_SLURM_PARALLEL=16 (array tasks at once)  PRISM_SLURM_EXTRA="" (more sbatch flags)
#   PRISM_PYTHON=.venv/bin/python (the interpreter the array tasks run)
#   PRISM_SLURM_DIR=results/slurm (where submissions, job lists and logs go)
set -euo pipefail

dry_run=0
if [[ ${1:-} == --dry-run ]]; then dry_run=1; shift; fi
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: slurm/submit.sh [--dry-run] <experiment: table2|table3|table4|table5|compare> [hydra overrides...]" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
experiment=$1; shift
python=${PRISM_PYTHON:-$repo/.venv/bin/python}
if [[ $dry_run == 0 ]] && ! command -v sbatch >/dev/null; then
  echo "0 of ? submitted: sbatch not found, run this on a SLURM login node (or --dry-run to preview)" >&2
  exit 2
fi

list=$(mktemp)
errors=$(mktemp)
trap 'rm -f "$list" "$errors"' EXIT
# every job validated as `python -m pipelines run` does before anything is submitted (the first bad one: one line, exit 2)
(cd "$repo" && "$python" -m pipelines grid "experiment=$experiment" "$@" --pending --remote) > "$list" || exit 2
n=$(grep -c . "$list" || true)
if [[ $n -eq 0 ]]; then
  echo "nothing to submit: every run of $experiment is finished (force=true re-runs)"
  exit 0
fi

dir=${PRISM_SLURM_DIR:-$repo/results/slurm}/$experiment-$(date -u +%Y%m%dT%H%M%SZ)
base=$dir; k=1
while [[ -e $dir ]]; do dir=$base-$k; k=$((k + 1)); done  # never reuse (and never remove) another submission's folder
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

if [[ $dry_run == 1 ]]; then
  echo "dry run: $n jobs of $experiment would be submitted (nothing written):"
  sed 's/^/  /' "$list"
  echo "sbatch ${args[*]} $repo/slurm/array.sbatch $dir/jobs.txt"
  exit 0
fi

mkdir -p "$dir/logs"
cp "$list" "$dir/jobs.txt"
if ! out=$(sbatch "${args[@]}" "$repo/slurm/array.sbatch" "$dir/jobs.txt" 2>"$errors") \
    || [[ ! ${out%%;*} =~ ^[0-9]+$ ]]; then
  rm -rf "$dir"  # only what this call created: the list and an empty logs/ folder
  reason=$(grep . "$errors" | tail -n 1 || true)
  if grep -qi "configuration source\|slurm.conf\|SLURM_CONF" "$errors"; then  # installed, not configured
    reason="$reason; SLURM has no configuration here: set SLURM_CONF=/path/to/slurm.conf (ask your cluster admin) or run on a login node"
  fi
  echo "0 of $n submitted: ${reason:-sbatch printed no job id (got: ${out:-nothing})}" >&2
  exit 1
fi
cat "$errors" >&2  # sbatch's warnings, if any, on a successful submission
job_id=${out%%;*}
echo "$job_id" > "$dir/job_id"
echo "submitted array $job_id: $n jobs of $experiment; list $dir/jobs.txt, logs $dir/logs/"
echo "progress: slurm/status.sh $experiment"
