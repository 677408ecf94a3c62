#!/usr/bin/env python3
"""Repoint comments that cite documents outside the repository to docs/DECISIONS.md / docs/ARCHITECTURE.md.

    python scripts/repoint_citations.py            # rewrite tracked files in place, print each change
    python scripts/repoint_citations.py --check    # change nothing; exit 1 if any citation remains

Older comments cite design notes this repository does not ship ("SPEC §n", "report §n", "reference
doc §n", ...). Each is rewritten to the docs/DECISIONS.md row or docs/ARCHITECTURE.md section that
holds the same decision: first by a rule keyed on the citation *and* its surrounding words (so it
survives files being moved or split), else by the cited section number alone. Idempotent (the
replacements contain no citation). Exits 1 and lists the lines it could not map when any remain.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SELF = {"scripts/repoint_citations.py", "tests/test_no_outside_citations.py"}

# Anything that points at a document outside the repository (checked after rewriting).
OUTSIDE = re.compile(
    r"SPEC §|report §|[Rr]eference doc|reference §|paper-and-reference-code|design notes \(§|"
    r"the report \(§|[Tt]he report's literal|rank check \(§1\.9\)"
)

DEC = "docs/DECISIONS.md"
ARCH = "docs/ARCHITECTURE.md"

# (pattern, replacement): the citation with enough context to pick its row; applied in order.
RULES: list[tuple[str, str]] = [
    # conf/
    (r"Scale mapping \(SPEC §8\)", f"Scale mapping ({DEC} D34)"),
    (r"Factor-space DP-SGD \+ AdamW \(SPEC §2\)", f"Factor-space DP-SGD + AdamW ({DEC} D23)"),
    (r"random peft lora_A frozen \(SPEC §2\)", f"random peft lora_A frozen ({DEC} D24)"),
    (r"from pytorch-optimizer \(SPEC §2\)", f"from pytorch-optimizer ({DEC} D26)"),
    (r"written from its paper \(SPEC §2\)", f"written from its paper ({DEC} D27)"),
    (r"LoRA\+ \(SPEC §2\)", f"LoRA+ ({DEC} D25)"),
    (r"released-code variant \(SPEC §2; report §6\.2 CLI values\)", f"released-code variant ({DEC} D15, D16)"),
    (r"Gram matrix is an error \(SPEC §3\)", f"Gram matrix is an error ({DEC} D20)"),
    (r"eqs\. 25–26 variant \(SPEC §2\)", f"eqs. 25–26 variant ({DEC} D15)"),
    (r"no clipping, no noise \(SPEC §3\)", f"no clipping, no noise ({DEC} D7)"),
    (r"Embedded scale \(SPEC §8\)", f"Embedded scale ({DEC} D34)"),
    # docs/ARCHITECTURE.md refers to the first module sketch
    (r"Deviations from SPEC §10's sketch", "Deviations from the first module sketch"),
    (r"\(SPEC §10 allowed either\)", "(the first sketch allowed either)"),
    # prism/data, prompts, evaluation, metrics
    (r"Suites \(report §3\.1, §3\.4–3\.5\)", f"Suites ({DEC} D29–D31, D39)"),
    (r"GLUE8 at paper scale \(report §3\.1, §3\.4\)", f"GLUE8 at paper scale ({DEC} D29, D39)"),
    (r"Math-10K at paper scale \(report §3\.1, §3\.5\)", f"Math-10K at paper scale ({DEC} D31)"),
    (r"Alpaca templates, report §3\.4–3\.5\)", f"Alpaca templates, {DEC} D31, D39)"),
    (r"Training text \(report §3\.4\)", f"Training text ({DEC} D39)"),
    (r"Generation prompt \(report §3\.5\)", f"Generation prompt ({DEC} D9, D31)"),
    (r"Tokenise one training example \(report §3\.4\)", f"Tokenise one training example ({DEC} D39)"),
    (r"evaluation of a suite \(report §3\.5\)", f"evaluation of a suite ({DEC} D9–D12, D30, D31)"),
    (r"task metrics \(report §3\.5\)", f"task metrics ({DEC} D12, D30, D31)"),
    (r"whether the rules parsed it \(report §3\.5\)", f"whether the rules parsed it ({DEC} D30)"),
    (r"abbreviated in the report \(§3\.1\)", "only this abbreviation is published"),
    # prism core
    (r"shrunk noise covariance \(SPEC §3\)", f"shrunk noise covariance ({DEC} D4, D20)"),
    (r"paper's notation \(SPEC §1\)", f"paper's notation ({ARCH}, Notation)"),
    (r"an update rule \(SPEC §2–§3\)", f"an update rule ({DEC} D2, D23)"),
    (r"baseline optimizer \(SPEC §2–§3, Table 8\)", f"baseline optimizer ({DEC} D23, Table 8)"),
    (r"privatised gradient \(SPEC §2, Table 8\)", f"privatised gradient ({DEC} D23–D27, Table 8)"),
    (r"\(paper Alg\. 1; SPEC §3\)", f"(paper Alg. 1; {DEC} D13)"),
    (r"\(SPEC §3: never damp\)", f"({DEC} D20: never damp)"),
    (r"paper-and-reference-code §6\.4", f"{DEC} D15"),
    (r"the algorithm summary in the design notes \(§5\)", f"its reference implementation's defaults ({DEC} D27)"),
    (r"adapter export \(SPEC §4, §5, §8\)", f"adapter export ({DEC} D14, D32, D34, D37)"),
    (r"\bit, SPEC §8\)", f"it; {DEC} D34)"),
    (r"\(reference §1\.8\)", f"({DEC} D14)"),
    (r"DP plumbing \(SPEC §3\)", f"DP plumbing ({DEC} D1–D3, D21, D22)"),
    (r"DP-SGD \(SPEC §3; paper App\. B\.1\)", f"DP-SGD ({DEC} D1, D21; paper App. B.1)"),
    (r"Opacus PRV accountant, SPEC §3\)", f"Opacus PRV accountant, {DEC} D21)"),
    (r"LoRA factors \(SPEC §3\)", f"LoRA factors ({DEC} D3)"),
    (r"logical batches \(SPEC §3;", f"logical batches ({DEC} D21, D22;"),
    (r"private or not \(SPEC §3, Algorithm 1\)", f"private or not ({DEC} D1–D3, D7, Algorithm 1)"),
    (r"bit-identically \(SPEC §6\)", f"bit-identically ({ARCH})"),
    # tests
    (r"integration tests \(SPEC §9\)", f"integration tests ({DEC} D36)"),
    (r"slurm\.conf of SPEC §9 with", f"slurm.conf ({DEC} D36) with"),
    (r"slurm_harness\.py, SPEC §9\)", f"slurm_harness.py, {DEC} D36)"),
    (r"σ from the reference doc §10 for the paper's grid", f"σ computed with prv-accountant ({DEC} D1) for the paper's grid"),
    (r"Reference doc §10:", f"{DEC} D1:"),
    (r"\(SPEC §3: no damping\)", f"({DEC} D4: no damping)"),
    (r"The report's literal strings \(§3\.4, §3\.5\)", f"The released code's literal strings ({DEC} D31, D39)"),
    (r"rank check \(§1\.9\)", f"rank check ({DEC} D20)"),
    (r"Answer extraction \(report §3\.5\)", f"Answer extraction ({DEC} D12, D30, D31)"),
    (r"fixed vectors \(report §3\.5\)", f"fixed vectors ({DEC} D30)"),
    (r"Prompt strings \(report §3\.4–3\.5\)", f"Prompt strings ({DEC} D31, D39)"),
]

# Fallback by section number: where each design-note section's content now lives.
SPEC_SECTIONS = {
    "1": f"{ARCH}, Notation", "2": f"{DEC} D15, D23", "3": f"{DEC} D1–D3", "4": f"{DEC} D14",
    "5": f"{DEC} D29–D32", "6": ARCH, "8": f"{DEC} D34", "9": f"{DEC} D36", "10": ARCH,
}
REPORT_SECTIONS = {
    "1.8": f"{DEC} D14", "1.9": f"{DEC} D20", "3.1": f"{DEC} D29", "3.3": f"{DEC} D1, D21",
    "3.4": f"{DEC} D39", "3.5": f"{DEC} D30, D31", "6.2": f"{DEC} D15, D16", "6.4": f"{DEC} D15",
    "6.5": f"{DEC} D2–D5", "10": f"{DEC} D1",
}
FALLBACK = re.compile(r"(?P<doc>SPEC|report|[Rr]eference doc|reference) §(?P<sec>\d+(?:\.\d+)?)(?![\d.])")


def fallback(match: re.Match[str]) -> str:
    table = SPEC_SECTIONS if match["doc"] == "SPEC" else REPORT_SECTIONS
    return table.get(match["sec"], match[0])


def rewrite(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    """Apply :data:`RULES`, then the section fallback, line by line; return the text and the changes."""
    changes, out = [], []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        new = line
        if OUTSIDE.search(new):
            for pattern, replacement in RULES:
                new = re.sub(pattern, replacement, new)
            new = FALLBACK.sub(fallback, new)
        if new != line:
            changes.append((number, line.rstrip("\n"), new.rstrip("\n")))
        out.append(new)
    return "".join(out), changes


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return [p for p in listed.stdout.splitlines() if p not in SELF]


def remaining(paths: list[str]) -> list[tuple[str, int, str]]:
    """Lines of ``paths`` that still cite an outside document."""
    found = []
    for rel in paths:
        path = REPO / rel
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        found += [(rel, n, line) for n, line in enumerate(text.splitlines(), start=1) if OUTSIDE.search(line)]
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any citation remains")
    args = parser.parse_args(argv)
    paths = tracked_files()
    if not args.check:
        for rel in paths:
            path = REPO / rel
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
                continue
            new, changes = rewrite(text)
            if changes:
                path.write_text(new, encoding="utf-8")
                for number, old, line in changes:
                    print(f"{rel}:{number}:\n  - {old.strip()}\n  + {line.strip()}")
    left = remaining(paths)
    label = "CITES" if args.check else "UNMAPPED"
    for rel, number, line in left:
        print(f"{label} {rel}:{number}: {line.strip()}", file=sys.stderr)
    if left:
        fix = "run scripts/repoint_citations.py" if args.check else "add a rule to scripts/repoint_citations.py"
        print(f"{len(left)} citation(s) left; {fix}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
