"""Cross-field rules of a job config that passed its schema (the last step of :mod:`pipelines.config.validate`).

Types, choices and ranges of single fields are the schema's (:mod:`pipelines.config.schema`). What is
here needs two groups, the backbone's weights, the data or this machine; each rule raises
:class:`ConfigError` with one line, ``<what>, <how to fix>``, naming the field:
the LoRA rank against the narrowest targeted layer of the backbone (widths from
:mod:`prism.backbones`, no weights loaded; a ``backbone=local`` folder's model_type, safetensors sizes,
shards and tokenizer too), a ``suite=custom`` task's files line by line, the batch against the training-set
size, a GPU present for ``train.device=cuda``, room for the label after ``suite.cutoff_len``, paper-scale
data present, σ calibration feasible, a private selection's candidate (``privacy.selection``) scoring
validation rows of a private run, a W&B key for ``logging=online``.
Only the GPU check imports torch.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig

from pipelines.config.schema import ConfigError, positive_int, require
from prism.data.config import EmbeddedDataConfig, SuiteConfig
from prism.privacy.budget import total_steps
from prism.typed import node_of


def validate(cfg: DictConfig, *, here: bool = True) -> None:
    """Cross-field rules of a job config that passed :func:`pipelines.config.schema.conform`; raises
    :class:`ConfigError`. ``here=False``: the job runs on another machine, so the local device is not checked."""
    _results_dir(cfg)
    if here:
        _gpu(str(cfg.train.device))
    _lora_and_backbone(cfg)
    _selection(cfg)
    require(cfg.train.steps > 0 or math.isinf(float(cfg.privacy.epsilon)),
            f"train.steps=0 (the untrained reference model) releases nothing to account, run it with privacy=nondp "
            f"or set train.steps >= 1 for privacy.epsilon={cfg.privacy.epsilon}")
    n_train = _suite(cfg)
    _local_context(cfg)
    _budget(cfg, n_train, here)
    _logging(cfg.logging, here)


def _results_dir(cfg: DictConfig) -> None:
    _folder("results_dir", str(cfg.results_dir))
    if cfg.logging.mode != "disabled":  # W&B's own files go there
        _folder("logging.dir", str(cfg.logging.dir))


def _folder(key: str, value: str) -> None:
    """``key=value`` names a folder or a path still free for one (a file, or a symbolic link to nowhere or
    looping back on itself, there fails only once the run has started)."""
    path = Path(value).expanduser()
    require(bool(value) and (path.is_dir() or not (path.exists() or path.is_symlink())),
            f"{key}={value} is not a folder, point {key} at a folder")


def _gpu(device: str) -> None:
    if device.startswith("cuda"):
        import torch  # only here: a GPU check needs it

        require(torch.cuda.is_available(), f"train.device={device} but no GPU is visible, use train.device=auto or cpu")
        index = int(device.partition(":")[2] or 0)
        require(index < torch.cuda.device_count(), f"train.device={device} but only {torch.cuda.device_count()} "
                f"GPU(s) are visible, use train.device=cuda (or cuda:0)")


def _lora_and_backbone(cfg: DictConfig) -> None:
    from prism.backbones import BACKBONES, TextShape, local_problem, text_shape

    lora, backbone = cfg.lora, cfg.backbone
    linears = sorted(TextShape(1, 1, 1, 1, 1, 1).linear_shapes())
    targets = list(lora.targets)
    require(bool(targets) and len(set(targets)) == len(targets)
            and (backbone.name == "local" or set(targets) <= set(linears)),
            f"lora.targets={targets} must list distinct layer names out of {', '.join(linears)}")
    if backbone.name == "local":  # backbone=local: the folder's own layer names and widths (prism/backbones.py)
        problem = local_problem(backbone.path, targets, lora.r, backbone.lora_layers)
        require(problem is None, str(problem))
        return
    shape = text_shape(BACKBONES[backbone.name])
    if shape is None:  # a paper backbone not in the local cache: its loader checks the rank
        return
    if backbone.lora_layers is not None:
        require(backbone.lora_layers <= shape.num_hidden_layers,
                f"backbone.lora_layers={backbone.lora_layers} exceeds the {shape.num_hidden_layers} decoder "
                f"layers of {backbone.name}, use 1..{shape.num_hidden_layers} or null for all")
    widths = {name: min(shape.linear_shapes()[name]) for name in targets}
    narrowest = min(widths, key=widths.__getitem__)
    require(lora.r <= widths[narrowest],
            f"lora.r={lora.r} exceeds the width {widths[narrowest]} of {narrowest} in {backbone.name}, "
            f"use lora.r <= {widths[narrowest]} (e.g. lora=r16) or drop {narrowest} from lora.targets")


def _selection(cfg: DictConfig) -> None:
    """A selection's candidate (docs/PRIVACY.md "ε includes tuning") trains privately with the exact
    calibration, scores validation rows (embedded scale or a custom task) and publishes its test rows."""
    if cfg.privacy.get("selection") is None:
        return
    suite = cfg.suite
    require(math.isfinite(float(cfg.privacy.epsilon)), "privacy.selection needs a private run, choose privacy=eps6 "
            "or privacy=eps3 (or leave privacy.selection out)")
    require(cfg.privacy.calibration == "exact", f"privacy.selection is accounted for T steps at q = B/N, "
            f"not privacy.calibration={cfg.privacy.calibration}, use protocol=corrected")
    require(suite.scale == "embedded" or suite.name == "custom", "privacy.selection scores validation rows, built "
            "at embedded scale or for suite=custom only, use scale=embedded")
    require(suite.get("eval_split") != "validation", "privacy.selection publishes the test rows' scores, leave "
            "suite.eval_split out (or set it to test)")
    require(suite.name == "custom"  # a custom task's validation rows: suite.custom.validation_fraction
            or isinstance(suite.get("validation_per_task"), int) and suite.validation_per_task >= 1,
            f"privacy.selection scores suite.validation_per_task={suite.get('validation_per_task')} validation "
            "rows per task, set an integer >= 1, e.g. suite.validation_per_task=50")
    require(cfg.train.benchmark is None, "privacy.selection scores a trained model, set train.benchmark=null")


def _suite(cfg: DictConfig) -> int | None:
    """The suite's rules; returns the training-set size (None where only the data can tell)."""
    suite = cfg.suite
    require(suite.get("eval_split") != "validation" or suite.scale == "embedded" or suite.name == "custom",
            "suite.eval_split=validation is built at embedded scale only, use scale=embedded")
    per_task = suite.decoding.get("max_new_tokens_per_task") or {}
    if per_task and suite.scale == "embedded":
        from prism.data.embedded import EMBEDDED_TASKS

        unknown = sorted(set(per_task) - set(EMBEDDED_TASKS.get(suite.name, {})))
        require(not unknown, f"suite.decoding.max_new_tokens_per_task names {unknown}, not tasks of the embedded "
                             f"{suite.name} suite ({', '.join(EMBEDDED_TASKS.get(suite.name, {}))})")
    if suite.name == "custom":  # suite=custom: the user's files, checked line by line (prism/data/custom.py)
        from prism.backbones import token_counter
        from prism.data.custom import TaskFileError, check_task, validating

        try:
            check_task(suite.custom, cfg.train.batch_size, suite.cutoff_len, token_counter(cfg.backbone), cfg.backbone.name,
                       validating(node_of(SuiteConfig, suite), cfg.privacy.get("selection") is not None))
        except TaskFileError as err:
            raise ConfigError(str(err)) from None
        return
    n_train = {"embedded": _embedded_size, "paper": _paper_size}[suite.scale](suite.name, suite[suite.scale])
    if n_train is not None:
        require(cfg.train.batch_size <= n_train,
                f"train.batch_size={cfg.train.batch_size} exceeds the {n_train} training examples of "
                f"{suite.name} at {suite.scale} scale, lower train.batch_size to at most {n_train}")
    _label_room(cfg)
    return n_train


def _local_context(cfg: DictConfig) -> None:
    """A ``backbone=local`` model's context holds the longest sequence a run feeds it: a training
    sequence of ``suite.cutoff_len`` tokens, or an evaluation prompt (rows are checked against
    ``suite.cutoff_len`` too) and the generation cap."""
    if cfg.backbone.name != "local":
        return
    from prism.backbones import local_context

    context = local_context(cfg.backbone.path)
    decoding = cfg.suite.decoding
    generated = max([decoding.max_new_tokens, *(decoding.get("max_new_tokens_per_task") or {}).values()])
    require(context is None or cfg.suite.cutoff_len + generated <= context,
            f"suite.cutoff_len={cfg.suite.cutoff_len} plus {generated} generated tokens (suite.decoding.max_new_tokens) "
            f"exceed the {context}-token context of the model in backbone.path={cfg.backbone.path} (config.json), "
            f"lower suite.cutoff_len to at most {(context or 0) - generated}")


def _budget(cfg: DictConfig, n_train: int | None, here: bool) -> None:
    """σ calibration feasible for (ε, δ, q = B/N, T) and its accountant grid within this machine's
    memory (:func:`prism.privacy.limits.calibration_problem`; the memory only for a job run here)."""
    if n_train is None or math.isinf(float(cfg.privacy.epsilon)):
        return
    from prism.privacy.limits import calibration_problem

    steps = total_steps(cfg)
    rate = cfg.train.batch_size / n_train
    if cfg.privacy.calibration == "epochs":  # the released code's epoch-rounded question (docs/DECISIONS.md D1)
        per_epoch = math.ceil(round(1.0 / rate, 9))
        steps, rate = math.ceil(steps / per_epoch) * per_epoch, 1.0 / per_epoch
    if (selection := cfg.privacy.get("selection")) is not None:  # RDP, no accountant grid
        from prism.privacy.selection import calibrate_candidate_sigma

        try:
            calibrate_candidate_sigma(float(cfg.privacy.epsilon), float(cfg.privacy.delta), rate, steps,
                                      score_sigma=selection.score_noise, mean=selection.mean, shape=selection.shape)
        except ValueError as err:
            raise ConfigError(f"privacy.selection: {err}") from None
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if here else math.inf
    problem = calibration_problem(float(cfg.privacy.epsilon), float(cfg.privacy.delta), rate, steps, memory)
    require(problem is None, str(problem))


def _tasks(node: Mapping, key: str, valid: Mapping, where: str) -> list[str]:
    given = node.get(key)
    require(given is None or len(given) > 0, f"{where}.{key}=[] lists no task (an empty list would mean all "
            f"of them), list at least one, e.g. {where}.{key}=[{next(iter(valid))}], or give null for all")
    tasks = list(given or valid)
    unknown = [t for t in tasks if t not in valid]
    require(not unknown and len(set(tasks)) == len(tasks),
            f"{where}.{key}={tasks} must list distinct names out of {', '.join(valid)}")
    return tasks


def _embedded_size(name: str, node: Mapping) -> int:
    from prism.data.embedded import EMBEDDED_TASKS

    tasks = _tasks(node, "tasks", EMBEDDED_TASKS[name], "suite.embedded")
    typed = node_of(EmbeddedDataConfig, node)
    unscored = typed.unscored
    require(set(unscored) <= set(EMBEDDED_TASKS[name]) and not set(tasks) <= set(unscored),
            f"suite.embedded.unscored={list(unscored)} must name {name} tasks ({', '.join(EMBEDDED_TASKS[name])}) and "
            f"leave one of suite.embedded.tasks={tasks} scored, e.g. suite.embedded.unscored=[]")
    sizes = typed.train_per_task
    if isinstance(sizes, Mapping):  # task -> count; tasks it omits train on nothing
        unknown = sorted(set(sizes) - set(tasks))
        require(not unknown, f"suite.embedded.train_per_task names {unknown}, not among suite.embedded.tasks {tasks}")
        for task, count in sizes.items():
            positive_int(count, f"suite.embedded.train_per_task.{task}")
    else:
        positive_int(sizes, "suite.embedded.train_per_task")
        sizes = dict.fromkeys(tasks, sizes)
    n_eval = typed.eval_per_task
    for task in set(tasks) & set(FINITE_POOLS):
        n_task = int(sizes.get(task, 0))
        got_train, got_eval = _pool_supply(task, n_task, n_eval, typed.min_confidence)
        require(got_train >= n_task and got_eval >= n_eval,
                f"the embedded task {task} yields {got_train} train / {got_eval} eval rows, fewer than the "
                f"{n_task} / {n_eval} asked for: lower suite.embedded.train_per_task or suite.embedded.eval_per_task")
    return sum(int(sizes.get(t, 0)) for t in tasks)


FINITE_POOLS = ("tweet_sentiment",)  # embedded stand-ins drawn from a fixed corpus (the others are generated)


@functools.lru_cache(maxsize=16)
def _pool_supply(task: str, n_train: int, n_eval: int, min_confidence: float) -> tuple[int, int]:
    """(train, eval) rows the stand-in yields for this request (its own builder, no model)."""
    from prism.data.embedded import tweet_sentiment

    node = EmbeddedDataConfig(tasks=[task], train_per_task=n_train, eval_per_task=n_eval, unscored=[],
                              min_confidence=min_confidence)
    train, evals, _ = {"tweet_sentiment": tweet_sentiment}[task](n_train, n_eval, 0, node)
    return len(train), len(evals)


def _paper_size(name: str, node: Mapping) -> int | None:
    """Training-set size at paper scale (GLUE: an upper bound), after checking the data is present."""
    if name == "glue8":
        from prism.data.glue import GLUE_TASKS

        tasks = _tasks(node, "tasks", GLUE_TASKS, "suite.paper")
        for task in tasks:
            for split in ("train", *(s for _, s in GLUE_TASKS[task].eval_splits)):
                require(_glue_cached(task, split),
                        f"suite.paper.tasks: GLUE {task}/{split} is not in the local data cache, "
                        "run `make data` (needs network) or use scale=embedded")
        return len(tasks) * int(node.get("train_per_task") or 1250)
    from prism.data.math10k import LLM_ADAPTERS_URL, MATH10K_URL, MATH_TESTS, testset_location

    tests = _tasks(node, "tests", MATH_TESTS, "suite.paper")
    train_file = str(node.get("train_file") or MATH10K_URL)
    require(_present(train_file),
            f"suite.paper.train_file: math_10k.json is not at {train_file} nor in the local data cache, "
            "run `make data` (needs network), give a local path, or use scale=embedded")
    root = str(node.get("llm_adapters") or LLM_ADAPTERS_URL)
    for test in tests:
        location = testset_location(root, MATH_TESTS[test][0])
        require(_present(location),
                f"suite.paper.llm_adapters: the {test} test set is not at {location} nor in the local data "
                "cache, run `make data` (needs network), give a local checkout, or use scale=embedded")
    return node.get("train_rows")


def _present(spec: str) -> bool:
    from prism.data.math10k import cached_path, is_url

    return (cached_path(spec) if is_url(spec) else Path(spec).expanduser()).is_file()


def _glue_cached(task: str, split: str) -> bool:
    """The `make data` cache has the split, or the Hugging Face datasets cache has the task."""
    from prism.data import cache_dir

    if (cache_dir() / "glue" / task / f"{split}.jsonl").is_file():
        return True
    hf_home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", hf_home / "datasets")).expanduser()
    return (datasets_cache / "nyu-mll___glue" / task).is_dir()


def _label_room(cfg: DictConfig) -> None:
    """With a byte-level tokenizer a prompt is as many tokens as UTF-8 bytes, so when even the
    shortest possible GLUE prompt fills ``suite.cutoff_len`` every label is cut off (loss 0)."""
    from prism.backbones import BACKBONES

    suite = cfg.suite
    if suite.family != "glue" or not BACKBONES[cfg.backbone.name].byte_tokens:
        return
    from prism.data import Example
    from prism.data.embedded import EMBEDDED_TASKS
    from prism.data.glue import GLUE_TASKS
    from prism.data.prompts import train_prompt

    node = suite[suite.scale]
    if suite.scale == "embedded":
        column_of = {spec.column: spec for spec in GLUE_TASKS.values()}
        specs = [column_of[EMBEDDED_TASKS[suite.name][t][0]] for t in (node.get("tasks") or EMBEDDED_TASKS[suite.name])]
    else:
        specs = [GLUE_TASKS[t] for t in (node.get("tasks") or GLUE_TASKS)]
    shortest = min(len(train_prompt(Example("", spec.instruction, "x", "", 0), with_output=False).encode())
                   for spec in specs)
    require(shortest < suite.cutoff_len,
            f"suite.cutoff_len={suite.cutoff_len} leaves no room for the label: every {suite.name} prompt is at "
            f"least {shortest} tokens with backbone {cfg.backbone.name}'s byte tokenizer, "
            f"raise suite.cutoff_len (e.g. suite.cutoff_len=1024)")


def _logging(lg: DictConfig, here: bool) -> None:
    """``logging=online`` needs a W&B key and, for a job run here, the server within seconds
    (:func:`pipelines.config.wandb_access.access_problem`): W&B itself would retry for minutes, after the run folder."""
    if lg.mode != "online":
        return
    from pipelines.config.wandb_access import OFFLINE_FIX

    problem = _wandb_problem(here)
    require(problem is None, f"logging=online: {problem}, or {OFFLINE_FIX}")


@functools.cache
def _wandb_problem(reach: bool) -> str | None:
    """:func:`pipelines.config.wandb_access.access_problem`, asked once per process."""
    from pipelines.config.wandb_access import access_problem

    return access_problem(reach=reach)
