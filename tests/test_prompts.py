"""Prompt strings (docs/DECISIONS.md D31, D39), label masking and the collator, with an in-test character tokenizer."""
from __future__ import annotations

import pytest
import torch
from conftest import char_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from prism.data import Example
from prism.data.prompts import (
    IGNORE_INDEX,
    TruncatedLabelError,
    collate,
    eval_prompt,
    response_text,
    tokenize_example,
    tokenize_train_set,
    train_prompt,
)

# The released code's literal strings (docs/DECISIONS.md D31, D39), written out independently of prism.data.prompts.
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request. \n\n                ### Instruction:\n                {instruction}"
    "\n                \n                ### Input:\n                {input}\n                \n                "
    "### Response:\n                {output}"
)
NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.  "
    "\n\n                ### Instruction:\n                {instruction}\n                \n                "
    "### Response:\n                {output}"
)
MATH_EVAL = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

GLUE_EX = Example("rte", "Decide.", "Premise: a\nHypothesis: b", "not_entailment", 1)
MATH_EX = Example("gsm8k", "What is 2+3?", "", "The answer is 5.", 5.0)


def test_training_templates_exact() -> None:
    assert train_prompt(GLUE_EX) == WITH_INPUT.format(instruction="Decide.", input=GLUE_EX.input, output="not_entailment")
    assert train_prompt(MATH_EX) == NO_INPUT.format(instruction="What is 2+3?", output="The answer is 5.")
    assert train_prompt(GLUE_EX, with_output=False).endswith("### Response:\n" + " " * 16)


def test_eval_templates_exact() -> None:
    assert eval_prompt(MATH_EX, "math") == MATH_EVAL.format(instruction="What is 2+3?")
    assert eval_prompt(GLUE_EX, "glue") == WITH_INPUT.format(instruction="Decide.", input=GLUE_EX.input, output="")
    with pytest.raises(ValueError, match="glue"):
        eval_prompt(MATH_EX, "vision")


def test_math_eval_template_switch() -> None:
    """``math_template="train"``: the training text minus the answer (the text itself is the answer's
    prefix), for Math only; the default stays the un-indented LLM-Adapters evaluation template."""
    switched = eval_prompt(MATH_EX, "math", "train")
    assert train_prompt(MATH_EX) == switched + MATH_EX.output
    assert switched == NO_INPUT.format(instruction="What is 2+3?", output="")
    assert eval_prompt(MATH_EX, "math") == eval_prompt(MATH_EX, "math", "llm_adapters") != switched
    assert eval_prompt(GLUE_EX, "glue", "train") == eval_prompt(GLUE_EX, "glue")
    with pytest.raises(ValueError, match="math_eval_template"):
        eval_prompt(MATH_EX, "math", "indented")


def test_response_text_splits_at_first_marker() -> None:
    assert response_text("prompt ### Response:\n positive ### Response: x") == "\n positive ### Response: x"
    assert response_text("no marker") == "no marker"


def test_masking_only_response_carries_loss() -> None:
    tok = char_tokenizer()
    feat = tokenize_example(tok, GLUE_EX, cutoff_len=1024, train_on_inputs=False)
    full = train_prompt(GLUE_EX)
    assert feat["input_ids"] == [*tok(full)["input_ids"], tok.eos_token_id]
    supervised = [t for t in feat["labels"] if t != IGNORE_INDEX]
    # one token per character: exactly the output characters plus EOS carry loss, at the end
    assert len(supervised) == len("not_entailment") + 1
    assert tok.decode(supervised, skip_special_tokens=True) == "not_entailment"
    assert feat["labels"][-len(supervised):] == feat["input_ids"][-len(supervised):]
    both = tokenize_example(tok, GLUE_EX, cutoff_len=1024, train_on_inputs=True)
    assert both["labels"] == both["input_ids"] == feat["input_ids"]


def test_truncation_and_eos_rule() -> None:
    tok = char_tokenizer()
    n = len(train_prompt(MATH_EX))
    cut = tokenize_example(tok, MATH_EX, cutoff_len=40, train_on_inputs=True)
    assert len(cut["input_ids"]) == 40 and cut["input_ids"][-1] != tok.eos_token_id
    exact = tokenize_example(tok, MATH_EX, cutoff_len=n, train_on_inputs=True)  # no room left for EOS
    assert len(exact["input_ids"]) == n and exact["input_ids"][-1] != tok.eos_token_id
    roomy = tokenize_example(tok, MATH_EX, cutoff_len=n + 1, train_on_inputs=True)
    assert roomy["input_ids"][-1] == tok.eos_token_id and len(roomy["input_ids"]) == n + 1
    masked = tokenize_example(tok, GLUE_EX, cutoff_len=30, train_on_inputs=False)  # all prompt: no loss
    assert all(t == IGNORE_INDEX for t in masked["labels"])


@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_training_set_truncated_before_its_label_is_an_error(train_on_inputs: bool) -> None:
    """One token per character: the label survives iff the cutoff exceeds the prompt's length."""
    tok = char_tokenizer()
    prompt = len(train_prompt(GLUE_EX, with_output=False))
    kept = tokenize_train_set(tok, [GLUE_EX, MATH_EX], prompt + 1, train_on_inputs, "char")
    assert kept[0]["labels"][prompt:] == tok("n")["input_ids"]  # the first character of "not_entailment"
    with pytest.raises(TruncatedLabelError) as err:
        tokenize_train_set(tok, [MATH_EX, GLUE_EX], prompt, train_on_inputs, "char")
    message = str(err.value)
    assert "\n" not in message and f"suite.cutoff_len={prompt}" in message and "1 of 2" in message
    assert f"at least {len(train_prompt(GLUE_EX)) + 1}" in message and "char" in message


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_pads_to_multiple(side: str) -> None:
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": list(range(10, 20)), "labels": list(range(10, 20))}]
    out = collate(feats, pad_id=0, pad_to_multiple_of=8, padding_side=side)
    assert out["input_ids"].shape == (2, 16) and out["input_ids"].dtype == torch.long
    pad = [0] * 13
    exp_ids = [5, 6, 7] + pad if side == "right" else pad + [5, 6, 7]
    exp_lab = [-100, 6, 7] + [-100] * 13 if side == "right" else [-100] * 13 + [-100, 6, 7]
    exp_mask = [1] * 3 + [0] * 13 if side == "right" else [0] * 13 + [1] * 3
    assert out["input_ids"][0].tolist() == exp_ids
    assert out["labels"][0].tolist() == exp_lab
    assert out["attention_mask"][0].tolist() == exp_mask
    assert out["attention_mask"][1].sum() == 10
    with pytest.raises(ValueError, match="padding_side"):
        collate(feats, 0, padding_side="middle")


@pytest.mark.parametrize("output", ["positive", "not_entailment", "The answer is 42."])
def test_prompt_as_trained_is_the_prefix_the_model_saw_in_training(output: str) -> None:
    """The eval prompt's tokens equal the masked prefix of the training sequence (BPE space merge)."""
    from tokenizers import trainers

    from prism.data.prompts import encode_prompt_as_trained

    ex = Example("sst2", "Classify.", "Sentence: fine", output, 1)
    # a GPT-2 style byte-level BPE trained on the template, so whitespace runs and " word" merge
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([train_prompt(ex)] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    prompt = train_prompt(ex, with_output=False)
    trained = tok(train_prompt(ex))["input_ids"]
    as_trained = encode_prompt_as_trained(tok, prompt)
    assert trained[: len(as_trained)] == as_trained
    assert tok.decode(trained[len(as_trained):]).strip() == output  # the rest is the response
    # the plain text encoding ends on a whitespace token that training never produced
    assert tok(prompt)["input_ids"] != as_trained
