"""Auto-launch of the bundled engine: one local `python -m engine serve` per port, reused across prompts.

`ensure_engine(settings)` returns once an engine answers `/v1/health` at the settings' URL. If none
answers and auto-launch is on (and the URL points at this machine), it starts the engine as a
subprocess of the ComfyUI process, logs its output to a file in the temp dir, waits for health and
keeps it for later prompts. Started engines are stopped when the interpreter exits.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from . import comfy_compat
from .client import protocol

PACK_ROOT = Path(__file__).resolve().parent.parent
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LaunchedEngine:
    process: subprocess.Popen
    url: str
    token_file: Path
    log_file: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(getattr(signal, "SIGKILL", signal.SIGTERM))
            self.process.wait(timeout)

    def _signal(self, sig) -> None:
        # The engine runs in its own session so that its ranks (torch.distributed.run children) go with it.
        try:
            if os.name == "posix":
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        except ProcessLookupError:
            pass


_lock = threading.Lock()  # held while checking for and starting an engine; readers of _launched do not take it
_launched: dict[tuple[str, int], LaunchedEngine] = {}


def health_url(url: str) -> str:
    parts = urlsplit(url)
    scheme = "https" if parts.scheme in ("wss", "https") else "http"
    return f"{scheme}://{parts.netloc}/v1/health"


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise ValueError(f"H3Forge: engine URL must look like ws://host:port, got {url!r}")
    return parts.hostname, parts.port or protocol.DEFAULT_PORT


def probe(url: str, timeout: float = 1.0) -> dict | None:
    """The engine's /v1/health answer, or None when nothing (or something else) answers there."""
    try:
        with urllib.request.urlopen(health_url(url), timeout=timeout) as reply:
            health = json.loads(reply.read())
    except (OSError, ValueError):
        return None
    return health if isinstance(health, dict) and health.get("engine") == "h3forge" else None


def launched(url: str) -> LaunchedEngine | None:
    """The engine this process started for `url`, if any and still running."""
    engine = _launched.get(host_port(url))
    return engine if engine is not None and engine.alive() else None


def exit_report(url: str) -> str | None:
    """Why the engine this process started for `url` is gone (exit code and log tail), or None if it is not."""
    engine = _launched.get(host_port(url))
    if engine is None or engine.alive():
        return None
    return (f"The bundled engine exited with code {engine.process.returncode}. "
            f"Log ({engine.log_file}):\n{engine.log_tail()}")


def serve_command(settings: dict, port: int, token_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "engine", "serve"]
    if settings.get("models_dir"):
        cmd += ["--models", settings["models_dir"]]
    else:
        cmd += ["--preset", settings.get("preset") or "tiny"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file)]
    if settings.get("device", "auto") != "auto":
        cmd += ["--device", settings["device"]]
    if int(settings.get("gpus", 1)) > 1:
        cmd += ["--gpus", str(int(settings["gpus"]))]
    return cmd


def _start(settings: dict) -> LaunchedEngine:
    url = settings["url"]
    _, port = host_port(url)
    token_file = protocol.default_token_file()  # the engine creates it (0600); clients here read it by default
    log_file = Path(comfy_compat.get_temp_directory()) / f"h3forge-engine-{port}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACK_ROOT), env.get("PYTHONPATH")) if p)
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            serve_command(settings, port, token_file), cwd=PACK_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return LaunchedEngine(process, url, token_file, log_file)


def _ensure_sync(settings: dict, timeout: float) -> None:
    url = settings["url"]
    host, port = host_port(url)
    with _lock:
        engine = _launched.get((host, port))
        if probe(url) is not None:
            if engine is not None and not engine.alive():  # ours died; someone else serves here now
                del _launched[(host, port)]
            return
        if not settings.get("auto_launch", True):
            raise RuntimeError(
                f"H3Forge: no engine answers at {url}. Start one with `python -m engine serve --preset tiny` "
                f"(or --models DIR) from the H3Forge folder, or turn on auto_launch in the H3Forge Engine node.")
        if host not in LOCAL_HOSTS:
            raise RuntimeError(
                f"H3Forge: no engine answers at {url}, and auto-launch only starts engines on this machine. "
                f"Start the engine on {host}, or point the URL at ws://127.0.0.1:{port}.")
        if engine is None or not engine.alive():
            engine = _launched[(host, port)] = _start(settings)
        deadline = time.monotonic() + timeout
        while probe(url) is None:
            if not engine.alive():
                raise RuntimeError(f"H3Forge: the bundled engine did not start. {exit_report(url)}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"H3Forge: the bundled engine did not answer {health_url(url)} within {timeout:.0f} s. "
                    f"Log ({engine.log_file}):\n{engine.log_tail()}")
            time.sleep(0.2)


async def ensure_engine(settings: dict, timeout: float | None = None) -> None:
    """Makes sure an engine answers at settings["url"], starting the bundled one when needed and allowed."""
    if timeout is None:
        timeout = float(os.environ.get("H3FORGE_LAUNCH_TIMEOUT", "600"))
    return await asyncio.to_thread(_ensure_sync, settings, timeout)


@atexit.register
def stop_all() -> None:
    engines = list(_launched.values())
    _launched.clear()
    for engine in engines:
        engine.stop()
