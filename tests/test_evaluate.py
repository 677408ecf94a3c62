"""evaluate_suite end to end: a scripted model (known answers → known scores) and a tiny random Llama."""
from __future__ import annotations

import pytest
import torch
from conftest import DECODING, char_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from prism.data import Example, Suite
from prism.data.prompts import encode_prompt_as_trained, eval_prompt, response_text
from prism.evaluation.evaluate import common_prefix_length, evaluate_suite, generate_responses
from prism.evaluation.metrics import parse_glue_label
from prism.fastpath.prefix import prefix_depth
from prism.models import attach_lora, load_backbone

KEYS = {"scores", "columns", "average", "parse_failure", "n", "skipped", "samples", "seconds", "eval_rows", "suite",
        "scale", "per_example"}


def _glue_suite() -> Suite:
    def nli(task, i, label):
        return Example(task, "Task: MNLI.", f"Premise: p{i}\nHypothesis: h{i}", "", label)

    evals = {
        "mnli_matched": [nli("mnli_matched", i, i % 3) for i in range(6)],
        "mnli_mismatched": [nli("mnli_mismatched", i, i % 3) for i in range(4)],
        "tweet_sentiment": [Example("tweet_sentiment", "Task: SST-2.", f"Sentence: s{i}", "", i % 2) for i in range(5)]
        + [Example("tweet_sentiment", "Task: SST-2.", "Sentence: bad", "", 7)],  # invalid gold → skipped
    }
    columns = {"mnli_matched": "MNLI", "mnli_mismatched": "MNLI", "tweet_sentiment": "SST-2"}
    return Suite("glue8", "embedded", "glue", [], evals, False, 384, columns)


def _math_suite() -> Suite:
    evals = {
        "gsm_symbolic": [Example("gsm_symbolic", f"What is {i}+{i}?", "", "", float(2 * i)) for i in range(5)],
        "arith_choice": [Example("arith_choice", f"Pick {c}. Answer Choices: (A) 1 (B) 2", "", "", c) for c in "AB"],
    }
    return Suite("math10k", "embedded", "math", [], evals, True, 256, {"gsm_symbolic": "GSM8K", "arith_choice": "AQuA"})


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: "generates" a fixed answer chosen from the (left-padded) prompt text."""

    def __init__(self, tokenizer, answer_for) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.answer_for = tokenizer, answer_for
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls.append({"shape": tuple(input_ids.shape), "mask": attention_mask.clone(), **kwargs})
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
            rows.append(ids + self.tokenizer(self.answer_for(prompt))["input_ids"] + [self.tokenizer.eos_token_id])
        width = max(map(len, rows))
        return torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def _nli_answer(prompt: str) -> str:
    i = int(prompt.split("Premise: p")[1].split("\n")[0]) if "Premise: p" in prompt else 0
    if "Task: SST-2" in prompt:
        return ["negative", "positive", "positive", "???", "Yes"][int(prompt.split("Sentence: s")[1][0])]
    return ["entailment", "neutral", "contradiction"][i % 3] if i != 5 else "unclear"


def test_scripted_glue_scores_columns_and_failures() -> None:
    tok = char_tokenizer()
    model = ScriptedModel(tok, _nli_answer)
    model.train()
    decoding = {**DECODING, "shared_prefix": False}  # a scripted model has no KV cache
    res = evaluate_suite(model, tok, _glue_suite(), decoding, batch_size=4)
    assert set(res) == KEYS and model.training  # mode restored
    assert res["n"] == {"mnli_matched": 6, "mnli_mismatched": 4, "tweet_sentiment": 5}
    assert res["eval_rows"] == {"mnli_matched": 6, "mnli_mismatched": 4, "tweet_sentiment": 6}
    assert res["skipped"] == {"mnli_matched": 0, "mnli_mismatched": 0, "tweet_sentiment": 1}
    assert res["scores"]["mnli_matched"] == pytest.approx(5 / 6)  # "unclear" → fallback label 0 vs gold 2
    assert res["scores"]["mnli_mismatched"] == 1.0
    # SST-2 golds 0,1,0,1,0; predictions negative, positive, positive, ??? (→0), Yes (→1, failure)
    assert res["scores"]["tweet_sentiment"] == pytest.approx(2 / 5)
    assert res["parse_failure"] == {"mnli_matched": 1 / 6, "mnli_mismatched": 0.0, "tweet_sentiment": 2 / 5}
    assert res["columns"] == pytest.approx({"MNLI": (5 / 6 + 1) / 2, "SST-2": 2 / 5})
    assert res["average"] == pytest.approx(((5 / 6 + 1) / 2 + 2 / 5) / 2)
    first = model.calls[0]
    assert first["num_beams"] == 1 and first["max_new_tokens"] == 8 and first["do_sample"] is False
    assert (first["mask"][:, -1] == 1).all()  # left padding: every prompt ends at the last column


def test_scripted_math_template_and_extraction() -> None:
    tok = char_tokenizer()

    def answer(prompt: str) -> str:
        assert prompt.endswith("\n\n### Response:\n")  # un-indented Math evaluation template
        if "Pick" in prompt:
            return "A store sells it. The answer is (B)."  # gold A then B: 1 of 2 right
        i = int(prompt.split("What is ")[1].split("+")[0])
        return f"{i}+{i} is {2 * i:,}." if i != 4 else "I cannot tell."

    decoding = {**DECODING, "num_beams": 4, "max_new_tokens": 10}
    res = evaluate_suite(ScriptedModel(tok, answer), tok, _math_suite(), decoding, 2)
    assert res["scores"] == {"gsm_symbolic": pytest.approx(4 / 5), "arith_choice": 0.5}
    assert res["parse_failure"] == {"gsm_symbolic": pytest.approx(1 / 5), "arith_choice": 0.0}
    assert res["columns"] == {"GSM8K": pytest.approx(0.8), "AQuA": 0.5}
    per = res["per_example"]  # the per-row outcomes the aggregator's bootstrap resamples
    assert {t: (p["column"], sum(p["correct"]) / len(p["correct"])) for t, p in per.items()} == {
        "gsm_symbolic": ("GSM8K", pytest.approx(0.8)), "arith_choice": ("AQuA", 0.5)}
    assert len(per["gsm_symbolic"]["rows"]) == 16 and per["gsm_symbolic"]["rows"] != per["arith_choice"]["rows"]


def test_tiny_llama_end_to_end() -> None:
    tok = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    suite = _glue_suite()
    for decoding in ({**DECODING, "max_new_tokens": 4}, {**DECODING, "num_beams": 2, "max_new_tokens": 3}):
        res = evaluate_suite(model, tok, suite, decoding, batch_size=4)
        assert set(res) == KEYS and set(res["columns"]) == {"MNLI", "SST-2"}
        assert all(0.0 <= f <= 1.0 for f in res["parse_failure"].values())
    # the reported failure rate is what the rules give on the same (greedy, deterministic) responses
    examples = suite.eval["mnli_matched"]
    texts = generate_responses(model, tok, [eval_prompt(ex, "glue") for ex in examples],
                               {**DECODING, "num_beams": 2, "max_new_tokens": 3}, batch_size=3)
    assert res["samples"]["mnli_matched"] == texts[:3]
    failures = sum(not parse_glue_label("mnli", t)[1] for t in texts)
    assert res["parse_failure"]["mnli_matched"] == pytest.approx(failures / len(texts))
    assert all(len(t) <= 3 + 16 + 1 for t in texts)  # response starts after the prompt's marker


def _greedy_alone(model, tok, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """Reference: one prompt, no padding, no shared cache, plain ``generate``: (response, new tokens)."""
    ids = torch.tensor([encode_prompt_as_trained(tok, prompt)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return response_text(tok.decode(out[0], skip_special_tokens=True)), out.shape[1] - ids.shape[1]


@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-gemma"])
def test_batched_shared_prefix_greedy_equals_unbatched(backbone: str) -> None:
    """Left-padded batches behind a shared-prefix KV cache give each prompt the greedy tokens it gets
    alone, token for token (prompts of different lengths, so most rows carry padding)."""
    model, tok = load_backbone({"name": backbone}, "cpu")
    inputs = ["Sentence: ok", "Sentence: a much longer tweet, with more words in it", "Sentence: x y",
              "Sentence: twelve chars", "Sentence: !"]
    prompts = [eval_prompt(Example("t", "Task: SST-2.", text, "", 0), "glue") for text in inputs]
    prompts.append(eval_prompt(Example("t", "What is 2+2?", "", "", 4.0), "math"))  # little shared prefix
    assert common_prefix_length([encode_prompt_as_trained(tok, p) for p in prompts[:5]]) > 100
    reference = [_greedy_alone(model, tok, p, 6) for p in prompts]
    assert sum(n for _, n in reference) > 3 * len(prompts)  # the comparison covers generated tokens
    decoding = {**DECODING, "num_beams": 1, "max_new_tokens": 6, "prompt_encoding": "as_trained"}
    for batch_size in (4, 6):
        assert generate_responses(model, tok, prompts, decoding, batch_size) == [text for text, _ in reference]


def test_common_prefix_length_keeps_one_token_per_row() -> None:
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2  # a row equal to the prefix keeps its last token
    assert common_prefix_length([[7], [7]]) == 0
    assert common_prefix_length([[1, 2, 3]]) == 2


@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-gemma"])
def test_frozen_prompt_cache_generates_what_the_full_model_does(backbone: str, tmp_path, monkeypatch) -> None:
    """LoRA on the top layer only: the stored frozen-layer KV of the prompts plus the trained top layer
    give the same greedy responses as plain batched ``generate`` and as each prompt alone; the store
    is computed once and reused (another run, other LoRA weights: still equal)."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]}
    inputs = ["Sentence: ok", "Sentence: a much longer tweet, with more words in it", "Sentence: x y",
              "Sentence: twelve chars", "Sentence: !"]
    prompts = [eval_prompt(Example("t", "Task: SST-2.", text, "", 0), "glue") for text in inputs]
    prompts.append(eval_prompt(Example("t", "What is 2+2?", "", "", 4.0), "math"))
    greedy = {**DECODING, "num_beams": 1, "max_new_tokens": 6, "prompt_encoding": "as_trained"}
    for seed in (0, 1):
        model, tok = load_backbone({"name": backbone}, "cpu")
        model = attach_lora(model, lora, {"name": backbone, "lora_layers": 1}, init="peft",
                            generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5, generator=torch.Generator().manual_seed(seed))
        assert prefix_depth(model) == 1
        stored = generate_responses(model, tok, prompts, greedy, batch_size=4)
        plain = generate_responses(model, tok, prompts, {**greedy, "frozen_prefix": False, "shared_prefix": False}, 4)
        assert stored == plain == [_greedy_alone(model, tok, p, 6)[0] for p in prompts]
    assert len([p for p in (tmp_path / "prompts").iterdir() if p.is_dir()]) == 1  # one store, reused


def test_math_eval_template_reaches_the_prompts() -> None:
    """``math_eval_template=train`` evaluates Math on the training text minus the answer; the default the
    un-indented LLM-Adapters template. The scripted model answers right only on the indented template."""
    tok = char_tokenizer()
    indented = " " * 16 + "### Instruction:"

    def answer(prompt: str) -> str:
        if indented not in prompt:
            return "-1"
        return str(2 * int(prompt.split("What is ")[1].split("+")[0])) if "What is " in prompt else "(B)"

    suite = _math_suite()
    base = {**DECODING, "shared_prefix": False}
    default = evaluate_suite(ScriptedModel(tok, answer), tok, suite, base, batch_size=4)
    switched = evaluate_suite(ScriptedModel(tok, answer), tok, suite, {**base, "math_eval_template": "train"}, 4)
    assert default["scores"] == {"gsm_symbolic": 0.0, "arith_choice": 0.0}
    assert switched["scores"] == {"gsm_symbolic": 1.0, "arith_choice": 0.5}  # golds A, B; always "(B)"


def test_per_task_token_cap_reaches_generate() -> None:
    """``max_new_tokens_per_task`` caps the named task; the others keep ``max_new_tokens``."""
    tok = char_tokenizer()
    model = ScriptedModel(tok, lambda prompt: "(A)." if "Pick" in prompt else "2.")
    decoding = {**DECODING, "max_new_tokens_per_task": {"gsm_symbolic": 12},
                "shared_prefix": False}
    evaluate_suite(model, tok, _math_suite(), decoding, 8)
    assert [call["max_new_tokens"] for call in model.calls] == [12, 8]  # gsm_symbolic, then arith_choice
