"""Prompt templates, tokenisation with label masking, and the padding collator.

The strings follow the paper's pipeline (LLM-Adapters Alpaca templates, docs/DECISIONS.md D31, D39) with
its odd whitespace: the training templates indent every line by 16 spaces and carry trailing spaces, the
Math evaluation template has no indentation (kept at paper scale; the embedded scale evaluates Math with
the training template, docs/DECISIONS.md D61).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from prism.data.rows import Example

IGNORE_INDEX = -100
RESPONSE_MARKER = "### Response:"

_PAD = " " * 16
TRAIN_TEMPLATE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request. \n\n"
    f"{_PAD}### Instruction:\n{_PAD}{{instruction}}\n{_PAD}\n"
    f"{_PAD}### Input:\n{_PAD}{{input}}\n{_PAD}\n"
    f"{_PAD}### Response:\n{_PAD}{{output}}"
)
TRAIN_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.  \n\n"
    f"{_PAD}### Instruction:\n{_PAD}{{instruction}}\n{_PAD}\n"
    f"{_PAD}### Response:\n{_PAD}{{output}}"
)
MATH_EVAL_TEMPLATE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def train_prompt(example: Example, with_output: bool = True) -> str:
    """Training text (docs/DECISIONS.md D39): the with-input template when `input` is non-empty, else the other."""
    output = example.output if with_output else ""
    template = TRAIN_TEMPLATE_WITH_INPUT if example.input else TRAIN_TEMPLATE_NO_INPUT
    return template.format(instruction=example.instruction, input=example.input, output=output)


MATH_EVAL_TEMPLATES = ("llm_adapters", "train")


def eval_prompt(example: Example, family: str, math_template: str = "llm_adapters") -> str:
    """Generation prompt (docs/DECISIONS.md D9, D31): GLUE reuses the training template with an empty output;
    Math uses the un-indented LLM-Adapters evaluation template (instruction only), or with
    ``math_template="train"`` (``suite.decoding.math_eval_template``, embedded scale: docs/DECISIONS.md D61)
    the training template with an empty output, as GLUE does."""
    if math_template not in MATH_EVAL_TEMPLATES:
        raise ValueError(f"suite.decoding.math_eval_template={math_template!r}: use one of {', '.join(MATH_EVAL_TEMPLATES)}")
    if family == "glue" or (family == "math" and math_template == "train"):
        return train_prompt(example, with_output=False)
    if family == "math":
        return MATH_EVAL_TEMPLATE.format(instruction=example.instruction)
    raise ValueError(f"unknown suite family {family!r}: use 'glue' or 'math'")


def encode_prompt_as_trained(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` exactly as they appear inside a training sequence ``prompt + output``.

    The templates end in whitespace and the response follows without a separator, so in training a BPE
    tokenizer (SmolLM2's) moves the last space into the first response token: ``"…Response:\n" + 16 spaces +
    "positive"`` becomes ``[…, "\n"+15 spaces, " positive"]``. The prompt alone ends in ``"\n"+16 spaces``, a
    boundary the model never saw (it answers with a fresh line). So a word is glued to the prompt as in
    training and only the tokens ending inside the prompt are kept; without that merge (SentencePiece,
    Gemma) this is the prompt's own tokenisation."""
    encoded = tokenizer(prompt + "a", return_offsets_mapping=True)
    return [tok for tok, (_, end) in zip(encoded["input_ids"], encoded["offset_mapping"]) if end <= len(prompt)]


def response_text(decoded: str) -> str:
    """The part of a decoded generation after the first ``### Response:`` (whole text if absent)."""
    _, marker, rest = decoded.partition(RESPONSE_MARKER)
    return rest if marker else decoded


def _ids(tokenizer: Any, text: str, cutoff_len: int) -> list[int]:
    return list(tokenizer(text, truncation=True, max_length=cutoff_len, padding=False)["input_ids"])


def tokenize_example(tokenizer: Any, example: Example, cutoff_len: int, train_on_inputs: bool) -> dict:
    """Tokenise one training example (docs/DECISIONS.md D39): the text truncated at `cutoff_len`, EOS appended
    when there is room, ``labels = input_ids`` with the prompt's positions at -100 unless `train_on_inputs`."""
    return _tokenize(tokenizer, example, cutoff_len, train_on_inputs)[0]


def _tokenize(tokenizer: Any, example: Example, cutoff_len: int, train_on_inputs: bool) -> tuple[dict, int]:
    """:func:`tokenize_example` and the number of response tokens that survived truncation."""
    input_ids = _ids(tokenizer, train_prompt(example), cutoff_len)
    n_prompt = len(_ids(tokenizer, train_prompt(example, with_output=False), cutoff_len))
    n_response = len(input_ids) - n_prompt
    eos = tokenizer.eos_token_id
    if eos is not None and (not input_ids or input_ids[-1] != eos) and len(input_ids) < cutoff_len:
        input_ids.append(eos)
    labels = list(input_ids)
    if not train_on_inputs:
        labels[:n_prompt] = [IGNORE_INDEX] * min(n_prompt, len(labels))
    return {"input_ids": input_ids, "labels": labels}, n_response


class TruncatedLabelError(ValueError):
    """Training examples whose response was cut off entirely by ``suite.cutoff_len``."""


def tokenize_train_set(tokenizer: Any, examples: Sequence[Example], cutoff_len: int, train_on_inputs: bool,
                       backbone: str) -> list[dict]:
    """:func:`tokenize_example` for every training example, refusing examples truncated before their
    label: their prompt alone fills ``cutoff_len``, so (without ``train_on_inputs``) every label is
    -100 and the example trains on nothing; if all are, the loss is a silent 0."""
    features, cut = [], []
    for example in examples:
        feature, n_response = _tokenize(tokenizer, example, cutoff_len, train_on_inputs)
        features.append(feature)
        if n_response <= 0:
            cut.append(example)
    if cut:
        needed = max(len(tokenizer(train_prompt(ex))["input_ids"]) + 1 for ex in cut)  # + EOS
        raise TruncatedLabelError(
            f"suite.cutoff_len={cutoff_len} cuts off the whole label of {len(cut)} of {len(features)} "
            f"training examples with backbone {backbone}'s tokenizer, so they would train on nothing; "
            f"raise suite.cutoff_len to at least {needed} (or pick a backbone whose tokenizer needs fewer tokens)")
    return features


def collate(
    features: Sequence[dict],
    pad_id: int,
    pad_to_multiple_of: int | None = 8,
    padding_side: str = "right",
) -> dict[str, torch.Tensor]:
    """Pad a list of ``{input_ids, labels}`` to a common length (rounded up to `pad_to_multiple_of`):
    inputs with `pad_id`, labels with -100, attention mask 0 on padding."""
    import torch  # here only: config validation reads the templates above without loading torch

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not features:
        raise ValueError("collate needs at least one feature")
    length = max(len(f["input_ids"]) for f in features)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        ids = list(f["input_ids"])
        rows = (ids, [1] * len(ids), list(f.get("labels", ids)))
        for key, row, fill in zip(out, rows, (pad_id, 0, IGNORE_INDEX)):
            pad = [fill] * (length - len(ids))
            out[key].append(pad + row if padding_side == "left" else row + pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
