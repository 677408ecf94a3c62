"""The typed job (docs/ARCHITECTURE.md, "Resolved config schema"): one dataclass per config group, the
object :func:`prism.train.train_and_evaluate` reads as attributes (``job.suite.embedded.eval_per_task``).

Each field carries its type, its help (``metadata["help"]``) and, in ``__post_init__``, its choices and
range; ``Optional[...]`` says where ``null`` is allowed. The *values* live in ``conf/``: a field without
a default is a key every composition has (a group yaml sets it); a field with a default is a key that
only some group options set (``suite.embedded`` at embedded scale, ``tune`` in the learning-rate sweep,
``privacy.selection`` in a private selection) and may be absent. The suite node's classes are in
:mod:`prism.data.config`; ``method`` is the method's own dataclass (:mod:`prism.methods.schema`, built by
:func:`prism.methods.registry.check`). :func:`job_of` builds a job from a resolved config or mapping;
``pipelines/config/schema.py`` registers these classes with Hydra and words their errors. No torch.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from prism.backbones import BACKBONES
from prism.data.config import SuiteConfig
from prism.methods import registry
from prism.methods.schema import MethodConfig
from prism.typed import ConfigError, choice, help_field, node_of, positive_int, require

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
PRIVACY_NAME = re.compile(r"eps(\d+(?:\.\d+)?)")
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class BackboneConfig:
    """``conf/backbone/*.yaml`` (+ ``backbone_scale/``): the frozen model LoRA is attached to."""

    name: str = help_field("key of prism.models.BACKBONES (or local: backbone.path)")
    paper_name: str = help_field("the table row the run stands for (differs from name only under backbone_scale/)")
    dtype: str = help_field("frozen weights' dtype: float32 | bfloat16 | float64")
    lora_layers: int | None = help_field("LoRA on the last K decoder layers; null: every layer")
    path: str | None = help_field("backbone=local: the model folder (save_pretrained)", None)

    def __post_init__(self) -> None:
        require(self.name in BACKBONES, f"backbone.name={self.name!r} is not a known backbone, "
                                        f"choose backbone=<one of {', '.join(BACKBONES)}>")
        choice(self.dtype, "backbone.dtype", ("float32", "bfloat16", "float64"))
        if self.lora_layers is not None:
            positive_int(self.lora_layers, "backbone.lora_layers")


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
        choice(self.calibration, "privacy.calibration", ("exact", "epochs"))
        choice(self.noise_source, "privacy.noise_source", ("seeded", "os"), " (the OS CSPRNG)")
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
    (``pipelines.config.tuned_rates.lr_source``; not hashed: ``pipelines.config.identity.NON_RESULT_KEYS``)."""

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
        choice(self.prefix_cache, "train.prefix_cache", ("auto", "off"))
        require(DEVICES.fullmatch(self.device) is not None, f"train.device={self.device!r} must be auto, cpu or cuda")
        choice(self.padding_side, "train.padding_side", ("left", "right"))
        choice(self.nondp_trainer, "train.nondp_trainer", ("shared", "hf"))


@dataclass
class ProtocolConfig:
    """``conf/protocol/*.yaml`` (D1-D12): which DP-SGD and evaluation conventions the run follows."""

    name: str = help_field("corrected | released")
    eval_batch_size: dict[str, int] | None = help_field("released: evaluation batch per suite family", None)

    def __post_init__(self) -> None:
        choice(self.name, "protocol.name", ("corrected", "released"))


@dataclass
class LoggingConfig:
    """``conf/logging/*.yaml``: W&B (pipelines/runs/wandb_log.py)."""

    mode: str = help_field("online | offline | disabled")
    project: str = help_field("W&B project")
    entity: str | None = help_field("W&B entity; null: the account's default")
    dir: str = help_field("where W&B writes")

    def __post_init__(self) -> None:
        choice(self.mode, "logging.mode", ("online", "offline", "disabled"), " (or choose logging=<one of those>)")


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
    method: Any = help_field("the optimizer: its method's dataclass (prism.methods.schema), built from the node")
    privacy: PrivacyConfig = help_field("the DP target")
    lora: LoraConfig = help_field("the adapter")
    train: TrainConfig = help_field("the loop")
    protocol: ProtocolConfig = help_field("corrected | released conventions")
    logging: LoggingConfig = help_field("W&B")
    tune: TuneConfig | None = help_field("experiment=tune and table2-accounted only", None)
    diagnostics_budgets: dict[str, DiagnosticsConfig] | None = help_field("experiment=diagnostics only", None)

    def __post_init__(self) -> None:
        if not isinstance(self.method, MethodConfig):
            self.method = registry.check(self.method)
        require(0 <= self.seed < 2**32, f"seed={self.seed!r} must be an integer in [0, 2^32)")
        require(EXPERIMENT_NAME.fullmatch(self.experiment) is not None,
                f"experiment={self.experiment!r} names a folder, use letters, digits, '.', '_' or '-'")


def job_of(cfg: JobConfig | DictConfig | Mapping[str, Any]) -> JobConfig:
    """The typed job of a resolved job config (:func:`prism.typed.node_of`; the method node through its
    dataclass); a :class:`JobConfig` is returned as it is."""
    return node_of(JobConfig, cfg)
