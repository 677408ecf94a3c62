"""Which reproduction protocol a run followed, item by item (``conf/protocol/*.yaml``).

``corrected`` (default) is standard DP-SGD; ``released`` reproduces what the paper's released code
ran. Each item is an ordinary config key (``ITEMS``) that can be overridden on its own, so a run's
protocol is the set of values it actually used; :func:`protocol_record` writes them, with the DP
status they imply, into ``final.json``. docs/DECISIONS.md lists every item with its row id.
"""
from __future__ import annotations

import functools
from typing import Any

# item → its config key (docs/DECISIONS.md D1–D12)
ITEMS: dict[str, str] = {
    "calibration": "privacy.calibration",
    "denominator": "privacy.denominator",
    "per_example_scale": "privacy.per_example_scale",
    "noise_damping": "method.noise_damping",
    "pinv_rcond": "method.pinv_rcond",
    "init_svd": "method.init_svd",
    "nondp_trainer": "train.nondp_trainer",
    "padding_side": "train.padding_side",
    "prompt_encoding": "suite.decoding.prompt_encoding",
    "eval_batch_size": "train.eval_batch_size",
    "renormalize_logits": "suite.decoding.renormalize_logits",
    "remove_invalid_values": "suite.decoding.remove_invalid_values",
    "choice_regex": "suite.decoding.choice_regex",
}
NOT_DP_AS_STATED = "not a valid DP guarantee as stated"


def value(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` (an :data:`ITEMS` value) in a run's job (:class:`prism.job.JobConfig`)."""
    return functools.reduce(getattr, key.split("."), cfg)


def dp_caveats(cfg: Any, tangent: bool) -> list[str]:
    """Why the accounted (ε, δ) does not hold for this run's mechanism as run (empty: it holds);
    ``tangent``: the method noises in the tangent space, where ``noise_damping`` acts (PRISM)."""
    from prism.privacy.accounting import is_private  # here: the aggregator imports this module, Opacus not

    if not is_private(cfg):
        return []
    caveats = []
    if cfg.privacy.per_example_scale == "released":
        caveats.append("per_example_scale=released: a record's gradient is weighted by k^p·T_i/T_micro, which "
                       "depends on the other records of its micro-batch, so the clipped sum's sensitivity is not C")
    if cfg.privacy.denominator == "realised":
        caveats.append("denominator=realised: the noise scale σC/|batch| reveals the realised batch size")
    damping = cfg.method.noise_damping
    if damping and tangent:
        caveats.append(f"noise_damping={damping}: the tangent noise covariance is (N + {damping}·I)^-1, "
                       "below the N^-1 the accountant assumes")
    return caveats


def protocol_record(cfg: Any, tangent: bool) -> dict[str, Any]:
    """The ``protocol`` block of ``final.json``: preset name, every item's value, DP status (``non-private``, ``(ε, δ)-DP as accounted`` or :data:`NOT_DP_AS_STATED`)
    and caveats (``tangent``: as in :func:`dp_caveats`)."""
    from prism.privacy.accounting import is_private

    caveats = dp_caveats(cfg, tangent)
    guarantee = (NOT_DP_AS_STATED if caveats else "(ε, δ)-DP as accounted") if is_private(cfg) else "non-private"
    return {
        "name": cfg.protocol.name,
        "items": {item: value(cfg, key) for item, key in ITEMS.items()},
        "dp_guarantee": guarantee,
        "dp_caveats": caveats,
    }
