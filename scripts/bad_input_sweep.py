"""Bad-input sweep: run each case against a checkout and classify the outcome.

    python scripts/bad_input_sweep.py [--repo PATH] [--only ID,ID] [--json OUT]

Each case runs in a fresh process (``PYTHONPATH=<repo>``, working directory and ``results_dir``
a new temporary folder, so nothing is written into the checkout) with the trainer replaced by a
stub (no model is loaded; a stub call means "validation let it through and it would train").
Classes: ``clean`` (one ``error:`` line naming the field and a fix, exit 2, no traceback, no run
folder, nothing launched), ``correct`` (a valid input doing what it says), ``unclear`` (refused,
but with a traceback, several lines, a wrong fix, a hang or a folder left behind), ``silent``
(accepted although wrong: it would train, list or launch), ``loss`` (an earlier result gone).
Prints one Markdown row per case and the totals. ``tests/test_bad_input_sweep.py`` runs the cases of
group 6 (task files and model folders, :data:`FAST_GROUPS`) in the fast suite and every case under
``make test-all``; a case that is ``silent`` or ``loss`` fails it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
FAST_GROUPS = (6,)
"""Groups whose cases take seconds each and load no model: run by the fast test suite."""

PRELUDE = textwrap.dedent('''
    import errno, json, logging, os, sys
    from pathlib import Path
    T = Path(os.environ["SWEEP_TMP"])
    RES = str(T / "results")
    def stub(cfg, folder, log_fn):
        (T / "TRAINED").write_text(str(folder))
        return {"columns": {"SST-2": 0.5}}
    def run_main(argv):
        from pipelines.verbs import run
        from pipelines.runs import runner
        from pipelines.__main__ import main as cli
        runner.default_trainer = stub
        return cli(["run", *argv])
    def verdict(cls, note=""):
        print("VERDICT", cls, note)
''')


@dataclass
class Case:
    id: str
    group: int
    what: str
    code: str                      # Python run after PRELUDE (``sys.exit(...)`` sets the exit code)
    must: tuple[str, ...] = ()     # substrings of the error line of a clean refusal
    never: tuple[str, ...] = ()    # substrings a clean refusal must not contain (a wrong fix)
    expect: str = "error"          # error | verdict (the code prints its own VERDICT)
    env: dict[str, str] = field(default_factory=dict)
    timeout: int = 240


def run_case(case: Case, repo: Path) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        t = Path(tmp)
        (t / "home").mkdir()
        env = {**os.environ, "PYTHONPATH": str(repo), "SWEEP_TMP": tmp, "SWEEP_REPO": str(repo),
               "OMP_NUM_THREADS": "1", "HOME": str(t / "home"), **case.env}
        env.setdefault("PRISM_CACHE", os.environ.get("PRISM_CACHE", str(Path.home() / ".cache" / "prism")))
        env = {k: v.replace("{T}", tmp) for k, v in env.items()}
        try:
            done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(case.code).replace("{T}", tmp)],
                                  cwd=tmp, env=env, capture_output=True, text=True, timeout=case.timeout)
        except subprocess.TimeoutExpired:
            return "unclear", f"no answer within {case.timeout} s"
        out, err = done.stdout, done.stderr
        if case.expect == "verdict":
            line = next((x for x in out.splitlines() if x.startswith("VERDICT ")), None)
            if line is None:
                tail = (err.strip().splitlines() or ["no verdict"])[-1]
                return "unclear", f"rc {done.returncode}: {tail[:150]}"
            _, cls, *note = line.split(" ", 2)
            return cls, (note[0] if note else "")[:200]
        lines = [x for x in err.strip().splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
        trained, launched = (t / "TRAINED").exists(), (t / "LAUNCHED").exists()
        runs = [p for p in (t / "results" / "runs").glob("*") if p.is_dir() and p.name != "_views"] \
            if (t / "results" / "runs").exists() else []
        first = lines[0] if lines else ""
        if done.returncode == 0 and (trained or launched or out.strip()):
            return "silent", f"exit 0, {'trained' if trained else 'launched' if launched else 'listed'}: " \
                             f"{(out.strip().splitlines() or [''])[0][:120]}"
        if "Traceback" in err + out:
            return "unclear", f"traceback: {(lines or ['?'])[-1][:150]}"
        ok = (done.returncode == 2 and len(lines) == 1 and first.startswith("error: ") and not trained
              and not launched and not runs and all(m in first for m in case.must)
              and not any(n in first for n in case.never))
        return ("clean" if ok else "unclear"), f"rc {done.returncode}: {first[:200]}" + (
            f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "") + (" [run folder left]" if runs else "")


def _run(*argv: str) -> str:
    return f"sys.exit(run_main([*{list(argv)!r}, 'results_dir=' + RES, 'logging=disabled']))"


def _grid(*argv: str) -> str:
    args = ["grid", f"experiment={argv[0]}", *argv[1:]]
    return f"from pipelines.__main__ import main as cli\nsys.exit(cli([*{args!r}, 'results_dir=' + RES]))"


def _reproduce(*argv: str, results: bool = True) -> str:
    tail = ", 'results_dir=' + RES" if results else ""
    args = ["reproduce", f"experiment=table{argv[0]}", *argv[1:]]
    return ("from pipelines.runs import launch\nfrom pipelines.__main__ import main as cli\n"
            "launch.launch = lambda *a, **k: ((T / 'LAUNCHED').write_text('x'), (True, ''))[1]\n"
            "launch.aggregate = lambda *a, **k: None\n"
            f"sys.exit(cli([*{args!r}{tail}]))")


def _shell(cmd: str) -> str:
    return (f"import subprocess\nrepo = os.environ['SWEEP_REPO']\n"
            f"done = subprocess.run({cmd!r}.replace('REPO', repo).replace('RES', RES), shell=True, cwd=repo,"
            " capture_output=True, text=True)\n"
            "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr); sys.exit(done.returncode)")


def _calibrate(eps: float) -> str:
    return textwrap.dedent(f'''
        import time
        from prism.privacy.accounting import calibrate_sigma
        t0 = time.time()
        try:
            sigma = calibrate_sigma({eps!r}, 1e-5, 64 / 2000, 30)
            verdict("silent", f"σ = {{sigma:.3g}} returned for ε = {eps:g}")
        except ValueError as err:
            one = "\\n" not in str(err) and "privacy.epsilon" in str(err)
            verdict("clean" if one else "unclear", f"{{time.time() - t0:.0f}} s: {{str(err)[:150]}}")
    ''')


STATE = {
    "garbage_status": '''
        from pipelines.verbs import run
        from pipelines.runs import store
        from pipelines.config.validate import load_job
        from omegaconf import OmegaConf
        job = ["results_dir=" + RES, "logging=disabled"]
        cfg = load_job(job); folder = store.run_dir(cfg); folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        store.write_json_atomic(folder / "final.json", {"columns": {"SST-2": 0.625}})
        earlier = (folder / "final.json").read_bytes()
        (folder / "status.json").write_text("{garbage")
        rc = run_main(job)
        kept = [p for p in folder.iterdir() if p.is_file() and p.read_bytes() == earlier]
        verdict("correct" if kept else "loss", f"rc {rc}; earlier result {'kept as ' + kept[0].name if kept else 'overwritten'}")
    ''',
    "enospc": '''
        from pipelines.verbs import run
        from pipelines.runs import store
        from pipelines.config.validate import load_job
        def trainer(cfg, folder, log_fn):
            (folder / "checkpoint").mkdir(exist_ok=True)
            (folder / "checkpoint" / f".checkpoint.pt.tmp-{os.getpid()}").write_bytes(b"0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        real = store.write_json_atomic
        def full(path, obj):
            if list(Path(path).parent.rglob(".*tmp-*")):
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, obj)
        runner.default_trainer = trainer; store.write_json_atomic = full
        job = ["results_dir=" + RES, "logging=disabled"]
        import contextlib, io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = run.command(job)
        folder = store.run_dir(load_job(job))
        state = json.loads((folder / "status.json").read_text())["state"]
        temp = list(folder.rglob(".*tmp*"))
        ok = state == "failed" and not temp and err.getvalue().count("\\n") == 1
        verdict("correct" if ok else "unclear", f"rc {rc}, status {state}, temporaries left {len(temp)}")
    ''',
    "wandb": '''
        from pipelines.verbs import run
        from pipelines.runs import store
        from pipelines.config.validate import load_job
        def unreachable(*a, **k):
            raise ConnectionError("wandb: Network error (ConnectionError), api.wandb.ai unreachable")
        runner.WandbRun = unreachable; runner.default_trainer = stub
        job = ["results_dir=" + RES, "logging=disabled"]
        import contextlib, io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = run.command(job)
            except Exception as exc:
                rc = f"raised {type(exc).__name__}"
        state = json.loads((store.run_dir(load_job(job)) / "status.json").read_text())["state"]
        verdict("correct" if state == "failed" and "Traceback" not in err.getvalue() else "unclear",
                f"rc {rc}, status {state}")
    ''',
    "ctrl_c": '''
        from pipelines.verbs import run
        from pipelines.runs import store
        from pipelines.config.validate import load_job
        def trainer(cfg, folder, log_fn):
            raise KeyboardInterrupt
        runner.default_trainer = trainer
        job = ["results_dir=" + RES, "logging=disabled"]
        import contextlib, io, traceback
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = run.command(job)
            except KeyboardInterrupt:
                rc = "KeyboardInterrupt traceback"
        state = json.loads((store.run_dir(load_job(job)) / "status.json").read_text())["state"]
        ok = state == "failed" and rc == 130 and err.getvalue().count("\\n") == 1
        verdict("correct" if ok else "unclear", f"rc {rc}, status {state}")
    ''',
    "read_only_finished": '''
        from pipelines.verbs import run
        from pipelines.runs import store
        from pipelines.config.validate import load_job
        from omegaconf import OmegaConf
        job = ["results_dir=" + RES, "logging=disabled"]
        cfg = load_job(job); folder = store.run_dir(cfg); folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        store.write_json_atomic(folder / "final.json", {"columns": {"SST-2": 0.625}})
        store.write_status(folder, "finished", started="t", attempts=1, ended="t")
        def ro(self, *a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        runner.FileLock.acquire = ro
        import contextlib, io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = run_main(job)
        verdict("correct" if rc == 0 and not (T / "TRAINED").exists() else "unclear",
                f"rc {rc}: {err.getvalue().strip()[:150]}")
    ''',
    "read_only_new": '''
        from pipelines.verbs import run
        def ro(self, *a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        runner.FileLock.acquire = ro
        import contextlib, io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = run_main(["results_dir=" + RES, "logging=disabled"])
        text = err.getvalue().strip()
        ok = rc == 2 and text.count("\\n") == 0 and "results_dir" in text and "traceback.txt" not in text
        verdict("clean" if ok else "unclear", f"rc {rc}: {text[:150]}")
    ''',
    "aggregate_file": '''
        sys.path.insert(0, os.path.join(os.environ["SWEEP_REPO"], "tests"))
        from test_aggregate import make_run
        make_run(T / "runs", "a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8}, experiment="table2")
        (T / "tables").write_text("not a folder")
        from pipelines.__main__ import main as cli
        sys.exit(cli(["aggregate", "experiment=table2", f"runs_dir={T / 'runs'}", f"out_dir={T / 'tables'}"]))
    ''',
    "aggregate_read_only": '''
        sys.path.insert(0, os.path.join(os.environ["SWEEP_REPO"], "tests"))
        from test_aggregate import make_run
        make_run(T / "runs", "a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8}, experiment="table2")
        def ro(self, *a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        Path.mkdir = ro
        from pipelines.__main__ import main as cli
        sys.exit(cli(["aggregate", "experiment=table2", f"runs_dir={T / 'runs'}", f"out_dir={T / 'tables'}"]))
    ''',
    "prompt_cache": '''
        import torch
        from prism.models import attach_lora, load_backbone
        from prism.fastpath.prompt_cache import FrozenPrompts
        model, _ = load_backbone({"name": "tiny-llama"}, "cpu")
        model = attach_lora(model, {"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]},
                            {"name": "tiny-llama", "lora_layers": 1}, init="peft", generator=torch.Generator().manual_seed(0))
        rows = [[5, 6, 7, 8, 9], [5, 6, 11], [12, 13, 14, 15]]
        store = FrozenPrompts.build(model, rows, cache_dir=T / "prompts")
        original = store.path.read_bytes()
        bad = bytearray(original)
        for i in range(len(bad) - 64, len(bad) - 32):
            bad[i] ^= 0xFF
        store.path.write_bytes(bytes(bad))
        FrozenPrompts.build(model, rows, cache_dir=T / "prompts")
        verdict("correct" if store.path.read_bytes() == original else "silent",
                "rebuilt" if store.path.read_bytes() == original else "flipped bytes kept and used")
    ''',
    "sigma_cache": '''
        from prism.privacy.accounting import calibrate_sigma, calibrate_sigma_cached
        args = (6.0, 1e-5, 64 / 2000, 30)
        good = calibrate_sigma_cached(*args, cache_dir=T / "sigma")
        (path,) = (T / "sigma").glob("*.json")
        stored = json.loads(path.read_text()); stored["sigma"] = good / 2; path.write_text(json.dumps(stored))
        again = calibrate_sigma_cached(*args, cache_dir=T / "sigma")
        verdict("correct" if again == good else "silent", f"σ {good:.4g} -> {again:.4g} after tampering")
    ''',
    "tuned_removed": '''
        import re
        text = (Path(os.environ["SWEEP_REPO"]) / "conf" / "tuned" / "embedded.yaml").read_text()
        head, rates = text.split("rates:\\n", 1)
        kept = [e for e in re.split(r"(?m)^(?=- method: )", rates) if not e.startswith("- method: lamb")]
        (T / "tuned").mkdir()
        (T / "tuned" / "embedded.yaml").write_text(head + "rates:\\n" + "".join(kept))
        sys.exit(run_main(["method=lamb", "results_dir=" + RES, "logging=disabled"]))
    ''',
    "epsilon_below": '''
        sys.path.insert(0, os.path.join(os.environ["SWEEP_REPO"], "tests"))
        from conftest import make_run
        from pipelines import tables as agg
        make_run(T / "runs", "a1", method="prism", privacy="eps6", suite="glue8", columns={"SST-2": 0.8},
                 experiment="table2", epsilon_spent=2.0)
        from pipelines.tables.specs import SPECS
        result = agg.build_table(SPECS["table2"], agg.read_run_folders(T / "runs", "table2"), "embedded")
        refused = [m for m in result.missing if "realised ε=2" in m]  # where the realised-ε-above check answers too
        verdict("correct" if refused else "silent", (refused or ["averaged into its cell"])[0][:160])
    ''',
    "loop_task": '''
        (T / "a").symlink_to(T / "b"); (T / "b").symlink_to(T / "a")
        from pipelines.__main__ import main as cli
        sys.exit(cli(["compare", f"task={T / 'a'}", "labels=yes,no", "results_dir=" + RES]))
    ''',
    "boolean_labels": '''
        from pipelines.verbs import compare
        task = T / "t.jsonl"
        task.write_text("".join(json.dumps({"prompt": f"Q{i}?", "target": ["true", "false"][i % 2]}) + "\\n"
                                for i in range(80)))
        try:
            p = compare.plan({"task": str(task), "labels": "true,false", "methods": "adamw", "eps": "inf"},
                             ["backbone=tiny-llama", "results_dir=" + RES])
            labels = list(p.configs[0].suite.custom.labels)
            verdict("correct" if labels == ["true", "false"] else "silent", f"labels {labels}")
        except Exception as err:
            one = "\\n" not in str(err) and "quote" in str(err)
            verdict("clean" if one else "unclear", f"{type(err).__name__}: {str(err)[:150]}")
    ''',
    "number_labels": '''
        task = T / "t.jsonl"
        task.write_text("".join(json.dumps({"prompt": f"Q{i}?", "target": str(1 + i % 3)}) + "\\n" for i in range(80)))
        sys.exit(run_main(["suite=custom", "backbone=tiny-llama", f"suite.custom.train={task}",
                           "suite.custom.labels=[1,2,3]", "results_dir=" + RES, "logging=disabled"]))
    ''',
    "online_unreachable": '''
        import socket
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        os.environ.update(WANDB_API_KEY="k" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{port}")
        sys.exit(run_main(["logging=online", "results_dir=" + RES]))
    ''',
    "audit_out_file": '''
        from pipelines.verbs import audit_run
        from pipelines.__main__ import main as cli
        def trained(*a, **k):
            (T / "TRAINED").write_text("x")
            raise SystemExit(1)
        audit_run.audit_training_run = trained
        (T / "file").write_text("an earlier table")
        sys.exit(cli(["audit-run", "methods=adamw", "epsilons=6", "canaries=100", f"out={T / 'file'}"]))
    ''',
}


FILES = textwrap.dedent('''
    import struct
    def rows(n, start=0, ids=True):
        return [{**({"id": f"r{i}"} if ids else {}), "prompt": f"Review {i}: {'great' if i % 2 else 'awful'}.",
                 "target": ["negative", "positive"][i % 2]} for i in range(start, start + n)]
    def write(name, records):
        path = T / name
        path.write_text("".join(json.dumps(r) + "\\n" for r in records))
        return path
    def custom(train, *extra):
        return ["suite=custom", "backbone=tiny-llama", f"suite.custom.train={train}",
                "suite.custom.labels=[positive,negative]", *extra]
    def local_model(name, model_type="llama", shards=1, context=2048):
        """A save_pretrained-shaped folder (2-layer Llama widths, zero weights), written without torch."""
        folder = T / name
        folder.mkdir()
        h, f, q, kv = 64, 128, 64, 32
        (folder / "config.json").write_text(json.dumps({
            "model_type": model_type, "hidden_size": h, "intermediate_size": f, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2,
            "max_position_embeddings": context}))
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
        tensors = {f"model.layers.{i}.{m}.weight": s for i in range(2) for m, s in shapes.items()}
        tensors["model.embed_tokens.weight"] = (2, h)
        names = sorted(tensors)
        per = -(-len(names) // shards)
        weight_map = {}
        for j in range(shards):
            file = "model.safetensors" if shards == 1 else f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
            header, at = {}, 0
            for n in names[j * per:(j + 1) * per]:
                size = 4 * tensors[n][0] * tensors[n][1]
                header[n] = {"dtype": "F32", "shape": list(tensors[n]), "data_offsets": [at, at + size]}
                weight_map[n], at = file, at + size
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            (folder / file).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
        if shards > 1:
            (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        from tokenizers import Tokenizer, models
        Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
        return folder
    def local(folder, *extra):
        return ["backbone=local", f"backbone.path={folder}", *extra]
    def trained(argv, words=()):
        """correct: the valid input trains (the stub), printing any warning that holds ``words``."""
        import contextlib, io
        seen = io.StringIO()
        handler = logging.StreamHandler(seen)
        logging.getLogger("prism").addHandler(handler)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = run_main([*argv, "results_dir=" + RES, "logging=disabled"])
        warned = [x for x in seen.getvalue().splitlines() if x.strip()]
        done = rc == 0 and (T / "TRAINED").exists()
        if not done:
            verdict("unclear", f"refused, rc {rc}: {err.getvalue().strip()[:160]}")
        elif words and not (len(warned) == 1 and all(w in warned[0] for w in words)):
            verdict("silent", f"trained without the warning ({len(warned)} warning lines)")
        else:
            verdict("correct", f"rc 0{': ' + warned[0][:150] if words else ''}")
''')


def _files(code: str) -> str:
    return FILES + textwrap.dedent(code)


def _slurm_fake() -> dict[str, str]:
    return {"PATH": "{T}/bin" + os.pathsep + os.environ["PATH"], "PRISM_PYTHON": sys.executable,
            "PRISM_SLURM_DIR": "{T}/slurm"}


FAKE_SLURM = ("mkdir -p {T}/bin && for n in sbatch squeue; do printf '#!/usr/bin/env bash\\n"
              "echo \"slurm: error: Could not establish a configuration source\" >&2\\nexit 1\\n' > {T}/bin/$n; "
              "chmod +x {T}/bin/$n; done")


def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append
    # ---- 1. grid entry points
    add(Case("g1", 1, "grid table2 train.steps=abc", _grid("table2", "train.steps=abc"), ("train.steps", "job")))
    add(Case("g2", 1, "grid table2 train.stpes=5 (typo)", _grid("table2", "train.stpes=5"), ("did you mean",),
             ("+train.stpes",)))
    add(Case("g3", 1, "grid table2 method.horizontalize=none (bad for AdamW jobs only)",
             _grid("table2", "method.horizontalize=none"), ("method.horizontalize", "method=adamw")))
    add(Case("g4", 1, "grid table2 scale=paper, no data", _grid("table2", "scale=paper"), ("make data",),
             env={"PRISM_CACHE": "{T}/no-cache", "HF_DATASETS_CACHE": "{T}/no-hf"}))
    add(Case("g5", 1, "grid table4 lora.dropout=1.0", _grid("table4", "lora.dropout=1.0"), ("lora.dropout",)))
    add(Case("g6", 1, "reproduce 2 train.steps=abc", _reproduce("2", "train.steps=abc"), ("train.steps", "job")))
    add(Case("g7", 1, "reproduce 2 scale=paper, no data", _reproduce("2", "scale=paper"), ("make data",),
             ("runs_dir",), env={"PRISM_CACHE": "{T}/no-cache", "HF_DATASETS_CACHE": "{T}/no-hf"}))
    add(Case("g8", 1, "reproduce 2 launcher=slurm train.steps=abc (submitit path)",
             _reproduce("2", "launcher=slurm", "train.steps=abc"), ("train.steps",)))
    add(Case("g9", 1, "reproduce 2 train.stpes=5", _reproduce("2", "train.stpes=5"), ("did you mean",), ("+train",)))
    add(Case("g10", 1, "reproduce 2 --frobnicate", _reproduce("2", "--frobnicate"), ("--frobnicate",), ("Lexer",)))
    add(Case("g11", 1, "submit.sh --dry-run table2 train.steps=abc",
             _shell("slurm/submit.sh --dry-run table2 train.steps=abc results_dir=RES"), ("train.steps",),
             ("would be submitted",), env={"PRISM_PYTHON": sys.executable, "PRISM_SLURM_DIR": "{T}/slurm"}))
    add(Case("g12", 1, "submit.sh --dry-run table5 lora.r=0", _shell("slurm/submit.sh --dry-run table5 lora.r=0 results_dir=RES"),
             ("lora.r",), env={"PRISM_PYTHON": sys.executable, "PRISM_SLURM_DIR": "{T}/slurm"}))
    add(Case("g13", 1, "run -m experiment=table2 train.steps=abc launcher=submitit_local",
             _run("-m", "experiment=table2", "train.steps=abc", "launcher=submitit_local"), ("train.steps",)))
    add(Case("g14", 1, "run train.stpes=5", _run("train.stpes=5"), ("did you mean train.steps",)))
    add(Case("g15", 1, "run +train.stpes=5", _run("+train.stpes=5"), ("did you mean train.steps",)))
    add(Case("g16", 1, "run experiment=täble (non-ASCII, unquoted)", _run("experiment=täble"), ("quote",), ("Lexer",)))
    add(Case("g17", 1, "run results_dir=/tmp/my runs (split by the shell)", _run("results_dir=/tmp/my", "runs"),
             ("quote",)))
    add(Case("g18", 1, "reproduce 2 'results_dir=/tmp/ü'", _reproduce("2", "results_dir=/tmp/ü", results=False),
             ("quote",), ("Lexer",)))
    add(Case("g19", 1, "reproduce 2 ... --help (ARGS=--help)", textwrap.dedent('''
        from pipelines.__main__ import main as cli
        import contextlib, io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli(["reproduce", "experiment=table2", "scale=embedded", "launcher=local", "jobs=2", "--help"])
        verdict("correct" if rc == 0 and "usage" in out.getvalue() else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    add(Case("g20", 1, "grid table2 --help", textwrap.dedent('''
        from pipelines.__main__ import main as cli
        import contextlib, io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli(["grid", "experiment=table2", "--help"])
        verdict("correct" if rc == 0 and "usage" in out.getvalue() else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    # ---- 2. method- and accountant-specific values
    for i, (method, override) in enumerate([
        ("prism", "method.horizontalize=sideways"), ("prism", "method.preconditioner=diag"),
        ("prism", "method.compute_dtype=float16"), ("prism", "method.rank_fallback=zero"),
        ("prism", "method.floor_factor=-1"), ("prism", "method.cond_max=0.5"), ("prism", "method.init=peft"),
        ("prism", "method.floor_mode=vector"), ("prism", "method.beta1=1.0"), ("prism_paper", "method.pinv_rcond=1.5"),
        ("prism", "method.noise_damping=-1e-8"), ("prism", "method.init_svd=exact"),
        ("lamb", "method.max_grad_norm=1.0"), ("lamb", "method.pre_norm=true"),
        ("loraplus", "method.loraplus_lr_ratio=0"), ("lora_rite", "method.update_skipping=-1"),
        ("adamw", "method.betas=[0.9,1.5]"),
    ], 1):
        add(Case(f"m{i}", 2, f"method={method} {override}", _run(f"method={method}", override), (override.split("=")[0],)))
    add(Case("a1", 2, "privacy.delta=1e-30", _run("privacy.delta=1e-30"), ("privacy.delta",)))
    add(Case("a2", 2, "privacy.epsilon=1e9 (name eps1000000000)",
             _run("privacy.epsilon=1e9", "privacy.name=eps1000000000"), ("privacy.epsilon",)))
    add(Case("a3", 2, "privacy.epsilon=0.004", _run("privacy.epsilon=0.004", "privacy.name=eps0.004"), ("privacy.epsilon",)))
    add(Case("a4", 2, "σ calibration for ε=1e9 (the accountant itself)", _calibrate(1e9), expect="verdict", timeout=90))
    add(Case("a5", 2, "σ calibration for ε=100 (past the validator's bound)", _calibrate(100.0), expect="verdict",
             timeout=90))
    add(Case("a6", 2, "suite=math10k train.steps=100000000 (424 GiB)", _run("suite=math10k", "train.steps=100000000"),
             ("train.steps",)))
    add(Case("a7", 2, "suite.embedded.eval_per_task=5000 (beyond the SST-2 stand-in)",
             _run("suite.embedded.eval_per_task=5000"), ("suite.embedded.eval_per_task",)))
    # ---- 3. caches
    add(Case("c1", 3, "prompt cache: bytes flipped, size kept", STATE["prompt_cache"], expect="verdict"))
    add(Case("c2", 3, "σ cache: stored σ halved", STATE["sigma_cache"], expect="verdict"))
    # ---- 4. accepted but meaning something else
    add(Case("w1", 4, "suite.embedded.tasks=[]", _run("suite.embedded.tasks=[]"), ("suite.embedded.tasks",)))
    add(Case("w2", 4, "suite=math10k suite.embedded.tasks=[]", _run("suite=math10k", "suite.embedded.tasks=[]"),
             ("suite.embedded.tasks",)))
    add(Case("w3", 4, "results_dir='~/x' (quoted)", textwrap.dedent('''
        rc = run_main(["results_dir='~/x'", "logging=disabled"])
        home = Path(os.environ["HOME"])
        where = (T / "TRAINED").read_text() if (T / "TRAINED").exists() else ""
        ok = rc == 0 and where.startswith(str(home / "x")) and not (T / "~").exists()
        verdict("correct" if ok else "silent", f"rc {rc}: trained into {where[:80]}")
    '''), expect="verdict"))
    add(Case("w4", 4, "gpu-check methods=nope", _shell(f"{sys.executable} -m pipelines gpu-check profile=tiny methods=nope"),
             ("methods=",), timeout=300))
    add(Case("w5", 4, "math10k mapping train_per_task={basic_arithmetic:100,leg_counting:50}", textwrap.dedent('''
        rc = run_main(["suite=math10k", "suite.embedded.train_per_task={basic_arithmetic:100,leg_counting:50}",
                       "suite.embedded.tasks=[basic_arithmetic,leg_counting]", "results_dir=" + RES, "logging=disabled"])
        verdict("correct" if rc == 0 and (T / "TRAINED").exists() else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    add(Case("w6", 4, "glue8 mapping train_per_task={tweet_sentiment:100,syllogism:50}", textwrap.dedent('''
        rc = run_main(["suite.embedded.train_per_task={tweet_sentiment:100,syllogism:50}", "results_dir=" + RES,
                       "logging=disabled"])
        verdict("correct" if rc == 0 and (T / "TRAINED").exists() else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    add(Case("w7", 4, "results_dir=\"<tmp>/my runs\" (quoted as the hint says)", textwrap.dedent('''
        rc = run_main([f'results_dir="{T}/my runs"', "logging=disabled"])
        ok = rc == 0 and (T / "TRAINED").read_text().startswith(str(T / "my runs"))
        verdict("correct" if ok else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    add(Case("w8", 4, "results_dir='<tmp>/ü' (quoted non-ASCII)", textwrap.dedent('''
        rc = run_main([f"results_dir='{T}/ü'", "logging=disabled"])
        ok = rc == 0 and (T / "TRAINED").read_text().startswith(str(T / "ü"))
        verdict("correct" if ok else "unclear", f"rc {rc}")
    '''), expect="verdict"))
    add(Case("w9", 4, "suite.paper.tasks=[] scale=paper", _run("scale=paper", "suite.paper.tasks=[]"),
             ("suite.paper.tasks",)))
    # ---- 5. states after failure
    add(Case("s1", 5, "garbage status.json beside a valid final.json", STATE["garbage_status"], expect="verdict"))
    add(Case("s2", 5, "ENOSPC with a half-written checkpoint", STATE["enospc"], expect="verdict"))
    add(Case("s3", 5, "W&B server unreachable at init", STATE["wandb"], expect="verdict"))
    add(Case("s4", 5, "Ctrl-C during training", STATE["ctrl_c"], expect="verdict"))
    add(Case("s5", 5, "read-only store, finished run", STATE["read_only_finished"], expect="verdict"))
    add(Case("s6", 5, "read-only store, new run", STATE["read_only_new"], expect="verdict"))
    add(Case("s7", 5, "aggregate out_dir is a file", STATE["aggregate_file"], ("out_dir",)))
    add(Case("s8", 5, "aggregate out_dir read-only", STATE["aggregate_read_only"], ("out_dir",)))
    add(Case("s9", 5, "SLURM installed, not configured: submit.sh",
             _shell(FAKE_SLURM + " && slurm/submit.sh table5 method=prism results_dir=RES"), expect="verdict_shell",
             env=_slurm_fake()))
    add(Case("s10", 5, "SLURM installed, not configured: reproduce launcher=slurm",
             f"import subprocess\nsubprocess.run({FAKE_SLURM!r}, shell=True)\n" + _reproduce("5", "method=prism", "launcher=slurm")
             .replace("launch.launch = lambda *a, **k: ((T / 'LAUNCHED').write_text('x'), (True, ''))[1]\n", ""),
             expect="verdict_shell", env=_slurm_fake()))
    # ---- 6. task files (suite=custom) and model folders (backbone=local)
    add(Case("f1", 6, "train.jsonl and eval.jsonl both number ids from r0 (as GLUE's splits do)", _files('''
        test = [{**row, "id": f"r{k}"} for k, row in enumerate(rows(10, start=100))]  # ids r0..r9 again
        trained(custom(write("train.jsonl", rows(80)), f"suite.custom.eval={write('eval.jsonl', test)}"))
    '''), expect="verdict"))
    add(Case("f2", 6, "2 eval prompts are also training prompts (leakage)", _files('''
        test = [*rows(3, start=100, ids=False), *rows(2, start=5, ids=False)]
        trained(custom(write("train.jsonl", rows(80, ids=False)), f"suite.custom.eval={write('eval.jsonl', test)}"),
                ("2 of 5 evaluation rows", "eval.jsonl line 4", "train.jsonl line 6"))
    '''), expect="verdict"))
    add(Case("f3", 6, "a Latin-1 byte on line 100 of train.jsonl", _files('''
        path = write("train.jsonl", rows(99))
        path.write_bytes(path.read_bytes() + '{"prompt": "café", "target": "positive"}\\n'.encode("latin-1"))
        sys.exit(run_main([*custom(path), "results_dir=" + RES, "logging=disabled"]))
    '''), ("train.jsonl line 100 column 16", "UTF-8")))
    add(Case("f4", 6, "train.jsonl saved as UTF-16 (Windows 'Unicode')", _files('''
        path = write("train.jsonl", rows(80))
        path.write_text(path.read_text(), encoding="utf-16")
        sys.exit(run_main([*custom(path), "results_dir=" + RES, "logging=disabled"]))
    '''), ("train.jsonl line 1", "UTF-16", "UTF-8")))
    add(Case("f5", 6, "train.jsonl with a UTF-8 byte-order mark (Excel, Notepad)", _files('''
        path = write("train.jsonl", rows(80))
        path.write_bytes(b"\\xef\\xbb\\xbf" + path.read_bytes())
        trained(custom(path))
    '''), expect="verdict"))
    add(Case("f6", 6, "a 10,000-token row on line 5 of eval.jsonl", _files('''
        test = [*rows(4, start=100), {"prompt": "x" * 10_000, "target": "positive"}]
        sys.exit(run_main([*custom(write("train.jsonl", rows(80)), f"suite.custom.eval={write('eval.jsonl', test)}"),
                           "results_dir=" + RES, "logging=disabled"]))
    '''), ("eval.jsonl line 5", "suite.cutoff_len=384")))
    add(Case("f7", 6, "an id twice inside eval.jsonl", _files('''
        test = [*rows(4, start=100), {"id": "r101", "prompt": "Again.", "target": "positive"}]
        sys.exit(run_main([*custom(write("train.jsonl", rows(80)), f"suite.custom.eval={write('eval.jsonl', test)}"),
                           "results_dir=" + RES, "logging=disabled"]))
    '''), ("eval.jsonl line 5", "duplicate id 'r101'", "line 2")))
    add(Case("f8", 6, "backbone=local, a whole folder", _files('''
        trained(local(local_model("model")))
    '''), expect="verdict"))
    add(Case("f9", 6, "backbone=local, model.safetensors truncated (an interrupted copy)", _files('''
        folder = local_model("model")
        with (folder / "model.safetensors").open("r+b") as fh:
            fh.truncate(fh.seek(0, 2) - 1000)
        sys.exit(run_main([*local(folder), "results_dir=" + RES, "logging=disabled"]))
    '''), ("backbone.path", "model.safetensors is truncated")))
    add(Case("f10", 6, "backbone=local, config.json model_type unknown to transformers", _files('''
        sys.exit(run_main([*local(local_model("model", model_type="llama9")), "results_dir=" + RES, "logging=disabled"]))
    '''), ("backbone.path", "model_type 'llama9'", "unknown to the installed transformers")))
    add(Case("f11", 6, "backbone=local, an encoder-decoder (model_type t5)", _files('''
        sys.exit(run_main([*local(local_model("model", model_type="t5")), "results_dir=" + RES, "logging=disabled"]))
    '''), ("backbone.path", "model_type 't5'", "not a causal language model")))
    add(Case("f12", 6, "backbone=local, a sharded model with a shard missing", _files('''
        folder = local_model("model", shards=3)
        (folder / "model-00002-of-00003.safetensors").unlink()
        sys.exit(run_main([*local(folder), "results_dir=" + RES, "logging=disabled"]))
    '''), ("backbone.path", "model.safetensors.index.json", "model-00002-of-00003.safetensors")))
    add(Case("f13", 6, "backbone=local, tokenizer.json cut in half", _files('''
        folder = local_model("model")
        text = (folder / "tokenizer.json").read_text()
        (folder / "tokenizer.json").write_text(text[: len(text) // 2])
        sys.exit(run_main([*local(folder), "results_dir=" + RES, "logging=disabled"]))
    '''), ("backbone.path", "tokenizer.json")))
    add(Case("f14", 6, "backbone=local, a 256-token context under suite.cutoff_len=384", _files('''
        sys.exit(run_main([*local(local_model("model", context=256)), "results_dir=" + RES, "logging=disabled"]))
    '''), ("suite.cutoff_len=384", "256-token context", "backbone.path")))
    # ---- 7. messages in the words typed, checks before any cost
    add(Case("n1", 7, "old module entry point: python -m pipelines.verbs.grid table2",
             _shell(f"{sys.executable} -m pipelines.verbs.grid table2 results_dir=RES"), ("python -m pipelines",)))
    add(Case("n2", 7, "make -n compare TASK=... METHOD=prism (METHODS misspelt)",
             _shell("make -n -C REPO compare TASK=examples/tweet_sentiment/train.jsonl METHOD=prism"), ("METHOD",)))
    add(Case("n3", 7, "a tuned file with one method's entries removed (method=lamb)", STATE["tuned_removed"],
             ("embedded.yaml", "lamb"), env={"PRISM_TUNED_DIR": "{T}/tuned"}))
    add(Case("n4", 7, "a record whose ε spent is below its row's (eps6 row, ε 2)", STATE["epsilon_below"], expect="verdict"))
    add(Case("n5", 7, "σ cache: stored σ doubled", STATE["sigma_cache"].replace("good / 2", "good * 2"), expect="verdict"))
    add(Case("n6", 7, "compare task= a symlink loop", STATE["loop_task"], ("task=",)))
    add(Case("n7", 7, "run methd=prism,adamw (misspelt key, comma list)", _run("methd=prism,adamw"),
             ("unknown key methd", "did you mean method"), ("add -m",)))
    add(Case("n8", 7, "compare labels=true,false (YAML booleans)", STATE["boolean_labels"], expect="verdict"))
    add(Case("n9", 7, "run suite.custom.labels=[1,2,3] (YAML numbers)", STATE["number_labels"],
             ("suite.custom.labels", "quote")))
    add(Case("n10", 7, "logging=online, W&B server unreachable", STATE["online_unreachable"], ("logging=offline",),
             timeout=200))
    add(Case("n11", 7, "audit-run out= an existing file", STATE["audit_out_file"], ("out=",), timeout=300))
    add(Case("n12", 7, "logging.dir= an existing file (logging=offline)", textwrap.dedent('''
        (T / "wandb-file").write_text("x")
        sys.exit(run_main(["logging=offline", f"logging.dir={T / 'wandb-file'}", "results_dir=" + RES]))
    '''), ("logging.dir",)))
    return c


def classify_shell(case: Case, repo: Path) -> tuple[str, str]:
    """SLURM cases: a one-line '0 of N submitted' reason that names the fix (SLURM_CONF)."""
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(repo), "SWEEP_TMP": tmp, "SWEEP_REPO": str(repo), "OMP_NUM_THREADS": "1",
               **{k: v.replace("{T}", tmp) for k, v in case.env.items()}}
        code = PRELUDE + textwrap.dedent(case.code).replace("{T}", tmp)
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=case.timeout)
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        first = lines[0] if lines else ""
        if "Traceback" in done.stderr:
            return "unclear", "traceback"
        if done.returncode != 0 and len(lines) == 1 and "SLURM_CONF" in first:
            return "clean", first[:200]
        return "unclear", f"rc {done.returncode}: {first[:200]}"


def classify(case: Case, repo: Path) -> tuple[str, str]:
    """The class of ``case`` run against the checkout ``repo``, and a note on the outcome."""
    return classify_shell(case, repo) if case.expect == "verdict_shell" else run_case(case, repo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=HERE)
    parser.add_argument("--only", default="")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    results = {}
    print("| id | group | input | class | outcome |\n|---|---|---|---|---|", flush=True)
    for case in cases():
        if wanted and case.id not in wanted:
            continue
        cls, note = classify(case, args.repo)
        results[case.id] = {"group": case.group, "what": case.what, "class": cls, "note": note}
        print(f"| {case.id} | {case.group} | {case.what.replace('|', '/')} | {cls} | {note.replace('|', '/')} |", flush=True)
    totals: dict[str, int] = {}
    for r in results.values():
        totals[r["class"]] = totals.get(r["class"], 0) + 1
    print("\ntotals:", ", ".join(f"{k} {v}" for k, v in sorted(totals.items())), f"(of {len(results)})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
