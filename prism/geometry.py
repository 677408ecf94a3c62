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
  ``κ(A)²`` — except where a caller bounds ``κ`` and asks for ``M⁻¹ = R_A⁻¹R_A⁻ᵀ`` itself
  (:func:`privatized_lift`'s ``gram_inverse``, docs/DECISIONS.md D66). No damping anywhere: a rank-deficient factor is
  an error (:func:`check_full_rank`), never a silently shrunk noise covariance (docs/DECISIONS.md D4, D20).
* Thin QRs are Householder (``torch.linalg.qr``) except :func:`frames` with ``cholesky`` (:func:`cholesky_qr2`:
  the same ``Q``, ``R`` for the factors the float32 rank check admits) and the retraction's new block,
  which :func:`block_basis` factors (GEMM passes instead of Householder sweeps; docs/DECISIONS.md D66).
* Opt-in exceptions for the released protocol (docs/DECISIONS.md D4, D5): ``lift(rcond=…)`` uses
  eigenvalue-cut pseudo-inverses and ``tangent_noise(damping=…)`` the damped ``(N + δI)^{-1/2}``.
* :func:`retract` computes in float64 internally (its cost is ``O((m+n) r²)`` once per step per
  module) and returns the input dtype; everything else computes in the input dtype.
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


def frame_part(fr: Frame, j: slice) -> Frame:
    """Modules ``j`` of a batched frame ``[G, …]``: the frame of that smaller batch (views, no copy)."""
    return Frame(*(x[j] for x in fr))


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


def frames(factors: Sequence[tuple[Tensor, Tensor]], cholesky: bool = False,
           work: Sequence[tuple[Tensor, Tensor]] | None = None) -> list[Frame]:
    """:func:`frame` of several ``(A, B)`` batches, with one SVD of all their ``R`` factors of equal rank.

    ``cholesky``: thin QRs by :func:`cholesky_qr2` (one :func:`householder_signs` call for all factors)
    instead of Householder; ``work``: its two workspaces per factor, in the order ``A₁, B₁, A₂, …``."""
    for A, B in factors:
        _check_pair(A, B)
    matrices = [X for pair in factors for X in pair]
    if cholesky:
        starts = [_cholesky_qr2_start(X, None if work is None else work[i][0]) for i, X in enumerate(matrices)]
        signs = fused(householder_signs, [start.top for start in starts])
        flat = [_cholesky_qr2_finish(start, d, None if work is None else work[i][1])
                for i, (start, (d,)) in enumerate(zip(starts, signs))]
    else:
        flat = [tuple(torch.linalg.qr(X, mode="reduced")) for X in matrices]
    qrs = [(*flat[2 * i], *flat[2 * i + 1]) for i in range(len(factors))]
    spectra = fused(_safe_svd, [R for _, RA, _, RB in qrs for R in (RA, RB)])
    inverses = fused(_triangular_inverse, [R for _, RA, _, RB in qrs for R in (RA, RB)])
    return [
        Frame(A=A, B=B, QA=QA, RA=RA, QB=QB, RB=RB,
              SA=spectra[2 * i][0], VA=spectra[2 * i][1], SB=spectra[2 * i + 1][0], VB=spectra[2 * i + 1][1],
              RAi=inverses[2 * i][0], RBi=inverses[2 * i + 1][0])
        for i, ((A, B), (QA, RA, QB, RB)) in enumerate(zip(factors, qrs))
    ]


def householder_signs(Q: Tensor) -> Tensor:
    """``d`` [..., r] in ``{±1}`` with ``Q·diag(d)`` the ``Q`` of LAPACK's Householder QR (``geqrf``) of ``Q R``.

    Householder reconstruction from a tall-skinny QR: elimination on the top ``r×r`` block of ``Q`` with
    ``d_j = −sign`` of each pivot (sign(0) = +, as LAPACK's reflector ``β = −sign(α)‖x‖``) reproduces the reflectors of ``geqrf``, whose ``R`` is
    ``diag(d)`` times the positive-diagonal ``R``. (``geqrf`` skips a reflector, ``β = α``, for a column
    already zero below its diagonal; there the signs can differ.) ``O(r³)`` work on ``r×r`` blocks."""
    r = Q.shape[-1]
    M = Q[..., :r, :r].clone()
    d = torch.empty(Q.shape[:-2] + (r,), dtype=Q.dtype, device=Q.device)
    for j in range(r):
        pivot = M[..., j, j]
        d[..., j] = torch.where(pivot >= 0, -1.0, 1.0)
        M[..., j, j] = pivot - d[..., j]  # |pivot − d_j| ≥ 1: no small divisor
        if j + 1 < r:
            column = M[..., j + 1:, j] / M[..., j, j, None]
            M[..., j + 1:, j + 1:] -= column[..., :, None] * M[..., j, None, j + 1:]
    return d


def cholesky_qr2(X: Tensor, work: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Thin QR ``X = Q R`` by CholeskyQR2 (``R₁ = chol(XᵀX)``, ``Q₁ = X R₁⁻¹``, the same again on ``Q₁``), with
    the signs of Householder's (:func:`householder_signs`), so ``Q``, ``R`` equal ``torch.linalg.qr``'s to rounding.

    Four passes over ``X`` (two Gram products, two products with ``r×r`` triangular inverses), against the
    Householder QR's column-by-column sweeps: GEMM work. Accurate (``‖QᵀQ − I‖`` and ``‖X − QR‖/‖X‖`` at
    ``O(eps)``) while ``κ(X) ≲ 1/√(eps·m r)`` — for float64 ``X`` and
    ``m r ≤ 2·10⁵`` above ``10⁵``, beyond the ``κ ≤ 1/√eps32 = 2,896`` that the float32 rank check admits.
    Where a Cholesky factorisation fails or ``X`` is not finite, that matrix's ``R`` is NaN (the rank check
    then rejects it; no host read here). ``work``: two tensors shaped like ``X`` (contiguous) for ``Q₁``
    and ``Q``."""
    start = _cholesky_qr2_start(X, None if work is None else work[0])
    return _cholesky_qr2_finish(start, householder_signs(start.top), None if work is None else work[1])


class _CholeskyStart(NamedTuple):
    """:func:`cholesky_qr2` up to the signs: ``Q₁ = X R₁⁻¹``, ``R₁``, ``R₂``, ``R₂⁻¹``, the top ``r×r`` block of
    ``Q₁R₂⁻¹`` (for :func:`householder_signs`) and whether both Cholesky factorisations succeeded."""

    Q1: Tensor
    R1: Tensor
    R2: Tensor
    R2i: Tensor
    top: Tensor
    ok: Tensor


def _cholesky_qr2_start(X: Tensor, out: Tensor | None) -> _CholeskyStart:
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
    R1, info1 = torch.linalg.cholesky_ex(X.mT @ X, upper=True)
    Q1 = torch.matmul(X, torch.linalg.solve_triangular(R1, eye, upper=True), out=out)
    R2, info2 = torch.linalg.cholesky_ex(Q1.mT @ Q1, upper=True)
    R2i = torch.linalg.solve_triangular(R2, eye, upper=True)
    return _CholeskyStart(Q1, R1, R2, R2i, Q1[..., : X.shape[-1], :] @ R2i, (info1 == 0) & (info2 == 0))


def _cholesky_qr2_finish(start: _CholeskyStart, d: Tensor, out: Tensor | None) -> tuple[Tensor, Tensor]:
    """``Q = Q₁R₂⁻¹diag(d)``, ``R = diag(d)R₂R₁`` (NaN where a factorisation failed or ``R`` is not finite)."""
    Q = torch.matmul(start.Q1, start.R2i * d[..., None, :], out=out)
    R = (start.R2 @ start.R1) * d[..., :, None]
    ok = start.ok & R.isfinite().flatten(-2).all(-1)
    return Q, torch.where(ok[..., None, None], R, torch.full_like(R, math.nan))


def block_basis(Y: Tensor, work: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``Y = Q R`` with ``R`` upper triangular and ``Q`` orthonormal wherever ``Y`` has rank, for any finite ``Y``
    (also rank-deficient or zero): CholeskyQR2 whose Cholesky factorisations fall back to a shifted Gram.

    Each of the two passes factors ``XᵀX = RᵀR`` (``X = Y``, then ``Q₁ = Y R₁⁻¹``); where that Cholesky
    fails (a numerically singular Gram), it factors ``XᵀX + δI`` with ``δ = (p + r + 1)·eps·‖X‖²_F + tiny``
    (``p`` rows), above the Gram's rounding, so it always succeeds — decided per matrix on the ``r×r``
    factors, with no host read. ``Q R = Y`` holds by construction (``Q = Y (R₂R₁)⁻¹``, backward error
    ``eps·κ(Y)``); ``Q`` is orthonormal to ``O(eps)`` while ``κ(Y) ≲ 1/√(eps·p r)`` (as :func:`cholesky_qr2`).
    Where a pass needed the shift, ``Q`` is orthonormal to about ``δ/‖X‖²_F`` along the directions of ``Y``
    above ``√δ`` and short along those below, which carry only their ``R`` rows, that small (a zero ``Y``
    gives ``Q = 0``, ``R ≈ 0``). Four ``p×r`` GEMM passes; the signs are Cholesky's (positive diagonal), not
    Householder's. ``work``: two tensors shaped like ``Y`` for ``Q₁``, ``Q``.
    """
    eye = torch.eye(Y.shape[-1], dtype=Y.dtype, device=Y.device)
    rows, r = Y.shape[-2:]

    def factor(X: Tensor) -> Tensor:
        gram = X.mT @ X
        R, info = torch.linalg.cholesky_ex(gram, upper=True)
        delta = (rows + r + 1) * torch.finfo(X.dtype).eps * gram.diagonal(dim1=-2, dim2=-1).sum(-1)
        shifted, _ = torch.linalg.cholesky_ex(gram + (delta + torch.finfo(X.dtype).tiny)[..., None, None] * eye,
                                              upper=True)
        ok = (info == 0) & R.isfinite().flatten(-2).all(-1)
        return torch.where(ok[..., None, None], R, shifted)

    R1 = factor(Y)
    Q1 = torch.matmul(Y, torch.linalg.solve_triangular(R1, eye, upper=True), out=None if work is None else work[0])
    R2 = factor(Q1)
    Q = torch.matmul(Q1, torch.linalg.solve_triangular(R2, eye, upper=True), out=None if work is None else work[1])
    return Q, R2 @ R1


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
            "B = lora_A.weightᵀ (prism.lora)"
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


def lifted_sqnorm(
    A: Tensor, B: Tensor, gA: Tensor, gB: Tensor, frame: Frame | None = None
) -> Tensor:
    """Eqs. 14–15 from the factor gradients: ``‖ΔA Bᵀ + A ΔBᵀ‖²_F`` of the lift of ``(g_A, g_B)``, unformed.

    With ``X_A = g_A R_B⁻¹`` (``= G Q_B``), ``X_B = g_B R_A⁻¹`` (``= GᵀQ_A``), ``c_A = Q_AᵀX_A`` and
    ``c_B = Q_BᵀX_B``, the lift's image (eq. 14) has the orthogonal blocks ``Q_A ½(c_A + c_Bᵀ) Q_Bᵀ``,
    ``(I − Π_A) X_A Q_Bᵀ`` and ``Q_A X_Bᵀ (I − Π_B)``, so its squared norm is
    ``¼‖c_A + c_Bᵀ‖² + (‖X_A‖² − ‖c_A‖²) + (‖X_B‖² − ‖c_B‖²)`` (``= ‖P(G)‖²`` of eq. 13 when
    ``g_A = GB``, ``g_B = GᵀA``). One product with ``R⁻¹`` and one ``r``-row product per factor — a third
    of the lift plus :func:`intrinsic_sqnorm` — so per-example clipping (eq. 16) never forms the lift;
    the clipped sum is lifted once (the lift is linear). The two differences lose at most
    ``eps·(‖X_A‖² + ‖X_B‖²)``, which for gradients of that form is ``≤ 2 eps`` of the result (each
    of ``‖X_A‖²``, ``‖X_B‖²`` is at most the result); ``R⁻¹`` adds ``eps·κ`` as in the lift.
    """
    fr = _frame(A, B, frame)
    XA = gA @ fr.RBi
    XB = gB @ fr.RAi
    cA, cB = fr.QA.mT @ XA, fr.QB.mT @ XB

    def sq(X: Tensor) -> Tensor:
        return torch.linalg.vector_norm(X, dim=(-2, -1)).square()  # no squared copy of X

    return 0.25 * sq(cA + cB.mT) + (sq(XA) - sq(cA)).clamp_min(0.0) + (sq(XB) - sq(cB)).clamp_min(0.0)


def gram_lifted_sqnorms(
    PA: Tensor, KA: Tensor, PB: Tensor, KB: Tensor, WA: Tensor, WB: Tensor
) -> Tensor:
    """:func:`lifted_sqnorm` from ``r×r`` products of the factor gradients (per example, per module).

    ``P_A = g_Aᵀg_A``, ``K_A = Q_Aᵀg_A``, ``P_B = g_Bᵀg_B``, ``K_B = Q_Bᵀg_B`` and the whiteners
    ``W_A = R_B⁻¹``, ``W_B = R_A⁻¹`` (``X_A = g_A W_A``, ``X_B = g_B W_B``; the identity when the
    gradients were whitened before the products). The blocks of :func:`lifted_sqnorm` are
    ``c_A = K_A W_A``, ``c_B = K_B W_B`` and ``‖(I − Π_A)X_A‖² = tr(W_Aᵀ (P_A − K_AᵀK_A) W_A)``
    (``P_A − K_AᵀK_A = g_Aᵀ(I − Π_A)g_A``), so the ``m×r`` gradients are read once, by two products
    whose outputs are ``r×r``. Accuracy: the products' rounding (``eps·√m`` of ``‖g‖²``) is carried
    through ``W`` on both sides, ``eps·κ²`` relative to the result — in float64 ``≤ 1e-9`` for the
    κ ≤ 1/√eps32 that the float32 rank check admits; at the float64 admission limit the gradients must
    be whitened first (``W = I``, the block form's ``eps·κ``). Shapes ``[..., r, r]`` → ``[...]``.
    """
    cA, cB = KA @ WA, KB @ WB

    def outside(P: Tensor, K: Tensor, W: Tensor) -> Tensor:  # ‖(I − Π)X‖², clamped at the rounding floor
        return (((P - K.mT @ K) @ W) * W).sum((-2, -1)).clamp_min(0.0)

    return 0.25 * (cA + cB.mT).square().sum((-2, -1)) + outside(PA, KA, WA) + outside(PB, KB, WB)


NORMAL_CHUNK = 1 << 16  # pairs per pass of standard_normal's transform (2 MiB of its float64 work): from cache


def standard_normal(shape: tuple[int, ...], generator: torch.Generator | None, dtype: torch.dtype,
                    device: torch.device, workspace: tuple[Tensor, Tensor] | None = None,
                    chunk: float = NORMAL_CHUNK) -> Tensor:
    """i.i.d. N(0, 1) draws of ``shape``; float64 on the CPU by a vectorised Box–Muller transform.

    Same law as ``torch.randn(dtype=float64)`` on the CPU, which applies Box–Muller to pairs of
    uniforms on the grid ``{j·2⁻⁵³}``, element by element: here ``u = (b mod 2⁵³)·2⁻⁵³`` for uniform
    63-bit integers ``b`` (``random_`` of int64; torch's uniforms take the same low 53 bits of a
    64-bit draw), so ``u₁``, ``u₂`` are independent and uniform on the same grid and
    ``(√(−2 ln(1 − u₁)) cos 2πu₂, √(−2 ln(1 − u₁)) sin 2πu₂)`` is the same pair of independent
    normals (exact law up to the last-bit rounding of ``log``/``cos``/``sin``), with the same largest
    magnitude ``√(2·53 ln 2) ≈ 8.57`` (float32 draws stop at ``≈ 5.77``). Vectorised ops instead of torch's
    scalar loop: about 0.6× its time; after the one stream of integers, the transform runs chunk by chunk of
    ``chunk`` pairs (elementwise, so the same values; ``math.inf``: one pass). Other dtypes and devices:
    ``torch.randn``.

    ``workspace``: two float64 tensors of at least ``2⌈numel/2⌉`` elements each; the draws are then
    computed in them (no fresh allocation: on the CPU a fresh block above glibc's mmap threshold
    page-faults on first touch) and returned as a view of the first, with the same values.
    """
    if dtype != torch.float64 or torch.device(device).type != "cpu":
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)
    half = (math.prod(shape) + 1) // 2
    if workspace is None:
        workspace = (torch.empty(2 * half, dtype=dtype, device=device), torch.empty(2 * half, dtype=dtype, device=device))
    out, scratch = (w[: 2 * half].view(2, half) for w in workspace)
    j = scratch.view(torch.int64).random_(generator=generator)
    step = half if chunk >= half else int(chunk)
    for start in range(0, half, step):  # the transform's passes over cache-sized chunks of pairs
        o, s, i = (x[:, start: start + step] for x in (out, scratch, j)) if step < half else (out, scratch, j)
        o.copy_(i.bitwise_and_(2**53 - 1))  # 2⁵³·u: uniform integers in [0, 2⁵³), as torch's uniform_real
        radius = torch.log1p(o[0].mul_(-(2.0**-53)), out=o[0]).mul_(-2.0).sqrt_()  # √(−2 ln(1 − u₁)), 1 − u₁ ∈ (0, 1]
        theta = o[1].mul_(2.0 * math.pi * 2.0**-53)
        cos = torch.cos(theta, out=s[0])
        theta.sin_().mul_(radius)
        radius.mul_(cos)
    return out.view(-1)[: math.prod(shape)].view(shape)


def tangent_noise(
    A: Tensor,
    B: Tensor,
    generator: torch.Generator | None = None,
    frame: Frame | None = None,
    sample_shape: tuple[int, ...] = (),
    damping: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Eq. 19 at unit scale: factor noise whose image ``Ξ_A Bᵀ + A Ξ_Bᵀ`` has the law of ``P_{A,B}(Ξ)``.

    With ``Ξ`` dense N(0, I), ``P(Ξ) = Q_A (Q_AᵀΞ) + (I − Π_A)(Ξ Q_B) Q_Bᵀ``; the two blocks
    ``Q_AᵀΞ`` and ``(I − Π_A)Ξ`` are independent, so ``P(Ξ) =_d Q_A Ω_Bᵀ + (I − Π_A) Ω_A Q_Bᵀ``
    with independent ``Ω_A ~ N(0, I_{m×r})``, ``Ω_B ~ N(0, I_{n×r})`` (Lemmas A.17–A.19). In
    factors: ``Ξ_A = (I − Π_A) Ω_A R_B⁻ᵀ``, ``Ξ_B = Ω_B R_A⁻ᵀ`` — the rows of ``Ω R⁻ᵀ`` have
    covariance ``R⁻¹R⁻ᵀ = N⁻¹`` (resp. ``M⁻¹``), the same law as the paper's ``Ω N^{-1/2}``.
    ``O((m+n) r)`` random numbers (:func:`standard_normal`); the caller multiplies by ``σC/b`` (eq. 17). ``sample_shape``
    prepends independent draws.

    ``damping`` (released protocol, docs/DECISIONS.md D4): whiten with the symmetric
    ``(N + damping·I)^{-1/2}``, ``(M + damping·I)^{-1/2}`` instead, as the released code does with
    ``1e-8``; the row covariance becomes ``(N + damping·I)⁻¹``, slightly below the ``N⁻¹`` the
    accountant assumes. ``0.0`` gives the exact law through the symmetric root.
    """
    fr = _frame(A, B, frame)
    Omega_A = standard_normal((*sample_shape, *fr.A.shape), generator, fr.A.dtype, fr.A.device)
    Omega_B = standard_normal((*sample_shape, *fr.B.shape), generator, fr.B.dtype, fr.B.device)
    Omega_A = Omega_A.sub_(_project(fr.QA, Omega_A))
    if damping is not None:
        if damping < 0:
            raise ValueError(f"damping={damping} must be >= 0 (method.noise_damping)")
        XiA = Omega_A @ _gram_function(fr.SB, fr.VB, lambda w: (w + damping).rsqrt())
        XiB = Omega_B @ _gram_function(fr.SA, fr.VA, lambda w: (w + damping).rsqrt())
        return XiA, XiB
    XiA = Omega_A @ fr.RBi.mT
    XiB = Omega_B @ fr.RAi.mT
    return XiA, XiB


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


def privatized_lift(
    fr: Frame, gA: Tensor, gB: Tensor, scale: float, tau: float, omega: tuple[Tensor, Tensor] | None,
    horizontal: bool, gram_inverse: bool, out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Eq. 17 in one pass: ``H(scale·lift(g_A, g_B) + τ(Ξ_A, Ξ_B))`` (eqs. 14, 19; ``H`` = :func:`horizontalize`
    when ``horizontal``), equal to :func:`lift`, :func:`tangent_noise` and :func:`horizontalize` in turn.

    ``omega = (Ω_A, Ω_B)``: the unit draws of :func:`tangent_noise` (``None``: no noise, ``τ = 0``). Every
    projection onto ``span(A)``, ``span(B)`` is an ``r×r`` coefficient taken from ``K_A = Q_Aᵀg_A``,
    ``Q_AᵀΩ_A`` (and the B analogues) before the factor-sized products: with ``W_A = scale·N⁻¹``,
    ``W_B = scale·M⁻¹``

    ``ΔA = g_A W_A + Ω_A τR_B⁻ᵀ − Q_A (½K_A W_A + Q_AᵀΩ_A τR_B⁻ᵀ − R_A Ω_H)``,
    ``ΔB = g_B W_B + Ω_B τR_A⁻ᵀ − Q_B (½K_B W_B + R_B Ω_Hᵀ)``,

    with ``Ω_H`` the gauge of :func:`horizontalize` for ``C = ΔBᵀB − AᵀΔA``, which (``Q_AᵀQ_A = I``) is
    ``(R_Bᵀ(½K_B W_B + Q_BᵀΩ_B τR_A⁻ᵀ))ᵀ − R_Aᵀ ½K_A W_A`` (the noise has ``AᵀΞ_A = 0``): per factor
    three products with the ``m×r`` operands (``Q_Aᵀ``, ``W``, ``Q_A``) plus two for the noise, instead
    of about a dozen. ``gram_inverse``: multiply by the ``r×r`` matrix ``N⁻¹ = R_B⁻¹R_B⁻ᵀ`` once
    instead of by ``R_B⁻¹`` then ``R_B⁻ᵀ``; forming it rounds at ``eps·κ²`` relative to the result, so
    it needs a bounded ``κ`` — ``≤ 2e-9`` in float64 for the ``κ ≤ 1/√eps32 = 2,896`` the float32 rank
    check admits (docs/DECISIONS.md D66). ``out``: tensors shaped like ``g_A``, ``g_B`` for the result.
    """
    RAi, RBi = fr.RAi, fr.RBi
    if gram_inverse:
        WA, WB = (RBi @ RBi.mT).mul_(scale), (RAi @ RAi.mT).mul_(scale)
        YA = torch.matmul(gA, WA, out=None if out is None else out[0])
        YB = torch.matmul(gB, WB, out=None if out is None else out[1])
        VA, VB = (fr.QA.mT @ gA) @ WA, (fr.QB.mT @ gB) @ WB  # Q_AᵀY_A, Q_BᵀY_B
    else:
        YA = torch.matmul(gA @ RBi, RBi.mT * scale, out=None if out is None else out[0])
        YB = torch.matmul(gB @ RAi, RAi.mT * scale, out=None if out is None else out[1])
        VA, VB = ((fr.QA.mT @ gA) @ RBi) @ (RBi.mT * scale), ((fr.QB.mT @ gB) @ RAi) @ (RAi.mT * scale)
    KA, KB = 0.5 * VA, 0.5 * VB  # Q_Aᵀ of what the projections remove; the vertical part Q_AᵀΔA stays ½V_A
    HB = KB
    if omega is not None:
        TA, TB = tau * RBi.mT, tau * RAi.mT
        _rows(YA).baddbmm_(_flat(omega[0]), _flat(TA.expand(*YA.shape[:-2], *TA.shape[-2:])))
        _rows(YB).baddbmm_(_flat(omega[1]), _flat(TB.expand(*YB.shape[:-2], *TB.shape[-2:])))
        KA = KA + (fr.QA.mT @ omega[0]) @ TA
        HB = KB + (fr.QB.mT @ omega[1]) @ TB  # Q_BᵀΔB (Ξ_B is not projected)
    if horizontal:
        Omega = _sylvester_gauge(fr, (fr.RB.mT @ HB).mT - fr.RA.mT @ (0.5 * VA))
        KA = KA - fr.RA @ Omega
        KB = KB + fr.RB @ Omega.mT
    _rows(YA).baddbmm_(_flat(fr.QA), _flat(KA), alpha=-1.0)
    _rows(YB).baddbmm_(_flat(fr.QB), _flat(KB), alpha=-1.0)
    return YA, YB


def tangent_noise_sqnorm(fr: Frame, omega_A: Tensor, omega_B: Tensor) -> Tensor:
    """Eq. 21's ``‖Ξ_A Bᵀ + A Ξ_Bᵀ‖²_F`` of :func:`tangent_noise`'s draw from its unit draws ``(Ω_A, Ω_B)``.

    The image ``(I − Π_A)Ω_A Q_Bᵀ + Q_A Ω_Bᵀ`` has orthogonal blocks, so the norm is
    ``‖Ω_A‖² − ‖Q_AᵀΩ_A‖² + ‖Ω_B‖²`` (no ``R⁻¹``; the difference is about ``(m − r)/m`` of ``‖Ω_A‖²``).
    """
    def sq(X: Tensor) -> Tensor:
        return torch.linalg.vector_norm(X, dim=(-2, -1)).square()
    return sq(omega_A) - sq(fr.QA.mT @ omega_A) + sq(omega_B)


def _flat(T: Tensor) -> Tensor:
    """``T`` [..., p, q] as ``[batch, p, q]`` (a copy only where the layout needs one)."""
    return T.reshape(-1, *T.shape[-2:])


def _rows(T: Tensor) -> Tensor:
    """Contiguous ``T`` [..., p, q] as a ``[batch, p, q]`` view, the target of an in-place batched product."""
    return T.view(-1, *T.shape[-2:])


class Retraction(NamedTuple):
    """Eq. 22's thin QRs ``[A, ΔA] = Q_u R_u``, ``[B, ΔB] = Q_v R_v`` (``Q`` as column blocks) and the core."""

    Qu: tuple[Tensor, ...]
    Qv: tuple[Tensor, ...]
    Ru: Tensor
    Rv: Tensor
    core: Tensor


def _minus_product(X: Tensor, Q: Tensor, C: Tensor) -> Tensor:
    """``X − Q C`` as one fused batched product (``X``, ``Q``, ``C`` share their leading dims)."""
    return torch.baddbmm(_flat(X), _flat(Q), _flat(C), alpha=-1.0).view(X.shape)


def extend_qr(Q: Tensor, R: Tensor, X: Tensor, C: Tensor | None = None, shift: Tensor | None = None,
              work: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Thin QR of ``[Q R, X + Q·shift]`` from the thin QR ``Q R`` of its first block (block Gram–Schmidt): ``(Q₂, R_full)``.

    ``X = Q C + Y`` with ``C = QᵀX`` (pass it if known) taken twice ("twice is enough": ``Y ⟂ Q`` to
    rounding), then ``Y = Q₂R₂`` by :func:`block_basis` (CholeskyQR2, GEMM work instead of Householder
    sweeps): ``[QR, X + Q·shift] = [Q, Q₂] [[R, C + shift], [0, R₂]]``. Where ``Y`` is (numerically)
    zero, ``R₂`` is too, so ``Q₂`` never reaches the retracted factors (the core, hence its singular
    vectors, weight it by ``R₂``); eq. 22's point does not depend on the basis ``Q₂`` of ``span(Y)``.
    A component ``Q·shift`` inside ``span(Q)`` costs only ``r×r`` work. ``work = (Y, Q₁, Q₂)``: tensors
    shaped like ``X`` for ``Y`` (may be ``X`` itself, which is then overwritten) and :func:`block_basis`'s.
    """
    C = Q.mT @ X if C is None else C
    if work is None:
        Y = _minus_product(X, Q, C)
    else:
        Y = work[0] if work[0] is X else work[0].copy_(X)
        _rows(Y).baddbmm_(_flat(Q), _flat(C), alpha=-1.0)
    C2 = Q.mT @ Y
    _rows(Y).baddbmm_(_flat(Q), _flat(C2), alpha=-1.0)  # in place on the fresh Y
    Q2, R2 = block_basis(Y, None if work is None else work[1:])
    top = torch.cat([R, C + C2 if shift is None else C + C2 + shift], dim=-1)
    return Q2, torch.cat([top, torch.cat([torch.zeros_like(R2), R2], dim=-1)], dim=-2)


def retraction_core(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, lr: float, frame: Frame | None = None, horizontal: bool = False,
    work: tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None,
) -> Retraction:
    """Eq. 22, first half: the thin QRs and the core ``R_u K R_vᵀ``, in float64 (see :func:`retract`).

    ``horizontal``: retract the :func:`horizontalize`-d direction ``(ΔA + AΩ, ΔB − BΩᵀ)``. With a
    float64 ``frame`` of ``(A, B)`` the QRs of ``[A, ΔA]``, ``[B, ΔB]`` extend the frame's
    (:func:`extend_qr`) instead of starting over, and the gauge term, inside ``span(A)``,
    ``span(B)``, enters as ``r×r`` shifts ``R_A Ω``, ``−R_B Ωᵀ`` (``Ω`` from ``Q_AᵀΔA``, ``Q_BᵀΔB``);
    ``work``: the two factors' :func:`extend_qr` workspaces there.
    """
    _check_pair(A, B)
    r = A.shape[-1]
    if frame is not None and frame.QA.dtype == torch.float64:
        dA64, dB64 = dA.to(torch.float64), dB.to(torch.float64)
        CA, CB = frame.QA.mT @ dA64, frame.QB.mT @ dB64
        shifts = (None, None)
        if horizontal:  # AᵀΔA = R_AᵀC_A, ΔBᵀB = C_BᵀR_B
            Omega = _sylvester_gauge(frame, CB.mT @ frame.RB - frame.RA.mT @ CA)
            shifts = (frame.RA @ Omega, -(frame.RB @ Omega.mT))
        (Q2u, Ru) = extend_qr(frame.QA, frame.RA, dA64, C=CA, shift=shifts[0], work=work and work[0])
        (Q2v, Rv) = extend_qr(frame.QB, frame.RB, dB64, C=CB, shift=shifts[1], work=work and work[1])
        Qu, Qv = (frame.QA, Q2u), (frame.QB, Q2v)
    else:
        if horizontal:  # in the frame's dtype, then float64
            dA, dB = horizontalize(A, B, dA, dB, frame=frame)
        dA64, dB64 = dA.to(torch.float64), dB.to(torch.float64)
        Qu, Ru = torch.linalg.qr(torch.cat([A.to(torch.float64), dA64], dim=-1), mode="reduced")
        Qv, Rv = torch.linalg.qr(torch.cat([B.to(torch.float64), dB64], dim=-1), mode="reduced")
        Qu, Qv = (Qu,), (Qv,)
    # R_u K without forming K: R_u K = [R_u1 − lr R_u2, −lr R_u1] for R_u = [R_u1, R_u2].
    RuK = torch.cat([Ru[..., :r] - lr * Ru[..., r:], -lr * Ru[..., :r]], dim=-1)
    return Retraction(Qu=Qu, Qv=Qv, Ru=Ru, Rv=Rv, core=RuK @ Rv.mT)


def joined_retractions(parts: Sequence[Retraction], Qu: tuple[Tensor, ...], Qv: tuple[Tensor, ...]) -> Retraction:
    """The :class:`Retraction` of a batch from those of consecutive slices of its modules, whose ``Q`` blocks are
    slices of ``Qu``, ``Qv`` (the ``r×r``-sized ``R`` factors and cores are concatenated)."""
    return Retraction(Qu=Qu, Qv=Qv, Ru=torch.cat([p.Ru for p in parts]), Rv=torch.cat([p.Rv for p in parts]),
                      core=torch.cat([p.core for p in parts]))


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


def block_product(blocks: tuple[Tensor, ...], M: Tensor, out: Tensor | None = None) -> Tensor:
    """``[Q_1, Q_2, …] M`` without concatenating the blocks: ``Σ_b Q_b M_b`` over the matching row blocks of ``M``
    (into the contiguous ``out`` if given)."""
    width = blocks[0].shape[-1]
    out = torch.matmul(blocks[0], M[..., :width, :], out=out)
    for Qb in blocks[1:]:
        Mb = M[..., width:width + Qb.shape[-1], :]
        width += Qb.shape[-1]
        out.view(-1, *out.shape[-2:]).baddbmm_(Qb.reshape(-1, *Qb.shape[-2:]), Mb.reshape(-1, *Mb.shape[-2:]))
    return out


def retract(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, lr: float, align: bool = True, frame: Frame | None = None,
    horizontal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Eq. 22: best rank-r approximation of the first-order point ``Z − lr (ΔA Bᵀ + A ΔBᵀ)``.

    ``[A, ΔA] K [B, ΔB]ᵀ`` with ``K = [[I, −lr I], [−lr I, 0]]`` equals that point (no ``lr² ΔAΔBᵀ``
    term); thin QRs ``[A, ΔA] = Q_u R_u``, ``[B, ΔB] = Q_v R_v`` reduce it to the SVD of the
    ``2r×2r`` core ``R_u K R_vᵀ = U_c S V_cᵀ``. Balanced refactorisation ``A' = Q_u U_c √S_r``,
    ``B' = Q_v V_c √S_r`` (``A'ᵀA' = B'ᵀB' = S_r``); with ``align`` the factors are rotated by the
    orthogonal Procrustes solution ``Q = U'V'ᵀ`` of ``A'ᵀA + B'ᵀB = U'ΣV'ᵀ``, which keeps ``Z'``,
    ``Π_{A'}``, ``Π_{B'}`` and the balance (App. A.22, A.24). The rotation acts on the small
    coefficients before the one ``m×2r`` product per factor; ``frame``, ``horizontal``: see
    :func:`retraction_core`. Computed in float64, returned in the
    input dtype. If the point has rank < r the trailing columns are zero; the next step's
    :func:`check_full_rank` reports it. (The batched method runs the same pieces with each SVD
    fused over all shape groups.)
    """
    rt = retraction_core(A, B, dA, dB, lr, frame=frame, horizontal=horizontal)
    MA, MB = balanced_coefficients(torch.linalg.svd(rt.core), A.shape[-1])
    if align:
        Q = procrustes_rotation(torch.linalg.svd(procrustes_target(rt, MA, MB)))
        MA, MB = MA @ Q, MB @ Q
    return block_product(rt.Qu, MA).to(A.dtype), block_product(rt.Qv, MB).to(B.dtype)


def default_rcond(dtype: torch.dtype) -> float:
    """Default relative singular-value cutoff: ``√eps`` (float32 ≈ 3.5e-4, float64 ≈ 1.5e-8)."""
    return math.sqrt(torch.finfo(dtype).eps)


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


def check_frames(frames: list[Frame], modules: list[list[str]], rcond: float | None = None,
                 nan_R: bool = False) -> None:
    """Raise :class:`RankDeficientError` unless every factor of every frame is finite and full rank.

    ``frames[g]`` holds the factors of the modules named ``modules[g]`` (batched ``[G, m, r]`` or one
    module ``[m, r]``). Reads the singular values the frames already hold (no further SVD) with one
    host read per call; the offending module is looked up only on failure. ``rcond`` defaults to
    :func:`default_rcond` of the factors' dtype (solves then lose at most ``√eps`` relative
    accuracy). The tangent space (eq. 11), the lift (eq. 14) and the noise sampler (eq. 19) need
    full column rank. ``nan_R``: the frames' ``R`` is NaN wherever a factor is not finite (:func:`frames`
    with ``cholesky``: a non-finite entry makes the Gram's diagonal non-finite), so the singular values
    alone decide and the factors are not read.
    """
    if not frames:
        return
    cutoff = default_rcond(frames[0].A.dtype) if rcond is None else rcond
    masks = [(sv[..., -1] > cutoff * sv[..., 0] if nan_R else _admissible(X, sv, cutoff)).all()
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


def prism_noise_energy(m: int, n: int, r: int, tau: float) -> float:
    """Eq. 20–21: ``E‖τ P_{A,B}(Ξ)‖²_F = τ² r(m + n − r)``, independent of ``A``, ``B``."""
    return tau**2 * tangent_dim(m, n, r)


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


def min_gauge_noise_energy(A: Tensor, B: Tensor, tau: float) -> float:
    """Eq. 35: ``min_c`` of :func:`gauge_noise_energy`, ``2τ² √(mn) ‖A‖_F ‖B‖_F``."""
    m, n = A.shape[0], B.shape[0]
    return 2.0 * tau**2 * math.sqrt(m * n) * A.norm().item() * B.norm().item()
