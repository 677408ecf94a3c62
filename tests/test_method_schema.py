"""Method keys are checked by each method's config dataclass (prism/methods/schema.py), which the
validator and ``build_method`` both build; accountant limits and budgets are refused before any
model load (prism/privacy/limits.py), and σ calibration cannot run unbounded.

Independent expectations: the runtime's own accepted values (the constants the code maps a choice
with), Opacus (its RDP at integer orders, its PRV grid, its refusals), and the rule that
the validator never imports torch.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.config.validate import ConfigError, load_job
from prism.methods import build_method, registry, schema
from prism.privacy import limits as dp_limits

REPO = Path(__file__).resolve().parents[1]
METHODS = registry.names()

# (method, override, the key the one-line error must name)
BAD = [
    ("prism", "method.horizontalize=sideways", "method.horizontalize"),
    ("prism", "method.preconditioner=diag", "method.preconditioner"),
    ("prism", "method.compute_dtype=float16", "method.compute_dtype"),
    ("prism", "method.rank_fallback=zero", "method.rank_fallback"),
    ("prism", "method.floor_factor=-0.5", "method.floor_factor"),
    ("prism", "method.cond_max=0.5", "method.cond_max"),
    ("prism", "method.init=peft", "method.init"),
    ("prism", "method.floor_mode=vector", "method.floor_mode"),
    ("prism", "method.beta2=1.0", "method.beta2"),
    ("prism_paper", "method.pinv_rcond=1.5", "method.pinv_rcond"),
    ("prism", "method.noise_damping=-1e-8", "method.noise_damping"),
    ("prism", "method.init_svd=exact", "method.init_svd"),
    ("adamw", "method.betas=[0.9,1.5]", "method.betas"),
    ("adamw", "method.eps=0", "method.eps"),
    ("adamw", "method.weight_decay=-0.1", "method.weight_decay"),
    ("loraplus", "method.loraplus_lr_ratio=0", "method.loraplus_lr_ratio"),
    ("lamb", "method.max_grad_norm=1.0", "method.max_grad_norm"),
    ("lamb", "method.pre_norm=true", "method.pre_norm"),
    ("lamb", "method.n_sma_threshold=-1", "method.n_sma_threshold"),
    ("lora_rite", "method.update_skipping=-1", "method.update_skipping"),
    ("ffa", "method.lr=-1", "method.lr"),
]


@pytest.mark.parametrize("method, override, key", BAD)
def test_bad_method_values_are_refused_by_the_validator_and_the_method(method: str, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_job([f"method={method}", override])
    line = str(refused.value)
    assert line.startswith(f"{key}=") and "\n" not in line
    node = OmegaConf.to_container(load_job([f"method={method}"]).method)
    name, _, value = override.partition("=")
    node[name.removeprefix("method.")] = OmegaConf.to_container(OmegaConf.create(f"v: {value}"))["v"]
    with pytest.raises(schema.SchemaError) as built:  # the method builds the same dataclass, before any tensor
        build_method(OmegaConf.create(node), {}, None)
    assert str(built.value).split(" ", 1)[1] == line.split(" ", 1)[1]  # same rule (the validator makes 0 a 0.0)


# (method, a method key, a key of another section of the same type, the value typed for both)
SAME_TYPE = [
    ("prism", "method.lr", "lora.dropout", "abc"),
    ("prism", "method.lr", "lora.dropout", "true"),
    ("prism", "method.lr", "lora.dropout", "null"),
    ("prism", "method.debias", "force", "maybe"),
    ("lamb", "method.n_sma_threshold", "train.steps", "2.5"),
    ("adamw", "method.betas", "lora.targets", "0.9"),
]


@pytest.mark.parametrize("method, key, other, value", SAME_TYPE)
def test_a_wrong_method_type_is_worded_as_in_every_other_section(method: str, key: str, other: str,
                                                                 value: str) -> None:
    """The method node is typed by OmegaConf's structured config of its class, as every other section is:
    the same wrong value gets the same line, but for the key's name."""
    lines = []
    for name in (key, other):
        with pytest.raises(ConfigError) as refused:
            load_job([f"method={method}", f"{name}={value}"])
        lines.append(str(refused.value).replace(name, "<key>"))
    assert lines[0] == lines[1] and "<key>" in lines[0]


@pytest.mark.parametrize("protocol", ["corrected", "released"])
@pytest.mark.parametrize("method", METHODS)
def test_schema_covers_the_shipped_method_nodes(method: str, protocol: str) -> None:
    node = load_job([f"method={method}", f"protocol={protocol}"]).method
    assert set(node) == {f.name for f in fields(registry.config_class(method))}
    registry.check(node)


def test_schema_choices_are_the_runtime_choices() -> None:
    """The choices the code maps to behaviour (its constants) are the dataclass's choices, and the
    dataclass refuses a value out of range."""
    pytest.importorskip("torch")
    from prism.methods.prism import COMPUTE_DTYPES
    from prism.models.spectral import SVD_MODES

    choices = {f.name: f.metadata["choices"] for f in fields(schema.PrismConfig)}
    assert set(choices["compute_dtype"]) == set(COMPUTE_DTYPES)
    assert choices["init_svd"] == SVD_MODES
    base = OmegaConf.to_container(load_job(["method=prism"]).method)
    assert schema.PrismConfig.from_node(base).cond_max == base["cond_max"]
    for field, value in [("cond_max", 0.5), ("beta1", 1.0), ("floor_factor", -1.0), ("horizontalize", "x")]:
        with pytest.raises(schema.SchemaError, match=f"^method.{field}="):
            schema.PrismConfig.from_node({**base, field: value})


def test_the_validator_imports_no_torch() -> None:
    code = ("import sys\nfrom pipelines.config.validate import load_job\n"
            f"for m in {list(METHODS)!r}:\n    load_job([f'method={{m}}'])\n"
            "load_job(['privacy.epsilon=1e9', 'privacy.name=eps1000000000']) if False else None\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# ----------------------------------------------------------------------------- accountant limits
Q, T = 64 / 2000, 30  # the embedded GLUE8 question


def test_rdp_is_opacus_rdp_at_integer_orders() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants.analysis import rdp as opacus_rdp

    for sigma, q in [(0.3, 0.032), (0.7, 0.064), (5.0, 0.001), (1.0, 1.0)]:
        ours = dp_limits.rdp_curve(sigma, q)
        theirs = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(dp_limits.ORDERS))
        assert ours == pytest.approx(theirs, rel=1e-9)


def test_grid_estimate_is_opacus_prv_domain() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    for sigma, steps in [(1.0, 3000), (0.6, 300), (20.0, 10_000)]:
        prv = PoissonSubsampledGaussianPRV(sample_rate=Q, noise_multiplier=sigma)
        domain = PRVAccountant()._get_domain(prvs=[prv], num_self_compositions=[steps], eps_error=0.01,
                                            delta_error=1e-8)
        # integer orders only: L (hence the grid) is at most about a tenth larger than Opacus' own
        assert domain.size - 2 <= dp_limits.prv_grid_points(sigma, Q, steps, 1e-5) <= 1.15 * domain.size


@pytest.mark.parametrize("overrides, field", [
    (["privacy.epsilon=1e9", "privacy.name=eps1000000000"], "privacy.epsilon"),
    (["privacy.epsilon=0.004", "privacy.name=eps0.004"], "privacy.epsilon"),
    (["privacy.delta=1e-30"], "privacy.delta"),
    (["suite=math10k", "train.steps=100000000"], "train.steps"),
])
def test_accountant_limits_are_refused_before_any_model_load(overrides: list[str], field: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job(overrides)
    assert time.perf_counter() - t0 < 10


def test_what_the_validator_refuses_the_accountant_refuses() -> None:
    """Opacus itself: δ = 1e-30 overflows its float grid; ε = 0.004 is within its error bound (and
    the accountant says so in one line naming the field)."""
    pytest.importorskip("opacus")
    from prism.privacy import accounting

    with pytest.raises(ValueError, match="Floating point errors"):
        accounting.epsilon_spent(1.0, Q, T, 1e-30)
    from opacus.accountants.utils import get_noise_multiplier

    with pytest.raises(ValueError, match="budget is too low"):
        get_noise_multiplier(target_epsilon=0.004, target_delta=1e-5, sample_rate=Q, steps=T, accountant="prv",
                             epsilon_tolerance=0.01, eps_error=0.01)
    with pytest.raises(ValueError, match="privacy.epsilon=0.008 is too small to calibrate"):
        accounting.calibrate_sigma(0.008, 1e-5, Q, T)


def test_calibration_is_bounded_and_unchanged_where_it_works() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants.utils import get_noise_multiplier

    from prism.privacy.accounting import calibrate_sigma, epsilon_spent

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="privacy=nondp"):
        calibrate_sigma(1e9, 1e-5, Q, T)
    assert time.perf_counter() - t0 < 5
    floor = epsilon_spent(dp_limits.SIGMA_FLOOR, Q, T, 1e-5)
    assert floor < dp_limits.rdp_epsilon(dp_limits.SIGMA_FLOOR, Q, T, 1e-5)  # the validator's bound is looser
    with pytest.raises(ValueError, match="beyond what σ calibration can reach"):
        calibrate_sigma(math.ceil(floor) + 1.0, 1e-5, Q, T)
    expected = get_noise_multiplier(target_epsilon=6.0, target_delta=1e-5, sample_rate=Q, steps=T, accountant="prv",
                                    epsilon_tolerance=0.01, eps_error=0.01)
    assert calibrate_sigma(6.0, 1e-5, Q, T) == expected
