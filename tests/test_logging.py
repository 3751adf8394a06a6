"""Engine logs: size-rotated files per rank, and the log of an auto-launched engine outliving the process (ComfyUI)
that started it."""

import asyncio
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from engine.runtime import log
from engine_fixture import REPO, free_port
from test_nodes import PROMPT, engine_settings
from test_pack_import import load_pack

load_pack()
launcher = importlib.import_module("h3forge_pack.nodes.launcher")
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo  # noqa: E402


@pytest.fixture
def restore_logger():
    handlers, level = list(log.logger.handlers), log.logger.level
    yield
    for handler in log.logger.handlers:
        handler.close()
    log.logger.handlers[:], log.logger.level = handlers, level


def test_log_file_rotates_by_size_per_rank(tmp_path, restore_logger):
    path = tmp_path / "logs" / "engine.log"
    log.setup_logging(rank=1, log_file=path, max_bytes=2000)
    for i in range(400):
        log.log_event("job.step", job="x" * 32, step=i)
    rank_file = tmp_path / "logs" / "engine.rank1.log"
    kept = sorted(p.name for p in rank_file.parent.iterdir())
    assert kept == ["engine.rank1.log", "engine.rank1.log.1", "engine.rank1.log.2", "engine.rank1.log.3"]
    assert all((rank_file.parent / name).stat().st_size <= 2000 for name in kept)
    assert "step=399" in rank_file.read_text() and "rank=1" in rank_file.read_text()


LAUNCH_AND_DIE = textwrap.dedent("""
    import asyncio, importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("h3forge_pack", os.path.join(sys.argv[1], "__init__.py"))
    pack = importlib.util.module_from_spec(spec)
    sys.modules["h3forge_pack"] = pack
    spec.loader.exec_module(pack)
    launcher = sys.modules["h3forge_pack.nodes.launcher"]
    settings = {"url": sys.argv[2], "auto_launch": True, "preset": "tiny", "device": "cpu"}
    asyncio.run(launcher.ensure_engine(settings))
    print(json.dumps({"pid": launcher.launched(sys.argv[2]).pid}), flush=True)
    os._exit(0)  # as a killed ComfyUI: no atexit, so the engine it started keeps running
""")


def test_engine_log_outlives_the_process_that_launched_it(tmp_path, monkeypatch):
    """A ComfyUI that started the engine dies; the next one empties its temp folder (ComfyUI does at start) and
    reuses the running engine: the engine's log is still there, at the same path, and still written."""
    monkeypatch.setenv("H3FORGE_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("H3FORGE_LOG_DIR", str(tmp_path / "logs"))
    url = f"ws://127.0.0.1:{free_port()}"
    started = subprocess.run([sys.executable, "-c", LAUNCH_AND_DIE, str(REPO), url], capture_output=True, text=True,
                             timeout=180, env=dict(os.environ))
    assert started.returncode == 0, started.stderr
    pid = json.loads(started.stdout)["pid"]
    try:
        port = launcher.host_port(url)[1]
        log_file = tmp_path / "logs" / f"h3forge-engine-{port}.log"
        assert launcher.log_file(port) == log_file and "event=engine.listening" in log_file.read_text()
        assert launcher.launched(url) is None  # not this process's engine: it is reused, not started again
        settings = engine_settings(url, auto_launch=True)
        _, frames, _, job = asyncio.run(H3ForgeTextToVideo().generate(PROMPT, 5.0, "16:9", 64, 64, 2, 1,
                                                                      engine=settings, unique_id="7"))
        assert frames.shape == (124, 64, 64, 3) and launcher.launched(url) is None
        assert f"event=job.done job={job}" in log_file.read_text()
        assert f"job={job}" in launcher.log_tail(port)
        with urllib.request.urlopen(launcher.health_url(url), timeout=5) as reply:
            assert json.load(reply)["engine"] == "h3forge"
    finally:
        stop_orphan(pid)


def stop_orphan(pid: int, grace_s: float = 15.0) -> None:
    """SIGTERM to an engine whose parent is gone (so no wait() here), SIGKILL if it outlives `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
