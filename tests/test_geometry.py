"""prism.mechanism.geometry against dense references, closed forms and brute force (paper eqs. 8–23)."""
from __future__ import annotations

import math

import pytest
import torch

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry as geo
from tests.oracles import prism_noise_energy, retract

F64 = torch.float64


def _factors(m: int, n: int, r: int, dtype: torch.dtype = F64, seed: int = 2024) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g, dtype=dtype), torch.randn(n, r, generator=g, dtype=dtype)


def _ill_conditioned(r: int, cond: float, seed: int = 1) -> torch.Tensor:
    """A random R ∈ GL(r) with condition number ``cond``."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=F64))
    return U @ torch.diag(torch.logspace(0, math.log10(cond), r, dtype=F64)) @ V.mT


def _gauge(A: torch.Tensor, B: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A R, B R⁻ᵀ)``: the same Z (eq. 2)."""
    return A @ R, torch.linalg.solve(R, B.mT).mT


def _vec(X: torch.Tensor) -> torch.Tensor:
    """Column-stacking vec over the last two dims (the convention of eq. 46)."""
    return X.mT.reshape(*X.shape[:-2], -1)


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm()).item()


# ----------------------------------------------------------------------------- lift and norm (eqs. 13–15)


@pytest.mark.parametrize("use_frame", [False, True])
def test_lift_image_is_dense_tangent_projection(use_frame: bool) -> None:
    m, n, r, b = 11, 8, 3, 5
    A, B = _factors(m, n, r)
    G = torch.randn(b, m, n, dtype=F64)
    kwargs = {"frame": geo.frame(A, B)} if use_frame else {}
    dA, dB = geo.lift(A, B, G @ B, G.mT @ A, **kwargs)
    assert dA.shape == (b, m, r) and dB.shape == (b, n, r)
    P = geo.tangent_project(A, B, G)
    assert (dA @ B.mT + A @ dB.mT - P).abs().max() <= 1e-10
    # single example, unbatched
    dA0, dB0 = geo.lift(A, B, G[0] @ B, G[0].mT @ A)
    assert (dA0 @ B.mT + A @ dB0.mT - P[0]).abs().max() <= 1e-10


def test_tangent_project_is_pinv_formula_and_idempotent() -> None:
    A, B = _factors(9, 6, 2)
    G = torch.randn(9, 6, dtype=F64)
    PA, PB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
    P = geo.tangent_project(A, B, G)
    assert torch.allclose(P, PA @ G + G @ PB - PA @ G @ PB, atol=1e-12)
    assert torch.allclose(geo.tangent_project(A, B, P), P, atol=1e-12)
    # normal part Π_A^⊥ G Π_B^⊥ is orthogonal to the tangent part (Lemma A.9)
    assert abs(((G - P) * P).sum().item()) <= 1e-10


def test_lift_matches_explicit_inverse_formula() -> None:
    A, B = _factors(10, 7, 3)
    gA, gB = torch.randn(10, 3, dtype=F64), torch.randn(7, 3, dtype=F64)
    PA, PB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
    YA, YB = gA @ torch.linalg.inv(B.mT @ B), gB @ torch.linalg.inv(A.mT @ A)
    dA, dB = geo.lift(A, B, gA, gB)
    assert torch.allclose(dA, YA - 0.5 * PA @ YA, atol=1e-12)
    assert torch.allclose(dB, YB - 0.5 * PB @ YB, atol=1e-12)


def test_lift_float32() -> None:
    A, B = _factors(12, 9, 4, dtype=torch.float32)
    G = torch.randn(3, 12, 9)
    dA, dB = geo.lift(A, B, G @ B, G.mT @ A)
    assert dA.dtype == torch.float32
    P = geo.tangent_project(A.double(), B.double(), G.double())
    assert _rel((dA @ B.mT + A @ dB.mT).double(), P) <= 1e-5


def test_intrinsic_sqnorm_is_dense_norm_for_any_lift() -> None:
    m, n, r, b = 10, 7, 3, 4
    A, B = _factors(m, n, r)
    G = torch.randn(b, m, n, dtype=F64)
    dA, dB = geo.lift(A, B, G @ B, G.mT @ A)
    dense = geo.tangent_project(A, B, G).square().sum((-2, -1))
    s2 = geo.intrinsic_sqnorm(A, B, dA, dB)
    assert s2.shape == (b,)
    assert torch.allclose(s2, dense, rtol=1e-10)
    assert torch.allclose(geo.intrinsic_sqnorm(A, B, dA, dB, frame=geo.frame(A, B)), dense, rtol=1e-10)
    # vertical shift (AΩ, −BΩᵀ) changes the lift but not the tangent vector (eq. 38, Prop. A.15)
    Omega = 3.0 * torch.randn(b, r, r, dtype=F64)
    vA, vB = dA + A @ Omega, dB - B @ Omega.mT
    assert not torch.allclose(vA, dA)
    assert torch.allclose(geo.intrinsic_sqnorm(A, B, vA, vB), dense, rtol=1e-10)


def test_rank_one_norm_closed_form() -> None:
    """Eq. 42: ‖P(u vᵀ)‖² = ‖û‖²‖v‖² + ‖u‖²‖v̂‖² − ‖û‖²‖v̂‖²."""
    A, B = _factors(8, 6, 2)
    u, v = torch.randn(8, dtype=F64), torch.randn(6, dtype=F64)
    G = torch.outer(u, v)
    uh, vh = A @ torch.linalg.lstsq(A, u[:, None]).solution, B @ torch.linalg.lstsq(B, v[:, None]).solution
    expected = uh.square().sum() * v.square().sum() + u.square().sum() * vh.square().sum()
    expected = expected - uh.square().sum() * vh.square().sum()
    dA, dB = geo.lift(A, B, G @ B, G.mT @ A)
    assert torch.allclose(geo.intrinsic_sqnorm(A, B, dA, dB), expected, rtol=1e-10)


# ----------------------------------------------------------------------------- gauge invariance (Thm 3.3)

GAUGES = [("ill-conditioned R", None)] + [(f"c={c:g}", c) for c in (1e-3, 1e-1, 1.0, 10.0, 1e3)]


@pytest.mark.parametrize(("label", "c"), GAUGES, ids=[g[0] for g in GAUGES])
def test_gauge_invariance_of_projected_gradient_norm_and_clip(label: str, c: float | None) -> None:
    m, n, r, b = 12, 9, 4, 6
    A, B = _factors(m, n, r)
    R = _ill_conditioned(r, 1e4) if c is None else c * torch.eye(r, dtype=F64)
    A2, B2 = _gauge(A, B, R)
    assert torch.allclose(A2 @ B2.mT, A @ B.mT, rtol=1e-10, atol=1e-10)
    G = torch.randn(b, m, n, dtype=F64)

    def clip_quantities(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gA, gB = G @ B, G.mT @ A
        dA, dB = geo.lift(A, B, gA, gB)
        s = geo.intrinsic_sqnorm(A, B, dA, dB).sqrt()
        factor_sq = gA.square().sum((-2, -1)) + gB.square().sum((-2, -1))
        return dA @ B.mT + A @ dB.mT, s, factor_sq

    dZ, s, f = clip_quantities(A, B)
    dZ2, s2, f2 = clip_quantities(A2, B2)
    assert _rel(dZ2, dZ) <= 1e-8
    assert _rel(s2, s) <= 1e-8
    C = s.median().item()  # clipping active for about half the examples
    alpha, alpha2 = torch.clamp(C / s, max=1.0), torch.clamp(C / s2, max=1.0)
    assert (alpha < 1).any() and _rel(alpha2, alpha) <= 1e-8
    if c != 1.0:  # eq. 4: the factor-space norm moves with the gauge
        assert _rel(f2, f) > 1e-2


# ----------------------------------------------------------------------------- noise sampler (eq. 19, Thm 3.1)


def _projection_covariance(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Eq. 46 with column-stacking vec: (I_n ⊗ Π_A) + (Π_B ⊗ I_m) − (Π_B ⊗ Π_A)."""
    m, n = A.shape[0], B.shape[0]
    PA, PB = A @ torch.linalg.pinv(A), B @ torch.linalg.pinv(B)
    In, Im = torch.eye(n, dtype=F64), torch.eye(m, dtype=F64)
    return torch.kron(In, PA) + torch.kron(PB, Im) - torch.kron(PB, PA)


def _covariance_mismatch(A: torch.Tensor, B: torch.Tensor, XiA: torch.Tensor, XiB: torch.Tensor) -> float:
    """Largest |Ĉ − C| in units of its Monte-Carlo standard error sqrt((C_ii C_jj + C_ij²)/draws)."""
    X = _vec(XiA @ B.mT + A @ XiB.mT)
    draws = X.shape[0]
    C_hat = X.mT @ X / draws
    C = _projection_covariance(A, B)
    d = torch.diagonal(C)
    se = ((torch.outer(d, d) + C.square()) / draws).sqrt()
    return ((C_hat - C).abs() / se.clamp_min(1e-3 / math.sqrt(draws))).max().item()


def test_projection_covariance_reference_matches_dense_projection() -> None:
    """The eq.-46 Kronecker formula (and its vec convention) against the dense operator of eq. 13."""
    A, B = _factors(4, 3, 2)
    m, n = 4, 3
    basis = torch.eye(m * n, dtype=F64).reshape(m * n, n, m).mT  # vec⁻¹ of the unit vectors
    P = _vec(geo.tangent_project(A, B, basis)).mT
    assert torch.allclose(P, _projection_covariance(A, B), atol=1e-12)


@pytest.mark.parametrize("gauge", [False, True])
def test_sampler_law_equals_dense_projection(gauge: bool) -> None:
    m, n, r, draws = 7, 5, 2, 40_000
    A, B = _factors(m, n, r)
    if gauge:
        A, B = _gauge(A, B, _ill_conditioned(r, 1e2, seed=3))
    g = torch.Generator().manual_seed(123)
    XiA, XiB = sample_tangent_noise(A, B, generator=g, sample_shape=(draws,))
    assert XiA.shape == (draws, m, r) and XiB.shape == (draws, n, r)
    assert _covariance_mismatch(A, B, XiA, XiB) < 5.0
    sq = (XiA @ B.mT + A @ XiB.mT).square().sum((-2, -1))
    d = int(torch.linalg.matrix_rank(_projection_covariance(A, B)))  # dim T_Z M_r, by brute force (eq. 46)
    assert abs(sq.mean().item() - d) < 3 * math.sqrt(2 * d / draws)  # χ²_d: variance 2d
    assert prism_noise_energy(m, n, r, 1.0) == d  # eq. 20 in closed form: τ² r(m + n − r)


def test_sampler_negative_controls_fail_the_law_test() -> None:
    """The covariance test detects an unwhitened or damped sampler (docs/DECISIONS.md D4: no damping)."""
    m, n, r, draws = 7, 5, 2, 40_000
    A, B = _factors(m, n, r)
    A, B = 0.05 * A, 20.0 * B  # same Z-scale, small Gram M so damping +1e-2 matters
    g = torch.Generator().manual_seed(7)
    OmA = torch.randn(draws, m, r, generator=g, dtype=F64)
    OmB = torch.randn(draws, n, r, generator=g, dtype=F64)
    PA = A @ torch.linalg.pinv(A)
    M, N = A.mT @ A, B.mT @ B

    def inv_sqrt(S: torch.Tensor) -> torch.Tensor:
        w, V = torch.linalg.eigh(S)
        return V @ torch.diag(w.rsqrt()) @ V.mT

    exact = ((OmA - PA @ OmA) @ inv_sqrt(N), OmB @ inv_sqrt(M))  # eq. 19 literally
    unwhitened = (OmA - PA @ OmA, OmB)
    damped = ((OmA - PA @ OmA) @ inv_sqrt(N + 1e-2 * torch.eye(r, dtype=F64)), OmB @ inv_sqrt(M + 1e-2 * torch.eye(r, dtype=F64)))
    assert _covariance_mismatch(A, B, *exact) < 5.0
    assert _covariance_mismatch(A, B, *unwhitened) > 20.0
    assert _covariance_mismatch(A, B, *damped) > 20.0


def test_sampler_rank_space_moments() -> None:
    """Eq. 50: E[Ξ_AᵀΞ_A] = (m − r) N⁻¹, E[Ξ_BᵀΞ_B] = n M⁻¹."""
    m, n, r, draws = 9, 6, 3, 20_000
    A, B = _factors(m, n, r)
    XiA, XiB = sample_tangent_noise(A, B, generator=torch.Generator().manual_seed(5), sample_shape=(draws,))
    EA = (XiA.mT @ XiA).mean(0)
    EB = (XiB.mT @ XiB).mean(0)
    assert _rel(EA, (m - r) * torch.linalg.inv(B.mT @ B)) < 0.03
    assert _rel(EB, n * torch.linalg.inv(A.mT @ A)) < 0.03


def test_sampler_is_reproducible_and_float32() -> None:
    A, B = _factors(16, 12, 4, dtype=torch.float32)
    first = sample_tangent_noise(A, B, generator=torch.Generator().manual_seed(9))
    second = sample_tangent_noise(A, B, generator=torch.Generator().manual_seed(9), frame=geo.frame(A, B))
    assert first[0].dtype == torch.float32 and first[0].shape == (16, 4) and first[1].shape == (12, 4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    # the draw lies in the tangent space
    E = first[0] @ B.mT + A @ first[1].mT
    assert _rel(geo.tangent_project(A, B, E), E) < 1e-5


def test_factor_and_bilinear_noise_energy_closed_forms() -> None:
    """Eqs. 8–9 against Monte Carlo of factor-space noise ξ_A, ξ_B ~ N(0, τ²)."""
    m, n, r, tau, draws = 6, 5, 2, 0.7, 50_000
    A, B = _factors(m, n, r)
    g = torch.Generator().manual_seed(11)
    xA = tau * torch.randn(draws, m, r, generator=g, dtype=F64)
    xB = tau * torch.randn(draws, n, r, generator=g, dtype=F64)
    first = (xA @ B.mT + A @ xB.mT).square().sum((-2, -1)).mean().item()
    bilinear = (xA @ xB.mT).square().sum((-2, -1)).mean().item()
    assert first == pytest.approx(geo.factor_noise_energy(A, B, tau), rel=0.02)
    assert bilinear == pytest.approx(geo.bilinear_noise_energy(m, n, r, tau), rel=0.03)


# ----------------------------------------------------------------------------- horizontalisation (Prop. A.11)


def _brute_force_horizontal(A, B, dA, dB) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin over Ω of ‖ΔA + AΩ‖² + ‖ΔB − BΩᵀ‖² by least squares over vec(Ω)."""
    r = A.shape[1]
    cols = []
    for k in range(r * r):
        E = torch.zeros(r * r, dtype=F64)
        E[k] = 1.0
        E = E.reshape(r, r)
        cols.append(torch.cat([(A @ E).reshape(-1), (-B @ E.mT).reshape(-1)]))
    L = torch.stack(cols, 1)
    rhs = -torch.cat([dA.reshape(-1), dB.reshape(-1)])
    Omega = torch.linalg.lstsq(L, rhs[:, None]).solution.reshape(r, r)
    return dA + A @ Omega, dB - B @ Omega.mT


def test_horizontalize_is_least_norm_representative() -> None:
    m, n, r = 9, 7, 3
    A, B = _factors(m, n, r)
    A = A @ _ill_conditioned(r, 30.0)  # unbalanced, non-commuting Grams
    dA, dB = _factors(m, n, r, seed=42)
    hA, hB = geo.horizontalize(A, B, dA, dB)
    bA, bB = _brute_force_horizontal(A, B, dA, dB)
    assert torch.allclose(hA, bA, atol=1e-10) and torch.allclose(hB, bB, atol=1e-10)
    assert torch.allclose(hA @ B.mT + A @ hB.mT, dA @ B.mT + A @ dB.mT, atol=1e-12)
    assert torch.allclose(A.mT @ hA, (B.mT @ hB).mT, atol=1e-10)  # eq. 30
    # the paper's printed eq.-39 right-hand side BᵀΔB − AᵀΔA gives a larger factor norm (typo)
    M, N = A.mT @ A, B.mT @ B
    C_typo = B.mT @ dB - A.mT @ dA
    I = torch.eye(r, dtype=F64)
    sylvester = torch.kron(I, M) + torch.kron(N, I)  # vec(MΩ + ΩN), N symmetric
    Omega_typo = torch.linalg.solve(sylvester, _vec(C_typo)).reshape(r, r).mT
    typo_norm = (dA + A @ Omega_typo).square().sum() + (dB - B @ Omega_typo.mT).square().sum()
    assert typo_norm > hA.square().sum() + hB.square().sum() + 1e-6


def test_horizontalize_batched_and_idempotent() -> None:
    A, B = _factors(8, 6, 2)
    dA, dB = torch.randn(4, 8, 2, dtype=F64), torch.randn(4, 6, 2, dtype=F64)
    hA, hB = geo.horizontalize(A, B, dA, dB, frame=geo.frame(A, B))
    for i in range(4):
        one = geo.horizontalize(A, B, dA[i], dB[i])
        assert torch.allclose(hA[i], one[0], atol=1e-12) and torch.allclose(hB[i], one[1], atol=1e-12)
    again = geo.horizontalize(A, B, hA, hB)
    assert torch.allclose(again[0], hA, atol=1e-12) and torch.allclose(again[1], hB, atol=1e-12)


# ----------------------------------------------------------------------------- retraction (eq. 22–23)


def _retraction_case(seed: int = 2024, lr: float = 0.3):
    m, n, r = 10, 8, 3
    A, B = _factors(m, n, r, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    dA, dB = torch.randn(m, r, generator=g, dtype=F64), torch.randn(n, r, generator=g, dtype=F64)
    X = A @ B.mT - lr * (dA @ B.mT + A @ dB.mT)  # first-order point
    return A, B, dA, dB, lr, X


@pytest.mark.parametrize("align", [False, True])
def test_retract_is_truncated_svd_of_first_order_point(align: bool) -> None:
    A, B, dA, dB, lr, X = _retraction_case()
    r = A.shape[1]
    A2, B2 = retract(A, B, dA, dB, lr, align=align)
    U, S, Vh = torch.linalg.svd(X)
    best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
    Z2 = A2 @ B2.mT
    assert torch.allclose(Z2, best, atol=1e-10)
    assert torch.linalg.matrix_rank(Z2).item() == r
    # eq. 23: distortion ≤ lr² ‖ΔA ΔBᵀ‖_F
    assert (Z2 - X).norm() <= lr**2 * (dA @ dB.mT).norm() + 1e-12
    # balanced refactorisation: A'ᵀA' = B'ᵀB' (= S_r, diagonal, before alignment)
    assert torch.allclose(A2.mT @ A2, B2.mT @ B2, atol=1e-10)
    if not align:
        assert torch.allclose(A2.mT @ A2, torch.diag(S[:r]), atol=1e-10)


def test_retract_procrustes_alignment() -> None:
    A, B, dA, dB, lr, _ = _retraction_case(seed=2, lr=0.05)
    A2, B2 = retract(A, B, dA, dB, lr, align=True)
    S = A2.mT @ A + B2.mT @ B
    assert torch.allclose(S, S.mT, atol=1e-10)
    assert torch.linalg.eigvalsh(S).min() >= -1e-10
    # alignment can only move the new factors closer to the old ones
    U, Vt = retract(A, B, dA, dB, lr, align=False)
    aligned = (A2 - A).square().sum() + (B2 - B).square().sum()
    unaligned = (U - A).square().sum() + (Vt - B).square().sum()
    assert aligned <= unaligned + 1e-12


def test_retract_zero_step_and_dtype() -> None:
    A, B = _factors(7, 5, 2, dtype=torch.float32)
    zA, zB = torch.zeros_like(A), torch.zeros_like(B)
    A2, B2 = retract(A, B, zA, zB, lr=0.1)
    assert A2.dtype == torch.float32 and A2.shape == A.shape and B2.shape == B.shape
    assert _rel((A2 @ B2.mT).double(), (A @ B.mT).double()) < 1e-6
    A3, B3 = retract(A.double(), B.double(), torch.randn(7, 2, dtype=F64), torch.randn(5, 2, dtype=F64), lr=0.0)
    assert torch.allclose(A3 @ B3.mT, (A @ B.mT).double(), atol=1e-6)


# ----------------------------------------------------------------------------- rank check (docs/DECISIONS.md D20)


def test_check_full_rank_accepts_full_rank() -> None:
    A, B = _factors(9, 7, 3)
    geo.check_full_rank(A, B, module="layers.0.q_proj")
    geo.check_full_rank(A.float(), B.float(), module="layers.0.q_proj")


@pytest.mark.parametrize("defect", ["zero_A", "duplicate_column_B", "nan_A", "inf_B"])
def test_check_full_rank_raises_naming_module(defect: str) -> None:
    A, B = _factors(9, 7, 3)
    if defect == "zero_A":  # peft's default init puts the zeros in the paper's A
        A = torch.zeros_like(A)
    elif defect == "duplicate_column_B":
        B[:, 2] = B[:, 0]
    elif defect == "nan_A":
        A[3, 1] = float("nan")
    else:
        B[0, 0] = float("inf")
    with pytest.raises(geo.RankDeficientError, match="model.layers.3.v_proj") as info:
        geo.check_full_rank(A, B, module="model.layers.3.v_proj")
    assert isinstance(info.value, ValueError)


def test_shape_errors_name_the_fix() -> None:
    A, B = _factors(9, 7, 3)
    with pytest.raises(ValueError, match="same r"):
        geo.frame(A, B[:, :2])
    with pytest.raises(ValueError, match="lora.r"):
        geo.frame(torch.randn(2, 3, dtype=F64), torch.randn(5, 3, dtype=F64))


def test_tangent_dim_and_energies() -> None:
    assert geo.tangent_dim(4096, 4096, 16) == 16 * (8192 - 16)
    assert geo.bilinear_noise_energy(3, 4, 2, 0.5) == pytest.approx(3 * 4 * 2 * 0.5**4)
    assert prism_noise_energy(3, 4, 2, 0.5) == pytest.approx(0.25 * 2 * 5)
    A, B = torch.ones(3, 2), 2 * torch.ones(4, 2)
    assert geo.factor_noise_energy(A, B, 0.5) == pytest.approx(0.25 * (3 * 32 + 4 * 6))
