"""``python -m pipelines migrate``: move the run folders of the older layout into the shared run store
(:func:`pipelines.runs.store.migrate`, docs/DECISIONS.md D82)."""
from __future__ import annotations

from pathlib import Path

from pipelines.config.identity import HASH_RE
from pipelines.runs.store import migrate


def main(*, results_dir: str = "results") -> int:
    """Move the old-layout run folders under ``results_dir``/runs into the store (``python -m pipelines migrate``)."""
    root = Path(results_dir)
    if not (root / "runs").is_dir():
        raise ValueError(f"results_dir={root}: no run store at {root / 'runs'}, pass the results_dir that holds runs/")
    moved = migrate(root)
    for source, target in moved:
        print(f"moved {source} -> {target}")
    print(f"{sum(HASH_RE.fullmatch(target.name) is not None for _, target in moved)} run folder(s) moved into "
          f"{root / 'runs'}")
    return 0
