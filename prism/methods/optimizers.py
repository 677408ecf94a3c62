"""The update rules the factor-space baselines apply to their privatised gradient (docs/DECISIONS.md D23–D27, Table 8).

Every hyper-parameter is read explicitly from the method config node (``conf/method/<name>.yaml``);
nothing falls back to a library default, so a library upgrade cannot silently change a baseline.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_optimizer import Lamb
from torch import nn

from prism.methods.lora_rite import LoRARite

ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
LORAPLUS_FIELDS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "loraplus_lr_ratio")
LAMB_FIELDS = (
    "lr", "betas", "eps", "weight_decay", "weight_decouple", "fixed_decay", "rectify",
    "degenerated_to_sgd", "n_sma_threshold", "grad_averaging", "max_grad_norm", "pre_norm", "adam",
    "adam_debias", "adanorm", "foreach", "maximize",
)
LORA_RITE_FIELDS = ("lr", "betas", "eps", "update_skipping", "clip_unmagnified_grad")


def method_fields(cfg: DictConfig, fields: tuple[str, ...]) -> dict[str, Any]:
    """Read ``fields`` from the method node as plain Python values (lists become tuples).

    Raises ``ValueError`` naming the missing field and the yaml to add it to.
    """
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    missing = [f for f in fields if plain.get(f) is None]
    if missing:
        raise ValueError(
            f"method {plain.get('name')!r} needs {', '.join(missing)}; add them to conf/method/{plain.get('name')}.yaml"
        )
    return {f: tuple(plain[f]) if isinstance(plain[f], list) else plain[f] for f in fields}


def loraplus_param_groups(
    params: Mapping[str, nn.Parameter], lr: float, ratio: float, weight_decay: float
) -> list[dict[str, Any]]:
    """LoRA+ (Hayou et al. 2024) groups: peft ``lora_A`` (paper B) at ``lr``, peft ``lora_B`` (paper A) at ``lr·ρ``.

    The same two non-empty groups as ``peft.optimizers.create_loraplus_optimizer`` builds for a model
    whose only trainable tensors are LoRA linear factors (checked against it in the tests); built by
    name here because that function needs the whole peft model.
    """
    other = [n for n in params if ".lora_A." not in n and ".lora_B." not in n]
    if other:
        raise ValueError(f"loraplus splits learning rates over LoRA factors only; {other[0]} is neither lora_A nor lora_B")
    group_a = [p for n, p in params.items() if ".lora_A." in n]
    group_b = [p for n, p in params.items() if ".lora_B." in n]
    return [
        {"params": group_a, "lr": lr, "weight_decay": weight_decay},
        {"params": group_b, "lr": lr * ratio, "weight_decay": weight_decay},
    ]


def build_optimizer(cfg: DictConfig, params: Mapping[str, nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer of the baseline ``cfg.name`` over ``params`` (name → trainable parameter).

    * ``adamw`` / ``ffa``: ``torch.optim.AdamW``.
    * ``loraplus``: AdamW over :func:`loraplus_param_groups`.
    * ``lamb``: ``pytorch_optimizer.Lamb`` (You et al. 2020) with its global-norm gradient rescaling
      switched off (``pre_norm: false``, ``max_grad_norm: 0``) so the privatised gradient reaches the
      moments unchanged; the layer-wise trust ratio stays on (``adam: false``).
    * ``lora_rite``: :class:`prism.methods.lora_rite.LoRARite`.
    """
    name = cfg.name
    if name in ("adamw", "ffa"):
        kw = method_fields(cfg, ADAMW_FIELDS)
        return torch.optim.AdamW(list(params.values()), **kw)
    if name == "loraplus":
        kw = method_fields(cfg, LORAPLUS_FIELDS)
        groups = loraplus_param_groups(params, kw.pop("lr"), kw.pop("loraplus_lr_ratio"), kw.pop("weight_decay"))
        return torch.optim.AdamW(groups, **kw)
    if name == "lamb":
        kw = method_fields(cfg, LAMB_FIELDS)
        if kw["pre_norm"] or kw["max_grad_norm"] != 0:
            raise ValueError("lamb must not rescale the privatised gradient: set pre_norm: false and max_grad_norm: 0")
        return Lamb(list(params.values()), **kw)
    if name == "lora_rite":
        return LoRARite(params, **method_fields(cfg, LORA_RITE_FIELDS))
    raise ValueError(f"no factor-space optimizer for method {name!r}; choose adamw, loraplus, lamb, ffa or lora_rite")
