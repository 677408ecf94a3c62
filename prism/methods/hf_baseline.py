"""Non-private baselines trained the way the released code trained them (docs/DECISIONS.md D7).

The released code trained its non-private baselines with the HF ``Trainer``: linear warm-up then decay
of the learning rate, a global gradient-norm clip of 1.0 (none for LoRA-RITE), AdamW without weight
decay, and the checkpoint with the lowest loss on a periodically evaluated hold-out split restored at
the end. ``train.nondp_trainer: hf`` reproduces that around the shared loop (:class:`HFTrainerBaseline`
wraps the non-private :class:`~prism.methods.factor.FactorDPMethod`). Differences to the HF Trainer:
batches stay Poisson-sampled, the hold-out loss is the mean over every hold-out token, and update
``t = 1..T`` uses ``lr·min(t/W, (T−t)/(T−W))`` (HF's first update has learning rate 0). Budgets are
fractions of ``train.steps`` and of the training set: the released numbers at paper scale (warm-up 100
steps, evaluation every 100 / 10 steps, 1,000 / 120 hold-out examples), proportional ones below.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from prism.data.prompts import collate
from prism.fastpath.prefix import PrefixCache
from prism.methods.base import Method, Release
from prism.methods.factor import FactorDPMethod
from prism.methods.registry import lookup
from prism.privacy.accounting import is_private
from prism.privacy.noise import NoiseSource
from prism.privacy.per_example import IGNORE_INDEX, per_example_loss, supervised_mask

TRAINERS = ("shared", "hf")
NORM_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_


@dataclass(frozen=True)
class HFRecipe:
    """Step counts of the released non-private recipe for one run."""

    total_steps: int
    warmup_steps: int
    eval_every: int
    holdout: int
    max_grad_norm: float  # 0: no clipping
    weight_decay: float  # the HF Trainer's AdamW default: 0

    @classmethod
    def from_config(cls, cfg: Any, n_examples: int) -> HFRecipe | None:
        """The recipe when ``train.nondp_trainer == "hf"`` and the run is a non-private baseline, else None."""
        trainer = cfg.train.nondp_trainer
        if trainer not in TRAINERS:
            raise ValueError(f"train.nondp_trainer={trainer!r}; choose one of {TRAINERS}")
        method = lookup(cfg.method)
        if trainer == "shared" or is_private(cfg) or method.tangent:
            return None
        hf, steps = cfg.train.hf_trainer, int(cfg.train.steps)
        holdout = round(float(hf.holdout_fraction) * n_examples)
        if not 1 <= holdout < n_examples:
            raise ValueError(f"train.hf_trainer.holdout_fraction={hf.holdout_fraction} leaves a hold-out of "
                             f"{holdout} of {n_examples} examples; choose a fraction in (0, 1)")
        clip = float(hf.max_grad_norm) if method.hf_clips else 0.0  # released: no clip for RITE
        return cls(total_steps=steps, warmup_steps=round(float(hf.warmup_fraction) * steps),
                   eval_every=max(1, round(float(hf.eval_every_fraction) * steps)), holdout=holdout,
                   max_grad_norm=clip, weight_decay=float(hf.weight_decay))


def linear_warmup_factor(step: int, warmup: int, total: int) -> float:
    """HF's ``get_linear_schedule_with_warmup`` multiplier at ``step``: ``step/warmup`` during the
    warm-up, then ``(total − step)/(total − warmup)``, never below 0."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def holdout_split(examples: Sequence[Any], size: int, seed: int) -> tuple[list[Any], list[Any]]:
    """``(train, holdout)``: a seeded random ``size`` examples held out, both in their original order."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:size])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


@torch.no_grad()
def holdout_loss(model: nn.Module, features: Sequence[dict], pad_id: int, batch_size: int,
                 device: torch.device, prefix: PrefixCache | None = None) -> float:
    """Mean next-token loss over every supervised token of ``features`` (eval mode); with ``prefix`` (their
    :class:`prism.fastpath.prefix.PrefixCache`, same order) replayed through the trained top layers only."""
    was_training = model.training
    total, tokens = 0.0, 0
    try:
        for start in range(0, len(features), batch_size):
            if prefix is not None:
                replay = prefix.batch(list(range(start, min(start + batch_size, len(features)))))["loss_fn"]
                losses = replay.losses(model, training=False)
                counts = (replay.positions[1] != IGNORE_INDEX).sum(1)
            else:
                model.eval()
                batch = {k: v.to(device) for k, v in collate(features[start:start + batch_size], pad_id).items()}
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               use_cache=False).logits
                losses = per_example_loss(logits, batch["labels"], batch["attention_mask"])
                counts = supervised_mask(batch["labels"], batch["attention_mask"]).sum(1)
            total += float((losses * counts).sum())
            tokens += int(counts.sum())
    finally:
        model.train(was_training)
    return total / max(tokens, 1)


class HFTrainerBaseline(Method):
    """A non-private factor-space baseline with the released HF-Trainer recipe around its optimizer."""

    def __init__(self, inner: FactorDPMethod, recipe: HFRecipe, validation_loss: Callable[[], float]) -> None:
        if inner.dp:
            raise ValueError("the HF-Trainer recipe is for non-private runs (privacy=nondp)")
        super().__init__(inner.params, None)
        self.inner, self.recipe, self.validation_loss = inner, recipe, validation_loss
        self.base_lrs = [group["lr"] for group in inner.optimizer.param_groups]
        for group in inner.optimizer.param_groups:
            group["weight_decay"] = recipe.weight_decay
        self.t = 0
        self.best: dict[str, Any] = {"loss": math.inf, "step": None, "params": None}

    def zero_accumulators(self) -> None:
        self.inner.zero_accumulators()

    def accumulate(self, grads: Mapping[str, Tensor]) -> None:
        self.inner.accumulate(grads)

    def add_noise(self, denominator: float, noise: NoiseSource, diagnostics: bool = True) -> Release:
        return self.inner.add_noise(denominator, noise, diagnostics)

    def update(self, release: Release, diagnostics: bool = True) -> dict[str, Tensor]:
        return self.inner.update(release, diagnostics)

    def clip_stats(self) -> dict[str, Tensor]:
        return {}

    def step(self, denominator: float, generator: torch.Generator | None,
             diagnostics: bool = True) -> dict[str, Tensor]:
        """Scheduled learning rate, global clip of the mean gradient (on the device, as ``clip_grad_norm_``), the
        optimizer step, and every ``eval_every`` steps the hold-out loss and a snapshot of the best parameters."""
        self.t += 1
        factor = linear_warmup_factor(self.t, self.recipe.warmup_steps, self.recipe.total_steps)
        for group, base in zip(self.inner.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        sums = list(self.inner.summed.values())
        stats: dict[str, Tensor] = {"lr_factor": torch.tensor(factor, device=sums[0].device)}
        if self.recipe.max_grad_norm > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a, dtype=torch.float64)
                                                         for a in sums])) / denominator
            coef = (self.recipe.max_grad_norm / (norm + NORM_EPS)).clamp(max=1.0)
            torch._foreach_mul_(sums, coef.to(sums[0].dtype))
            stats["grad_norm"] = norm
        stats.update(self.inner.step(denominator, generator, diagnostics))
        if self.t % self.recipe.eval_every == 0:
            loss = self.validation_loss()
            stats["holdout_loss"] = torch.tensor(loss)
            if loss < self.best["loss"]:
                params = {n: p.detach().cpu().clone() for n, p in self.params.items()}
                self.best = {"loss": loss, "step": self.t, "params": params}
        return stats

    @torch.no_grad()
    def restore_best(self) -> int | None:
        """Load the lowest-hold-out-loss parameters (HF's ``load_best_model_at_end``); their step, or
        None when no evaluation ran (the last iterate stays)."""
        if self.best["params"] is None:
            return None
        for name, p in self.params.items():
            p.copy_(self.best["params"][name].to(p.device))
        return int(self.best["step"])

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "t": self.t, "best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.t, self.best = int(state["t"]), dict(state["best"])
