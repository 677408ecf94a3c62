"""Rank-space adaptive transform (eqs. 24–27) against closed forms, dense references and Monte Carlo."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry
from prism.mechanism.adaptive import (
    FactorMoments,
    RankSpaceAdaptive,
    moment_estimates,
    noise_second_moments,
    preconditioner,
    update_moments,
)
from prism.methods.schema import PrismConfig

F64 = torch.float64
M, N, R = 9, 7, 3



def knobs(**kw) -> PrismConfig:
    """PRISM's config with the released defaults but for ``kw`` (the adaptive transform's knobs)."""
    return PrismConfig(name="prism", lr=1.0, **kw)


RELEASED = knobs()
PAPER = knobs(preconditioner="ridge", floor_mode="geometry", debias=True, cond_max=None)


def factors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, R, generator=g, dtype=F64), torch.randn(N, R, generator=g, dtype=F64)


def run(cfg: PrismConfig, deltas, tau: float, sigmas) -> tuple[torch.Tensor, torch.Tensor]:
    ad = RankSpaceAdaptive(cfg, M, N, R, F64, torch.device("cpu"))
    for dA, dB in deltas:
        UA, UB = ad.step(dA, dB, tau, *sigmas)
    return UA, UB


def random_deltas(steps: int, scale: float = 1.0, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(M, R, generator=g, dtype=F64), scale * torch.randn(N, R, generator=g, dtype=F64))
            for _ in range(steps)]


@pytest.mark.parametrize("cfg", [PAPER, knobs(preconditioner="ridge")], ids=["geometry", "scalar"])
def test_ridge_bound_eq27_is_attained_when_noise_dominates(cfg: PrismConfig) -> None:
    """Thm 3.5: ‖m̂ (V̂+λI)^{-1/2}‖_F ≤ λ^{-1/2}‖m̂‖_F; tight when V̂ ≪ λ."""
    A, B = factors()
    sigmas = noise_second_moments(geometry.frame(A, B))
    tau = 0.3
    lam_A = cfg.floor_factor * tau**2 * (sigmas[0].trace().item() / R if cfg.floor_mode == "geometry" else 1.0)
    for scale, tight in ((3.0, False), (1e-4, True)):
        ad = RankSpaceAdaptive(cfg, M, N, R, F64, torch.device("cpu"))
        for dA, dB in random_deltas(4, scale):
            UA, _ = ad.step(dA, dB, tau, *sigmas)
        m_hat, _ = moment_estimates(cfg, ad.A, ad.t, tau, sigmas[0])
        ratio = (UA.norm() / (lam_A**-0.5 * m_hat.norm())).item()
        assert ratio <= 1.0 + 1e-12
        if tight:
            assert ratio > 0.999
        else:
            assert ratio < 0.9


def test_floor_bound_is_attained_when_noise_dominates() -> None:
    """Eigen-floor form: w ≥ λ ⇒ ‖U‖_F ≤ λ^{-1/2}‖m̂‖_F, with equality when V̂ ≪ λ."""
    A, B = factors()
    sigmas = noise_second_moments(geometry.frame(A, B))
    tau = 0.3
    lam = RELEASED.floor_factor * tau**2
    for scale, tight in ((3.0, False), (1e-4, True)):
        ad = RankSpaceAdaptive(RELEASED, M, N, R, F64, torch.device("cpu"))
        for dA, dB in random_deltas(4, scale):
            _, UB = ad.step(dA, dB, tau, *sigmas)
        m_hat, _ = moment_estimates(RELEASED, ad.B, ad.t, tau, sigmas[1])
        ratio = (UB.norm() / (lam**-0.5 * m_hat.norm())).item()
        assert ratio <= 1.0 + 1e-12
        assert (ratio > 0.999) == tight


@pytest.mark.parametrize("cfg", [RELEASED, PAPER, knobs(floor_mode="geometry", bias_correction=False)],
                         ids=["released", "paper", "floor-geometry-nobc"])
def test_orthogonal_gauge_equivariance_lemma_a30(cfg: PrismConfig) -> None:
    """Feeding (ΔA R, ΔB R) and noise moments RᵀΣR at every step gives (U_A R, U_B R)."""
    A, B = factors()
    sA, sB = noise_second_moments(geometry.frame(A, B))
    Rot, _ = torch.linalg.qr(torch.randn(R, R, dtype=F64))
    deltas = random_deltas(5, scale=0.2)
    UA, UB = run(cfg, deltas, 0.3, (sA, sB))
    UA_r, UB_r = run(cfg, [(dA @ Rot, dB @ Rot) for dA, dB in deltas], 0.3, (Rot.T @ sA @ Rot, Rot.T @ sB @ Rot))
    torch.testing.assert_close(UA_r, UA @ Rot, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(UB_r, UB @ Rot, rtol=1e-9, atol=1e-11)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.numpy().astype(np.float64)


def test_two_steps_match_dense_references() -> None:
    """Both preconditioners against references written with numpy / scipy, independent of the module."""
    A, B = factors()
    fr = geometry.frame(A, B)
    tau, b1, b2, t = 0.2, 0.9, 0.999, 2
    deltas = random_deltas(t, scale=0.5)
    Ninv = np.linalg.inv(_np(B.T @ B))
    Minv = np.linalg.inv(_np(A.T @ A))
    for k, (rows, cov) in enumerate(((M, (M - R) / M * Ninv), (N, Minv))):
        D = [_np(d[k]) for d in deltas]
        m1 = (1 - b1) * (b1 * D[0] + D[1])
        V = (1 - b2) * (b2 * D[0].T @ D[0] + D[1].T @ D[1]) / rows
        m_hat, V_hat = m1 / (1 - b1**t), V / (1 - b2**t)

        # paper: ridge, geometry floor, debias; U = m̂ (V̂ − τ²Σ)₊ + λI + eps)^{-1/2}
        Vd = V_hat - tau**2 * cov
        w, E = np.linalg.eigh(Vd)
        Vd_psd = E @ np.diag(np.maximum(w, 0)) @ E.T
        lam = 0.5 * tau**2 * np.trace(cov) / R
        ref_paper = m_hat @ scipy.linalg.fractional_matrix_power(Vd_psd + (lam + 1e-8) * np.eye(R), -0.5)
        got_paper = run(PAPER, deltas, tau, noise_second_moments(fr))[k]
        np.testing.assert_allclose(_np(got_paper), np.real(ref_paper), rtol=1e-8, atol=1e-10)

        # released: eigen floor max(w + eps, 0.5 τ²), condition clamp 1e4
        w, E = np.linalg.eigh(V_hat)
        w = np.array([max(max(x, 0.0) + 1e-8, 0.5 * tau**2) for x in w])
        w = np.maximum(w, w.max() / 1e4)
        ref_released = m_hat @ E @ np.diag(w**-0.5) @ E.T
        got_released = run(RELEASED, deltas, tau, noise_second_moments(fr))[k]
        np.testing.assert_allclose(_np(got_released), ref_released, rtol=1e-8, atol=1e-10)


def test_condition_clamp_bounds_preconditioner_condition_number() -> None:
    """Non-DP (λ = 0), rank-1 V̂ = vvᵀ: P has eigenvalues (‖v‖²+eps)^{-1/2} and ((‖v‖²+eps)/1e4)^{-1/2}."""
    v = torch.randn(R, dtype=F64)
    p = torch.linalg.eigvalsh(preconditioner(RELEASED, torch.outer(v, v), 0.0))
    w_max = v.square().sum().item() + 1e-8
    torch.testing.assert_close(p, torch.tensor([w_max**-0.5] + [(w_max / 1e4) ** -0.5] * (R - 1), dtype=F64))
    unclamped = torch.linalg.eigvalsh(preconditioner(knobs(cond_max=None), torch.outer(v, v), 0.0))
    assert unclamped.max().item() == pytest.approx(1e4)  # eps^{-1/2}: what the clamp prevents


@pytest.mark.parametrize("bias_correction", [True, False])
def test_debias_removes_the_known_noise_moment(bias_correction: bool) -> None:
    """Pure eq.-19 noise τΞ: E[V̂] = τ²Σ (eq. 50) and the debiased V̂ has mean ≈ 0 (Monte Carlo, 4 SE)."""
    A, B = factors()
    fr = geometry.frame(A, B)
    sigmas = noise_second_moments(fr)
    cfg = knobs(debias=True, bias_correction=bias_correction)
    S, T, tau = 4000, 3, 0.7
    g = torch.Generator().manual_seed(3)
    states = [FactorMoments(torch.zeros(S, M, R, dtype=F64), torch.zeros(S, R, R, dtype=F64)),
              FactorMoments(torch.zeros(S, N, R, dtype=F64), torch.zeros(S, R, R, dtype=F64))]
    for _ in range(T):
        XiA, XiB = sample_tangent_noise(A, B, generator=g, frame=fr, sample_shape=(S,))
        update_moments(cfg, states[0], tau * XiA)
        update_moments(cfg, states[1], tau * XiB)
    for state, sigma in zip(states, sigmas):
        _, V_hat = moment_estimates(cfg, state, T, tau, sigma)
        mean, se = V_hat.mean(0), V_hat.std(0) / S**0.5
        assert ((mean.abs() / se) < 4.0).all(), mean
        raw = moment_estimates(knobs(bias_correction=bias_correction), state, T, tau, sigma)[1].mean(0)
        assert raw.diagonal().min() > 10 * se.max()  # without debias the noise moment is clearly there


def test_config_rejects_unknown_choices() -> None:
    with pytest.raises(ValueError, match="preconditioner"):
        knobs(preconditioner="adam")
    with pytest.raises(ValueError, match="floor_mode"):
        knobs(floor_mode="trace")
    assert PrismConfig.from_node({"name": "prism", "lr": 1.0, "cond_max": None, "beta1": 0.5}) == knobs(
        cond_max=None, beta1=0.5)
