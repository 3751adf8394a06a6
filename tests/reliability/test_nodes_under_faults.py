"""The Text to Video node when the engine is unreachable, restarted, killed or frozen, and when ComfyUI interrupts it
during the upload or the generation: each ends in an error an artist can read (or ComfyUI's interrupt), never in a
hung node. Every node call is bounded by a timeout. The tests share one port whose engine they restart, freeze
and (last) kill."""

import asyncio
import contextlib
import os
import signal
import socket
import time

import pytest
import torch

from engine_fixture import free_port, start_engine
from nodes.client import EngineError
from test_nodes import PROMPT, comfy, engine_settings, fresh_comfy_state  # noqa: F401 (autouse fixture)
from h3forge_pack.nodes import client as node_client  # the client module the node (loaded as ComfyUI does) uses
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo

from .helpers import SlowProxy, wait_until

BOUND_S = 60  # no node call here may take longer
LONG = 1000  # steps of a job that is still running whenever the test acts on it


class EngineOnPort:
    """An engine that tests stop, kill, freeze and start again on one port, with the same token."""

    def __init__(self, tmp):
        self.tmp, self.port, self.running, self.engine = tmp, free_port(), contextlib.ExitStack(), None

    @property
    def settings(self) -> dict:
        return engine_settings(f"ws://127.0.0.1:{self.port}", (self.tmp / "token").read_text().strip())

    def start(self):
        self.engine = self.running.enter_context(start_engine(self.tmp, port=self.port))

    def stop(self):
        self.running.close()

    def signal(self, sig):
        os.killpg(self.engine.process.pid, sig)

    def ensure_started(self):
        if self.engine is None or self.engine.process.poll() is not None:
            self.stop()
            self.start()


@pytest.fixture(scope="module")
def restartable(tmp_path_factory):
    engine = EngineOnPort(tmp_path_factory.mktemp("restartable"))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def on_port(restartable):
    restartable.ensure_started()
    return restartable


def node_call(settings, steps=2, **inputs):
    """The node's coroutine: a 64x64 clip."""
    return H3ForgeTextToVideo().generate(PROMPT, 5.0, "16:9", 64, 64, steps, 1, engine=settings, unique_id="n",
                                         **inputs)


async def bounded(coro):
    return await asyncio.wait_for(coro, BOUND_S)


async def first_step(job):
    await wait_until(lambda: job.done() or any(bar.updates for bar in comfy.ProgressBar.created), BOUND_S,
                     "the first denoising step")


def readable(error: BaseException) -> str:
    message = str(error)
    assert message.startswith("H3Forge: ") and "Traceback" not in message, message
    return message


def test_unreachable_engine_is_a_readable_error(recorder, monkeypatch):
    monkeypatch.setenv("H3FORGE_LAUNCH_TIMEOUT", "2")  # how long the node waits for a silent listener's health
    with recorder.case("nodes"), socket.socket() as black_hole:
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen()  # accepts TCP connections (the kernel does) and never answers
        # Nothing listening, and something that accepts and stays silent, are told apart.
        for port, node_words, client_words in (
                (free_port(), "no engine answers", "nothing accepts connections"),
                (black_hole.getsockname()[1], "did not answer", "accepts connections but did not answer")):
            url = f"ws://127.0.0.1:{port}"
            with pytest.raises(RuntimeError) as caught:
                asyncio.run(bounded(node_call(engine_settings(url))))
            assert url in readable(caught.value) and node_words in str(caught.value)
            started = time.monotonic()
            with pytest.raises(node_client.EngineError) as caught:
                asyncio.run(bounded(node_client.EngineClient(url, token="t", connect_timeout=1, connect_wait=2).run(
                    "t2va", {"prompt": "x"})))
            elapsed = time.monotonic() - started
            assert caught.value.code == "unreachable" and client_words in caught.value.message
            assert 2 <= elapsed < 5  # it kept trying for connect_wait, and no longer


def test_engine_restarted_between_prompts_is_transparent(on_port, recorder):
    with recorder.case("nodes"):
        settings, client = on_port.settings, on_port.engine.client()
        assert asyncio.run(bounded(node_call(settings)))[1].shape == (124, 64, 64, 3)
        on_port.stop()
        on_port.start()
        outputs = asyncio.run(bounded(node_call(settings)))
        result = asyncio.run(bounded(client.run("t2va", {"prompt": "after the restart", "steps": 2, "width": 64,
                                                         "height": 64})))
        recorder.lost("nodes", outputs[1].shape != (124, 64, 64, 3))
        assert outputs[1].shape == (124, 64, 64, 3) and result.frames.shape == (124, 64, 64, 3)


def test_engine_restarted_during_generation_is_a_readable_error(on_port, recorder):
    async def restart_mid_job():
        job = asyncio.ensure_future(node_call(on_port.settings, steps=LONG))
        await first_step(job)
        await asyncio.to_thread(on_port.stop)
        await asyncio.to_thread(on_port.start)
        with pytest.raises((RuntimeError, ValueError)) as caught:
            await bounded(job)
        return caught.value

    with recorder.case("nodes"):
        message = readable(asyncio.run(restart_mid_job()))
        assert "shut down during this job" in message
        assert asyncio.run(bounded(node_call(on_port.settings)))[1].shape == (124, 64, 64, 3)


def test_frozen_engine_times_out_with_a_readable_error(on_port, recorder, monkeypatch):
    """SIGSTOP: the engine's socket still accepts, nothing answers. The WebSocket heartbeat notices, and the
    reconnect gives up after its connect timeout."""
    monkeypatch.setattr(node_client, "HEARTBEAT_S", 1.0)
    monkeypatch.setattr(node_client, "RECONNECT_DELAYS_S", (0.1,))

    async def freeze_mid_job():
        job = asyncio.ensure_future(node_call(on_port.settings, steps=LONG))
        await first_step(job)
        on_port.signal(signal.SIGSTOP)
        try:
            with pytest.raises(RuntimeError) as caught:
                await bounded(job)
        finally:
            on_port.signal(signal.SIGCONT)
        return caught.value

    with recorder.case("nodes"):
        message = readable(asyncio.run(freeze_mid_job()))
        assert "Lost the connection" in message
        client, cancel = on_port.engine.client(), asyncio.Event()
        cancel.set()  # the abandoned job goes on after SIGCONT: attach and cancel it
        running = asyncio.run(client.status())["running"]
        with pytest.raises(EngineError, match="Cancelled"):
            asyncio.run(bounded(client.attach(running["job"], cancel=cancel)))


def test_interrupt_during_upload_cancels_the_engine_job(on_port, recorder):
    image = torch.rand(1, 1024, 1024, 3)  # 3 MiB on the wire, at ~3 MiB/s through the proxy
    interrupted_at = []

    def on_upload(total):
        if total > 2**20 and not interrupted_at:
            interrupted_at.append(total)
            comfy.interrupt_current_processing(True)  # ComfyUI's Cancel button

    async def interrupt_mid_upload():
        async with SlowProxy(on_port.port, on_upload) as proxy:
            settings = {**on_port.settings, "url": f"ws://127.0.0.1:{proxy.port}"}
            with pytest.raises(comfy.InterruptProcessingException):
                await bounded(node_call(settings, steps=LONG, first_frame=image))
            return proxy.uploaded

    with recorder.case("nodes"):
        uploaded = asyncio.run(interrupt_mid_upload())
        assert interrupted_at and interrupted_at[0] < 3 * 2**20 < uploaded  # the interrupt came mid-upload
        status = asyncio.run(on_port.engine.client().status())
        assert status["running"] is None and status["recent"][0]["state"] == "cancelled"


def test_interrupt_during_generation_cancels_the_engine_job(on_port, recorder):
    async def interrupt_mid_job():
        job = asyncio.ensure_future(node_call(on_port.settings, steps=LONG))
        await first_step(job)
        comfy.interrupt_current_processing(True)
        with pytest.raises(comfy.InterruptProcessingException):
            await bounded(job)

    with recorder.case("nodes"):
        asyncio.run(interrupt_mid_job())
        status = asyncio.run(on_port.engine.client().status())
        assert status["running"] is None and status["recent"][0]["state"] == "cancelled"


def test_engine_killed_during_generation_is_a_readable_error(on_port, recorder, monkeypatch):
    monkeypatch.setattr(node_client, "RECONNECT_DELAYS_S", (0.1, 0.2))

    async def kill_mid_job():
        job = asyncio.ensure_future(node_call(on_port.settings, steps=LONG))
        await first_step(job)
        on_port.signal(signal.SIGKILL)
        with pytest.raises(RuntimeError) as caught:
            await bounded(job)
        return caught.value

    with recorder.case("nodes"):
        message = readable(asyncio.run(kill_mid_job()))
        assert "Lost the connection" in message and "could not reconnect" in message
