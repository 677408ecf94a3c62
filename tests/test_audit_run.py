"""One-run audit harness (prism.audit.canaries, pipelines.verbs.audit_run) on mechanisms of known privacy.

The methods here are test-only Gaussian mechanisms implementing :class:`prism.methods.base.Method` plus the
release hook the harness reads: one clips in the flat factor space, one in PRISM's tangent space
(lift, eq. 14; isotropic tangent noise, eq. 19). With every canary sampled in every step (rate 1) a
run of T steps is a Gaussian mechanism with μ = √T/σ per canary, so its true ε is the GDP curve's
(:func:`prism.audit.step.gdp_epsilon`). The test-only 'noise ÷ 10' variants live in this file; the
audit's own broken-noise control is :class:`pipelines.verbs.audit_run.BrokenNoise`.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_cfg

from pipelines.__main__ import main as cli
from pipelines.verbs import audit_run
from pipelines.verbs.audit_run import AuditRow, audit_method, write_table
from prism.audit.canaries import draw_directions, gradients, project, sqnorms
from prism.audit.step import gdp_epsilon
from prism.mechanism import geometry
from prism.mechanism.lora import lora_pairs, read_pair
from prism.methods.base import Method, PrivacySpec, Release
from prism.privacy.noise import SeededNoise

M, N, R = 512, 384, 8
A_NAME, B_NAME = "x.lora_B.default.weight", "x.lora_A.default.weight"


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {A_NAME: torch.nn.Parameter(torch.randn(M, R, generator=g, dtype=torch.float64)),
            B_NAME: torch.nn.Parameter(torch.randn(R, N, generator=g, dtype=torch.float64))}


class FlatGaussian(Method):
    """Factor-space DP-SGD: clip each example's flat norm to C, add N(0, (noise·C)²), SGD step."""

    def __init__(self, params, privacy: PrivacySpec, noise_scale: float = 1.0, lr: float = 1e-3) -> None:
        super().__init__(params, privacy)
        self.noise_scale, self.lr, self.examples = noise_scale, lr, 0
        self.zero_accumulators()

    def zero_accumulators(self) -> None:
        self.sum = {n: torch.zeros_like(p) for n, p in self.params.items()}

    def accumulate(self, grads) -> None:
        k = next(iter(grads.values())).shape[0]
        norms = torch.sqrt(sum(grads[n].reshape(k, -1).square().sum(1) for n in self.params))
        coef = (self.privacy.clip_norm / norms).clamp(max=1.0)
        for n in self.params:
            self.sum[n] += torch.einsum("k,k...->...", coef, grads[n])
        self.examples += k

    def add_noise(self, denominator, noise, diagnostics=True):
        sd = self.noise_scale * self.privacy.sigma * self.privacy.clip_norm
        return Release({n: (s + sd * noise.normal(tuple(s.shape), s.device)) / denominator for n, s in self.sum.items()},
                       sd / denominator)

    def update(self, release, diagnostics=True):
        with torch.no_grad():
            for n, p in self.params.items():
                p -= self.lr * release.tensors[n]
        return {}

    def clip_stats(self):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None: ...


class BrokenFlatGaussian(FlatGaussian):
    """Claims σ, adds σ/10."""

    def __init__(self, params, privacy: PrivacySpec) -> None:
        super().__init__(params, privacy, noise_scale=0.1)


class TangentGaussian(FlatGaussian):
    """PRISM's mechanism in one module: clip by the intrinsic norm of the lift, add τ·tangent noise, and a
    step along the lift (the factors move, so each step's projection uses that step's factors)."""

    def accumulate(self, grads) -> None:
        pair = lora_pairs(self.params)[0]
        A, B = (x.detach() for x in read_pair(self.params, pair))
        gA, gB = read_pair(grads, pair)
        norms = geometry.lifted_norm_terms(geometry.frame(A, B), gA, gB)[0].sqrt()
        coef = (self.privacy.clip_norm / norms).clamp(max=1.0)
        dA, dB = geometry.lift(A, B, torch.einsum("k,k...->...", coef, gA), torch.einsum("k,k...->...", coef, gB))
        self.sum[pair.a_name] += dA
        self.sum[pair.b_name] += dB.mT
        self.examples += len(coef)

    def add_noise(self, denominator, noise, diagnostics=True):
        pair = lora_pairs(self.params)[0]
        A, B = (x.detach() for x in read_pair(self.params, pair))
        XiA, XiB = geometry.tangent_noise(geometry.frame(A, B), noise.normal(tuple(A.shape), A.device),
                                          noise.normal(tuple(B.shape), B.device))
        tau = self.noise_scale * self.privacy.sigma * self.privacy.clip_norm
        return Release({pair.a_name: (self.sum[pair.a_name] + tau * XiA) / denominator,
                        pair.b_name: (self.sum[pair.b_name] + tau * XiB.mT) / denominator}, tau / denominator)


def _real_examples(method: Method, g: torch.Generator, k: int = 6) -> None:
    """A micro-batch of ordinary per-example gradients (random, norm about C/2)."""
    method.accumulate({n: 0.5 * torch.randn(k, *p.shape, generator=g, dtype=p.dtype) / math.sqrt(2 * p.numel())
                       for n, p in method.params.items()})


def _run(cls, space, sigma=10.0, steps=16, canaries=400, k=40, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    method = cls(_params(seed), PrivacySpec(sigma=sigma, clip_norm=1.0))

    def step_fn(wrapped):
        wrapped.zero_accumulators()
        _real_examples(wrapped, g)
        wrapped.step(64.0, g)

    result, wrapped = audit_method(method, space, canaries, k, k, 1.0, steps, step_fn, 1e-5, seed, report=lambda _: None)
    return result, wrapped, method


def test_canary_gradients_have_the_stated_norm_and_pass_through_accumulate():
    params = _params()
    for space in ("factor", "tangent"):
        d = draw_directions(space, params, 10, seed=1)
        ids = torch.tensor([0, 3, 7])
        grads = gradients(d, params, ids, clip_norm=1.0, per_example=True)
        if space == "factor":
            norms = torch.sqrt(sum(grads[n].reshape(3, -1).square().sum(1) for n in params))
        else:
            A, B = read_pair(params, lora_pairs(params)[0])
            gA, gB = read_pair(grads, lora_pairs(params)[0])
            norms = geometry.lifted_norm_terms(geometry.frame(A.detach(), B.detach()), gA, gB)[0].sqrt()
        torch.testing.assert_close(norms, torch.full((3,), 2.0, dtype=torch.float64))
    _, wrapped, method = _run(FlatGaussian, "factor", steps=2, canaries=20, k=5)
    assert method.examples == 2 * 6 + int(wrapped.sampled.sum())  # the canaries went through accumulate
    assert torch.equal(wrapped.sampled[wrapped.included], torch.full((len(wrapped.included),), 2))


def test_canaries_are_orthogonal_and_shared_out_up_to_each_blocks_cells():
    """Factor canaries are cells of a random orthonormal basis per tensor: their directions, embedded in the
    flat factor vector, are orthonormal; a [3, 2] tensor takes its 6 cells, a [8, 4] one the other 14 of 20;
    more canaries than cells is refused."""
    params = {"x.lora_B.default.weight": torch.zeros(3, 2), "x.lora_A.default.weight": torch.zeros(8, 4)}
    d = draw_directions("factor", params, 20, seed=3)
    counts = {key: len(d.members(key)) for key in d.keys}
    assert counts == {"x.lora_B.default.weight": 6, "x.lora_A.default.weight": 14}
    flat = torch.zeros(20, 6 + 32, dtype=torch.float64)
    for key, (start, stop) in {"x.lora_B.default.weight": (0, 6), "x.lora_A.default.weight": (6, 38)}.items():
        ids = d.members(key)
        flat[ids, start:stop] = (d.left[key][:, :, None] * d.right[key][:, None, :]).flatten(1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(20, dtype=torch.float64))
    with pytest.raises(ValueError, match="at most 38"):
        draw_directions("factor", params, 39, seed=3)


def test_tangent_projection_against_the_dense_lift():
    """⟨ΔZ, P(G_c)⟩/‖P(G_c)‖ from the rank-1 formula equals the dense computation, and the lift of a
    canary's own gradient scores its norm (2C) on it."""
    params = _params()
    d = draw_directions("tangent", params, 6, seed=2)
    pair = lora_pairs(params)[0]
    A, B = (x.detach() for x in read_pair(params, pair))
    grads = gradients(d, params, torch.tensor([4]), clip_norm=1.0, per_example=False)
    dA, dB = geometry.lift(A, B, *read_pair(grads, pair))
    release = {pair.a_name: dA, pair.b_name: dB.mT}
    scores = project(d, release, params)
    dZ = dA @ B.T + A @ dB.T
    for c in range(6):
        P = geometry.tangent_project(A, B, torch.outer(d.left["x"][c], d.right["x"][c]))
        assert float(scores[c]) == pytest.approx(float((dZ * P).sum() / P.norm()), rel=1e-9)
        assert float(sqnorms(d, params)[c]) == pytest.approx(float(P.square().sum()), rel=1e-9)
    assert float(scores[4]) == pytest.approx(2.0, rel=1e-9)


@pytest.mark.parametrize("cls,space", [(FlatGaussian, "factor"), (TangentGaussian, "tangent")])
def test_correct_mechanism_stays_below_its_epsilon(cls, space):
    result, _, _ = _run(cls, space)
    eps_true = gdp_epsilon(math.sqrt(16) / 10.0, 1e-5)  # 1.55
    assert result.guesses == 80 and result.epsilon_lower <= eps_true


@pytest.mark.parametrize("cls,space", [(BrokenFlatGaussian, "factor")])
def test_noise_divided_by_ten_is_caught(cls, space):
    result, _, _ = _run(cls, space)
    assert result.epsilon_lower > gdp_epsilon(math.sqrt(16) / 10.0, 1e-5)


def test_tangent_noise_divided_by_ten_is_caught():
    class BrokenTangent(TangentGaussian):
        def __init__(self, params, privacy):
            super().__init__(params, privacy, noise_scale=0.1)

    result, _, _ = _run(BrokenTangent, "tangent")
    assert result.epsilon_lower > gdp_epsilon(math.sqrt(16) / 10.0, 1e-5)


def test_table_round_trips(tmp_path):
    rows = [AuditRow("prism", audit_run.GENUINE, 6.0, 1000, 200, 120, 0.31, 0.35, 0.12, 0.5, "0.20 ± 0.10", "abc123"),
            AuditRow("prism", audit_run.BROKEN, 6.0, 1000, 200, 200, 5.2, 6.4, 2.0, 8.0, "6.50 ± 0.10", "abc123"),
            AuditRow("adamw", audit_run.NONPRIVATE, math.inf, 1000, 200, 200, 3.1, math.nan, math.nan, math.nan, "",
                     "def456")]
    md, csv_path = write_table(rows, "embedded", tmp_path)
    with csv_path.open() as fh:
        read = list(csv.DictReader(fh))
    assert [r["method"] for r in read] == ["prism", "prism", "adamw"] and float(read[2]["claimed_epsilon"]) == math.inf
    assert [r["row"] for r in read] == ["DP run", "control: noise ÷ 10", "control: non-private"]
    text = md.read_text()
    assert "| prism | DP run | 6 | 1000 | 200 | 120 | 0.31 | 0.35 | 0.12 (0.50) | 0.20 ± 0.10 | pass | `abc123` |" in text
    assert "| prism | control: noise ÷ 10 | 6 | 1000 | 200 | 200 | 5.20 | 6.40 | 2.00 (8.00) | 6.50 ± 0.10 | caught |" in text
    assert "| adamw | control: non-private | ∞ (non-private) | 1000 | 200 | 200 | 3.10 | – | – | – | – | `def456` |" in text


def test_verdicts_flag_a_defect_and_a_missed_control():
    """A DP run passes at or below its ε and is a defect above it (either bound); a broken control is caught
    above its claimed ε and missed at or below it."""
    def row(kind, steinke, fdp):
        return AuditRow("prism", kind, 3.0, 10, 5, 5, steinke, fdp, 0.0, 0.0, "", "h")

    assert [audit_run.verdict(row(audit_run.GENUINE, *b)) for b in ((2.9, 3.0), (3.1, 2.0), (1.0, 3.2))] == \
        ["pass", "DEFECT", "DEFECT"]
    assert [audit_run.verdict(row(audit_run.BROKEN, *b)) for b in ((2.9, 3.0), (2.0, 3.2), (3.5, math.nan))] == \
        ["MISSED", "caught", "caught"]


@pytest.mark.parametrize("argv,field", [(["epsilons=0"], "epsilons"), (["methods=sgd"], "methods"),
                                        (["k_pos=40000", "k_neg=20000"], "k_pos"), (["scale=paper"], "scale")])
def test_cli_rejects_bad_input_in_one_line(argv, field, capsys, tmp_path):
    assert cli(["audit-run", *argv, f"out={tmp_path / 't'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err and not (tmp_path / "t").exists()


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_an_out_that_cannot_be_a_folder_is_one_line_before_any_training(where, capsys, tmp_path, monkeypatch):
    def no_training(*_):
        raise AssertionError("audit-run trained although out= cannot hold its tables")

    monkeypatch.setattr(audit_run, "audit_training_run", no_training)
    (tmp_path / "taken").write_text("an earlier result")
    out = tmp_path / "taken" if where == "a file" else tmp_path / "taken" / "tables"
    assert cli(["audit-run", "methods=adamw", "epsilons=6", "canaries=100", f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: out={out}: ") and "a file" in err, err
    assert (tmp_path / "taken").read_text() == "an earlier result"


class ScaledNoise:
    """Test-only: a noise source whose draws are ``scale`` times unit normals (a broken mechanism)."""

    def __init__(self, generator: torch.Generator, scale: float) -> None:
        self.inner, self.scale = SeededNoise(generator), scale

    def normal(self, shape, device):
        return self.scale * self.inner.normal(shape, device)


@pytest.mark.parametrize("name,space", [("adamw", "factor"), ("prism", "tangent")])
@pytest.mark.parametrize("scale", [1.0, 0.1], ids=["correct", "noise÷10"])
def test_real_methods_pass_and_their_noise_divided_by_ten_is_caught(name, space, scale):
    """The production methods (their own accumulate, add_noise and update) with canaries in every step:
    with their noise the bound stays below the true ε of 16 steps of σ = 10 (the GDP curve, 1.55); with the
    same draws ÷ 10 through a test-only noise source the bound exceeds it."""
    from omegaconf import OmegaConf

    from prism.methods import build_method
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "method" / f"{name}.yaml")
    cfg.lr = 1e-3
    g = torch.Generator().manual_seed(5)
    method = build_method(cfg, _params(0), PrivacySpec(sigma=10.0, clip_norm=1.0))
    noise = ScaledNoise(torch.Generator().manual_seed(6), scale)

    def step_fn(wrapped):
        wrapped.zero_accumulators()
        _real_examples(wrapped, g)
        wrapped.step(64.0, noise)

    result, _ = audit_method(method, space, 400, 40, 40, 1.0, 16, step_fn, 1e-5, 0, report=lambda _: None)
    eps_true = gdp_epsilon(math.sqrt(16) / 10.0, 1e-5)
    assert (result.epsilon_lower <= eps_true) if scale == 1.0 else (result.epsilon_lower > eps_true)


def test_split_rule_audits_the_unseen_half():
    g = torch.Generator().manual_seed(7)
    method = BrokenFlatGaussian(_params(1), PrivacySpec(sigma=10.0, clip_norm=1.0))

    def step_fn(wrapped):
        wrapped.zero_accumulators()
        _real_examples(wrapped, g)
        wrapped.step(64.0, g)

    result, _ = audit_method(method, "factor", 400, 0, 0, 1.0, 16, step_fn, 1e-5, 3, split=True, report=lambda _: None)
    assert result.canaries == 200 and (result.k_pos, result.k_neg) in audit_run.split_candidates(200)
    assert result.epsilon_lower > gdp_epsilon(math.sqrt(16) / 10.0, 1e-5)


def test_harness_matches_the_ideal_run():
    """The correct flat mechanism with every canary in every step (q = 1) against the simulated ideal run
    of :func:`prism.audit.one_run.expected_bounds` at the same σ, T, m, k: the number of correct
    guesses agrees (the real examples and the other canaries interfere little)."""
    from prism.audit.one_run import dpsgd_canary_scores, top_bottom_guesses

    rng = np.random.default_rng(5)
    ideal = []
    for _ in range(50):
        included = rng.random(400) < 0.5
        guesses = top_bottom_guesses(dpsgd_canary_scores(included, 1.0, 16, 10.0, rng), 40, 40)
        ideal.append(int((guesses == np.where(included, 1, -1)).sum()))
    harness = [_run(FlatGaussian, "factor", seed=s)[0].correct for s in range(3)]
    assert abs(np.mean(harness) - np.mean(ideal)) < 3 * np.std(ideal)


@pytest.mark.slow  # builds the tiny backbone and calibrates σ (about 20 s on a shared 2-core machine)
def test_canaries_ride_the_real_training_loop():
    """The real loop (prism.train.build/train_step: Poisson sampler, tiny backbone, Opacus per-example
    gradients) with the test mechanism on the run's own LoRA parameters: the canaries are sampled at the
    run's rate alongside real examples, enter the same accumulate, and every canary is scored each step."""
    from prism import train as T

    cfg = tiny_cfg("method=adamw", "privacy=eps6")
    s = T.build(cfg)
    method = FlatGaussian(s.method.params, s.method.privacy)
    seen = []
    inner_accumulate = method.accumulate
    method.accumulate = lambda grads: (seen.append(next(iter(grads.values())).shape[0]), inner_accumulate(grads))

    def step_fn(wrapped):
        s.method = wrapped
        T.train_step(s, cfg)

    result, wrapped = audit_method(method, "factor", 60, 5, 0, s.sampler.sample_rate, cfg.train.steps, step_fn,
                                   1e-5, 0, report=lambda _: None)
    assert s.sampler.sample_rate == pytest.approx(8 / 32)
    assert method.examples == sum(seen) and int(wrapped.sampled.sum()) > 0
    assert int(wrapped.sampled[~np.isin(np.arange(60), wrapped.included.numpy())].sum()) == 0  # excluded never enter
    assert torch.isfinite(wrapped.scores).all() and result.guesses == 5


@pytest.mark.parametrize("name,space", [("adamw", "factor"), ("prism", "tangent")])
def test_the_audits_broken_noise_control_is_caught_and_the_genuine_run_passes(name, space):
    """The audit's own control (:class:`pipelines.verbs.audit_run.BrokenNoise` around the run's noise source) on the
    production methods with 1,000 canaries and 300 "in" guesses: 16 steps of σ = 5 with every canary in every
    step (true ε 3.39, the GDP curve) pass with either bound; the same run with the control's noise is caught."""
    from omegaconf import OmegaConf

    from prism.methods import build_method
    eps_true = gdp_epsilon(math.sqrt(16) / 5.0, 1e-5)
    verdicts = []
    for broken in (False, True):
        cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "method" / f"{name}.yaml")
        cfg.lr = 1e-3
        g = torch.Generator().manual_seed(5)
        method = build_method(cfg, _params(0), PrivacySpec(sigma=5.0, clip_norm=1.0))
        noise = SeededNoise(torch.Generator().manual_seed(6))
        noise = audit_run.BrokenNoise(noise) if broken else noise

        def step_fn(wrapped, g=g, noise=noise):
            wrapped.zero_accumulators()
            _real_examples(wrapped, g)
            wrapped.step(64.0, noise)

        result, _ = audit_method(method, space, 1000, 300, 0, 1.0, 16, step_fn, 1e-5, 0, report=lambda _: None)
        row = AuditRow(name, audit_run.BROKEN if broken else audit_run.GENUINE, eps_true, result.canaries,
                       result.guesses, result.correct, result.epsilon_lower, result.epsilon_fdp_lower, result.mu_lower,
                       0.0, "", "h")
        verdicts.append(audit_run.verdict(row))
    assert verdicts == ["pass", "caught"]


def test_broken_noise_control_is_reachable_only_from_the_audit():
    """The control's noise wrapper is named in no module but the audit's, no config holds a noise scale, and an
    override that tries to add one is an unknown key."""
    from pipelines.config.rules import ConfigError
    from pipelines.config.validate import load_job

    root = Path(__file__).resolve().parents[1]
    users = {p.relative_to(root).as_posix() for d in ("prism", "pipelines") for p in (root / d).rglob("*.py")
             if "BrokenNoise" in p.read_text() or "BROKEN_NOISE_SCALE" in p.read_text()}
    assert users == {"pipelines/verbs/audit_run.py"}
    assert not any("noise_scale" in p.read_text() or "broken" in p.read_text().lower()
                   for p in (root / "conf").rglob("*.yaml"))
    for override in ("+privacy.noise_scale=0.1", "privacy.noise_scale=0.1", "++privacy.broken=true"):
        with pytest.raises(ConfigError):
            load_job(["method=prism", "scale=smoke", "privacy=eps6", override])
