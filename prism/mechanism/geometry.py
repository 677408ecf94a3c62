"""Fixed-rank geometry of PRISM (paper §3, Algorithm 1, eqs. 11–23) as small batched torch functions.

Notation (paper §3.1): ``A ∈ R^{m×r}``, ``B ∈ R^{n×r}``, ``Z = A Bᵀ``, ``M = AᵀA``, ``N = BᵀB``,
``Π_A = A M⁻¹ Aᵀ``, ``Π_B = B N⁻¹ Bᵀ`` (eq. 12). Factor gradients ``g_A = G B`` and ``g_B = Gᵀ A``
for the intrinsic gradient ``G = ∇_Z ℓ``.

Conventions:

* ``A``, ``B`` are ``[..., m, r]``, ``[..., n, r]`` with the same leading *module* dims: one module is
  ``[m, r]``; a group of modules of one shape ``(m, n, r)`` is ``[G, m, r]`` and every function below
  then runs once, batched, for the whole group (torch.linalg batches QR, solves, eigh and SVD).
  Factor-space tangent quantities (``g_A``, ``ΔA``, …) may carry further leading dims in front of the
  module dims (per-example gradients of a group are ``[b, G, m, r]``); they broadcast.
* Nothing here forms an ``m×n`` matrix except :func:`tangent_project`, the dense reference.
* Gram inverses are never formed from ``AᵀA``: the thin QR ``A = Q_A R_A`` gives ``M = R_AᵀR_A``
  and ``Π_A = Q_A Q_Aᵀ`` (Lemma A.18), so a solve is a product with the ``r×r`` triangular inverse
  ``R_A⁻¹`` (formed once per step in the :class:`Frame`) and its error grows with ``κ(A)``, not
  ``κ(A)²``. No damping anywhere: a rank-deficient factor is an error (:func:`check_full_rank`), never a
  silently shrunk noise covariance (docs/DECISIONS.md D4, D20).
* Every thin QR is Householder (``torch.linalg.qr``); the retraction extends the frame's QR
  (:func:`extend_qr`) instead of factoring ``[A, ΔA]`` anew.
* Opt-in exceptions for the released protocol (docs/DECISIONS.md D4, D5): ``lift(rcond=…)`` uses
  eigenvalue-cut pseudo-inverses and ``tangent_noise(damping=…)`` the damped ``(N + δI)^{-1/2}``.
* The retraction (:func:`retraction_core`) computes in float64; everything else computes in the input dtype.
* Nothing here draws random numbers: the noise functions take unit draws (:mod:`prism.privacy.noise`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class RankDeficientError(ValueError):
    """A LoRA factor is rank-deficient or non-finite, so the tangent space of eq. 11 is undefined."""


class Frame(NamedTuple):
    """Per-step quantities of one module's factors, shared by every lift/norm/noise of that step.

    ``A = Q_A R_A``, ``B = Q_B R_B`` (thin QR, ``Q`` orthonormal, ``R`` upper triangular), so
    ``M = R_AᵀR_A``, ``N = R_BᵀR_B``, ``Π_A = Q_A Q_Aᵀ``, ``Π_B = Q_B Q_Bᵀ``; the SVDs
    ``R_A = · diag(s_A) V_Aᵀ``, ``R_B = · diag(s_B) V_Bᵀ`` give ``M = V_A diag(s_A²) V_Aᵀ``,
    ``N = V_B diag(s_B²) V_Bᵀ`` (for :func:`horizontalize`) and the singular values of ``A``, ``B``
    (for :func:`check_frames`). A non-finite ``R`` gets ``s = 0`` (the SVD fails on NaN). ``M``, ``N``
    themselves are never formed. ``RAi = R_A⁻¹``, ``RBi = R_B⁻¹`` (triangular solves against ``I``): every
    ``X R⁻¹`` of the step is then one batched product, ``eps·κ`` relative error like a triangular solve
    (each column of ``R⁻¹`` is a backward-stable solve) at a fraction of its cost on tall ``X``.
    """

    A: Tensor
    B: Tensor
    QA: Tensor
    RA: Tensor
    QB: Tensor
    RB: Tensor
    SA: Tensor
    VA: Tensor
    SB: Tensor
    VB: Tensor
    RAi: Tensor
    RBi: Tensor


def fused(fn: Callable[[Tensor], Tensor | tuple[Tensor, ...]], batches: Sequence[Tensor]) -> list[tuple[Tensor, ...]]:
    """``[fn(X) for X in batches]`` with one call of the batched matrix function ``fn`` per matrix shape.

    The batches' leading dims are flattened and concatenated, so e.g. one SVD serves every shape
    group of a step (one kernel chain and, on CUDA, one convergence check instead of one per group).
    """
    out: list[tuple[Tensor, ...] | None] = [None] * len(batches)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, X in enumerate(batches):
        by_shape.setdefault(tuple(X.shape[-2:]), []).append(i)
    for index in by_shape.values():
        flat = [batches[i].reshape(-1, *batches[i].shape[-2:]) for i in index]
        result = fn(flat[0] if len(flat) == 1 else torch.cat(flat))
        result = tuple(result) if isinstance(result, tuple) else (result,)
        sizes = [X.shape[0] for X in flat]
        parts = [part.split(sizes) for part in result]
        for j, i in enumerate(index):
            lead = batches[i].shape[:-2]
            out[i] = tuple(p[j].reshape(*lead, *p[j].shape[1:]) for p in parts)
    return out


def _safe_svd(R: Tensor) -> tuple[Tensor, Tensor]:
    """Singular values and right singular vectors of ``R``; non-finite matrices get zeros."""
    finite = torch.isfinite(R).flatten(-2).all(-1)[..., None, None]
    _, s, Vh = torch.linalg.svd(torch.where(finite, R, torch.zeros_like(R)).detach())
    return s, Vh.mT


def frames(factors: Sequence[tuple[Tensor, Tensor]]) -> list[Frame]:
    """:func:`frame` of several ``(A, B)`` batches: Householder thin QRs (``torch.linalg.qr``), then one SVD of
    all their ``R`` factors of equal rank and one triangular inverse of each (:func:`fused`)."""
    for A, B in factors:
        _check_pair(A, B)
    qrs = [(*torch.linalg.qr(A, mode="reduced"), *torch.linalg.qr(B, mode="reduced")) for A, B in factors]
    spectra = fused(_safe_svd, [R for _, RA, _, RB in qrs for R in (RA, RB)])
    inverses = fused(_triangular_inverse, [R for _, RA, _, RB in qrs for R in (RA, RB)])
    return [
        Frame(A=A, B=B, QA=QA, RA=RA, QB=QB, RB=RB,
              SA=spectra[2 * i][0], VA=spectra[2 * i][1], SB=spectra[2 * i + 1][0], VB=spectra[2 * i + 1][1],
              RAi=inverses[2 * i][0], RBi=inverses[2 * i + 1][0])
        for i, ((A, B), (QA, RA, QB, RB)) in enumerate(zip(factors, qrs))
    ]


def _triangular_inverse(R: Tensor) -> Tensor:
    """``R⁻¹`` of upper-triangular ``R`` [..., r, r] (one batched triangular solve against ``I``)."""
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    return torch.linalg.solve_triangular(R, eye, upper=True)


def frame(A: Tensor, B: Tensor) -> Frame:
    """Factor ``A``, ``B`` once per step (thin QR, Gram matrices and their spectra; Lemma A.18)."""
    return frames([(A, B)])[0]


def _check_pair(A: Tensor, B: Tensor) -> None:
    if A.ndim < 2 or A.ndim != B.ndim or A.shape[:-2] != B.shape[:-2] or A.shape[-1] != B.shape[-1]:
        raise ValueError(
            f"expected factors A [..., m, r] and B [..., n, r] with the same r and module dims, got "
            f"{tuple(A.shape)} and {tuple(B.shape)}; pass the paper's A = lora_B.weight and "
            "B = lora_A.weightᵀ (prism.mechanism.lora)"
        )
    (m, r), n = A.shape[-2:], B.shape[-2]
    if r > min(m, n):
        raise ValueError(f"rank r={r} exceeds min(m, n)={min(m, n)}; lower lora.r")


def _frame(A: Tensor, B: Tensor, fr: Frame | None) -> Frame:
    return frame(A, B) if fr is None else fr


def _project(Q: Tensor, X: Tensor) -> Tensor:
    """``Q Qᵀ X`` for orthonormal ``Q`` [p, r] and ``X`` [..., p, k]."""
    return Q @ (Q.mT @ X)


def _solve_gram(X: Tensor, R_inv: Tensor) -> Tensor:
    """``X (RᵀR)⁻¹`` as ``(X R⁻¹) R⁻ᵀ``: two products with the triangular inverse (never ``(RᵀR)⁻¹``
    itself, whose rounding would grow with ``κ(R)²``)."""
    return (X @ R_inv) @ R_inv.mT


def tangent_project(A: Tensor, B: Tensor, G: Tensor) -> Tensor:
    """Eq. 13: ``P_{A,B}(G) = Π_A G + G Π_B − Π_A G Π_B`` (dense reference; ``G`` [..., m, n])."""
    _check_pair(A, B)
    QA, _ = torch.linalg.qr(A, mode="reduced")
    QB, _ = torch.linalg.qr(B, mode="reduced")
    PA_G = _project(QA, G)
    G_PB = _project(QB, G.mT).mT
    return PA_G + G_PB - _project(QB, PA_G.mT).mT


def lift(
    A: Tensor, B: Tensor, gA: Tensor, gB: Tensor, frame: Frame | None = None, rcond: float | None = None
) -> tuple[Tensor, Tensor]:
    """Eq. 14, canonical lift of factor gradients ``g_A = G B`` [..., m, r], ``g_B = Gᵀ A`` [..., n, r].

    ``ΔA = g_A N⁻¹ − ½ Π_A (g_A N⁻¹)``, ``ΔB = g_B M⁻¹ − ½ Π_B (g_B M⁻¹)``, so that
    ``ΔA Bᵀ + A ΔBᵀ = P_{A,B}(G)`` (Lemma A.14). ``rcond`` (released protocol, docs/DECISIONS.md D5):
    use the pseudo-inverses ``N^†``, ``M^†`` of eq. 14 with eigenvalues ``≤ rcond·λ_max`` zeroed
    instead of the exact inverses (equal for a well-conditioned full-rank pair).
    """
    fr = _frame(A, B, frame)
    if rcond is None:
        YA = _solve_gram(gA, fr.RBi)
        YB = _solve_gram(gB, fr.RAi)
    else:
        YA = gA @ _gram_function(fr.SB, fr.VB, lambda w: _pinv_eigenvalues(w, rcond))
        YB = gB @ _gram_function(fr.SA, fr.VA, lambda w: _pinv_eigenvalues(w, rcond))
    return YA.sub_(_project(fr.QA, YA), alpha=0.5), YB.sub_(_project(fr.QB, YB), alpha=0.5)  # Y: fresh products


def _pinv_eigenvalues(w: Tensor, rcond: float) -> Tensor:
    """``1/w`` where ``w > rcond·max(w)`` (per module), else 0 (the eigenvalue map of a pseudo-inverse)."""
    return torch.where(w > rcond * w.amax(-1, keepdim=True), 1.0 / w, torch.zeros_like(w))


def _gram_function(S: Tensor, V: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``V diag(fn(w)) Vᵀ`` for the Gram matrix ``RᵀR = V diag(w) Vᵀ``, ``w = S²`` (the frame's SVD of ``R``)."""
    return (V * fn(S.square()).unsqueeze(-2)) @ V.mT


def intrinsic_sqnorm(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, frame: Frame | None = None
) -> Tensor:
    """Eq. 15, ``‖ΔA Bᵀ + A ΔBᵀ‖²_F``, as a sum of three non-negative block norms.

    With ``X_A = ΔA R_Bᵀ``, ``X_B = ΔB R_Aᵀ`` the image is ``X_A Q_Bᵀ + Q_A X_Bᵀ``; splitting it into
    the orthogonal blocks ``Q_A(Q_AᵀX_A + X_BᵀQ_B)Q_Bᵀ``, ``(I − Π_A)X_A Q_Bᵀ`` and ``Q_A X_Bᵀ(I − Π_B)``
    gives the same value as the trace form ``tr(ΔAᵀΔA N) + tr(ΔBᵀΔB M) + 2 tr((AᵀΔA)(BᵀΔB))``
    without its cancellation: the trace form loses ``eps·κ²`` relative accuracy (1.35× under-estimates
    at κ = 2,500 in float32), this form ``eps·κ`` (times the lift's vertical-to-image ratio).
    Valid for any lift of the tangent vector (Prop. A.15); batched ``dA`` [b, m, r] gives ``[b]``.
    """
    fr = _frame(A, B, frame)
    XA = dA @ fr.RB.mT
    XB = dB @ fr.RA.mT
    cA = fr.QA.mT @ XA
    cB = fr.QB.mT @ XB
    core = (cA + cB.mT).square().sum((-2, -1))
    return core + (XA - fr.QA @ cA).square().sum((-2, -1)) + (XB - fr.QB @ cB).square().sum((-2, -1))


def tangent_noise(fr: Frame, omega_A: Tensor, omega_B: Tensor, damping: float | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 19 at unit scale from unit draws: factor noise whose image ``Ξ_A Bᵀ + A Ξ_Bᵀ`` has the law of ``P_{A,B}(Ξ)``.

    With ``Ξ`` dense N(0, I), ``P(Ξ) = Q_A (Q_AᵀΞ) + (I − Π_A)(Ξ Q_B) Q_Bᵀ``; the two blocks
    ``Q_AᵀΞ`` and ``(I − Π_A)Ξ`` are independent, so ``P(Ξ) =_d Q_A Ω_Bᵀ + (I − Π_A) Ω_A Q_Bᵀ``
    with independent ``Ω_A ~ N(0, I_{m×r})``, ``Ω_B ~ N(0, I_{n×r})`` (Lemmas A.17–A.19), the caller's
    draws (``[..., m, r]``, ``[..., n, r]``; leading sample dims broadcast). In factors:
    ``Ξ_A = (I − Π_A) Ω_A R_B⁻ᵀ``, ``Ξ_B = Ω_B R_A⁻ᵀ`` — the rows of ``Ω R⁻ᵀ`` have covariance
    ``R⁻¹R⁻ᵀ = N⁻¹`` (resp. ``M⁻¹``), the law of the paper's ``Ω N^{-1/2}``. The caller multiplies by
    ``σC/b`` (eq. 17).

    ``damping`` (released protocol, docs/DECISIONS.md D4): whiten with the symmetric
    ``(N + damping·I)^{-1/2}``, ``(M + damping·I)^{-1/2}`` instead, as the released code does with
    ``1e-8``; the row covariance becomes ``(N + damping·I)⁻¹``, slightly below the ``N⁻¹`` the
    accountant assumes. ``0.0`` gives the exact law through the symmetric root.
    """
    outside = omega_A - _project(fr.QA, omega_A)
    if damping is not None:
        if damping < 0:
            raise ValueError(f"damping={damping} must be >= 0 (method.noise_damping)")
        return (outside @ _gram_function(fr.SB, fr.VB, lambda w: (w + damping).rsqrt()),
                omega_B @ _gram_function(fr.SA, fr.VA, lambda w: (w + damping).rsqrt()))
    return outside @ fr.RBi.mT, omega_B @ fr.RAi.mT


def horizontalize(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, frame: Frame | None = None
) -> tuple[Tensor, Tensor]:
    """Minimum-factor-norm representative ``(ΔA + AΩ, ΔB − BΩᵀ)`` of the tangent vector (Prop. A.11).

    ``Ω`` solves the Sylvester equation ``M Ω + Ω N = ΔBᵀB − AᵀΔA`` (the stationarity condition of
    ``‖ΔA + AΩ‖² + ‖ΔB − BΩᵀ‖²``; eq. 39 prints ``BᵀΔB`` — a transpose typo), via the
    eigendecompositions ``M = U diag(μ) Uᵀ``, ``N = V diag(ν) Vᵀ`` of the frame:
    ``Ω = U [(UᵀCV)_ij / (μ_i + ν_j)] Vᵀ``. The result satisfies ``AᵀΔA' = (BᵀΔB')ᵀ`` (eq. 30).
    """
    fr = _frame(A, B, frame)
    Omega = _sylvester_gauge(fr, dB.mT @ fr.B - fr.A.mT @ dA)
    return (fr.A @ Omega).add_(dA), (fr.B @ Omega.mT).neg_().add_(dB)  # in place on the fresh products


def _sylvester_gauge(fr: Frame, C: Tensor) -> Tensor:
    """The ``Ω`` of :func:`horizontalize`: ``M Ω + Ω N = C`` in the frame's eigenbases of ``M``, ``N``."""
    mu, U, nu, V = fr.SA.square(), fr.VA, fr.SB.square(), fr.VB
    return U @ ((U.mT @ C @ V) / (mu[..., :, None] + nu[..., None, :])) @ V.mT


ROUNDING_MARGIN = 8.0  # constant of lifted_norm_terms' error bound (docs/DECISIONS.md D70)


def lifted_norm_terms(fr: Frame, gA: Tensor, gB: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. 14–16 from factor gradients: the squared norm of the lift's image, a bound on its rounding, and
    the squared whitened factor norm.

    With ``X_A = g_A R_B⁻¹``, ``X_B = g_B R_A⁻¹``, ``c_A = Q_AᵀX_A``, ``c_B = Q_BᵀX_B`` the image of the lift
    (eq. 14) of ``(g_A, g_B)`` has the orthogonal blocks ``Q_A ½(c_A + c_Bᵀ) Q_Bᵀ``, ``(I − Π_A) X_A Q_Bᵀ`` and
    ``Q_A X_Bᵀ (I − Π_B)`` (``= P(G)`` of eq. 13 when ``g_A = GB``, ``g_B = GᵀA``). Each block is formed
    explicitly, so its norm carries the rounding of one product, never a difference of squares (which
    loses everything on a pair that is mostly a gauge direction ``(AΩ, −BΩᵀ)``). Returns ``(sq, err, fsq)``,
    ``[*lead, *F]`` each for ``gA`` ``[*lead, *F, m, r]``, ``gB`` ``[*lead, *F, n, r]`` and a frame of batch ``F``
    (``lead``: e.g. the examples):

    * ``sq``: the computed ``‖image‖²``;
    * ``err ≥ ‖computed blocks − exact blocks‖`` for the frame's ``(Q, R⁻¹)``,
      ``err = c·eps·(√r(κ_A + κ_B) + (m + n)(r + 1))·(‖X_A‖ + ‖X_B‖)``: the products with ``R⁻¹`` round at
      ``γ_r √r κ`` of ``‖X‖`` (``‖g‖ ≤ ‖X‖‖R‖``), the projections and the sums of squares at ``γ_m``, ``γ_{mr}``;
    * ``fsq = ‖X_A‖² + ‖X_B‖²``, at most ``2‖P(G)‖²`` for gradients ``(GB, GᵀA)`` (``X_A = GQ_B``, ``X_B = GᵀQ_A``).

    The clip norm (eq. 16, :meth:`prism.methods.prism.PrismMethod.accumulate`) is
    ``max(√Σsq + √Σerr², √(Σfsq/2))`` over modules: an upper bound of the exact norm for every factor pair,
    equal to the image norm for every gradient of the form ``(GB, GᵀA)``, and it bounds a gauge-dominated
    pair's factor size, whose lift and horizontalisation would otherwise round into the image at
    ``eps·κ²`` of that size (docs/DECISIONS.md D70).
    """
    (m, r), n = fr.A.shape[-2:], fr.B.shape[-2]
    lead = gA.shape[: gA.ndim - fr.A.ndim]
    L = math.prod(lead)
    XA, XB = _whitened_columns(gA, fr.RBi, L), _whitened_columns(gB, fr.RAi, L)  # [*F, p, L·r]
    cA, cB = fr.QA.mT @ XA, fr.QB.mT @ XB

    def sqnorm(colsq: Tensor) -> Tensor:  # squared column norms [*F, L·r] → per example [*lead, *F]
        return colsq.unflatten(-1, (L, r)).sum(-1).movedim(-1, 0).reshape(lead + fr.A.shape[:-2])

    def residual(X: Tensor, Q: Tensor, c: Tensor) -> Tensor:  # ‖X − Qc‖² by column, in place on Qc
        return (Q @ c).sub_(X).square_().sum(-2)

    cBt = cB.unflatten(-1, (L, r)).transpose(-3, -1).flatten(-2, -1)  # example i's c_Bᵀ in its columns
    sq = sqnorm((0.5 * (cA + cBt)).square_().sum(-2) + residual(XA, fr.QA, cA) + residual(XB, fr.QB, cB))
    kappa = fr.SA[..., 0] / fr.SA[..., -1] + fr.SB[..., 0] / fr.SB[..., -1]
    eta = ROUNDING_MARGIN * torch.finfo(XA.dtype).eps * (math.sqrt(r) * kappa + (m + n) * (r + 1))
    nA, nB = sqnorm(XA.square().sum(-2)).sqrt(), sqnorm(XB.square().sum(-2)).sqrt()
    return sq, eta * (nA + nB), nA.square() + nB.square()


def _whitened_columns(g: Tensor, R_inv: Tensor, L: int) -> Tensor:
    """``g R⁻¹`` for all examples at once: ``g`` ``[*lead, *F, p, r]`` (``L = Π lead``) → ``[*F, p, L·r]``,
    example ``i``'s product in columns ``i·r … i·r + r − 1``.

    With the examples beside the columns, each product of :func:`lifted_norm_terms` with a frame matrix
    (``R⁻¹``, ``Qᵀ``, ``Q``) is one matrix product per frame, with the per-example product's inner
    dimension, hence its rounding.
    """
    p = g.shape[-2]
    g = g.reshape(L, *g.shape[g.ndim - R_inv.ndim:]).movedim(0, -2).contiguous()  # [*F, p, L, r]
    return (g.flatten(-3, -2) @ R_inv).unflatten(-2, (p, L)).flatten(-2, -1)


class Retraction(NamedTuple):
    """Eq. 22's thin QRs ``[A, ΔA] = Q_u R_u``, ``[B, ΔB] = Q_v R_v`` (``Q`` as column blocks) and the core."""

    Qu: tuple[Tensor, ...]
    Qv: tuple[Tensor, ...]
    Ru: Tensor
    Rv: Tensor
    core: Tensor


def extend_qr(Q: Tensor, R: Tensor, X: Tensor, C: Tensor | None = None, shift: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
    """Thin QR of ``[Q R, X + Q·shift]`` from the thin QR ``Q R`` of its first block (block Gram–Schmidt): ``(Q₂, R_full)``.

    ``X = Q C + Y`` with ``C = QᵀX`` (pass it if known) taken twice ("twice is enough": ``Y ⟂ Q`` to
    rounding), then the thin QR ``Y = Q₂R₂``: ``[QR, X + Q·shift] = [Q, Q₂] [[R, C + shift], [0, R₂]]``.
    Where ``Y`` is (numerically) zero, ``R₂`` is too, so ``Q₂`` never reaches the retracted factors (the
    core, hence its singular vectors, weight it by ``R₂``); eq. 22's point does not depend on the basis
    ``Q₂`` of ``span(Y)``. A component ``Q·shift`` inside ``span(Q)`` costs only ``r×r`` work; the frame's
    QR of ``A`` is reused instead of factoring ``[A, ΔA]`` anew.
    """
    C = Q.mT @ X if C is None else C
    Y = X - Q @ C
    C2 = Q.mT @ Y
    Y = Y - Q @ C2
    Q2, R2 = torch.linalg.qr(Y, mode="reduced")
    top = torch.cat([R, C + C2 if shift is None else C + C2 + shift], dim=-1)
    return Q2, torch.cat([top, torch.cat([torch.zeros_like(R2), R2], dim=-1)], dim=-2)


def retraction_core(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, lr: float, frame: Frame, horizontal: bool = False,
) -> Retraction:
    """Eq. 22, first half: the thin QRs of ``[A, ΔA]``, ``[B, ΔB]`` and the core ``R_u K R_vᵀ``, in float64.

    ``[A, ΔA] K [B, ΔB]ᵀ`` with ``K = [[I, −lr I], [−lr I, 0]]`` equals ``Z − lr (ΔA Bᵀ + A ΔBᵀ)`` (no
    ``lr² ΔAΔBᵀ`` term). The QRs extend the ``frame``'s (:func:`extend_qr`; a frame in another dtype is
    refactored in float64 first). ``horizontal``: retract the :func:`horizontalize`-d direction
    ``(ΔA + AΩ, ΔB − BΩᵀ)``, whose gauge term, inside ``span(A)``, ``span(B)``, enters as ``r×r`` shifts
    ``R_A Ω``, ``−R_B Ωᵀ`` (``Ω`` from ``Q_AᵀΔA``, ``Q_BᵀΔB``).
    """
    _check_pair(A, B)
    r = A.shape[-1]
    if frame.QA.dtype != torch.float64:
        frame = frames([(A.to(torch.float64), B.to(torch.float64))])[0]
    dA64, dB64 = dA.to(torch.float64), dB.to(torch.float64)
    CA, CB = frame.QA.mT @ dA64, frame.QB.mT @ dB64
    shifts = (None, None)
    if horizontal:  # AᵀΔA = R_AᵀC_A, ΔBᵀB = C_BᵀR_B
        Omega = _sylvester_gauge(frame, CB.mT @ frame.RB - frame.RA.mT @ CA)
        shifts = (frame.RA @ Omega, -(frame.RB @ Omega.mT))
    Q2u, Ru = extend_qr(frame.QA, frame.RA, dA64, C=CA, shift=shifts[0])
    Q2v, Rv = extend_qr(frame.QB, frame.RB, dB64, C=CB, shift=shifts[1])
    # R_u K without forming K: R_u K = [R_u1 − lr R_u2, −lr R_u1] for R_u = [R_u1, R_u2].
    RuK = torch.cat([Ru[..., :r] - lr * Ru[..., r:], -lr * Ru[..., :r]], dim=-1)
    return Retraction(Qu=(frame.QA, Q2u), Qv=(frame.QB, Q2v), Ru=Ru, Rv=Rv, core=RuK @ Rv.mT)


def balanced_coefficients(core_svd: tuple[Tensor, Tensor, Tensor], r: int) -> tuple[Tensor, Tensor]:
    """Eq. 22, second half, in the QR bases: ``A' = Q_u M_A``, ``B' = Q_v M_B`` with ``M_A = U_c √S_r``, ``M_B = V_c √S_r``."""
    Uc, S, Vch = core_svd
    root = S[..., None, :r].sqrt()
    return Uc[..., :r] * root, Vch[..., :r, :].mT * root


def procrustes_target(rt: Retraction, MA: Tensor, MB: Tensor) -> Tensor:
    """``A'ᵀA + B'ᵀB = M_AᵀR_{u1} + M_BᵀR_{v1}`` (``A = Q_u R_{u1}``, ``R_{u1}`` the first ``r`` columns of ``R_u``): ``2r×r`` work only."""
    r = MA.shape[-1]
    return MA.mT @ rt.Ru[..., :r] + MB.mT @ rt.Rv[..., :r]


def procrustes_rotation(target_svd: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """``Q = U'V'ᵀ`` from the SVD of ``A'ᵀA + B'ᵀB = U'ΣV'ᵀ`` (App. A.24)."""
    Up, _, Vph = target_svd
    return Up @ Vph


def block_product(blocks: tuple[Tensor, ...], M: Tensor) -> Tensor:
    """``[Q_1, Q_2, …] M`` without concatenating the blocks: ``Σ_b Q_b M_b`` over the matching row blocks of ``M``."""
    out, width = None, 0
    for Qb in blocks:
        part = Qb @ M[..., width:width + Qb.shape[-1], :]
        out = part if out is None else out + part
        width += Qb.shape[-1]
    return out


DP_RCOND = 1e-4  # under DP no factor with κ > 1e4 is admitted, whatever compute_dtype (docs/DECISIONS.md D70)


def default_rcond(dtype: torch.dtype, dp: bool = False) -> float:
    """Relative singular-value cutoff: ``√eps`` (float32 ≈ 3.5e-4, float64 ≈ 1.5e-8); under DP at least
    :data:`DP_RCOND`, where the float64 lift and horizontalisation round at ``eps64·κ² ≤ 1.1e-8``."""
    cutoff = math.sqrt(torch.finfo(dtype).eps)
    return max(cutoff, DP_RCOND) if dp else cutoff


def full_rank_mask(X: Tensor, s: Tensor, rcond: float) -> Tensor:
    """Device-side ``[...]`` bool: factor ``X`` [..., p, r] with singular values ``s`` [..., r] (descending,
    0 when non-finite) is finite with ``σ_min > rcond·σ_max``. No host synchronisation. Finiteness from the
    extremes (NaN propagates through ``aminmax``, ±inf is an extreme): one reduction, no mask of ``X``."""
    low, high = torch.aminmax(X.flatten(-2), dim=-1)
    return low.isfinite() & high.isfinite() & (s[..., -1] > rcond * s[..., 0])


def _admissible(X: Tensor, s: Tensor, rcond: float) -> Tensor:
    """:func:`full_rank_mask`'s test with finiteness from the sum of ``X`` (one cheap reduction): a non-finite
    entry makes the sum non-finite; finite entries whose sum overflows are flagged too, and
    :func:`check_frames` then decides them by the exact mask (a conservative screen, never a miss)."""
    return X.sum((-2, -1)).isfinite() & (s[..., -1] > rcond * s[..., 0])


def check_frames(frames: list[Frame], modules: list[list[str]], rcond: float | None = None) -> None:
    """Raise :class:`RankDeficientError` unless every factor of every frame is finite and full rank.

    ``frames[g]`` holds the factors of the modules named ``modules[g]`` (batched ``[G, m, r]`` or one
    module ``[m, r]``). Reads the singular values the frames already hold (no further SVD) with one
    host read per call; the offending module is looked up only on failure. ``rcond`` defaults to
    :func:`default_rcond` of the factors' dtype (solves then lose at most ``√eps`` relative
    accuracy). The tangent space (eq. 11), the lift (eq. 14) and the noise sampler (eq. 19) need
    full column rank.
    """
    if not frames:
        return
    cutoff = default_rcond(frames[0].A.dtype) if rcond is None else rcond
    masks = [_admissible(X, sv, cutoff).all()
             for fr in frames for X, sv in ((fr.A, fr.SA), (fr.B, fr.SB))]
    if bool(torch.stack(masks).all()):  # the one host read
        return
    for fr, names in zip(frames, modules):
        for side, X, sv in (("A (peft lora_B)", fr.A, fr.SA), ("B (peft lora_A)", fr.B, fr.SB)):
            for module, Xi, si in zip(names, X.reshape(-1, *X.shape[-2:]), sv.reshape(-1, sv.shape[-1])):
                if bool(full_rank_mask(Xi, si, cutoff)):
                    continue
                if not torch.isfinite(Xi).all():
                    raise RankDeficientError(
                        f"{module}: LoRA factor {side} has non-finite entries; lower the learning rate or "
                        "the noise, or restart from the last checkpoint"
                    )
                ratio = (si[-1] / si[0]).item() if si[0] > 0 else 0.0
                raise RankDeficientError(
                    f"{module}: LoRA factor {side} is rank-deficient (σ_min/σ_max = {ratio:.3g} ≤ rcond "
                    f"{cutoff:.3g}); PRISM needs full-rank factors — use method.init=spectral instead of "
                    "the peft zero init, or lower lora.r"
                )


def check_full_rank(A: Tensor, B: Tensor, module: str | list[str], rcond: float | None = None) -> None:
    """:func:`check_frames` for one module (``module`` a name) or one batch ``[G, m, r]`` (``G`` names)."""
    names = [module] if isinstance(module, str) else list(module)
    check_frames([frame(A, B)], [names], rcond)


def tangent_dim(m: int, n: int, r: int) -> int:
    """``dim T_Z M_r = r(m + n − r)`` (§3.1)."""
    return r * (m + n - r)


def factor_noise_energy(A: Tensor, B: Tensor, tau: float) -> float:
    """Eq. 8: first-order ``E‖ξ_A Bᵀ + A ξ_Bᵀ‖²_F = τ²(m‖B‖²_F + n‖A‖²_F)`` for factor DP-SGD."""
    m, n = A.shape[0], B.shape[0]
    return tau**2 * (m * B.square().sum().item() + n * A.square().sum().item())


def bilinear_noise_energy(m: int, n: int, r: int, tau: float) -> float:
    """Eq. 9: ``E‖ξ_A ξ_Bᵀ‖²_F = m n r τ⁴``."""
    return m * n * r * tau**4


def one_sided_noise_energy(A: Tensor, B: Tensor, tau: float, noised: str) -> float:
    """Eq. 32 (Prop. A.6): noise on one factor only — ``τ² m‖B‖²_F`` (``noised="A"``) or ``τ² n‖A‖²_F`` (``"B"``).

    FFA trains the paper's ``A`` (peft ``lora_B``) and freezes ``B``, so its energy is the ``"A"`` case;
    there is no bilinear term.
    """
    if noised == "A":
        return tau**2 * A.shape[0] * B.square().sum().item()
    if noised == "B":
        return tau**2 * B.shape[0] * A.square().sum().item()
    raise ValueError(f"noised={noised!r}; choose 'A' or 'B'")


def prism_effective_noise(m: int, n: int, r: int, tau: float) -> float:
    """Eq. 21: PRISM's effective intrinsic noise ``E_Z = τ √(r(m + n − r))`` with ``τ = σC/b``."""
    return tau * math.sqrt(tangent_dim(m, n, r))


def gauge_noise_energy(A: Tensor, B: Tensor, tau: float, c: float) -> float:
    """Eq. 33 (Prop. A.7): first-order energy of factor DP at the gauge ``(cA, c⁻¹B)``,
    ``τ²(m‖B‖²_F / c² + n c² ‖A‖²_F)`` — unbounded as ``c → 0`` or ``∞`` (Cor. 2.3)."""
    m, n = A.shape[0], B.shape[0]
    return tau**2 * (m * B.square().sum().item() / c**2 + n * c**2 * A.square().sum().item())


def optimal_gauge(A: Tensor, B: Tensor) -> float:
    """Eq. 34: the minimiser ``c* = (m‖B‖²_F / (n‖A‖²_F))^{1/4}`` of :func:`gauge_noise_energy`."""
    m, n = A.shape[0], B.shape[0]
    return (m * B.square().sum().item() / (n * A.square().sum().item())) ** 0.25


