"""protocol=released, item by item, against independent expectations (docs/DECISIONS.md D1–D12).

Each test names the preset item it checks; the tiny models are random 2-layer float64 LMs.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import dp_accounting
import pytest
import torch
from conftest import DECODING, TARGETS, tiny_cfg
from omegaconf import OmegaConf
from opacus import GradSampleModule
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from pipelines.config.compose import job_config
from prism import train as T
from prism.audit.diagnostics import sample_tangent_noise
from prism.data.prompts import collate
from prism.evaluation.metrics import extract_choice, score_outputs
from prism.mechanism import geometry
from prism.methods import build_method
from prism.methods.base import PrivacySpec
from prism.methods.hf_baseline import HFRecipe, HFTrainerBaseline, holdout_split, linear_warmup_factor
from prism.methods.schema import PrismConfig
from prism.privacy import (
    PerExampleGradients,
    calibration_rate,
    calibration_steps,
    epsilon_spent,
    per_example_loss,
)
from prism.privacy.per_example import released_weights
from prism.privacy.protocol import ITEMS, NOT_DP_AS_STATED, protocol_record
from prism.privacy.sampling import noise_denominator

REPO = Path(__file__).resolve().parents[1]

VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")


def tiny_lora_llama() -> nn.Module:
    model = LlamaForCausalLM(LlamaConfig(**TINY)).double()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def features(lengths: list[int], prompts: list[int]) -> list[dict[str, list[int]]]:
    """Unpadded training rows: ``lengths[i]`` tokens, the first ``prompts[i]`` unsupervised."""
    out = []
    for n, p in zip(lengths, prompts):
        ids = torch.randint(1, VOCAB, (n,)).tolist()
        out.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return out


def pld_epsilon(sigma: float, q: float, steps: int, delta: float = 1e-5) -> float:
    """ε from dp-accounting's PLD accountant (an implementation independent of Opacus' PRV)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


# ----------------------------------------------------------------------------- presets
def test_presets_set_every_item_and_each_stays_overridable() -> None:
    corrected, released = job_config([]), job_config(["protocol=released"])
    assert corrected.protocol.name == "corrected" and released.protocol.name == "released"
    expected = {"calibration": "epochs", "denominator": "realised", "per_example_scale": "released",
                "noise_damping": 1e-8, "pinv_rcond": 1e-6, "init_svd": "randomized", "nondp_trainer": "hf",
                "padding_side": "left", "prompt_encoding": "text",
                "eval_batch_size": 128, "renormalize_logits": True, "remove_invalid_values": True,
                "choice_regex": "released"}
    assert protocol_record(released, tangent=True)["items"] == expected
    assert job_config(["protocol=released", "suite=math10k"]).train.eval_batch_size == 64
    assert protocol_record(corrected, tangent=True)["items"] == {
        "calibration": "exact", "denominator": "expected", "per_example_scale": "record", "noise_damping": None,
        "pinv_rcond": None, "init_svd": "auto", "nondp_trainer": "shared",
        "padding_side": "right", "prompt_encoding": "as_trained",
        "eval_batch_size": OmegaConf.load(REPO / "conf" / "scale" / "embedded.yaml").train.eval_batch_size,
        "renormalize_logits": False, "remove_invalid_values": False, "choice_regex": "lookaround"}
    # every item overridden by its own key: all back to the corrected values
    back = protocol_record(corrected, tangent=True)["items"]
    cfg = job_config(["protocol=released", *(f"{key}={'null' if back[item] is None else back[item]}"
                                             for item, key in ITEMS.items())])
    assert protocol_record(cfg, tangent=True)["items"] == back and cfg.protocol.name == "released"


def test_dp_status_is_recorded() -> None:
    assert protocol_record(job_config([]), tangent=True)["dp_guarantee"] == "(ε, δ)-DP as accounted"
    released = protocol_record(job_config(["protocol=released"]), tangent=True)
    assert released["dp_guarantee"] == NOT_DP_AS_STATED and len(released["dp_caveats"]) == 3
    assert protocol_record(job_config(["protocol=released", "privacy=nondp"]), tangent=True)["dp_guarantee"] == "non-private"
    only_calibration = job_config(["protocol=released", "privacy.per_example_scale=record",
                                   "privacy.denominator=expected", "method.noise_damping=null"])
    assert protocol_record(only_calibration, tangent=True)["dp_guarantee"] == "(ε, δ)-DP as accounted"


def test_wandb_summary_keeps_the_not_dp_flag() -> None:
    """The W&B summary gets the DP status strings of final.json (numbers-only summaries dropped them)."""
    from types import SimpleNamespace

    from pipelines.runs.wandb_log import WandbRun

    final = {"columns": {"SST-2": 0.5}, "epsilon_spent": 6.0,
             "protocol": {"name": "released", "dp_guarantee": "not a valid DP guarantee as stated",
                          "dp_caveats": ["denominator=realised: …", "noise_damping=1e-08: …"]}}
    written: dict = {}
    run = WandbRun.__new__(WandbRun)
    run.run, run.deferred = SimpleNamespace(summary=SimpleNamespace(update=written.update), finish=lambda exit_code: None), False
    run.finish(final)
    assert written["protocol/dp_guarantee"] == "not a valid DP guarantee as stated"
    assert "denominator=realised" in written["protocol/dp_caveats"] and written["epsilon_spent"] == 6.0


# ----------------------------------------------------------------------------- D1 calibration
def test_epoch_calibration_schedule() -> None:
    """N = 100, B = 40: L = ⌈2.5⌉ = 3 batches per epoch, so T = 4 is calibrated as 6 steps at q = 1/3
    (σ itself is checked against an independent accountant in the end-to-end test)."""
    assert calibration_rate(0.4, "epochs") == pytest.approx(1 / 3) and calibration_steps(4, 0.4, "epochs") == 6
    assert calibration_rate(64 / 9919, "epochs") == pytest.approx(1 / 155)  # Math-10K: 155 batches per epoch
    assert (calibration_rate(0.4, "exact"), calibration_steps(4, 0.4, "exact")) == (0.4, 4)
    assert job_config(["protocol=released"]).privacy.calibration == "epochs"


# ----------------------------------------------------------------------------- D2 denominator
def test_denominator_rule() -> None:
    assert noise_denominator("expected", 5, 8) == 8
    assert noise_denominator("realised", 5, 8) == 5
    assert noise_denominator("realised", 0, 8) == 8  # empty batch: the noise-only step of B
    with pytest.raises(ValueError, match="privacy.denominator"):
        noise_denominator("actual", 5, 8)


def test_realised_denominator_scales_the_privatised_gradient_by_the_ratio() -> None:
    params = {"m.lora_A.default.weight": nn.Parameter(torch.randn(3, 6, dtype=torch.float64)),
              "m.lora_B.default.weight": nn.Parameter(torch.randn(5, 3, dtype=torch.float64))}
    cfg = job_config(["method=adamw"]).method
    method = build_method(cfg, params, PrivacySpec(sigma=0.7, clip_norm=1.0))
    method.accumulate({n: torch.randn(5, *p.shape, dtype=torch.float64) for n, p in params.items()})
    realised, expected = noise_denominator("realised", 5, 8), noise_denominator("expected", 5, 8)
    a, _ = method.privatize(realised, torch.Generator().manual_seed(3))
    b, _ = method.privatize(expected, torch.Generator().manual_seed(3))
    for name in params:
        torch.testing.assert_close(a[name], b[name] * 8 / 5, rtol=1e-12, atol=0)


def test_loop_divides_by_the_realised_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_cfg("protocol=released", "method=adamw", "privacy=eps6", "train.prefix_cache=off")
    monkeypatch.setattr(T, "calibrate_for_run", lambda *args, **kwargs: 0.9)  # σ is not under test here
    s = T.build(cfg)
    seen: list[float] = []
    original = s.method.step
    monkeypatch.setattr(s.method, "step", lambda denominator, generator, *rest: seen.append(denominator)
                        or original(denominator, generator, *rest))
    monkeypatch.setattr(s.sampler, "sample", lambda: torch.tensor([1, 4, 6]))
    T.train_step(s, cfg)
    expected = cfg.copy()
    expected.privacy.denominator = "expected"
    T.train_step(s, expected)
    assert seen == [3.0, 8.0]


# ----------------------------------------------------------------------------- D4 damping, D5 pinv
def _pair(kappa: float) -> tuple[Tensor, Tensor]:
    """A [9, 3], B [7, 3] in float64 with singular values of B spread to condition number ``kappa``."""
    rotation = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64)).Q
    A = torch.linalg.qr(torch.randn(9, 3, dtype=torch.float64)).Q @ torch.diag(torch.tensor([2.0, 1.0, 0.5]).double())
    A = A @ rotation
    QB = torch.linalg.qr(torch.randn(7, 3, dtype=torch.float64)).Q
    B = QB @ torch.diag(torch.tensor([1.0, kappa ** -0.5, 1 / kappa]).double())
    return A, B


def _whitening(XiB: Tensor, OmegaB: Tensor) -> Tensor:
    """``W`` with ``Ξ_B = Ω_B W`` (Ω_B has full column rank)."""
    return torch.linalg.lstsq(OmegaB, XiB).solution


def test_noise_damping_shrinks_the_covariance_by_the_damping() -> None:
    A, B = _pair(10.0)
    M = A.mT @ A
    draws = {}
    for damping in (None, 0.0, 1e-8):
        g = torch.Generator().manual_seed(11)
        draws[damping] = sample_tangent_noise(A, B, generator=g, damping=damping)
    g = torch.Generator().manual_seed(11)
    torch.randn((9, 3), generator=g, dtype=torch.float64)
    OmegaB = torch.randn((7, 3), generator=g, dtype=torch.float64)
    cov = {d: (lambda W: W.mT @ W)(_whitening(draws[d][1], OmegaB)) for d in draws}
    eye = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(cov[None], torch.linalg.inv(M), rtol=1e-10, atol=1e-12)  # exact law
    torch.testing.assert_close(cov[0.0], torch.linalg.inv(M), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cov[1e-8], torch.linalg.inv(M + 1e-8 * eye), rtol=1e-10, atol=1e-14)
    # first order: (M + δI)^-1 = M^-1 − δ M^-2 + O(δ²), a ~1e-8 relative change
    shrink = cov[0.0] - cov[1e-8]
    torch.testing.assert_close(shrink, 1e-8 * torch.linalg.inv(M @ M), rtol=1e-4, atol=1e-13)
    assert 1e-9 < (shrink.norm() / cov[0.0].norm()).item() < 1e-7


def test_pinv_rcond_lift_matches_numpy_pinv_and_cuts_near_null_directions() -> None:
    gA, gB = torch.randn(4, 9, 3, dtype=torch.float64), torch.randn(4, 7, 3, dtype=torch.float64)
    for kappa, cut in ((10.0, False), (1e4, True)):  # κ(N) = κ(B)² = 1e2 | 1e8 > 1/rcond
        A, B = _pair(kappa)
        N, M = B.mT @ B, A.mT @ A
        QA, QB = torch.linalg.qr(A).Q, torch.linalg.qr(B).Q
        YA = gA @ torch.linalg.pinv(N, rtol=1e-6, hermitian=True)
        YB = gB @ torch.linalg.pinv(M, rtol=1e-6, hermitian=True)
        expect = (YA - 0.5 * QA @ QA.mT @ YA, YB - 0.5 * QB @ QB.mT @ YB)
        got = geometry.lift(A, B, gA, gB, rcond=1e-6)
        for x, y in zip(got, expect):
            torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9)
        exact = geometry.lift(A, B, gA, gB)
        assert torch.allclose(got[0], exact[0], rtol=1e-6, atol=1e-9) != cut


def test_prism_method_reads_the_released_geometry_keys() -> None:
    cfg = PrismConfig.from_node(job_config(["protocol=released"]).method)
    assert (cfg.noise_damping, cfg.pinv_rcond) == (1e-8, 1e-6)
    cfg = PrismConfig.from_node(job_config([]).method)
    assert (cfg.noise_damping, cfg.pinv_rcond) == (None, None)


# ----------------------------------------------------------------------------- D6 spectral-init SVD
def test_randomized_init_svd_is_near_optimal_and_used_below_the_exact_size() -> None:
    """A 200×120 matrix (below the exact-SVD size) with a decaying spectrum: ``randomized`` takes
    the range finder (not bit-equal to the exact SVD) and its rank-8 error is within 1 % of the
    Eckart–Young optimum ``(Σ_{j>8} s_j²)^{1/2}``."""
    from prism.models.spectral import top_r_svd

    U = torch.linalg.qr(torch.randn(200, 120)).Q
    V = torch.linalg.qr(torch.randn(120, 120)).Q
    s = 0.8 ** torch.arange(120.0)
    W = (U * s) @ V.T
    optimum = s[8:].square().sum().sqrt()
    exact, randomized = (top_r_svd(W, 8, torch.Generator().manual_seed(0), mode) for mode in ("auto", "randomized"))
    for Uk, Sk, Vk in (exact, randomized):
        assert torch.linalg.norm(W - (Uk * Sk) @ Vk.T) <= optimum * 1.01
    assert not torch.equal(exact[1], randomized[1])
    torch.testing.assert_close(randomized[1], s[:8], rtol=1e-3, atol=0)


# ----------------------------------------------------------------------------- D7 non-private baselines
def test_schedule_is_hf_linear_warmup() -> None:
    """Against transformers' own scheduler: its multiplier after ``t`` scheduler steps."""
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=7, num_training_steps=30)
    for t in range(31):
        assert linear_warmup_factor(t, 7, 30) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12), t
        opt.step()
        sched.step()


def _baseline(recipe: HFRecipe, losses: list[float]) -> tuple[HFTrainerBaseline, dict[str, nn.Parameter]]:
    params = {"m.lora_A.default.weight": nn.Parameter(torch.randn(3, 6, dtype=torch.float64)),
              "m.lora_B.default.weight": nn.Parameter(torch.randn(5, 3, dtype=torch.float64))}
    inner = build_method(job_config(["method=adamw"]).method, params, None)
    return HFTrainerBaseline(inner, recipe, lambda: losses.pop(0)), params


def test_hf_recipe_step_matches_torch_clip_and_adamw() -> None:
    recipe = HFRecipe(total_steps=10, warmup_steps=4, eval_every=100, holdout=1, max_grad_norm=1.0, weight_decay=0.0)
    method, params = _baseline(recipe, [])
    twin = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    reference = torch.optim.AdamW(list(twin.values()), lr=2e-4 * 10.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    lr = job_config(["method=adamw"]).method.lr
    for step in range(1, 4):
        grads = {n: 5.0 * torch.randn_like(p) for n, p in params.items()}  # micro-batch sums of 8 examples
        method.zero_accumulators()
        method.accumulate(grads)
        method.step(8.0, None)
        for n, p in twin.items():
            p.grad = grads[n] / 8.0
        assert torch.nn.utils.clip_grad_norm_(list(twin.values()), 1.0) > 1.0  # the clip is active
        reference.param_groups[0]["lr"] = lr * step / 4
        reference.step()
        for n, p in params.items():
            torch.testing.assert_close(p.detach(), twin[n].detach(), rtol=1e-12, atol=1e-15)


def test_hf_recipe_restores_the_best_holdout_checkpoint() -> None:
    recipe = HFRecipe(total_steps=6, warmup_steps=0, eval_every=2, holdout=1, max_grad_norm=0.0, weight_decay=0.0)
    method, params = _baseline(recipe, [3.0, 1.0, 2.0])
    snapshots = {}
    for step in range(1, 7):
        method.zero_accumulators()
        method.accumulate({n: torch.randn_like(p) for n, p in params.items()})
        stats = method.step(4.0, None)
        snapshots[step] = {n: p.detach().clone() for n, p in params.items()}
        assert ("holdout_loss" in stats) == (step % 2 == 0)
    assert method.restore_best() == 4  # losses 3, 1, 2 at steps 2, 4, 6
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), snapshots[4][n], rtol=0, atol=0)


def test_released_nondp_baseline_holds_out_and_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    train, held = holdout_split(list(range(50)), 5, seed=3)
    assert len(held) == 5 and sorted(train + held) == list(range(50)) and held == sorted(held)
    assert holdout_split(list(range(50)), 5, seed=3)[1] == held
    s = T.build(tiny_cfg("protocol=released", "method=adamw", "privacy=nondp", "train.prefix_cache=off"))
    assert isinstance(s.method, HFTrainerBaseline) and len(s.suite.train) == 32 - 3  # GLUE: 10 % held out
    assert s.method.recipe.warmup_steps == 1 and s.method.recipe.eval_every == 1  # 0.2 × 3 steps
    assert math.isfinite(s.method.validation_loss())
    assert s.method.inner.optimizer.param_groups[0]["weight_decay"] == 0.0


# ----------------------------------------------------------------------------- D8 padding, D9–D12 evaluation
def test_left_padding_gives_the_right_padded_per_example_losses_and_grads() -> None:
    """RoPE attention depends on relative positions only, so shifting every real token by its row's
    padding leaves ℓ_i and ∇ℓ_i unchanged without explicit position ids (up to rounding)."""
    model = tiny_lora_llama()
    rows = features([9, 5, 7], [2, 0, 3])
    per_example = PerExampleGradients(model)
    out = {}
    for side in ("right", "left"):
        batch = collate(rows, pad_id=0, pad_to_multiple_of=None, padding_side=side)
        out[side] = per_example.compute(**batch)
    assert collate(rows, 0, None, "left")["attention_mask"][1, 0] == 0  # row 1 is padded on the left
    # equal up to the rounding of RoPE's float32 angles at the shifted positions (measured ~3e-10)
    torch.testing.assert_close(out["left"][0], out["right"][0], rtol=1e-8, atol=1e-10)
    for name, g in out["right"][1].items():
        torch.testing.assert_close(out["left"][1][name], g, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(("text", "lookaround", "released"), [
    ("The answer is A B", "B", "A"),      # consumed neighbour: released cannot see B after "A "
    ("so (C)", "C", "C"),
    ("AB then D.", "D", "D"),
    ("A store sells pens", "A", "A"),
    ("XYZ", None, None),
    ("CD", "D", "D"),                     # no standalone letter: both fall back to the last A-E
])
def test_aqua_choice_rules(text: str, lookaround: str | None, released: str | None) -> None:
    assert extract_choice(text) == lookaround
    assert extract_choice(text, "released") == released
    assert score_outputs("AQuA", [text], ["A"], choice_rule="released")[0] == float(released == "A")


def test_generation_options_reach_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    from prism.evaluation.evaluate import generate_responses
    from prism.models import byte_tokenizer

    tok = byte_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": len(tok)})).eval()
    seen: list[dict] = []
    original = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    prompts = ["### Response:\n", "x ### Response:\n"]
    out = {}
    for flag in (False, True):
        decoding = {**DECODING, "num_beams": 1, "max_new_tokens": 3, "prompt_encoding": "text",
                    "renormalize_logits": flag, "remove_invalid_values": flag}
        out[flag] = generate_responses(model, tok, prompts, decoding, batch_size=2)
        assert seen[-1]["renormalize_logits"] is flag and seen[-1]["remove_invalid_values"] is flag
    assert out[True] == out[False]  # greedy: a log-softmax of the logits keeps the argmax


# ----------------------------------------------------------------------------- D3 per-example scale
def test_released_per_example_scale_equals_the_released_trainer_gradient() -> None:
    """D3. Expectation built the released way: HF's micro-batch token-mean loss (``labels=``) times k,
    per-sample gradients from Opacus with ``loss_reduction="mean"`` (which multiplies by k again)."""
    model = tiny_lora_llama()
    twin = copy.deepcopy(model)  # Opacus hooks a module once: the per-record gradients get their own copy
    batch = collate(features([9, 5, 7, 8], [2, 0, 3, 6]), pad_id=0, pad_to_multiple_of=None)
    k = batch["input_ids"].shape[0]
    reference = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
    loss = reference(**batch).loss  # HF: mean over every supervised token of the micro-batch
    (loss * k).backward()
    expect = {n: p.grad_sample.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for p in model.parameters():
        p.grad_sample, p.grad = None, None
    reference._close()

    losses, released = PerExampleGradients(model, scale="released", released_power=2).compute(**batch)
    for name, g in expect.items():  # HF computes its loss from float32 logits: agreement to ~1e-5
        torch.testing.assert_close(released[name], g, rtol=1e-4, atol=1e-7)
    _, record = PerExampleGradients(twin).compute(**batch)
    counts = torch.tensor([7.0, 4.0, 4.0, 2.0], dtype=torch.float64)  # targets per row: n - max(p, 1)
    weights = k**2 * counts / counts.sum()
    torch.testing.assert_close(released_weights(counts, 2), weights)
    assert released_weights(torch.zeros(3), 2).eq(0).all()  # no supervised token: zero weights
    name = next(iter(record))
    torch.testing.assert_close(released[name], weights.view(-1, 1, 1) * record[name], rtol=1e-5, atol=1e-7)
    # the weights couple records: row 0's contribution changes when row 3 gets longer
    assert released_weights(torch.tensor([7.0, 4.0, 4.0, 9.0]), 2)[0] < weights[0]
    logits = twin(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(losses, per_example_loss(logits, batch["labels"], batch["attention_mask"]).detach())


# ----------------------------------------------------------------------------- end to end
def test_released_tiny_run_end_to_end(tmp_path: Path) -> None:
    cfg = tiny_cfg("protocol=released", "method=prism", "privacy=eps6", "train.prefix_cache=off", "train.batch_size=7")
    final = T.train_and_evaluate(cfg, tmp_path)
    record = final["protocol"]
    assert record["name"] == "released" and record["dp_guarantee"] == NOT_DP_AS_STATED
    assert record["items"]["padding_side"] == "left" and record["items"]["eval_batch_size"] == 128
    # D1: N = 32, B = 7: L = ⌈32/7⌉ = 5, so the 3 steps were calibrated as 5 steps at q = 1/5
    assert pld_epsilon(final["sigma"], 0.2, 5) == pytest.approx(6.0, abs=0.05)
    assert pld_epsilon(final["sigma"], 7 / 32, 5) > 6.1
    assert final["sample_rate"] == 7 / 32 and final["epsilon_spent"] < 6.0 - 0.1  # accounted at B/N, 3 steps
    assert final["epsilon_spent"] == pytest.approx(epsilon_spent(final["sigma"], 7 / 32, 3, 1e-5), rel=1e-6)
    assert math.isfinite(final["average"])


def test_released_tiny_nondp_baseline_end_to_end(tmp_path: Path) -> None:
    """The HF-Trainer recipe inside the real loop (the grid's released non-private baseline cells)."""
    cfg = tiny_cfg("protocol=released", "method=adamw", "privacy=nondp", "train.prefix_cache=off")
    final = T.train_and_evaluate(cfg, tmp_path)
    assert final["protocol"]["name"] == "released" and final["protocol"]["dp_guarantee"] == "non-private"
    assert math.isfinite(final["average"])
