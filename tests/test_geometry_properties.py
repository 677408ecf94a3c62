"""Property tests of prism.mechanism.geometry over random shapes (m, n ≤ 64, r ≤ 8), float64 dense references."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.audit.diagnostics import sample_tangent_noise
from prism.mechanism import geometry as geo
from tests.oracles import retract

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    m = draw(st.integers(1, 64))
    n = draw(st.integers(1, 64))
    r = draw(st.integers(1, min(m, n, 8)))
    b = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64)

    return {"A": randn(m, r), "B": randn(n, r), "G": randn(b, m, n), "dA": randn(b, m, r), "dB": randn(b, n, r)}


@SETTINGS
@given(problems())
def test_lift_and_norm_match_dense_projection(p: dict[str, torch.Tensor]) -> None:
    A, B, G = p["A"], p["B"], p["G"]
    P = geo.tangent_project(A, B, G)
    dA, dB = geo.lift(A, B, G @ B, G.mT @ A)
    scale = 1.0 + P.abs().max().item()
    assert (dA @ B.mT + A @ dB.mT - P).abs().max() <= 1e-9 * scale
    assert torch.allclose(geo.intrinsic_sqnorm(A, B, dA, dB), P.square().sum((-2, -1)), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(problems())
def test_horizontalize_properties(p: dict[str, torch.Tensor]) -> None:
    A, B, dA, dB = p["A"], p["B"], p["dA"], p["dB"]
    hA, hB = geo.horizontalize(A, B, dA, dB)
    dZ = dA @ B.mT + A @ dB.mT
    assert torch.allclose(hA @ B.mT + A @ hB.mT, dZ, atol=1e-9 * (1 + dZ.abs().max().item()))
    assert torch.allclose(A.mT @ hA, (B.mT @ hB).mT, atol=1e-8 * (1 + hA.abs().max().item()))
    # least norm: never larger than the input lift
    before = dA.square().sum((-2, -1)) + dB.square().sum((-2, -1))
    after = hA.square().sum((-2, -1)) + hB.square().sum((-2, -1))
    assert (after <= before * (1 + 1e-12)).all()


@SETTINGS
@given(problems(), st.floats(0.0, 2.0))
def test_retract_attains_eckart_young_error(p: dict[str, torch.Tensor], lr: float) -> None:
    A, B, dA, dB = p["A"], p["B"], p["dA"][0], p["dB"][0]
    r = A.shape[1]
    X = A @ B.mT - lr * (dA @ B.mT + A @ dB.mT)
    A2, B2 = retract(A, B, dA, dB, lr)
    S = torch.linalg.svdvals(X)
    err = (A2 @ B2.mT - X).norm()
    optimum = S[r:].square().sum().sqrt()  # Eckart–Young: the best rank-r error
    assert abs(err - optimum) <= 1e-8 * (1 + S[0])
    assert err <= lr**2 * (dA @ dB.mT).norm() + 1e-8 * (1 + S[0])  # eq. 23
    assert torch.allclose(A2.mT @ A2, B2.mT @ B2, atol=1e-8 * (1 + S[0]))


@SETTINGS
@given(problems())
def test_noise_lies_in_tangent_space(p: dict[str, torch.Tensor]) -> None:
    A, B = p["A"], p["B"]
    XiA, XiB = sample_tangent_noise(A, B, generator=torch.Generator().manual_seed(0), sample_shape=(2,))
    E = XiA @ B.mT + A @ XiB.mT
    assert torch.allclose(geo.tangent_project(A, B, E), E, atol=1e-8 * (1 + E.abs().max().item()))
    # the A-part is orthogonal to col(A) (eq. 19: (I − Π_A) Ω_A …)
    assert (A.mT @ XiA).abs().max() <= 1e-8 * (1 + A.abs().max() * XiA.abs().max())
