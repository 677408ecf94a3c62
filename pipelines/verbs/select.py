"""Table 2 with ε including the learning-rate tuning: a private selection per cell and table seed.

    python -m pipelines select [methods=prism,adamw] [eps=6,3] [suites=glue8,math10k] [seed=42,43,44]
                              [scale=embedded] [launcher=local|slurm] [jobs=K] [overrides]
    make table2-accounted SCALE=embedded SEEDS=42,43,44 JOBS=2 [METHODS=..] [EPS=6,3]

Per cell (method × suite × ε) and table seed, Papernot & Steinke's repeat-and-select (docs/PRIVACY.md,
"ε includes tuning"; the accounting is :mod:`prism.privacy.selection`), its candidates planned once per
suite × ε × seed and shared by every method:

1. **plan** (:class:`Plans`, :func:`draws`): the candidate count K
   (:func:`prism.privacy.selection.draw_candidate_count`, ``privacy.selection.mean`` and ``.shape``), then K
   rate factors uniformly from the grid of ``conf/experiment/tune.yaml``, drawn by a generator seeded from
   the cell and the seed (``privacy.noise_source=seeded``: the table is a measurement,
   :data:`~prism.privacy.selection.SEEDED_PLAN`) or from the OS CSPRNG and kept in the store's private
   :data:`PLAN_FILE` (``os``). Candidate k is an ordinary job of the shared store
   (``experiment=table2-accounted``, ``tune.lr_factor=<its factor>``, ``privacy.selection.candidate=k``,
   W&B disabled), tagged into the view ``table2-accounted-candidates``;
2. **train** the candidates not finished, as :mod:`pipelines.verbs.reproduce` does (``launcher=local``: one
   worker pool for all of them; SLURM or submitit: one Hydra multirun per candidate, one after another).
   Each trains at the selection's σ and publishes only a noised count of its correct validation rows
   (:mod:`prism.train`); rerunning skips the finished ones;
3. **select** (:meth:`Selection.published`): per cell and seed the candidate with the largest noised score
   (ties: the lowest index). Nothing but the noised scores is read; only the published one's rate and score are
   printed, and only it is logged to W&B (:func:`log_published`). No line names a candidate count or index;
4. **render**: the published runs are tagged into the view ``table2-accounted`` and rendered by
   :mod:`pipelines.tables` in Table 2's layout (private rows only), "ε includes tuning" in the Markdown
   header, the CSV (column ``tuning``) and the figure's title:
   ``<results_dir>/tables/table2-accounted.<scale>.{md,csv,tex,_privacy_utility.png}``. The realised K and
   every candidate's rate and noised score go to ``table2-accounted.<scale>.audit.{csv,md}`` beside it: not
   covered by ε (given K, the published run is a best-of-K), never to be published with the table.

No extra training run follows the selection: the published candidate's own test rows are the cell.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from pipelines.config import grids, schema
from pipelines.config.compose import compose_config, job_config
from pipelines.config.grids import Cell
from pipelines.config.validate import load_grid
from pipelines.runs import launch, store, wandb_log
from pipelines.tables import build_table, read_run_folders, to_markdown, write_outputs
from pipelines.tables.build import SELECTED, fixed_config, load_paper
from pipelines.tables.records import RunRecord
from pipelines.tables.render import TUNING_INCLUDED
from pipelines.tables.specs import SPECS, TableSpec
from prism.data import sub_seed
from prism.privacy.selection import SEEDED_PLAN, draw_candidate_count

if TYPE_CHECKING:
    from prism.privacy.noise import OsGenerator

EXPERIMENT = "table2-accounted"  # conf/experiment/table2-accounted.yaml, and the view of the published runs
CANDIDATES = f"{EXPERIMENT}-candidates"  # the view of every candidate (the yaml's `experiment`)
CANDIDATE_LOGGING = "logging=disabled"  # a candidate's W&B: none (a loser's rate and score are audit material)
PLANNED = ("experiment", "method", "privacy", "suite", "seed", "tune.lr_factor", "privacy.selection.candidate")


def tune_grid() -> list[float]:
    """The rate factors of ``conf/experiment/tune.yaml``'s sweep (``tune.lr_factor``)."""
    params = compose_config(["experiment=tune"], with_hydra=True).hydra.sweeper.params
    return grids.comma_list(str(params["tune.lr_factor"]), "tune.lr_factor", grids.NUMBERS)


PLAN_FILE = f"{EXPERIMENT}.plan.json"  # in the store: the plans drawn from the OS CSPRNG (noise_source=os)


def draws(cell: Cell, seed: int, mean: float, shape: float, grid: Sequence[float],
          rng: np.random.Generator | OsGenerator | None = None) -> list[float]:
    """The rate factor of each candidate of ``cell``'s selection at table seed ``seed``: K from
    :func:`~prism.privacy.selection.draw_candidate_count`, then K factors drawn uniformly from ``grid``, by ``rng``
    (default: one generator seeded from the suite, the ε and the seed, the same draws on every rerun). Every
    method of a suite × ε × seed gets the same draws: the same tuning budget, not only in expectation."""
    rng = rng or np.random.default_rng(sub_seed(seed, EXPERIMENT, cell.suite, cell.privacy))
    count = draw_candidate_count(rng, mean, shape)
    return [float(grid[i]) for i in rng.integers(len(grid), size=count)]


@dataclass
class Plans:
    """Every selection's rate factors (:func:`draws`) under ``cfg`` (``privacy.selection``'s law, the scale,
    ``privacy.noise_source``): seeded, recomputed from the table seed; ``os``, drawn once from the OS CSPRNG and
    kept in the store's :data:`PLAN_FILE` (audit material, never published), so that a rerun trains the same
    candidates and the audit file lists them."""

    cfg: DictConfig

    def __post_init__(self) -> None:
        self.mean, self.shape = float(self.cfg.privacy.selection.mean), float(self.cfg.privacy.selection.shape)
        self.grid, self.secret = tune_grid(), self.cfg.privacy.noise_source == "os"
        self.path = Path(str(self.cfg.results_dir)) / "runs" / PLAN_FILE

    def key(self, cell: Cell, seed: int) -> str:
        """A plan's entry in :data:`PLAN_FILE`: its suite, ε, seed, scale and K's law (one for every method)."""
        return f"{self.cfg.suite.scale}/{cell.suite}/{cell.privacy}/seed={seed}/mean={self.mean:g}/shape={self.shape:g}"

    def factors(self, cell: Cell, seed: int) -> list[float]:
        """The selection's rate factors; under ``noise_source=os`` drawn (and written to :data:`PLAN_FILE`) at
        the first call for this selection, read back at every later one."""
        if not self.secret:
            return draws(cell, seed, self.mean, self.shape, self.grid)
        kept = store.read_json(self.path) if self.path.exists() else {}
        if (key := self.key(cell, seed)) not in kept:
            from prism.privacy.noise import OsGenerator  # torch: only when a secret plan is drawn

            kept[key] = draws(cell, seed, self.mean, self.shape, self.grid, OsGenerator())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            store.write_json_atomic(self.path, kept)
        return [float(f) for f in kept[key]]


@dataclass
class Selection:
    """One cell's selection at one table seed: its candidates' rate factors and store jobs (candidate k: index k)."""

    cell: Cell
    seed: int
    factors: list[float]
    jobs: list[launch.Job]

    @property
    def name(self) -> str:
        """The selection in a progress line: its cell and seed (no candidate count, no index)."""
        return f"{self.cell.suite} {self.cell.privacy} {self.cell.method} seed {self.seed}"

    def published(self) -> launch.Job | None:
        """The candidate with the largest noised score (ties: the lowest index); None until every
        candidate finished, and for K = 0 (a Poisson K)."""
        scores = []
        for job in self.jobs:
            if store.inspect_run(job.folder).state != "finished":
                return None
            scores.append(store.read_record(job.folder).selection.score)
        return self.jobs[int(np.argmax(scores))] if scores else None


def plan(cfg: DictConfig, overrides: Sequence[str], methods: list[str], epsilons: list[float], suites: list[str],
         seeds: list[int]) -> list[Selection]:
    """Every cell's selection at every seed (``cfg``: the experiment's config, its ``privacy.selection``; the rates
    of :class:`Plans`), its candidates' jobs validated (one line naming a bad job). A candidate logs nothing to
    W&B (:data:`CANDIDATE_LOGGING`): only the published one reaches it, after the selection (:func:`log_published`)."""
    plans, selections, jobs = Plans(cfg), [], []
    trained = [o for o in overrides if o.split("=")[0].lstrip("+~").split(".")[0] != "logging"]
    for epsilon in epsilons:
        for suite in suites:
            for method in methods:
                cell = Cell(suite, f"eps{epsilon:g}", method)  # privacy.name of grids.privacy_overrides
                for seed in seeds:
                    factors = plans.factors(cell, seed)
                    selections.append(Selection(cell, seed, factors, []))
                    jobs += [[f"experiment={EXPERIMENT}", f"method={method}", *grids.privacy_overrides(epsilon),
                              f"suite={suite}", f"seed={seed}", f"tune.lr_factor={factor!r}",
                              f"privacy.selection.candidate={k}", *trained, CANDIDATE_LOGGING]
                             for k, factor in enumerate(factors)]
    planned = iter([launch.Job.of(job, c) for job, c in zip(jobs, load_grid(jobs), strict=True)])
    for s in selections:
        s.jobs = [next(planned) for _ in s.factors]
    return selections


def table_spec(cfg: DictConfig, trained: Sequence[RunRecord]) -> TableSpec:
    """Table 2's layout for the published runs (``cfg``: as in :func:`plan`); its audit of a published run's
    selection lists each candidate the plan drew with its rate factor, and, from the finished runs of ``trained``
    (the candidates' view) of the same selection, its rate and noised score (NaN where none)."""
    plans = Plans(cfg)
    runs = {(r.get("seed"), fixed_config(r, SELECTED), r.get("privacy.selection.candidate")): r
            for r in trained if r.state == "finished"}

    def candidates(record: RunRecord) -> list[dict[str, Any]]:
        cell = Cell(str(record.get("suite.name")), str(record.get("privacy.name")), str(record.get("method.name")))
        out, selection = [], (record.get("seed"), fixed_config(record, SELECTED))
        for k, factor in enumerate(plans.factors(cell, int(record.get("seed")))):
            run = runs.get((*selection, k))
            block = run.final.selection if run else None
            out.append({"candidate": k, "lr_factor": factor, "lr": run.get("method.lr") if run else math.nan,
                        "noised_score": block.score if block else math.nan})
        return out

    note = "" if plans.secret else SEEDED_PLAN
    return dataclasses.replace(SPECS["table2"], name=EXPERIMENT, candidates=candidates, dp_note=note,
                               title=f"Utility on GLUE8 and Math-10K, r=16, {TUNING_INCLUDED}"
                                     f"{f' ({note})' if note else ''} [P Tab 2]")


def render(published: Sequence[launch.Job], cfg: DictConfig) -> list[Path]:
    """Tag the ``published`` runs into the view ``table2-accounted`` and write its table (the paper's private rows
    beside it) and its audit files; returns the paths."""
    root = Path(str(cfg.results_dir)) / "runs"
    for job in published:
        store.tag(root, EXPERIMENT, job.run_hash)
    paper = load_paper("table2")
    result = build_table(table_spec(cfg, read_run_folders(root, CANDIDATES)), read_run_folders(root, EXPERIMENT),
                         str(cfg.suite.scale), paper=paper[paper["Setting"] != "Non-DP"])
    paths = write_outputs(result, root.parent / "tables")
    print(to_markdown(result))
    return paths


def log_published(cfg: DictConfig, job: launch.Job) -> bool:
    """Log the published candidate ``job`` to W&B (``cfg.logging``, the command's) from its local record, as a run
    of the view ``table2-accounted``: its config and summary without the candidate's index, under an id hashed
    from that config (the run hash, which hashes the index, stays in the store). False when nothing was logged
    (logging disabled, or already logged)."""
    public = OmegaConf.merge(job.cfg, {"experiment": EXPERIMENT, "logging": cfg.logging})
    with open_dict(public):
        del public.privacy.selection.candidate
    record = store.read_record(job.folder)
    return wandb_log.log_record(public, store.run_hash(public), record.published_json(), store.read_metrics(job.folder),
                                record)


def main(overrides: Sequence[str], *, methods: str | None = None, eps: str | None = None, suites: str | None = None,
         seed: str | None = None, jobs: int | None = None) -> int:
    """Table 2 with ε including the rate tuning: per cell and seed, train K candidates of a private selection,
    publish the best by its noised validation score, render the table. ``methods`` (default Table 2's six),
    ``eps`` (default 6,3; private budgets only), ``suites`` (default glue8,math10k) and ``seed`` (default 42)
    are comma-separated lists; ``jobs``: local worker processes; the overrides (``scale=``, ``launcher=``,
    ``privacy.selection.mean=``, ...) apply to every candidate. Exit 0, 1 (a candidate failed), 2 (bad input)."""
    launcher = launch.override_value(overrides, "launcher", "local")
    if (code := launch.launcher_error(launcher)) is not None:  # before every candidate is validated
        return code
    if fixed := [o for o in overrides if o.split("=")[0].lstrip("+~") in PLANNED]:
        raise ValueError(f"{fixed[0]}: the plan sets {', '.join(PLANNED)} per candidate; choose the cells with "
                         "methods=, eps=, suites= and seed=")
    params = compose_config([f"experiment={EXPERIMENT}"], with_hydra=True).hydra.sweeper.params
    methods_ = grids.comma_list(methods or str(params["method"]), "methods")
    suites_ = grids.comma_list(suites or str(params["suite"]), "suites")
    epsilons = grids.budgets({"eps": eps or "6,3"})
    if not all(e < float("inf") for e in epsilons):
        raise ValueError(f"eps={eps}: a private selection needs a finite ε, e.g. eps=6,3")
    cfg = schema.record(job_config([f"experiment={EXPERIMENT}", *overrides]))  # privacy.selection's ranges, before K is drawn
    seeds = grids.comma_list(seed, "seed", grids.INTEGERS) if seed else [int(cfg.seed)]
    selections = plan(cfg, overrides, methods_, epsilons, suites_, seeds)
    pending, _ = launch.split_finished(CANDIDATES, [job for s in selections for job in s.jobs])
    waiting = {job.run_hash for job in pending}
    todo = [s for s in selections if any(j.run_hash in waiting for j in s.jobs)]  # by selection: K stays unprinted
    print(f"{EXPERIMENT}, plan: {len(selections)} selections (cell x seed), {len(selections) - len(todo)} trained, "
          f"{len(todo)} to train", flush=True)
    failure, log_dir = "", Path(str(cfg.results_dir)) / "logs" / EXPERIMENT
    selection_of = {job.run_hash: s.name for s in selections for job in s.jobs}
    unit = launch.Unit("selection", lambda job: selection_of[job.run_hash], overrides=False)
    if pending and launcher == "local":
        print(f"{EXPERIMENT}, train: {len(todo)} selections on the local pool", flush=True)
        _, failure = launch.launch(EXPERIMENT, launcher, pending, jobs, overrides, log_dir, unit)
    for s in todo if launcher != "local" else []:
        print(f"{EXPERIMENT}, train: {s.name}", flush=True)
        for job in (j for j in s.jobs if j.run_hash in waiting):  # one multirun per candidate (its overrides pin it)
            submitted, failure = launch.launch(EXPERIMENT, launcher, [job], jobs, job.overrides[1:], log_dir)
            if failure and not submitted:
                break
    print(f"{EXPERIMENT}, select: the best noised validation score of each selection", flush=True)
    published = []
    for s in selections:
        job = s.published()
        if job is None:
            what = "not every candidate finished" if s.jobs else "nothing to publish (a Poisson K drew none)"
        else:
            score = store.read_record(job.folder).selection.score
            what = f"rate x{s.factors[s.jobs.index(job)]:g}, noised score {score:.2f}"
            published.append(job)
            log_published(cfg, job)
        print(f"  {s.name}: {what}")
    print(f"{EXPERIMENT}, render: the published runs (view {EXPERIMENT})", flush=True)
    for path in render(published, cfg):
        print("wrote", path)
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0
