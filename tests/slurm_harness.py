"""A real single-node SLURM cluster for integration tests (docs/DECISIONS.md D36).

`LocalSlurm(root).start()` installs `slurm-wlm` and `munge` with apt-get when they are missing
(root only), starts a private `munged` (own key, socket, pid and log under `root`), writes a
one-node `slurm.conf` (node = `hostname -s`, CPUs=2, proctrack/linuxproc, task/none,
select/cons_tres with CR_Core, SlurmUser=root, free ports) and starts `slurmctld -c` and `slurmd`.
`env()` is the environment a client (`sbatch`, `squeue`, submitit) needs: `SLURM_CONF` pointing at
that file. `stop()` cancels every job, stops the three daemons by their pid files and checks that
none of them is left running. Nothing outside `root` is touched except the apt install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmd", "slurmctld", "munged")


class HarnessUnavailableError(RuntimeError):
    """The cluster cannot be provided on this machine (not root, apt failed); tests should skip."""


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def ensure_installed() -> float:
    """Install slurm-wlm and munge with apt-get if any binary is missing; return seconds spent."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return 0.0
    if os.geteuid() != 0:
        raise HarnessUnavailableError("slurm-wlm/munge are not installed and installing them needs root")
    t0 = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *PACKAGES]
    try:
        done = _run(install, env=env, timeout=600)
        if done.returncode != 0:
            _run(["apt-get", "update", "-q"], env=env, timeout=600)
            done = _run(install, env=env, timeout=600)
    except subprocess.TimeoutExpired as err:  # a hung mirror is an unavailable harness, not a failed test
        raise HarnessUnavailableError(f"apt-get timed out after {err.timeout:.0f} s") from err
    if done.returncode != 0:
        raise HarnessUnavailableError(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-300:]}")
    return time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _slurmstepd_pids() -> set[int]:
    """Live (non-zombie) slurmstepd processes on this machine."""
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "slurmstepd" and _alive(int(comm.parent.name)):
                pids.add(int(comm.parent.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


def _wait(predicate, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def slurm_conf(root: Path, node: str, cpus: int, mem_mb: int, ports: tuple[int, int], munge_socket: Path) -> str:
    """The one-node slurm.conf (docs/DECISIONS.md D36) with every state/spool/log/pid path under `root`."""
    return "\n".join([
        "ClusterName=prismtest",
        f"SlurmctldHost={node}",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        f"NodeName={node} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    """A private slurmctld + slurmd + munged living in `root` (see module docstring)."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root = Path(root)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.pid_files = {
            "munged": self.munge_dir / "munged.pid",
            "slurmctld": self.root / "slurmctld.pid",
            "slurmd": self.root / "slurmd.pid",
        }
        self.install_s = 0.0
        self.startup_s = 0.0
        self._foreign_steps: set[int] = set()

    def env(self) -> dict[str, str]:
        """Environment for SLURM clients: SLURM_CONF set to this cluster's config."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> LocalSlurm:
        self.install_s = ensure_installed()
        self._foreign_steps = _slurmstepd_pids()
        if os.geteuid() != 0:
            raise HarnessUnavailableError("starting slurmd/munged with SlurmUser=root needs root")
        t0 = time.monotonic()
        try:
            self._start_munge()
            for sub in ("state", "spool", "log"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            node = socket.gethostname().split(".")[0]
            self.conf.write_text(slurm_conf(self.root, node, self.cpus, max(_mem_total_mb() - 512, 1024),
                                            (_free_port(), _free_port()), self.munge_socket))
            self._daemon(["slurmctld", "-c", "-f", str(self.conf)], "slurmctld")
            self._daemon(["slurmd", "-f", str(self.conf)], "slurmd")
            _wait(self._node_idle, 60, "sinfo to show the node idle")
        except Exception:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _start_munge(self) -> None:
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o700)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon(["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                      f"--pid-file={self.pid_files['munged']}", f"--log-file={self.munge_dir / 'munged.log'}",
                      f"--seed-file={self.munge_dir / 'munged.seed'}"], "munged")

    def _daemon(self, cmd: list[str], name: str) -> None:
        done = _run(cmd, env=self.env(), timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed to start: {done.stderr.strip()[-500:]} (logs in {self.root})")
        _wait(lambda: self._pid(name) is not None, 30, f"{name} pid file")

    def _pid(self, name: str) -> int | None:
        path = self.pid_files[name]
        try:
            pid = int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) else None

    def _node_idle(self) -> bool:
        out = _run(["sinfo", "-h", "-o", "%T"], env=self.env(), timeout=30).stdout.split()
        return out == ["idle"]

    def queue_empty(self) -> bool:
        done = _run(["squeue", "-h", "-o", "%i"], env=self.env(), timeout=30)
        return done.returncode == 0 and not done.stdout.strip()

    def stop(self) -> None:
        """Cancel all jobs, stop slurmd, slurmctld, munged by pid file; raise if any survives."""
        if self._pid("slurmctld") is not None:
            _run(["scancel", "--user=root"], env=self.env(), timeout=30)
            with contextlib.suppress(TimeoutError):  # the daemons are stopped below regardless
                _wait(self.queue_empty, 60, "the queue to drain after scancel")
        survivors = []
        for name in DAEMONS:
            pid = self._pid(name)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            try:
                _wait(lambda p=pid: not _alive(p), 20, f"{name} (pid {pid}) to exit")
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
                if _alive(pid):
                    survivors.append(f"{name}:{pid}")
        try:
            _wait(lambda: not (_slurmstepd_pids() - self._foreign_steps), 30, "job steps to exit")
        except TimeoutError:
            survivors += [f"slurmstepd:{p}" for p in _slurmstepd_pids() - self._foreign_steps]
        if survivors:
            raise RuntimeError(f"processes still running after teardown: {survivors}")
