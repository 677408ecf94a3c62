"""The batched PRISM mechanism (one kernel chain per shape group) against the per-module reference
(:class:`tests.oracles.PerModulePrism`).

Deterministic parts must agree to 1e-6 relative in float64 (they agree to rounding); the batched
noise is checked against its law (eqs. 19–21), since its random stream differs from per-module draws.
Also: no host synchronisation inside ``accumulate``/``step`` and an op count independent of depth.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.profiler import ProfilerActivity, profile

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry as geo
from prism.mechanism.adaptive import RankSpaceAdaptive, noise_second_moments
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods import build_method
from prism.methods.base import PrivacySpec
from prism.methods.prism import PrismMethod
from prism.methods.schema import PrismConfig
from prism.privacy.noise import as_noise_source
from tests.oracles import PerModulePrism, example_norms, release_lifts, retract

F64 = torch.float64
R = 3
MIXED = ((8, 6), (6, 7), (8, 6), (6, 7), (8, 6), (9, 6))  # three shape groups: sizes 3, 2, 1 (m, n ≥ 2r)
RELEASED = {"name": "prism", "lr": 0.05, "init": "spectral", "compute_dtype": "float64"}
PAPER = {**RELEASED, "name": "prism_paper", "preconditioner": "ridge", "floor_mode": "geometry",
         "debias": True, "cond_max": None, "horizontalize": "none"}
ADAMW = {"name": "adamw", "lr": 1e-3, "init": "peft", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
         "amsgrad": False}
CONFIGS = {"prism": RELEASED, "prism_paper": PAPER, "pre_retract": {**RELEASED, "horizontalize": "pre_retract"},
           "plain": {**RELEASED, "preconditioner": "none", "horizontalize": "none"}}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def stacked_factors(G: int, m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``G`` modules with condition numbers up to ~50 (so a mixed-up batch index shows)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, 1.7, R, dtype=F64)
    A = torch.randn(G, m, R, generator=g, dtype=F64) * scale
    B = torch.randn(G, n, R, generator=g, dtype=F64) * scale.flip(0)
    return A, B


# ----------------------------------------------------------------------------- geometry, batched vs per module

def test_geometry_functions_batched_equal_per_module() -> None:
    G, m, n, k = 4, 9, 7, 5
    A, B = stacked_factors(G, m, n, seed=1)
    g = torch.Generator().manual_seed(2)
    gA, gB = torch.randn(k, G, m, R, generator=g, dtype=F64), torch.randn(k, G, n, R, generator=g, dtype=F64)
    dA, dB = torch.randn(G, m, R, generator=g, dtype=F64), torch.randn(G, n, R, generator=g, dtype=F64)
    fr = geo.frame(A, B)
    lA, lB = geo.lift(A, B, gA, gB, frame=fr)
    sq = geo.intrinsic_sqnorm(A, B, lA, lB, frame=fr)
    hA, hB = geo.horizontalize(A, B, dA, dB, frame=fr)
    sA, sB = noise_second_moments(fr)
    retracted = {align: retract(A, B, dA, dB, lr=0.3, align=align) for align in (True, False)}
    assert sq.shape == (k, G) and lA.shape == (k, G, m, R)
    for i in range(G):
        fi = geo.frame(A[i], B[i])
        ref_lift = geo.lift(A[i], B[i], gA[:, i], gB[:, i], frame=fi)
        assert rel(lA[:, i], ref_lift[0]) < 1e-10 and rel(lB[:, i], ref_lift[1]) < 1e-10
        assert rel(sq[:, i], geo.intrinsic_sqnorm(A[i], B[i], *ref_lift, frame=fi)) < 1e-10
        ref_h = geo.horizontalize(A[i], B[i], dA[i], dB[i], frame=fi)
        assert rel(hA[i], ref_h[0]) < 1e-10 and rel(hB[i], ref_h[1]) < 1e-10
        ref_s = noise_second_moments(fi)
        assert rel(sA[i], ref_s[0]) < 1e-10 and rel(sB[i], ref_s[1]) < 1e-10
        for align, (A2, B2) in retracted.items():
            ref_A2, ref_B2 = retract(A[i], B[i], dA[i], dB[i], lr=0.3, align=align)
            assert rel(A2[i], ref_A2) < 1e-10 and rel(B2[i], ref_B2) < 1e-10


def test_lifted_norm_terms_are_the_norm_of_the_lift_without_forming_it() -> None:
    """Clip norm from factor grads (eqs. 14–15): = ‖P(G)‖² (dense, eq. 13) for g_A = GB, g_B = GᵀA, and
    = the lift's image norm for arbitrary (inconsistent) factor grads too; batched over modules; the
    rounding bound is tiny next to the norm for such gradients."""
    G_, m, n, k = 3, 9, 7, 4
    A, B = stacked_factors(G_, m, n, seed=8)
    g = torch.Generator().manual_seed(9)
    G = torch.randn(k, G_, m, n, generator=g, dtype=F64)
    fr = geo.frame(A, B)
    got, err, fsq = geo.lifted_norm_terms(fr, G @ B, G.mT @ A)
    PiA, PiB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
    dense = (PiA @ G + G @ PiB - PiA @ G @ PiB).square().sum((-2, -1))
    assert got.shape == err.shape == (k, G_) and rel(got, dense) < 1e-10
    assert (err < 1e-11 * got.sqrt()).all() and (fsq <= 2 * got * (1 + 1e-12)).all()
    gA, gB = torch.randn(k, G_, m, R, generator=g, dtype=F64), torch.randn(k, G_, n, R, generator=g, dtype=F64)
    dA, dB = geo.lift(A, B, gA, gB, frame=fr)
    image = (dA @ B.mT + A @ dB.mT).square().sum((-2, -1))
    assert rel(geo.lifted_norm_terms(fr, gA, gB)[0], image) < 1e-10
    # two leading axes, and inputs in another memory layout, give each slice's own terms
    gA2, gB2 = torch.randn(2, k, G_, m, R, generator=g, dtype=F64), torch.randn(2, k, G_, R, n, generator=g, dtype=F64)
    got2 = geo.lifted_norm_terms(fr, gA2, gB2.mT)
    for i in range(2):
        for j in range(k):
            one = geo.lifted_norm_terms(fr, gA2[i, j], gB2[i, j].mT)
            assert all(rel(a[i, j], b) < 1e-12 for a, b in zip(got2, one))
    assert all(x.shape == (0, G_) for x in geo.lifted_norm_terms(fr, gA[:0], gB[:0]))  # no examples


@pytest.mark.parametrize("name", ["prism", "prism_paper"])
def test_adaptive_transform_batched_equals_per_module(name: str) -> None:
    cfg = PrismConfig.from_node(CONFIGS[name])
    G, m, n, tau = 3, 8, 6, 0.2
    A, B = stacked_factors(G, m, n, seed=3)
    sA, sB = noise_second_moments(geo.frame(A, B))
    batched = RankSpaceAdaptive(cfg, m, n, R, F64, torch.device("cpu"), batch=(G,))
    singles = [RankSpaceAdaptive(cfg, m, n, R, F64, torch.device("cpu")) for _ in range(G)]
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        dA, dB = torch.randn(G, m, R, generator=g, dtype=F64), torch.randn(G, n, R, generator=g, dtype=F64)
        UA, UB = batched.step(dA, dB, tau, sA, sB)
        for i, single in enumerate(singles):
            rA, rB = single.step(dA[i], dB[i], tau, sA[i], sB[i])
            assert rel(UA[i], rA) < 1e-10 and rel(UB[i], rB) < 1e-10


def test_batched_rank_check_names_the_deficient_module() -> None:
    A, B = stacked_factors(3, 8, 6, seed=5)
    geo.check_full_rank(A, B, ["l.0", "l.1", "l.2"])
    A[1, :, 2] = A[1, :, 0]
    with pytest.raises(geo.RankDeficientError, match="l.1: LoRA factor A"):
        geo.check_full_rank(A, B, ["l.0", "l.1", "l.2"])
    B[2, 0, 0] = float("nan")
    with pytest.raises(geo.RankDeficientError, match="l.2: LoRA factor B .* non-finite"):
        geo.check_full_rank(A[2:], B[2:], ["l.2"])


# ----------------------------------------------------------------------------- the method, batched vs per module

def make_params(shapes=MIXED, seed: int = 0) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = {}
    for i, (m, n) in enumerate(shapes):
        prefix = f"m.layers.{i}.proj"
        params[f"{prefix}.lora_A.default.weight"] = nn.Parameter(torch.randn(R, n, generator=g, dtype=F64))
        params[f"{prefix}.lora_B.default.weight"] = nn.Parameter(torch.randn(m, R, generator=g, dtype=F64))
    return params


def per_example_grads(params, k: int, seed: int, dp: bool = True) -> dict[str, torch.Tensor]:
    """Grads of ⟨G_i, ABᵀ⟩ with example scales spread over 1e-2..1e1 (some clipped, some not)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 1, k, dtype=F64)[:, None, None]
    grads = {}
    for pair in lora_pairs(params):
        A, B = (x.detach() for x in read_pair(params, pair))
        G = torch.randn(k, A.shape[0], B.shape[0], generator=g, dtype=F64) * scales
        grads[pair.a_name], grads[pair.b_name] = G @ B, A.mT @ G
    return grads if dp else {name: t.sum(0) for name, t in grads.items()}


def build(cfg: dict, params, privacy, batched: bool) -> PrismMethod:
    method = (PrismMethod if batched else PerModulePrism)(PrismConfig.from_node(cfg), params, privacy)
    assert len(method.groups) == (3 if batched else len(MIXED))
    return method


def step_with_lifts(method: PrismMethod, denominator: float, noise=None):
    """The three verbs' last two, keeping the release's per-module lifts."""
    lifts, release = release_lifts(method, denominator, noise)
    return lifts, {**method.clip_stats(), **method.update(release)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dp", [True, False], ids=["dp", "nondp"])
def test_method_batched_equals_per_module_reference(name: str, dp: bool) -> None:
    """σ = 0 (deterministic): norms, clip coefficients, lifts, stats and 3 steps of factors agree."""
    privacy = PrivacySpec(sigma=0.0, clip_norm=1.0) if dp else None
    runs = {}
    for batched in (True, False):
        params = make_params()
        method = build(CONFIGS[name], params, privacy, batched)
        trace = []
        for step in range(3):
            method.zero_accumulators()
            for micro in range(2):
                method.accumulate(per_example_grads(params, 3, seed=10 * step + micro, dp=dp))
            norms = example_norms(method) if dp else None
            lifts, stats = step_with_lifts(method, 4.0)
            trace.append((norms, lifts, stats))
        runs[batched] = (params, trace, method.state_dict())
    (p1, t1, s1), (p0, t0, s0) = runs[True], runs[False]
    for (n1, l1, st1), (n0, l0, st0) in zip(t1, t0):
        if dp:
            assert rel(n1, n0) < 1e-6 and (n0 > 1.0).any() and (n0 < 1.0).any()
        for module in l0:
            assert rel(l1[module][0], l0[module][0]) < 1e-6 and rel(l1[module][1], l0[module][1]) < 1e-6
        assert st1.keys() == st0.keys()
        for key in st0:
            assert st1[key].ndim == 0 and rel(st1[key], st0[key]) < 1e-6, key
    for name_ in p0:
        assert rel(p1[name_].detach(), p0[name_].detach()) < 1e-6, name_
    for module, state in s0["adaptive"].items():
        assert s1["adaptive"][module]["t"] == state["t"]
        for key in ("mA", "VA", "mB", "VB"):
            torch.testing.assert_close(s1["adaptive"][module][key], state[key], rtol=1e-6, atol=1e-12)


def test_batched_noise_law_per_module_and_across_modules() -> None:
    """Zero gradients: module i's noise image has covariance τ²·P_i (eq. 19: the law of τP(Ξ)), hence
    energy τ² r(m+n−r) (eq. 21); modules in one group are uncorrelated."""
    shapes = ((5, 4), (5, 4), (3, 4))
    sigma, C, denom, S = 1.3, 0.5, 8.0, 6000
    tau = sigma * C / denom
    params = make_params(shapes)
    method = build_method(OmegaConf.create(RELEASED), params, PrivacySpec(sigma=sigma, clip_norm=C))
    assert [len(g.pairs) for g in method.groups] == [2, 1]
    pairs = lora_pairs(params)
    factors = [tuple(x.detach() for x in read_pair(params, p)) for p in pairs]
    method.zero_accumulators()
    method.accumulate({n: torch.zeros(1, *p.shape, dtype=F64) for n, p in params.items()})
    gen = torch.Generator().manual_seed(6)
    images = [[] for _ in pairs]
    for _ in range(S):
        lifts, _ = release_lifts(method, denom, gen)
        for j, (p, (A, B)) in enumerate(zip(pairs, factors)):
            dA, dB = lifts[p.module]
            images[j].append((dA @ B.mT + A @ dB.mT).mT.reshape(-1))  # vec, column-stacking
    images = [torch.stack(x) / tau for x in images]
    tol = 6.0 / S**0.5
    for X, (A, B), (m, n) in zip(images, factors, shapes):
        PiA, PiB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
        Im, In = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)
        P = torch.kron(In, PiA) + torch.kron(PiB, Im) - torch.kron(PiB, PiA)  # vec(P(G)) = P vec(G)
        cov = X.mT @ X / S
        assert (cov - P).abs().max() < tol
        energy = X.square().sum(1)
        assert abs(energy.mean().item() - R * (m + n - R)) < 4 * energy.std().item() / S**0.5
    cross = images[0].mT @ images[1] / S
    assert cross.abs().max() < tol


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_example_with_a_non_finite_gradient_contributes_nothing(bad: float) -> None:
    """Its clip coefficient is 0 and its gradient zeroed: the release (same noise) is the other examples' alone,
    so the clipped sum's sensitivity holds for such a row too (docs/PRIVACY.md)."""
    releases = []
    for drop in (False, True):
        params = make_params()
        method = build_method(OmegaConf.create(RELEASED), params, PrivacySpec(sigma=1.0, clip_norm=1.0))
        grads = per_example_grads(params, 3, seed=1)
        grads[lora_pairs(params)[4].a_name][1, 0, 0] = bad
        if drop:
            grads = {n: g[[0, 2]] for n, g in grads.items()}
        method.zero_accumulators()
        method.accumulate(grads)
        releases.append(method.add_noise(4.0, as_noise_source(torch.Generator().manual_seed(0))).tensors)
    for n, t in releases[0].items():
        assert torch.isfinite(t).all()
        torch.testing.assert_close(t, releases[1][n], rtol=0, atol=0)


# ----------------------------------------------------------------------------- host syncs and op counts

def _profile(fn) -> list:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return list(prof.events())


def _host_reads(events) -> tuple[int, int]:
    """(our host reads, torch's linalg convergence checks): a check reads ``info`` on the host, which
    on CUDA is a device sync per eigh/SVD call (a fixed number per step once fused over groups).
    Reads inside ``torch.optim`` steps are of its step counters, which stay on the CPU (not a sync)."""
    def inside(e, prefix: str) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith(prefix):
                return True
            parent = parent.cpu_parent
        return False
    reads = [e for e in events if e.name == "aten::_local_scalar_dense"
             and not inside(e, "aten::_linalg_check_errors") and not inside(e, "Optimizer.step#")]
    return len(reads), sum(e.name == "aten::_linalg_check_errors" for e in events)


def _top_level_ops(events) -> int:
    """aten ops called from Python (not nested inside another aten op): the kernel-chain length."""
    def nested(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False
    return sum(e.name.startswith("aten::") and not nested(e) for e in events)


def _one_step(method, params, diagnostics: bool):
    grads = per_example_grads(params, 2, seed=3)
    method.zero_accumulators()  # one host read for the rank check, before the step's work

    def run() -> None:
        method.accumulate(grads)
        method.accumulate(grads)
        method.step(4.0, torch.Generator().manual_seed(0), diagnostics=diagnostics)
    return run


@pytest.mark.parametrize("diagnostics", [True, False])
def test_no_host_sync_inside_accumulate_and_step(diagnostics: bool) -> None:
    """No host read of ours; PRISM's eigh/SVD checks are 3 per step whatever the number of modules."""
    privacy = PrivacySpec(sigma=1.0, clip_norm=1.0)
    for cfg, checks in ((RELEASED, 3), (PAPER, 3), (ADAMW, 0)):
        for layers in (1, 2):
            params = make_params(MIXED * layers)
            method = build_method(OmegaConf.create(cfg), params, privacy)
            events = _profile(_one_step(method, params, diagnostics))
            assert _host_reads(events) == (0, checks), cfg["name"]
            assert any(e.name.startswith("aten::") for e in events)  # the profiler did see the step


def test_batched_op_count_is_independent_of_depth() -> None:
    """Doubling the layers (same shapes) leaves the batched step's op chain unchanged; per module it grows."""
    counts = {}
    for batched in (True, False):
        for layers in (1, 2):
            params = make_params(MIXED * layers)
            method = build(RELEASED, params, PrivacySpec(1.0, 1.0), batched) if layers == 1 else (
                PrismMethod if batched else PerModulePrism)(PrismConfig.from_node(RELEASED), params, PrivacySpec(1.0, 1.0))
            method.zero_accumulators()
            grads = per_example_grads(params, 2, seed=3)
            counts[batched, layers] = _top_level_ops(_profile(lambda m=method, g=grads: (
                m.accumulate(g), m.step(4.0, torch.Generator().manual_seed(0), diagnostics=False))))
    # stacking reads one tensor per module (aten::stack's inputs), not one op; only the writes'
    # unbind views are per module and nested, so the top-level count is identical
    assert counts[True, 1] == counts[True, 2], counts
    assert counts[False, 2] > 1.8 * counts[False, 1], counts


def test_released_geometry_options_act_per_module_on_batched_frames() -> None:
    """``lift(rcond=…)`` and ``tangent_noise(damping=…)`` (released protocol) on a ``[G, m, r]`` batch
    equal the per-module calls: the eigenvalue cut uses each module's own largest eigenvalue."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(3, 20, 4, generator=gen, dtype=torch.float64)
    B = torch.randn(3, 12, 4, generator=gen, dtype=torch.float64)
    A[1] *= 1e4  # very different scales across the group: a global max would cut module 0 and 2
    gA, gB = torch.randn_like(A), torch.randn_like(B)
    dA, dB = geo.lift(A, B, gA, gB, rcond=1e-6)
    XA, XB = sample_tangent_noise(A, B, generator=torch.Generator().manual_seed(1), damping=1e-8)
    for i in range(3):
        a, b = geo.lift(A[i], B[i], gA[i], gB[i], rcond=1e-6)
        torch.testing.assert_close(dA[i], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dB[i], b, rtol=1e-10, atol=1e-12)
        exact = geo.lift(A[i], B[i], gA[i], gB[i])
        torch.testing.assert_close(a, exact[0], rtol=1e-8, atol=1e-10)
    assert XA.shape == A.shape and XB.shape == B.shape
    torch.testing.assert_close(XA.mT @ A, torch.zeros(3, 4, 4, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["generic", "inside_span"])
def test_retraction_from_the_frame_equals_the_dense_truncated_svd(case: str) -> None:
    """Eq. 22 with the QRs of [A, ΔA], [B, ΔB] extended from the frame's (block Gram–Schmidt) is the best
    rank-r approximation of Z − lr(ΔA Bᵀ + A ΔBᵀ) (a dense truncated SVD), also when ΔA, ΔB lie in span(A),
    span(B) (the new block is zero), and with the horizontalisation's gauge term as an r×r shift (the
    retraction sees only the tangent vector)."""
    G, m, n = 3, 9, 7
    A, B = stacked_factors(G, m, n, seed=11)
    g = torch.Generator().manual_seed(12)
    dA, dB = torch.randn(G, m, R, generator=g, dtype=F64), torch.randn(G, n, R, generator=g, dtype=F64)
    if case == "inside_span":
        dA, dB = A @ torch.randn(G, R, R, generator=g, dtype=F64), B @ torch.randn(G, R, R, generator=g, dtype=F64)
    fr = geo.frame(A, B)
    Q2, R_full = geo.extend_qr(fr.QA, fr.RA, dA)
    Qu = torch.cat([fr.QA, Q2], dim=-1)
    assert rel(Qu @ R_full, torch.cat([A, dA], dim=-1)) < 1e-12
    if case == "generic":
        torch.testing.assert_close(Qu.mT @ Qu, torch.eye(2 * R, dtype=F64).expand(G, -1, -1), rtol=0, atol=1e-12)
    hA, hB = geo.horizontalize(A, B, dA, dB, frame=fr)
    U, S, Vh = torch.linalg.svd(A @ B.mT - 0.3 * (dA @ B.mT + A @ dB.mT))
    dense = (U[..., :R] * S[..., None, :R]) @ Vh[..., :R, :]
    ref = retract(A, B, dA, dB, lr=0.3, align=True)
    for align in (True, False):
        for got in (retract(A, B, dA, dB, lr=0.3, align=align, frame=fr),
                    retract(A, B, dA, dB, lr=0.3, align=align, frame=fr, horizontal=True),  # r×r gauge shift
                    retract(A, B, hA, hB, lr=0.3, align=align)):  # the same tangent vector, so the same point
            assert rel(got[0] @ got[1].mT, dense) < 1e-10
            if align:  # the aligned factors are unique (the Procrustes rotation fixes the gauge)
                assert rel(got[0], ref[0]) < 1e-10 and rel(got[1], ref[1]) < 1e-10
