#!/usr/bin/env bash
# Progress of the latest successful slurm/submit.sh array of an experiment, read from the run folders.
#   slurm/status.sh <experiment> [submission dir]
# Counts the jobs of jobs.txt by their run's state (pipelines.runs.store.run_state): finished / running
# (its job holds the run's lock) / stale (started, no live holder: killed, resumes on re-submission)
# / stopped (by a signal: scancel, preemption; resumes on re-submission) / failed / corrupt / missing (no folder yet), lists the failed ones with their error, and (when
# squeue is reachable) shows the array's pending/running tasks as SLURM sees them.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: slurm/status.sh <experiment> [results/slurm/<experiment>-<time>]" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
experiment=$1
dir=${2:-}
if [[ -z $dir ]]; then  # the newest submission that sbatch accepted (it has a job_id)
  for candidate in $(ls -d "${PRISM_SLURM_DIR:-$repo/results/slurm}/$experiment"-* 2>/dev/null | sort -r); do
    if [[ -f $candidate/job_id ]]; then dir=$candidate; break; fi
  done
fi
[[ -n $dir && -f $dir/jobs.txt ]] || { echo "no submission of $experiment under results/slurm/ (run slurm/submit.sh)" >&2; exit 1; }
echo "submission: $dir"
if [[ -f $dir/job_id ]] && command -v squeue >/dev/null; then
  echo "squeue (array $(cat "$dir/job_id")):"
  squeue -h -r -j "$(cat "$dir/job_id")" -o %T 2>/dev/null | sort | uniq -c | sed 's/^/  /' || true
fi
cd "$repo"
"${PRISM_PYTHON:-$repo/.venv/bin/python}" - "$dir/jobs.txt" <<'PY'
import shlex, sys
from collections import Counter
from pipelines.runs import store
from pipelines.config.compose import job_config

counts, failed = Counter(), []
for line in open(sys.argv[1]).read().splitlines():
    if not line.strip():
        continue
    cfg = job_config(shlex.split(line))
    folder = store.find_run(store.runs_root(cfg), store.run_hash(cfg))
    info = store.inspect_run(folder)
    state = store.run_state(folder, info).replace("absent", "missing")
    counts[state] += 1
    if state in ("failed", "corrupt"):
        failed.append(f"  {state}: {folder} {(info.status or {}).get('error') or info.reason}")
print(" ".join(f"{k}={counts[k]}" for k in ("finished", "running", "stale", "stopped", "failed", "corrupt", "missing")),
      f"total={sum(counts.values())}")
if failed:
    print("\n".join(failed))
PY
