"""Whether a job's W&B logging can work from here: an API key, and (``logging=online``) the server within reach.
A config rule checks it before any run starts (:mod:`pipelines.config.rules`), the logger before it opens a run
(:mod:`pipelines.runs.wandb_log`), ``python -m pipelines wandb-sync`` before it uploads."""
from __future__ import annotations

import configparser
import contextlib
import netrc
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

OFFLINE_FIX = "use logging=offline (`make wandb-sync` uploads the runs later)"


def has_api_key(url: str) -> bool:
    """Whether W&B would find an API key without prompting: ``WANDB_API_KEY``, the ``api_key`` of
    W&B's settings file, or a ``.netrc`` entry for the server's host (where ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    settings = Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings"
    parser = configparser.ConfigParser()
    with contextlib.suppress(configparser.Error):
        parser.read(settings)
    if parser.get("default", "api_key", fallback=""):
        return True
    host = urlparse(url).hostname or ""
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def access_problem(timeout_s: float = 5.0, reach: bool = True) -> str | None:
    """Why W&B cannot be reached right now (no API key, or, with ``reach``, no TCP connection to the server,
    ``WANDB_BASE_URL`` or the public one, within ``timeout_s``), as ``<what>, <how to fix>``; ``None`` when
    both are there. W&B itself retries for minutes on an unreachable server, so callers check first."""
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    if not has_api_key(url):
        return (f"no W&B API key for {url}, run `wandb login` or set WANDB_API_KEY "
                f"(offline runs stay under results/wandb until then)")
    if not reach:
        return None
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
    except OSError as err:
        return f"cannot reach the W&B server {url} ({err.strerror or err}), check the network or WANDB_BASE_URL"
    return None
