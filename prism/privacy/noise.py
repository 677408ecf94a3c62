"""Where the mechanisms' randomness comes from: seeded (reproducible) or the OS CSPRNG (``privacy.noise_source``).

Every method draws its unit Gaussian draws through a :class:`NoiseSource` (eqs. 3, 19), and the Poisson
sampler its inclusion coins through :func:`os_uniform` when the source is the OS:

* ``seeded`` (default): ``torch.randn`` in float64 from a ``torch.Generator`` seeded with ``seed + 2``;
  a run is reproducible bit for bit, and anyone who knows the config can regenerate its noise.
* ``os``: draws from the operating system's CSPRNG (``os.urandom``: no seed exists, so none can be
  enumerated). Each unit normal is the sum of four inverse-CDF normals divided by two, the float
  arithmetic that Opacus' secure mode uses against attacks that read the input off the low bits of a
  single transform's output (Mironov 2012; Jin et al. 2022). That sum is a mitigation, not a proof:
  docs/PRIVACY.md states what it does and does not defend against.

Uniforms are ``(b + ½)·2⁻⁵²`` for 52 random bits ``b``: every one is exact in float64 (``b + ½`` needs
53 significant bits), lies in ``[2⁻⁵³, 1 − 2⁻⁵³]``, never 0 or 1, and the grid is symmetric (``1 − u`` is
on it for every ``u``), so the inverse CDF is finite (its largest magnitude is ≈ 8.2 standard
deviations) and the draws are symmetric about 0.
"""
from __future__ import annotations

import os
import secrets
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

SECURE_TERMS = 4  # inverse-CDF normals summed per secure draw (their sum divided by √4)
UNIFORM_BITS = 52  # random bits per OS uniform: one fewer than float64's 53, so (b + ½) stays exact


class NoiseSource(Protocol):
    """A supplier of i.i.d. standard normal float64 draws."""

    def normal(self, shape: tuple[int, ...], device: torch.device) -> Tensor: ...


class SeededNoise:
    """``torch.randn`` (float64) from one ``torch.Generator``: reproducible, and checkpointed with the run."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def normal(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        gen_device = self.generator.device if self.generator is not None else device
        return torch.randn(shape, generator=self.generator, dtype=torch.float64, device=gen_device).to(device)


def os_uniform(n: int) -> Tensor:
    """``n`` float64 uniforms on ``{(b + ½)·2⁻⁵² : 0 ≤ b < 2⁵²}`` from the OS CSPRNG (``os.urandom``), on
    the CPU: the top 52 of 64 random bits, so ``b + ½`` is exact and no uniform rounds to 0 or 1."""
    bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - UNIFORM_BITS)
    return torch.from_numpy((bits.astype(np.float64) + 0.5) * 2.0**-UNIFORM_BITS)


class SecureNoise:
    """Unit normals from the OS CSPRNG: the sum of :data:`SECURE_TERMS` inverse-CDF normals over ``√SECURE_TERMS``."""

    generator = None  # nothing to checkpoint: a resumed run continues with fresh entropy

    def normal(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        n = int(np.prod(shape, dtype=np.int64))
        draws = torch.special.ndtri(os_uniform(SECURE_TERMS * n)).view(SECURE_TERMS, n).sum(0)
        return draws.div_(SECURE_TERMS**0.5).view(shape).to(device)


class OsGenerator:
    """The draws of a private selection's plan (``random``, ``integers``: the calls it makes of a
    ``numpy.random.Generator``) from the OS CSPRNG, so that no seed exists from which to recompute them."""

    def random(self) -> float:
        """One uniform of :func:`os_uniform`, in ``(0, 1)``."""
        return float(os_uniform(1)[0])

    def integers(self, high: int, size: int) -> np.ndarray:
        """``size`` integers uniform on ``[0, high)`` (``secrets.randbelow``: no modulo bias)."""
        return np.array([secrets.randbelow(high) for _ in range(size)], dtype=np.int64)


def as_noise_source(noise: NoiseSource | torch.Generator | None) -> NoiseSource:
    """A :class:`NoiseSource` from a source, a ``torch.Generator`` (seeded) or ``None`` (torch's default RNG)."""
    if noise is None or isinstance(noise, torch.Generator):
        return SeededNoise(noise)
    return noise
