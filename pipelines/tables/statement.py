"""The privacy statement of a table: one text, read from its runs, that every rendered format carries.

It follows the reporting list of Ponomareva et al. 2023 ("How to DP-fy ML", Sec. 5.3, reporting): the unit
of privacy and the adjacency, the sampling (Poisson, q, T), the accountant, δ, whether ε includes the
tuning, where the noise came from (a seeded PRNG makes the table a measurement, the OS CSPRNG a release)
and what ε does not cover (docs/PRIVACY.md). :func:`collect` reads the facts from the runs of a built
table, :func:`statement` words them; the Markdown, LaTeX, CSV and the figure of
:mod:`pipelines.tables.render` all print :func:`statement`, so no two formats state different things.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipelines.tables.records import RunRecord
from pipelines.tables.specs import as_float


@dataclass(frozen=True)
class PrivacyFacts:
    """What the private runs of a table ran under: per suite the sampling rates q and step counts T
    (``final.json``'s ``sample_rate`` and ``steps``), the δs, whether runs are published private
    selections (RDP accounting, ε includes tuning), how many ran at rates ``make tune`` chose and how many were
    stored without their rate's provenance (``train.lr_source``, recorded at compose), the noise
    sources (``privacy.noise_source``), whether runs logged un-noised per-step statistics
    (``privacy.log_private_stats``), the table's seeds and the number of private runs."""

    sampling: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()
    deltas: tuple[str, ...] = ()
    selections: int = 0
    tuned: int = 0
    unrecorded: int = 0
    noise_sources: tuple[str, ...] = ()
    private_stats: bool = False
    seeds: tuple[int, ...] = ()
    private: int = 0


def _values(records: Sequence[RunRecord], get) -> tuple[str, ...]:
    return tuple(sorted({v for v in (get(r) for r in records) if v is not None}, key=lambda v: (len(v), v)))


def collect(private: Sequence[RunRecord], *, tuned: int, seeds: Sequence[int], unrecorded: int = 0) -> PrivacyFacts:
    """The :class:`PrivacyFacts` of a table's private runs ``private`` (``tuned`` of them at tuned rates,
    ``unrecorded`` without their rate's provenance)."""
    suites = list(dict.fromkeys(str(r.get("suite.name")) for r in private))

    def number(value: object, fmt: str) -> str | None:
        x = as_float(value)
        return None if x is None else format(x, fmt)

    sampling = tuple((s, _values(mine, lambda r: number(r.final.sample_rate, ".4g")),
                      _values(mine, lambda r: number(r.final.steps, ".0f")))
                     for s in suites for mine in [[r for r in private if str(r.get("suite.name")) == s]])
    return PrivacyFacts(
        sampling=sampling, deltas=_values(private, lambda r: number(r.get("privacy.delta"), "g")),
        selections=sum(r.final.selection is not None for r in private), tuned=tuned,
        unrecorded=unrecorded, noise_sources=_values(private, lambda r: str(r.get("privacy.noise_source") or "seeded")),
        private_stats=any(r.get("privacy.log_private_stats", True) is not False for r in private),
        seeds=tuple(seeds), private=len(private))


def _listed(values: Sequence[str]) -> str:
    return " or ".join(values) if values else "not recorded"


def statement(facts: PrivacyFacts) -> str:
    """The privacy statement of a table (module docstring), one line; for a table without a private run,
    that its rows are non-private."""
    if not facts.private:
        return "Privacy: no private run in this table; its rows are non-private (no ε)."
    sampling = "; ".join(f"{suite} q = {_listed(q)}, T = {_listed(t)}" for suite, q, t in facts.sampling)
    if facts.selections:
        accountant = "RDP at integer orders over the whole private selection (Papernot & Steinke 2022)"
        if facts.selections < facts.private:
            accountant += f" for {facts.selections} of the {facts.private} private runs, PRV (Opacus) for the others"
        tuning = "ε includes the learning-rate tuning (private selection; K, the candidate index and the other " \
                 "candidates stay unpublished)"
    else:
        accountant = "PRV (Opacus) per run"
        told = [f"ε excludes the rate tuning: {facts.tuned} of the {facts.private} private runs use rates "
                "`make tune` chose on their data"] if facts.tuned else []
        told += [f"whether `make tune` chose the rates of {facts.unrecorded} of the {facts.private} private runs "
                 "is not recorded (stored without train.lr_source)"] if facts.unrecorded else []
        tuning = "; ".join(told) or "ε without tuning: every rate was fixed before training (defaults or method.lr)"
    seeds = ", ".join(map(str, facts.seeds))
    if facts.noise_sources == ("os",):  # a selection under the OS source draws K and the rates from it too
        what = "noise, batches, K and the rates" if facts.selections else "noise and batches"
        noise = f"{what} from the OS CSPRNG: a release"
    else:
        what = "the noise, the batches, K and the rates" if facts.selections else "the noise and the batches"
        noise = (f"noise from a seeded PRNG ({_listed(facts.noise_sources)}): a measurement, {what} follow from "
                 f"the printed seed(s) {seeds}; not a release")
    logs = ("the logs' per-step statistics and times" if facts.private_stats else
            "the logs (privacy.log_private_stats=false: no per-step statistics or times)")
    return (f"Privacy: unit one training row, add/remove adjacency; Poisson sampling, {sampling}; "
            f"accountant {accountant}; δ = {_listed(facts.deltas)}; {tuning}; {noise}. "
            f"ε does not cover the evaluation rows (released as scored; a user's held-out rows too), {logs}, or the "
            "files' modification times (docs/PRIVACY.md).")
