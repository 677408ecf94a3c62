"""Per-example losses and gradients of the trainable LoRA factors (docs/DECISIONS.md D3).

The per-example loss ``ℓ_i`` is the mean token cross-entropy over example ``i``'s supervised
tokens (paper §3: clipping bounds ``∇ℓ_i`` per record). HF's ``labels=`` loss is one mean over all
tokens of the micro-batch, which weights examples by their token count, so it is not used.

DP runs get ``∇ℓ_i`` for every example from Opacus' ``GradSampleModule`` in hooks mode with
``loss_reduction="sum"`` applied to ``Σ_i ℓ_i`` (the sum keeps each example's gradient unscaled).
Only trainable modules (peft's ``lora_A`` / ``lora_B`` linears) get hooks; the frozen base is never
touched. Hooks are enabled only inside :meth:`PerExampleGradients.compute`. Non-DP runs use
:func:`summed_gradients`, plain autograd of ``Σ_i ℓ_i``, and skip the per-example cost.

The training forward applies the LM head only where a label is read (:func:`supervised_positions`,
HF's ``logits_to_keep``): ``ℓ_i`` is unchanged and most of the vocabulary projection is skipped when
``train_on_inputs`` is false. Both entry points take either a token micro-batch or a ``loss_fn``
(:data:`LossFn`), e.g. a forward from cached frozen-prefix states (:mod:`prism.fastpath.prefix`).

``PerExampleGradients(scale="released")`` reproduces the released trainer's per-sample gradient
instead (docs/DECISIONS.md D3): it backpropagated the micro-batch token mean ``Σ_i (T_i/T_micro) ℓ_i``
(times ``k`` in its PRISM loop) through Opacus' ``loss_reduction="mean"``, which multiplies by ``k``
again, so example ``i`` contributes ``k^p · T_i/T_micro · ∇ℓ_i`` (:func:`released_weights`; ``p = 2``
PRISM, ``p = 1`` the DP baselines). The weight depends on the other records' token counts, so the
clipped sum no longer has sensitivity ``C``: such runs are not a valid DP guarantee as stated.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import Tensor, nn

IGNORE_INDEX = -100
SCALES = ("record", "released")

LossFn = Callable[[nn.Module], Tensor]
"""Given the (possibly Opacus-wrapped) model, run a training-mode forward of one micro-batch and
return the per-example losses ``ℓ_i`` ``[k]``; every trainable parameter must take part."""


def per_example_loss(logits: Tensor, labels: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``ℓ_i`` = mean over supervised tokens of ``−log p(y_{t+1} | y_{≤t})`` for each example.

    ``logits`` ``[k, L, V]``, ``labels`` ``[k, L]`` with ``−100`` on unsupervised positions; the
    causal shift pairs ``logits[:, t]`` with ``labels[:, t+1]``. With ``attention_mask``, a target
    predicted from a padding position (the first real token of a left-padded row) is not
    supervised, so padding never changes ``ℓ_i``. Returns ``[k]`` in at least float32. An example
    without supervised tokens has loss 0 and zero gradient (no NaN).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [k, L]")
    targets = labels[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, :-1] == 0, IGNORE_INDEX)
    return mean_token_loss(logits[:, :-1], targets)


def mean_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """``[k]`` mean cross-entropy of ``logits`` ``[k, P, V]`` against aligned ``targets`` ``[k, P]`` over
    the entries that are not ``−100`` (0 for a row without any), in at least float32."""
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [k, P]; "
                         "the model must honour logits_to_keep")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1).to(token_loss.dtype)
    return token_loss.sum(dim=1) / counts


def kept_token_loss(logits: Tensor, targets: Tensor, keep: Tensor) -> Tensor:
    """``[k]`` mean cross-entropy per row, as :func:`mean_token_loss` of ``targets`` ``[k, P]``, from
    the logits ``[n, V]`` of the kept entries only (``keep = targets ≠ −100``, row by row; the LM head
    then runs on no padding entry); 0 for a row without any."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    token_loss = F.cross_entropy(logits, targets[keep], reduction="none")
    rows = torch.arange(targets.shape[0], device=targets.device).unsqueeze(1).expand_as(targets)[keep]
    sums = token_loss.new_zeros(targets.shape[0]).index_add(0, rows, token_loss)
    return sums / keep.sum(dim=1).clamp(min=1).to(sums.dtype)


def supervised_mask(labels: Tensor, attention_mask: Tensor | None) -> Tensor:
    """``[k, L − 1]``: whether ``ℓ_i`` reads the prediction at ``t``, i.e. token ``t+1`` is supervised
    (label ≠ −100) and ``t`` is not padding, as in :func:`per_example_loss`; its row sums are the ``T_i``."""
    supervised = labels[:, 1:] != IGNORE_INDEX
    if attention_mask is not None:
        supervised &= attention_mask[:, :-1] != 0
    return supervised


def supervised_positions(labels: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """The positions whose logits ``ℓ_i`` reads: row ``i`` lists, in order, every ``t`` of :func:`supervised_mask`,
    padded to a common count ``P ≥ 1`` with position 0 and target −100.

    Returns ``positions`` ``[k, P]`` (HF's 2-D ``logits_to_keep``) and the aligned ``targets``
    ``[k, P]``, so ``mean_token_loss(logits[:, positions], targets)`` equals ``per_example_loss``.
    """
    k, length = labels.shape
    if length < 2:  # nothing to predict
        return labels.new_zeros(k, 1), labels.new_full((k, 1), IGNORE_INDEX)
    supervised = supervised_mask(labels, attention_mask)
    counts = supervised.sum(dim=1)
    width = max(int(counts.max()), 1)
    # a stable sort of "unsupervised" flags puts each row's supervised positions first, in order
    order = torch.sort((~supervised).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    filler = torch.arange(width, device=labels.device) >= counts[:, None]
    targets = labels.gather(1, order + 1).masked_fill(filler, IGNORE_INDEX)
    return order.masked_fill(filler, 0), targets


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("the model has no trainable parameters; attach LoRA adapters before computing gradients")
    return params


@contextmanager
def _quiet_input_hook_warning() -> Iterator[None]:
    """Opacus' full backward hooks warn when a layer's input needs no grad (the frozen base's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        yield


Positions = tuple[Tensor, Tensor]
"""``(positions, targets)`` of :func:`supervised_positions`."""


@dataclass(frozen=True)
class TokenBatch:
    """The :data:`LossFn` of a token micro-batch (as produced by ``prism.data.prompts.collate``); its
    ``labels`` and ``attention_mask`` stay readable (the released per-example weights need the token counts).

    ``positions``: :func:`supervised_positions` of ``labels`` already computed, on the host before the
    copy to the device (its width is a host value, so computing it on a GPU costs a device sync)."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    positions: Positions | None = None

    def __call__(self, model: nn.Module) -> Tensor:
        """Training-mode forward (dropout as configured) with the LM head applied only at
        :func:`supervised_positions`; the per-example losses ``ℓ_i`` ``[k]`` (equal to :func:`per_example_loss`
        of the full logits)."""
        positions, targets = (self.positions if self.positions is not None
                              else supervised_positions(self.labels, self.attention_mask))
        model.train()
        logits = model(input_ids=self.input_ids, attention_mask=self.attention_mask, logits_to_keep=positions,
                       use_cache=False).logits
        return mean_token_loss(logits, targets)


def _loss_fn(input_ids: Tensor | None, attention_mask: Tensor | None, labels: Tensor | None,
             loss_fn: LossFn | None) -> LossFn:
    tokens = (input_ids, attention_mask, labels)
    if loss_fn is not None:
        if any(t is not None for t in tokens):
            raise ValueError("pass either a token micro-batch (input_ids, attention_mask, labels) or loss_fn, not both")
        return loss_fn
    if any(t is None for t in tokens):
        raise ValueError("a token micro-batch needs input_ids, attention_mask and labels (or pass loss_fn=...)")
    return TokenBatch(input_ids, attention_mask, labels)


def released_weights(counts: Tensor, power: int) -> Tensor:
    """``w_i = k^power · T_i / Σ_j T_j`` for a micro-batch of ``k`` records with ``T_i`` supervised tokens.

    The released trainer's per-sample gradient is ``w_i ∇ℓ_i`` (module docstring): HF's micro-batch
    token mean weighs record ``i`` by ``T_i/T_micro``, Opacus' mean reduction multiplies by ``k``, and
    the released PRISM loop's ``loss × k`` by ``k`` once more (``power = 2``; baselines ``power = 1``).
    A micro-batch without supervised tokens gets zero weights.
    """
    counts = counts.to(torch.float64)
    return float(counts.numel()) ** power * counts / counts.sum().clamp(min=1.0)  # no device sync


def _counts(loss_fn: LossFn) -> Tensor:
    """``T_i``, the number of targets ``ℓ_i`` averages over, of a ``loss_fn`` that carries ``labels`` and
    ``attention_mask`` (:class:`TokenBatch`, :class:`prism.fastpath.prefix.PrefixBatch`)."""
    labels = getattr(loss_fn, "labels", None)
    if labels is None:
        raise ValueError("scale='released' needs the micro-batch's labels; this loss_fn does not expose them")
    return supervised_mask(labels, getattr(loss_fn, "attention_mask", None)).sum(dim=1)


class PerExampleGradients:
    """Per-example gradients ``∇ℓ_i`` of every trainable parameter via Opacus hooks.

    ``compute`` returns ``(losses [k], {name: grad [k, *param.shape]})`` with the peft model's own
    parameter names. Opacus records activations only in ``train()`` mode, so ``compute`` puts the
    model in train mode; switch dropout off through the config, never with ``eval()``.
    """

    def __init__(self, model: nn.Module, scale: str = "record", released_power: int = 2) -> None:
        """``scale``: ``record`` (``∇ℓ_i``) or ``released`` (``w_i ∇ℓ_i``, :func:`released_weights`
        with ``released_power``: 2 for PRISM's released loop, 1 for the released DP baselines)."""
        if scale not in SCALES:
            raise ValueError(f"privacy.per_example_scale={scale!r}; choose one of {SCALES}")
        self.scale, self.released_power = scale, released_power
        self.model = model
        self.params = _trainable(model)
        self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        self.module.disable_hooks()

    def compute(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, *, loss_fn: LossFn | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Losses ``[k]`` and per-example gradients ``{name: [k, *shape]}`` of one micro-batch, given
        as tokens or as a ``loss_fn`` (e.g. :meth:`prism.fastpath.prefix.PrefixCache.batch`)."""
        forward = _loss_fn(input_ids, attention_mask, labels, loss_fn)
        params = _trainable(self.model)
        if list(params) != list(self.params):
            # Opacus hooks follow the trainable set at wrapping time; a factor frozen later still fires them
            raise RuntimeError("the trainable parameters changed after PerExampleGradients was built; "
                               "build it after the method has frozen its factors (e.g. FFA's lora_A)")
        self.module.enable_hooks()
        try:
            losses = forward(self.module)
            k = losses.shape[0]
            objective = losses.sum()
            if self.scale == "released":
                counts = _counts(forward).to(losses.device)
                objective = (released_weights(counts, self.released_power).to(losses.dtype) * losses).sum()
            with _quiet_input_hook_warning():
                objective.backward()
            grads = {name: self._take(name, p, k) for name, p in params.items()}
        finally:
            self.module.disable_hooks()
            self._clear(params.values())
        return losses.detach(), grads

    @staticmethod
    def _take(name: str, p: nn.Parameter, k: int) -> Tensor:
        grad_sample = getattr(p, "grad_sample", None)
        if not isinstance(grad_sample, Tensor) or grad_sample.shape != (k, *p.shape):
            got = tuple(grad_sample.shape) if isinstance(grad_sample, Tensor) else type(grad_sample).__name__
            raise RuntimeError(f"no per-example gradient of shape {(k, *p.shape)} for trainable parameter {name} "
                               f"(got {got}); freeze it, or make sure the forward uses it")
        return grad_sample.detach()

    def _clear(self, params: Iterable[nn.Parameter]) -> None:
        """Drop grad samples, ``.grad`` and stale activations so micro-batches never accumulate."""
        for p in params:
            p.grad_sample = None
            p.grad = None
            p._forward_counter = 0
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample
        for module in self.model.modules():
            if hasattr(module, "activations"):
                module.activations = []
            if hasattr(module, "max_batch_len"):
                del module.max_batch_len


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder layer's activations in the backward pass instead of storing them
    (``train.activation_checkpointing``); returns the number of checkpointed layers.

    Uses transformers' reentrant checkpointing (``use_reentrant=True``), which is what keeps Opacus'
    hooks exact: the first forward of a checkpointed layer runs under ``no_grad``, where Opacus records
    no activations; the recomputation inside the backward runs with gradients on and records them once,
    right before the per-sample backward hooks read them (a non-reentrant checkpoint would record each
    input twice). The RNG state is replayed, so dropout draws the same masks in the recomputation. A
    reentrant layer only back-propagates when its input requires grad, which frozen embeddings or cached
    prefix states do not: a pre-hook marks such an input as a grad-requiring leaf (no history is cut).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model
    while hasattr(base, "_module") or hasattr(base, "get_base_model"):  # Opacus, then peft
        base = base._module if hasattr(base, "_module") else base.get_base_model()
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer.register_forward_pre_hook(_input_requires_grad)
    return len(layers)


def _input_requires_grad(module: nn.Module, args: tuple) -> tuple | None:
    if args and isinstance(args[0], Tensor) and torch.is_grad_enabled() and not args[0].requires_grad:
        return (args[0].detach().requires_grad_(), *args[1:])
    return None


def summed_gradients(model: nn.Module, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                     labels: Tensor | None = None, *,
                     loss_fn: LossFn | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Non-DP: losses ``[k]`` and ``{name: Σ_i ∇ℓ_i}`` (shape ``[*param.shape]``) by plain autograd;
    the micro-batch is given as tokens or as a ``loss_fn``."""
    forward = _loss_fn(input_ids, attention_mask, labels, loss_fn)
    params = _trainable(model)
    losses = forward(model)
    with _quiet_input_hook_warning():
        grads = torch.autograd.grad(losses.sum(), list(params.values()), allow_unused=True)
    for name, grad in zip(params, grads):
        if grad is None:
            raise RuntimeError(f"trainable parameter {name} got no gradient; freeze it or check the model")
    return losses.detach(), dict(zip(params, grads))
