"""The layers of ``pipelines/`` (docs/ARCHITECTURE.md, "Layout"): ``config < runs < tables < verbs``.

Every import of every module counts, at module level or inside a function. A module may import its own
layer and the layers below it; a verb imports no other verb (:data:`pipelines.__main__.VERBS` names each
one's function by its dotted path instead, imported when the verb is called); ``pipelines.config``
imports no torch, so a bad input is reported before the heavy libraries load.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipelines"
LAYERS = ("config", "runs", "tables", "verbs")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The dotted names of the ``pipelines`` modules ``path`` imports (``from pkg import mod``: ``pkg.mod``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import; name the module"
            names |= {node.module or ""} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n == "pipelines" or n.startswith("pipelines.")}


def layer(module: str) -> str | None:
    """The layer of a dotted name, None for the package's own ``pipelines``, ``__init__`` and ``__main__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def is_module(name: str) -> bool:
    parts = name.split(".")
    return PACKAGE.joinpath(*parts[1:]).with_suffix(".py").is_file() or (PACKAGE.joinpath(*parts[1:]) / "__init__.py").is_file()


def violations(package: Path = PACKAGE) -> list[str]:
    """One line per import that goes up a layer, or from one verb to another."""
    out = []
    for path in sorted(package.rglob("*.py")):
        module, own = module_name(path), layer(module_name(path))
        for name in sorted(imported(path)):
            target = layer(name)
            if own is None or target is None:
                continue
            if LAYERS.index(target) > LAYERS.index(own):
                out.append(f"{module} ({own}) imports {name} ({target}), a layer above it")
            elif own == target == "verbs" and is_module(name) and name.split(".")[:3] != module.split(".")[:3]:
                out.append(f"{module} imports the verb {name}")
    return out


def test_no_module_imports_a_layer_above_it_and_no_verb_imports_another() -> None:
    assert violations() == []


def test_pipelines_holds_only_the_four_layers_and_the_command() -> None:
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", "__main__.py", *LAYERS}


def test_every_verb_is_one_module_of_the_verbs_layer() -> None:
    from pipelines.__main__ import VERBS

    modules = {target.split(":")[0] for target, _ in VERBS.values()}
    assert {layer(m) for m in modules} == {"verbs"}
    assert len(modules) == len(VERBS)


def test_importing_the_config_layer_loads_no_torch() -> None:
    modules = sorted(module_name(p) for p in (PACKAGE / "config").rglob("*.py"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
