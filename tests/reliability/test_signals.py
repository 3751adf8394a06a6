"""Signals: SIGHUP (a closed terminal) is logged and ignored; SIGTERM with three idle clients and one running job
stops accepting, ends the job with a clear "shut down" error to its client, closes every connection with a close
frame (1001, going away) and a reason, and the engine exits within 10 s. Every signal leaves a log line."""

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from engine_fixture import start_engine
from nodes.client import EngineError
from test_server import next_control, raw_ws

from .helpers import normal_job_succeeds, serving, wait_until


async def close_frame(ws) -> tuple[int, str] | None:
    """(code, reason) of the close frame the engine sends, skipping other messages; None if the socket just ends."""
    while True:
        message = await ws.receive(timeout=12)
        if message.type == aiohttp.WSMsgType.CLOSE:
            return message.data, message.extra
        if message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            return None


@pytest.fixture(scope="module")
def signalled_engine(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("signals")) as running:
        yield running


def test_sighup_is_logged_and_ignored(signalled_engine, recorder):
    engine = signalled_engine
    with recorder.case("signals", "sighup", engine):
        os.kill(engine.process.pid, signal.SIGHUP)
        asyncio.run(wait_until(lambda: "signal=SIGHUP" in engine.log(), 10, "the SIGHUP log line"))
        assert engine.process.poll() is None and serving(engine)
        normal_job_succeeds(engine)


def test_sighup_to_a_two_rank_engine_is_ignored_by_torchrun_and_every_rank(tmp_path, recorder):
    """A closed terminal hangs up the engine's process group: torchrun's agent (which would stop the ranks on it) logs
    it and goes on, and so does every rank it reaches."""
    with start_engine(tmp_path, "--gpus", "2") as engine, recorder.case("signals", "sighup_ranks", engine):
        os.killpg(engine.process.pid, signal.SIGHUP)
        asyncio.run(wait_until(lambda: "SIGHUP ignored" in engine.log(), 10, "the agent's SIGHUP line"))
        assert engine.process.poll() is None and serving(engine)
        normal_job_succeeds(engine)


def test_sigterm_closes_every_client_with_a_reason_and_exits_within_10_s(signalled_engine, recorder):
    engine = signalled_engine

    async def scenario():
        async with aiohttp.ClientSession() as session:
            idle = [await raw_ws(session, engine) for _ in range(3)]
            for ws in idle:
                assert (await next_control(ws))["type"] == "welcome"
            progress = asyncio.Event()
            job = asyncio.create_task(engine.client().run("t2va", {
                "prompt": "running at the SIGTERM", "steps": 1000, "width": 64, "height": 64},
                on_progress=lambda event: event.stage == "denoising" and progress.set()))
            await asyncio.wait_for(progress.wait(), 60)
            started = time.monotonic()
            os.kill(engine.process.pid, signal.SIGTERM)
            closes = [await close_frame(ws) for ws in idle]
            try:
                await asyncio.wait_for(job, 12)
                failure = None
            except EngineError as err:
                failure = err
            await asyncio.get_running_loop().run_in_executor(None, engine.process.wait, 12)
            return closes, failure, time.monotonic() - started

    with recorder.case("signals", "sigterm_idle_clients"):
        closes, failure, seconds = asyncio.run(asyncio.wait_for(scenario(), 120))
        log = engine.log()
        recorder.note(f"signals: SIGTERM with 3 idle clients and a running job: exit {engine.process.returncode} "
                      f"after {seconds:.1f} s; close frames {closes}")
        assert seconds <= 10 and engine.process.returncode == 0, (seconds, log[-3000:])
        assert closes == [(aiohttp.WSCloseCode.GOING_AWAY, "shutting_down")] * 3, closes
        assert "signal=SIGTERM" in log and "reason=shutting_down" in log and "event=engine.stopped" in log
    with recorder.case("signals", "sigterm_running_job"):
        assert failure is not None and failure.code == "unavailable" and "shut down" in failure.message, failure
