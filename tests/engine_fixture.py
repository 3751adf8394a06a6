"""Start a real engine process (`python -m engine serve --preset tiny --device cpu`) on a free localhost port.

    from engine_fixture import start_engine
    with start_engine(tmp_path, "--gpus", "2") as engine:
        result = asyncio.run(engine.client().run(...))

`engine` (module scope) is one such engine shared by a test module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nodes.client import EngineClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningEngine:
    port: int
    token_file: Path
    log_file: Path
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def client(self, **kwargs) -> EngineClient:
        kwargs.setdefault("token", self.token)
        return EngineClient(self.url, **kwargs)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=1) as response:
            return json.load(response)
    except OSError:
        return None


@contextlib.contextmanager
def start_engine(tmp: Path, *args: str, env: dict | None = None, ready_timeout: float = 120.0,
                 port: int | None = None):
    """An engine on `port` (default: a free one), its token and log in `tmp`: one restarted on the same port and
    `tmp` keeps its token. A free port can be taken before the engine binds it (a gloo rank's listener draws from the
    same ephemeral range), so a chosen port that was is chosen again, up to three times."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        engine = _launch(tmp, port or free_port(), args, env)
        try:
            if _became_ready(engine, ready_timeout):
                yield engine
                return
        finally:
            _stop(engine.process)
        if port is not None or "address already in use" not in engine.log():
            break
    pytest.fail(f"engine did not become ready (exit {engine.process.poll()}):\n{engine.log()[-4000:]}")


def _launch(tmp: Path, port: int, args, env: dict | None) -> RunningEngine:
    token_file, log_file = tmp / "token", tmp / f"engine-{port}.log"
    cmd = [sys.executable, "-m", "engine", "serve", "--preset", "tiny", "--device", "cpu", "--port", str(port),
           "--token-file", str(token_file), *args]
    with open(log_file, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    return RunningEngine(port, token_file, log_file, process)


def _became_ready(engine: RunningEngine, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while (_health(engine.port) or {}).get("state") != "ready":
        if engine.process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the engine's process group (torchrun and its ranks too), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory):
    """One engine per test module; a module may set ENGINE_ARGS = [...] for extra serve flags."""
    args = getattr(request.module, "ENGINE_ARGS", [])
    with start_engine(tmp_path_factory.mktemp("engine"), *args) as running:
        yield running
