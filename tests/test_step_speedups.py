"""The fused and buffered pieces of PRISM's step and frame against the building blocks they replace.

:func:`geometry.cholesky_qr2` against Householder QR (``torch.linalg.qr``: the same ``Q`` and ``R``,
signs included), :func:`geometry.privatized_lift` against :func:`geometry.lift`,
:func:`geometry.tangent_noise` and :func:`geometry.horizontalize` in turn (the same draws), and a
whole DP step against the same three functions plus the plain Householder retraction. Float64,
tolerances at the rounding the docstrings state.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from prism import geometry as geo
from prism.lora import lora_pairs, read_pair
from prism.methods.base import PrivacySpec
from prism.methods.prism import PrismMethod

F64 = torch.float64
R = 4


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def conditioned(G: int, rows: int, kappa: float, g: torch.Generator) -> torch.Tensor:
    """``G`` random ``rows×R`` matrices with singular values spread log-evenly over ``[1, κ]``."""
    U = torch.linalg.qr(torch.randn(G, rows, R, generator=g, dtype=F64)).Q
    V = torch.linalg.qr(torch.randn(G, R, R, generator=g, dtype=F64)).Q
    return (U * torch.logspace(0, torch.log10(torch.tensor(kappa)).item(), R, dtype=F64)) @ V.mT


@pytest.mark.parametrize("kappa", [1.0, 30.0, 2896.0, 1e5])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_cholesky_qr2_equals_householder_qr(kappa: float, layout: str) -> None:
    """Same ``Q`` and ``R`` as LAPACK's Householder QR, including the signs of ``R``'s diagonal (so every
    product with ``R⁻¹`` — the noise whitening of eq. 19 — sees the same matrix)."""
    X = conditioned(6, 40, kappa, torch.Generator().manual_seed(int(kappa)))
    if layout == "column":
        X = X.mT.contiguous().mT
    Qh, Rh = torch.linalg.qr(X)
    Q, Rc = geo.cholesky_qr2(X)
    assert rel(Rc, Rh) < 1e-14
    assert rel(Q, Qh) < 1e-15 * kappa + 1e-14  # Q of an ill-conditioned X is itself sensitive (eps·κ)
    torch.testing.assert_close(Q.mT @ Q, torch.eye(R, dtype=F64).expand(6, R, R), rtol=0, atol=1e-14)
    assert rel(Q @ Rc, X) < 1e-15


def test_cholesky_qr2_failure_reads_as_rank_deficient() -> None:
    """A rank-deficient or non-finite matrix gets a NaN ``R`` (singular values 0 in the frame), the others are
    unaffected, so the rank check rejects exactly the failed ones."""
    X = torch.randn(3, 20, R, generator=torch.Generator().manual_seed(1), dtype=F64)
    X[0, :, 3] = X[0, :, 1]
    X[1, 5, 2] = float("nan")
    _, Rc = geo.cholesky_qr2(X)
    assert Rc[:2].isnan().all() and rel(Rc[2], torch.linalg.qr(X[2]).R) < 1e-14
    fr = geo.frames([(X, X)], cholesky=True)[0]
    mask = geo.full_rank_mask(X, fr.SA, 1e-8)
    assert mask.tolist() == [False, False, True]


def test_householder_signs_recover_lapack_from_any_column_signs() -> None:
    """On LAPACK's own ``Q`` the reconstructed signs are all +1; on ``Q`` with flipped columns they undo the
    flips — also where the pivots change sign along the elimination (negative leading block)."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(50, 12, R, generator=g, dtype=F64)
    X[:25, :R] = -torch.eye(R, dtype=F64) + 0.1 * X[:25, :R]
    Qh = torch.linalg.qr(X).Q
    assert torch.equal(geo.householder_signs(Qh), torch.ones(50, R, dtype=F64))
    flips = torch.where(torch.rand(50, R, generator=g) < 0.5, -1.0, 1.0).to(F64)
    assert torch.equal(geo.householder_signs(Qh * flips[:, None, :]), flips)


@pytest.mark.parametrize("kappa", [3.0, 2000.0])
@pytest.mark.parametrize("gram_inverse", [True, False])
@pytest.mark.parametrize("horizontal", [True, False])
@pytest.mark.parametrize("noise", [True, False])
def test_privatized_lift_equals_lift_noise_horizontalize(kappa: float, gram_inverse: bool, horizontal: bool,
                                                          noise: bool) -> None:
    """Eq. 17 in one pass equals the lift (eq. 14), plus τ times the eq.-19 noise of the same draws, then
    (optionally) horizontalised (Prop. A.11); ``gram_inverse`` (``N⁻¹`` formed) within its eps·κ² bound."""
    G, m, n = 5, 11, 9
    g = torch.Generator().manual_seed(7)
    A, B = conditioned(G, m, kappa, g), conditioned(G, n, kappa, g)
    gA, gB = torch.randn(G, m, R, generator=g, dtype=F64), torch.randn(G, n, R, generator=g, dtype=F64)
    fr, tau, scale = geo.frame(A, B), 0.7 if noise else 0.0, 1.0 / 3.0
    dA, dB = (x * scale for x in geo.lift(A, B, gA, gB, frame=fr))
    omega = None
    if noise:
        XiA, XiB = geo.tangent_noise(A, B, generator=torch.Generator().manual_seed(3), frame=fr)
        dA, dB = dA + tau * XiA, dB + tau * XiB
        draws = torch.Generator().manual_seed(3)
        omega = tuple(geo.standard_normal(X.shape, draws, F64, X.device) for X in (A, B))
    if horizontal:
        dA, dB = geo.horizontalize(A, B, dA, dB, frame=fr)
    out = (torch.empty_like(gA), torch.empty_like(gB))
    got = geo.privatized_lift(fr, gA, gB, scale, tau, omega, horizontal, gram_inverse, out=out)
    tol = 2e-15 * kappa**2 if gram_inverse else 2e-15 * kappa
    assert rel(got[0], dA) < tol and rel(got[1], dB) < tol
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    if noise:
        sq = geo.tangent_noise_sqnorm(fr, *omega)
        assert rel(sq, geo.intrinsic_sqnorm(A, B, XiA, XiB, frame=fr)) < 1e-13


def test_standard_normal_in_a_workspace_is_the_same_draw() -> None:
    """The workspace variant returns the same values and leaves the generator in the same state."""
    shape = (3, 7, 5)  # odd count: the pair layout's padding
    first, second = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    fresh = geo.standard_normal(shape, first, F64, torch.device("cpu"))
    work = (torch.full((106,), float("nan"), dtype=F64), torch.full((200,), float("nan"), dtype=F64))
    kept = geo.standard_normal(shape, second, F64, torch.device("cpu"), workspace=work)
    assert torch.equal(fresh, kept) and kept.data_ptr() == work[0].data_ptr()
    assert torch.equal(torch.randint(0, 2**62, (4,), generator=first), torch.randint(0, 2**62, (4,), generator=second))


def _params(G: int, m: int, n: int, seed: int) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(G):
        out[f"layers.{i}.proj.lora_A.default.weight"] = nn.Parameter(torch.randn(R, n, generator=g) / n**0.5)
        out[f"layers.{i}.proj.lora_B.default.weight"] = nn.Parameter(torch.randn(m, R, generator=g) / R**0.5)
    return out


@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
@pytest.mark.parametrize("batched", [True, False])
def test_dp_step_equals_the_unfused_building_blocks(compute_dtype: str, batched: bool) -> None:
    """Two DP steps (σ > 0): the privatised lift the step computes (CholeskyQR2 frame under float32, fused
    lift, kept buffers) equals the Householder frame's lift + tangent noise of the same draws +
    horizontalisation, and the new factors equal the plain Householder retraction (eq. 22) of it."""
    G, m, n, lr, denom = 3, 10, 8, 0.05, 4.0
    params = _params(G, m, n, seed=1)
    cfg = {"name": "prism", "lr": lr, "compute_dtype": compute_dtype, "preconditioner": "none"}
    method = PrismMethod(OmegaConf.create(cfg), params, PrivacySpec(sigma=0.9, clip_norm=1.0), batched=batched)
    captured = []
    inner = method.privatized_group
    method.privatized_group = lambda group, *a, **k: captured.append(inner(group, *a, **k)) or captured[-1]
    pairs = lora_pairs(params)
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        method.zero_accumulators()
        method.accumulate({name: torch.randn(2, *p.shape, generator=g) for name, p in params.items()})
        start = [tuple(x.detach().to(F64) for x in read_pair(params, p)) for p in pairs]
        sums = [(s[0].clone(), s[1].mT.clone()) for s in (grp.sums for grp in method.groups)]
        captured.clear()
        draws = torch.Generator().manual_seed(20 + step)
        method.step(denom, torch.Generator().manual_seed(20 + step), diagnostics=False)
        modules = 0
        for grp, (SA, SB), (dA_got, dB_got, _) in zip(method.groups, sums, captured):
            A = torch.stack([start[modules + i][0] for i in range(len(grp.pairs))])
            B = torch.stack([start[modules + i][1] for i in range(len(grp.pairs))])
            modules += len(grp.pairs)
            fr = geo.frame(A, B)  # Householder
            dA, dB = (x / denom for x in geo.lift(A, B, SA, SB, frame=fr))
            XiA, XiB = geo.tangent_noise(A, B, generator=draws, frame=fr)
            tau = method.tau(denom)
            dA, dB = geo.horizontalize(A, B, dA + tau * XiA, dB + tau * XiB, frame=fr)
            assert rel(dA_got, dA) < 1e-11 and rel(dB_got, dB) < 1e-11
            A_new, B_new = geo.retract(A, B, dA.to(getattr(torch, compute_dtype)).to(F64),
                                       dB.to(getattr(torch, compute_dtype)).to(F64), lr)
            for i, pair in enumerate(grp.pairs):
                got = [x.detach().to(F64) for x in read_pair(params, pair)]
                assert rel(got[0], A_new[i]) < 1e-6 and rel(got[1], B_new[i]) < 1e-6


@pytest.mark.parametrize("case", ["generic", "ill_conditioned", "rank_two", "rounding_noise", "zero"])
def test_block_basis_and_the_retraction_it_feeds(case: str) -> None:
    """:func:`geometry.block_basis` (CholeskyQR2 with shifted fallbacks) factors any finite block: ``QR = Y``,
    ``R`` upper triangular, ``Q`` orthonormal where ``Y`` has rank; and the retraction (eq. 22) built on it
    (the frame path) equals the one from Householder QRs of ``[A, ΔA]``, ``[B, ΔB]``, also when the new
    block is rank-deficient, at rounding level, or zero."""
    G, m, n = 3, 12, 10
    g = torch.Generator().manual_seed(5)
    A, B = conditioned(G, m, 20.0, g), conditioned(G, n, 20.0, g)
    fr = geo.frame(A, B)
    inside = A @ torch.randn(G, R, R, generator=g, dtype=F64)
    normal = {
        "generic": torch.randn(G, m, R, generator=g, dtype=F64),
        "ill_conditioned": conditioned(G, m, 1e6, g),
        "rank_two": torch.randn(G, m, 2, generator=g, dtype=F64) @ torch.randn(G, 2, R, generator=g, dtype=F64),
        "rounding_noise": torch.zeros(G, m, R, dtype=F64),
        "zero": None,
    }[case]
    dA = torch.zeros(G, m, R, dtype=F64) if normal is None else inside + normal  # zero: Y = 0 exactly
    dB = torch.randn(G, n, R, generator=g, dtype=F64)
    Y = dA - fr.QA @ (fr.QA.mT @ dA)
    Q, Rb = geo.block_basis(Y)
    assert Q.isfinite().all() and Rb.isfinite().all() and torch.equal(Rb, Rb.triu())
    assert (Q @ Rb - Y).norm() <= 1e-14 * dA.norm()
    if case == "zero":
        assert torch.equal(Y, torch.zeros_like(Y)) and torch.equal(Q, torch.zeros_like(Q)) and Rb.abs().max() < 1e-150
    rank = {"generic": R, "ill_conditioned": R, "rank_two": 2}.get(case, 0)
    if rank:
        Uy = torch.linalg.svd(Y).U[..., :rank]  # Q spans range(Y) orthonormally: its projection keeps norms
        if rank == R:
            assert (Q.mT @ Q - torch.eye(R, dtype=F64)).abs().max() < 1e-12
        assert (Q @ (Q.mT @ Uy) - Uy).norm() < 1e-10
    for horizontal in (False, True):
        ref = geo.retract(A, B, dA, dB, lr=0.3)
        got = geo.retract(A, B, dA, dB, lr=0.3, frame=fr, horizontal=horizontal)
        assert rel(got[0], ref[0]) < 1e-10 and rel(got[1], ref[1]) < 1e-10, (case, horizontal)


@pytest.mark.parametrize("defect", ["duplicate_column", "kappa_5000", "nan", "inf"])
def test_batched_float32_rank_check_decides_like_householder(defect: str) -> None:
    """Batched float32 ``compute_dtype`` under DP (CholeskyQR2 frames): a rank-deficient, too ill-conditioned
    or non-finite module is reported with the message the Householder frames give; ``rank_fallback: floor``
    repairs it and the frames then pass."""
    G, m, n = 3, 10, 8
    params = _params(G, m, n, seed=3)
    names = [f"layers.{i}.proj" for i in range(G)]
    A1 = params["layers.1.proj.lora_B.default.weight"]
    with torch.no_grad():
        if defect == "duplicate_column":
            A1[:, 2] = A1[:, 0]
        elif defect == "kappa_5000":
            A1.copy_(conditioned(1, m, 5000.0, torch.Generator().manual_seed(4))[0].float())
        else:
            A1[4, 1] = float(defect)
    A = torch.stack([params[f"{x}.lora_B.default.weight"].detach().double() for x in names])
    B = torch.stack([params[f"{x}.lora_A.default.weight"].detach().double().mT for x in names])
    with pytest.raises(geo.RankDeficientError) as expected:
        geo.check_full_rank(A, B, names, geo.default_rcond(torch.float32))
    cfg = {"name": "prism", "lr": 0.05}
    method = PrismMethod(OmegaConf.create(cfg), params, PrivacySpec(sigma=0.5, clip_norm=1.0))
    with pytest.raises(geo.RankDeficientError) as got:
        method.zero_accumulators()
    assert str(got.value) == str(expected.value) and "layers.1.proj" in str(got.value)
    if defect in ("duplicate_column", "kappa_5000"):
        method = PrismMethod(OmegaConf.create({**cfg, "rank_fallback": "floor"}), params,
                             PrivacySpec(sigma=0.5, clip_norm=1.0))
        method.zero_accumulators()
        geo.check_full_rank(method.groups[0].frame.A, method.groups[0].frame.B, names, geo.default_rcond(torch.float32))
