"""Auto-launch of the bundled engine: one local `python -m engine serve` per port, reused across prompts.

`ensure_engine(settings)` returns once an engine answers `/v1/health` at the settings' URL. If none
answers and auto-launch is on (and the URL points at this machine), it starts the engine as a
subprocess of the ComfyUI process, waits for health and keeps it for later prompts. Started engines are
stopped when the interpreter exits.

The engine logs to `h3forge-engine-<port>.log` (rotated by size) in $H3FORGE_LOG_DIR or ~/.h3forge/logs, not in
ComfyUI's temp folder, which ComfyUI empties when it starts: an engine that outlives a ComfyUI restart keeps its
log, and the next ComfyUI finds it by the port. What the process prints outside its log (a crash before logging
starts) goes to `h3forge-engine-<port>.console.log` beside it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from . import model_files
from .client import protocol

PACK_ROOT = Path(__file__).resolve().parent.parent
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
BUSY_WAIT_S = 30.0  # how long to wait for /v1/health from something that listens on the port but is silent


def log_dir() -> Path:
    return Path(os.environ.get("H3FORGE_LOG_DIR") or Path.home() / ".h3forge" / "logs").expanduser()


def log_file(port: int) -> Path:
    """The log of the engine this pack starts on `port` (the same path for every ComfyUI that starts one there)."""
    return log_dir() / f"h3forge-engine-{port}.log"


def console_file(port: int) -> Path:
    return log_dir() / f"h3forge-engine-{port}.console.log"


def log_tail(port: int, lines: int = 30) -> str:
    """The last lines of the engine's console output (a crash before its log started) and of its log."""
    parts = []
    for path in (console_file(port), log_file(port)):
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            parts.append("\n".join(text.splitlines()[-lines:]))
    return "\n".join(parts) or "(no log)"


@dataclass
class LaunchedEngine:
    process: subprocess.Popen
    url: str
    port: int
    token_file: Path
    command: list[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_file(self) -> Path:
        return log_file(self.port)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.port, lines)

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


def port_open(url: str, timeout: float = 1.0) -> bool:
    """Something accepts TCP connections at the URL's host and port."""
    try:
        with socket.create_connection(host_port(url), timeout=timeout):
            return True
    except OSError:
        return False


def probe(url: str, timeout: float = 3.0) -> dict | None:
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


def exit_report(url: str, wait: float = 0.0) -> str | None:
    """Why the engine this process started for `url` is gone (exit code and log tail), or None if it is not
    (after waiting up to `wait` seconds for it to finish exiting)."""
    engine = _launched.get(host_port(url))
    if engine is None:
        return None
    if wait > 0 and engine.alive():
        try:
            engine.process.wait(wait)
        except subprocess.TimeoutExpired:
            return None
    if engine.alive():
        return None
    return (f"The bundled engine exited with code {engine.process.returncode}. "
            f"Log ({engine.log_file}):\n{engine.log_tail()}")


FILE_FLAGS = (("dit", "--dit"), ("text_encoder", "--text-encoder"), ("video_vae", "--video-vae"),
              ("audio_vae", "--audio-vae"), ("tokenizer_dir", "--tokenizer-dir"))


def serve_command(settings: dict, port: int, token_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "engine", "serve"]
    files = settings.get("files") or {}
    if settings.get("models_dir"):
        cmd += ["--models", settings["models_dir"]]
    elif not files:
        cmd += ["--preset", settings.get("preset") or "toy"]
    cmd += [arg for role, flag in FILE_FLAGS if files.get(role) for arg in (flag, files[role])]
    # ComfyUI's model folders (extra_model_paths.yaml included): the engine reads the chosen files and the LoRA
    # node's names there.
    for folder, root in model_files.roots():
        if root.is_dir():
            cmd += ["--model-path", f"{folder}={root}"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file),
            "--log-file", str(log_file(port))]
    if settings.get("device", "auto") != "auto":
        cmd += ["--device", settings["device"]]
    if int(settings.get("gpus", 1)) > 1:
        cmd += ["--gpus", str(int(settings["gpus"]))]
    return cmd


def _start(settings: dict) -> LaunchedEngine:
    url = settings["url"]
    _, port = host_port(url)
    token_file = protocol.default_token_file()  # the engine creates it (0600); clients here read it by default
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACK_ROOT), env.get("PYTHONPATH")) if p)
    log_dir().mkdir(parents=True, exist_ok=True)
    command = serve_command(settings, port, token_file)
    with open(console_file(port), "wb") as console:
        process = subprocess.Popen(command, cwd=PACK_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=console,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return LaunchedEngine(process, url, port, token_file, command)


def _ensure_sync(settings: dict, timeout: float) -> None:
    url = settings["url"]
    host, port = host_port(url)
    with _lock:
        engine = _launched.get((host, port))
        if engine is not None and engine.alive() and engine.command != serve_command(settings, port,
                                                                                     engine.token_file):
            # The Engine node now asks for other models or options: the engine this ComfyUI started makes way.
            engine.stop()
            del _launched[(host, port)]
            engine = None
        if probe(url) is not None:
            if engine is not None and not engine.alive():  # ours died; someone else serves here now
                del _launched[(host, port)]
            return
        if (engine is None or not engine.alive()) and port_open(url):
            # Something listens but did not answer /v1/health in time: a busy engine (or another program). Starting
            # a second engine on a taken port would only fail; wait a while for the one there instead.
            _wait_for_health(url, min(timeout, BUSY_WAIT_S), None)
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
        _wait_for_health(url, timeout, engine)


def _wait_for_health(url: str, timeout: float, engine: LaunchedEngine | None) -> None:
    """Waits for /v1/health at `url`: the engine this process started (it must stay alive), or whatever listens."""
    deadline = time.monotonic() + timeout
    while probe(url) is None:
        if engine is not None and not engine.alive():
            raise RuntimeError(f"H3Forge: the bundled engine did not start. {exit_report(url)}")
        if engine is None and not port_open(url):
            raise RuntimeError(f"H3Forge: the program at {url} stopped before answering {health_url(url)}.")
        if time.monotonic() > deadline:
            port = host_port(url)[1]
            if engine is None:
                raise RuntimeError(
                    f"H3Forge: something at {url} accepts connections but did not answer {health_url(url)} within "
                    f"{timeout:.0f} s: a frozen engine, or another program on that port. Restart the engine, or "
                    f"point the URL at another port.")
            raise RuntimeError(f"H3Forge: the bundled engine did not answer {health_url(url)} within {timeout:.0f} s. "
                               f"Log ({log_file(port)}):\n{log_tail(port)}")
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
