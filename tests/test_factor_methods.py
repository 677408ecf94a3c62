"""Factor-space DP-SGD (eq. 3) and the baseline optimizers behind the Method interface."""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods import PrivacySpec, build_method
from prism.methods.base import CLIP_MARGIN

# The explicit hyper-parameters each conf/method/*.yaml carries (Table 8 GLUE learning rates).
ADAMW = {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False}
CFGS = {
    "adamw": {"name": "adamw", **ADAMW},
    "ffa": {"name": "ffa", **ADAMW},
    "loraplus": {"name": "loraplus", **ADAMW, "loraplus_lr_ratio": 6.0},
    "lamb": {
        "name": "lamb", "lr": 5e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0,
        "weight_decouple": True, "fixed_decay": False, "rectify": False, "degenerated_to_sgd": False,
        "n_sma_threshold": 5, "grad_averaging": True, "max_grad_norm": 0.0, "pre_norm": False, "adam": False,
        "adam_debias": False, "adanorm": False, "foreach": False, "maximize": False,
    },
    "lora_rite": {
        "name": "lora_rite", "lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-6,
        "update_skipping": 1.0, "clip_unmagnified_grad": 1.0,
    },
}


def cfg(name: str, **override):
    return OmegaConf.create({**CFGS[name], **override})


def make_params(modules: int = 2, m: int = 6, n: int = 5, r: int = 3, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """peft-named LoRA factors: lora_A (r×n) = paper Bᵀ, lora_B (m×r) = paper A; both random."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for i in range(modules):
        base = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        params[f"{base}.lora_A.default.weight"] = torch.nn.Parameter(torch.randn(r, n, generator=g))
        params[f"{base}.lora_B.default.weight"] = torch.nn.Parameter(0.5 * torch.randn(m, r, generator=g))
    return params


def per_example_grads(params, k: int, seed: int, huge: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = {n: 0.3 * torch.randn(k, *p.shape, generator=g) for n, p in params.items()}
    if huge is not None:
        for t in grads.values():
            t[huge] *= 1e4
    return grads


def clipped_sum_by_hand(grads: dict[str, torch.Tensor], C: float) -> dict[str, torch.Tensor]:
    """Eq. 3 over the concatenated factors, one example at a time (Opacus' 1e-6 in the denominator)."""
    k = next(iter(grads.values())).shape[0]
    out = {n: torch.zeros_like(t[0]) for n, t in grads.items()}
    for i in range(k):
        flat = torch.cat([t[i].reshape(-1) for t in grads.values()])
        coef = min(1.0, C / (flat.norm().item() + 1e-6))
        for n, t in grads.items():
            out[n] += coef * t[i]
    return out


def capture_grads(method) -> dict[str, torch.Tensor]:
    """Record the p.grad the torch optimizer sees at its step."""
    seen: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in method.params.items()}

    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                seen[names[id(p)]] = p.grad.clone()

    method.optimizer.register_step_pre_hook(hook)
    return seen


def test_clipped_sum_bounds_each_example_and_matches_eq3() -> None:
    params = make_params()
    C, B = 1.0, 8
    method = build_method(cfg("adamw"), params, PrivacySpec(sigma=0.0, clip_norm=C))
    grads = per_example_grads(params, k=5, seed=1, huge=2)
    method.zero_accumulators()
    method.accumulate({n: t[:3] for n, t in grads.items()})  # two micro-batches, one logical step
    method.accumulate({n: t[3:] for n, t in grads.items()})
    privatized, noise = method.privatize(B, torch.Generator().manual_seed(0))
    expected = clipped_sum_by_hand(grads, C * (1 - CLIP_MARGIN))  # the clip target (docs/PRIVACY.md)
    for n in params:
        assert torch.allclose(privatized[n] * B, expected[n], atol=1e-6)
        assert torch.count_nonzero(noise[n]) == 0
    method.zero_accumulators()
    method.accumulate({n: t[2:3] for n, t in grads.items()})
    alone, _ = method.privatize(1.0, None)
    contribution = torch.sqrt(sum(t.pow(2).sum() for t in alone.values()))
    assert contribution <= C * (1 - CLIP_MARGIN)
    assert contribution > 0.999 * C * (1 - CLIP_MARGIN)


def test_step_hands_the_clipped_mean_to_the_optimizer_and_reports_stats() -> None:
    params = make_params()
    C, B = 0.5, 8
    method = build_method(cfg("adamw"), params, PrivacySpec(sigma=0.0, clip_norm=C))
    seen = capture_grads(method)
    grads = per_example_grads(params, k=6, seed=3, huge=0)
    method.zero_accumulators()
    method.accumulate(grads)
    stats = method.step(B, torch.Generator().manual_seed(0))
    target = C * (1 - CLIP_MARGIN)
    expected = clipped_sum_by_hand(grads, target)
    norms = torch.sqrt(sum(t.reshape(6, -1).pow(2).sum(1) for t in grads.values()))
    for n in params:
        assert torch.allclose(seen[n], expected[n] / B, atol=1e-6)
        assert params[n].grad is None
    assert stats["clip_fraction"] == pytest.approx(float((norms > target).float().mean()))
    assert stats["grad_norm_mean"] == pytest.approx(float(norms.mean()), rel=1e-5)
    assert stats["noise_norm"] == 0.0
    assert stats["update_norm"] > 0


def test_nondp_divides_the_sum_by_the_realised_batch() -> None:
    params = make_params()
    method = build_method(cfg("adamw"), params, None)
    seen = capture_grads(method)
    g = torch.Generator().manual_seed(4)
    batches = [{n: torch.randn(p.shape, generator=g) for n, p in params.items()} for _ in range(2)]
    method.zero_accumulators()
    for batch in batches:
        method.accumulate(batch)
    stats = method.step(3, None)
    for n in params:
        assert torch.allclose(seen[n], (batches[0][n] + batches[1][n]) / 3)
    assert "noise_norm" not in stats and "clip_fraction" not in stats


def test_noise_has_std_sigma_C_over_B_per_coordinate() -> None:
    params = make_params(modules=4, m=32, n=24, r=8)
    sigma, C, B = 0.8, 1.5, 10
    method = build_method(cfg("adamw"), params, PrivacySpec(sigma=sigma, clip_norm=C))
    method.zero_accumulators()
    method.accumulate({n: torch.zeros(3, *p.shape) for n, p in params.items()})
    privatized, noise = method.privatize(B, torch.Generator().manual_seed(5))
    flat = torch.cat([privatized[n].reshape(-1) for n in params])  # 4·8·(32+24) = 1792 coordinates
    assert torch.equal(flat, torch.cat([noise[n].reshape(-1) for n in params]).float())
    assert flat.std().item() == pytest.approx(sigma * C / B, rel=0.06)
    assert abs(flat.mean().item()) < 4 * sigma * C / B / flat.numel() ** 0.5
    again, _ = method.privatize(B, torch.Generator().manual_seed(5))
    assert all(torch.equal(again[n], privatized[n]) for n in params)


@pytest.mark.parametrize("name", ["adamw", "ffa"])
def test_noise_is_drawn_in_float64_and_the_sum_rounded_once(name: str) -> None:
    """The factor-space noise is σC/B times torch's float64 standard normals of the step's generator (the law
    of PRISM's noise, tails past float32's ≈ 5.77 cut); the noised average is rounded to float32 once."""
    params = make_params(modules=3, m=20, n=16, r=4)
    sigma, C, B = 0.7, 2.0, 8
    method = build_method(cfg(name), params, PrivacySpec(sigma=sigma, clip_norm=C))
    method.zero_accumulators()
    method.accumulate({n: torch.zeros(2, *p.shape) for n, p in params.items() if n in method.params})
    privatized, noise = method.privatize(B, torch.Generator().manual_seed(11))
    trained = [n for n in params if n in method.params]
    total = sum(params[n].numel() for n in trained)
    draws = torch.randn(total, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    expected = (draws * (sigma * C / B)).split([params[n].numel() for n in trained])
    for n, e in zip(trained, expected):
        assert noise[n].dtype == torch.float64 and privatized[n].dtype == torch.float32
        assert torch.equal(noise[n].reshape(-1), e)
        assert torch.equal(privatized[n].reshape(-1), e.to(torch.float32))


def test_clipped_sum_is_float64_so_neighbours_differ_by_at_most_C() -> None:
    """256 aligned examples of norm 10 clipped to C' = C(1 − CLIP_MARGIN), C = 1, plus one more: the sums differ
    by exactly the one clipped example, C'·10/(10 + 1e-6) (Opacus' coefficient), to float64 rounding; a float32 sum of 256
    aligned terms misses it by ≈ 3e-7 C."""
    params = make_params(modules=1, m=8, n=6, r=2)
    direction = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for n, p in params.items()}
    norm = torch.sqrt(sum(d.double().square().sum() for d in direction.values()))
    sums = []
    for k in (256, 257):
        method = build_method(cfg("adamw"), params, PrivacySpec(sigma=0.0, clip_norm=1.0))
        method.zero_accumulators()
        method.accumulate({n: (10.0 * d / norm.float()).expand(k, *d.shape).contiguous() for n, d in direction.items()})
        sums.append({n: a.clone() for n, a in method.summed.items()})
    diff = torch.sqrt(sum((sums[1][n] - sums[0][n]).square().sum() for n in params))
    assert all(a.dtype == torch.float64 for a in sums[0].values())
    assert abs(diff.item() - (1 - CLIP_MARGIN) * 10.0 / (10.0 + 1e-6)) < 1e-12


def test_returned_noise_survives_the_next_draw_with_float64_accumulators() -> None:
    """float64 parameters keep float64 accumulators, so the draws need no rounding: the noise handed back must
    still be a tensor of its own, not a view of the kept workspace that the next step's draws overwrite."""
    params = {n: torch.nn.Parameter(p.detach().double()) for n, p in make_params().items()}
    method = build_method(cfg("adamw"), params, PrivacySpec(sigma=1.0, clip_norm=1.0))
    method.zero_accumulators()
    method.accumulate({n: torch.zeros(2, *p.shape, dtype=torch.float64) for n, p in params.items()})
    _, first = method.privatize(4, torch.Generator().manual_seed(1))
    kept = {n: t.clone() for n, t in first.items()}
    method.privatize(4, torch.Generator().manual_seed(2))
    assert all(torch.equal(first[n], kept[n]) for n in params)


def test_noise_norm_is_the_first_order_intrinsic_noise_and_matches_eq8() -> None:
    params = make_params(modules=2, m=7, n=5, r=2)
    sigma, C, B = 1.2, 1.0, 4
    method = build_method(cfg("adamw"), params, PrivacySpec(sigma=sigma, clip_norm=C))
    g = torch.Generator().manual_seed(6)
    pairs = lora_pairs(params)
    energies, expected_energy = [], 0.0
    tau = sigma * C / B
    for pair in pairs:
        A, Bf = read_pair(params, pair)
        expected_energy += tau**2 * (A.shape[0] * Bf.detach().pow(2).sum() + Bf.shape[0] * A.detach().pow(2).sum())
    for draw in range(400):
        _, noise = method.privatize(B, g)
        dense = 0.0
        for pair in pairs:
            A, Bf = read_pair(params, pair)
            xi_A, xi_B = read_pair(noise, pair)
            dense += (xi_A @ Bf.detach().double().mT + A.detach().double() @ xi_B.mT).pow(2).sum()
        reported = method.noise_norm(noise)
        if draw < 3:
            assert reported == pytest.approx(float(dense.sqrt()), rel=1e-5)
        energies.append(reported**2)
    assert sum(energies) / len(energies) == pytest.approx(float(expected_energy), rel=0.1)


def test_loraplus_groups_match_peft_create_loraplus_optimizer() -> None:
    peft = pytest.importorskip("peft")
    from peft.optimizers import create_loraplus_optimizer

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(5, 6)
            self.v_proj = torch.nn.Linear(6, 4)

    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    reference = create_loraplus_optimizer(
        model, torch.optim.AdamW, lr=2e-4, loraplus_lr_ratio=6.0, loraplus_weight_decay=0.01
    )
    ours = build_method(cfg("loraplus"), trainable, None).optimizer

    def settings(opt) -> dict[int, tuple[float, float]]:
        return {id(p): (grp["lr"], grp["weight_decay"]) for grp in opt.param_groups for p in grp["params"]}

    assert settings(ours) == settings(reference)
    lrs = {n: settings(ours)[id(p)][0] for n, p in trainable.items()}
    assert {lr for n, lr in lrs.items() if ".lora_B." in n} == {2e-4 * 6.0}
    assert {lr for n, lr in lrs.items() if ".lora_A." in n} == {2e-4}


def test_ffa_never_changes_lora_A() -> None:
    params = make_params()
    start = {n: p.detach().clone() for n, p in params.items()}
    method = build_method(cfg("ffa", lr=1e-2), params, PrivacySpec(sigma=1.0, clip_norm=1.0))
    lora_A = [n for n in params if ".lora_A." in n]
    assert not any(params[n].requires_grad for n in lora_A)
    assert set(method.params) == {n for n in params if ".lora_B." in n}
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        method.zero_accumulators()
        method.accumulate(per_example_grads(params, k=4, seed=10 + step))  # lora_A grads are ignored
        stats = method.step(4, gen)
    for n in params:
        assert torch.equal(params[n], start[n]) == (n in lora_A)
    # the diagnostic counts noise on paper A only: ‖ξ_A Bᵀ‖ with the frozen B
    _, noise = method.privatize(4, torch.Generator().manual_seed(8))
    dense = sum(
        (read_pair(noise | {p.b_name: torch.zeros_like(params[p.b_name])}, p)[0] @ read_pair(params, p)[1].double().mT)
        .pow(2).sum() for p in lora_pairs(params)
    )
    assert method.noise_norm(noise) == pytest.approx(float(dense.sqrt()), rel=1e-5)
    assert stats["noise_norm"] > 0
    only_b = build_method(cfg("ffa"), {n: p for n, p in params.items() if n not in lora_A}, PrivacySpec(1.0, 1.0))
    assert only_b.noise_norm(noise) != only_b.noise_norm(noise)  # NaN: the frozen factor is unknown


def test_lamb_does_not_clip_the_gradient() -> None:
    w = torch.nn.Parameter(torch.randn(4, 3))
    pair = {"x.lora_A.default.weight": w, "x.lora_B.default.weight": torch.nn.Parameter(torch.randn(5, 4))}
    opt = build_method(cfg("lamb"), pair, None).optimizer  # lora_B has no gradient: not stepped
    huge = 1e6 * torch.randn(4, 3)
    w.grad = huge.clone()
    opt.step()
    assert torch.equal(w.grad, huge)
    assert torch.allclose(opt.state[w]["exp_avg"], 0.1 * huge)  # (1 − β1)·g, no rescaling
    with pytest.raises(ValueError, match="may not rescale the privatised gradient"):
        build_method(cfg("lamb", pre_norm=True, max_grad_norm=1.0), pair, None)


@pytest.mark.parametrize(("name", "trust"), [("lamb", True), ("adamw", False)])
def test_lamb_update_norm_follows_the_weight_norm(name: str, trust: bool) -> None:
    """LAMB (You et al. 2020): ‖Δw_l‖ = lr/(1−β1)·‖w_l‖·‖u_l‖/(‖u_l‖+eps) at step 1, so the ratio of two
    layers' update norms is the ratio of their weight norms; AdamW's is not."""
    g = torch.Generator().manual_seed(9)
    w1 = torch.nn.Parameter(0.1 * torch.randn(6, 3, generator=g))
    w2 = torch.nn.Parameter(2.0 * torch.randn(6, 3, generator=g))
    start = (w1.detach().clone(), w2.detach().clone())
    opt = build_method(cfg(name, weight_decay=0.0), {"a.lora_A.default.weight": w1, "a.lora_B.default.weight": w2}, None).optimizer
    w1.grad, w2.grad = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)
    opt.step()
    d1, d2 = (w1.detach() - start[0]).norm(), (w2.detach() - start[1]).norm()
    ratio = (d1 / d2).item()
    assert (ratio == pytest.approx((start[0].norm() / start[1].norm()).item(), rel=1e-4)) == trust
    if trust:
        assert d1.item() == pytest.approx(5e-3 / 0.1 * start[0].norm().item(), rel=1e-4)


@pytest.mark.parametrize("name", list(CFGS))
def test_resume_is_bit_identical(name: str) -> None:
    privacy = PrivacySpec(sigma=1.0, clip_norm=1.0)

    def run(method, params, steps, gen) -> None:
        for step in steps:
            method.zero_accumulators()
            method.accumulate(per_example_grads(params, k=3, seed=100 + step))
            method.step(3, gen)

    params = make_params(seed=1)
    method = build_method(cfg(name, lr=1e-2), params, privacy)
    gen = torch.Generator().manual_seed(11)
    run(method, params, range(3), gen)
    saved = ({n: p.detach().clone() for n, p in params.items()}, copy.deepcopy(method.state_dict()), gen.get_state())
    run(method, params, range(3, 5), gen)

    resumed_params = {n: torch.nn.Parameter(t.clone()) for n, t in saved[0].items()}
    resumed = build_method(cfg(name, lr=1e-2), resumed_params, privacy)
    resumed.load_state_dict(saved[1])
    resumed_gen = torch.Generator()
    resumed_gen.set_state(saved[2])
    run(resumed, resumed_params, range(3, 5), resumed_gen)
    for n in params:
        assert torch.equal(params[n], resumed_params[n])
    assert any(not torch.equal(params[n], saved[0][n]) for n in params)


def test_missing_hyperparameter_names_the_yaml() -> None:
    bad = OmegaConf.create({k: v for k, v in CFGS["adamw"].items() if k != "eps"})
    with pytest.raises(ValueError, match=r"eps.*conf/method/adamw.yaml"):
        build_method(bad, make_params(), None)
