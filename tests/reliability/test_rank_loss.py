"""A worker rank of a two-rank gloo engine killed (SIGKILL) mid-job, end to end through the Text to Video node and
auto-launch: the job fails with an error that says what happened, the engine exits non-zero with a log line saying
why, and the next node call brings a bundled engine back."""

import asyncio
import os
import signal

import pytest

from engine_fixture import free_port
from test_nodes import PROMPT, comfy, fresh_comfy_state, launcher  # noqa: F401 (autouse fixture)
from h3forge_pack.nodes.engine_node import H3ForgeEngine
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo

from .helpers import rank_pids, wait_until


def test_killed_rank_fails_the_job_readably_and_auto_launch_brings_the_engine_back(tmp_path, monkeypatch, recorder):
    monkeypatch.setenv("H3FORGE_TOKEN_FILE", str(tmp_path / "token"))
    url = f"ws://127.0.0.1:{free_port()}"
    settings = H3ForgeEngine().configure(url, "", True, "tiny", "", "cpu", 2, "auto", "engine default")[0]

    def generate(steps):
        return H3ForgeTextToVideo().generate(PROMPT, 5.0, "1:1", 64, 64, steps, 1, engine=settings, unique_id="r")

    async def kill_rank_mid_job():
        job = asyncio.ensure_future(generate(1000))
        await wait_until(lambda: job.done() or any(bar.updates for bar in comfy.ProgressBar.created), 120,
                         "the first denoising step")
        engine = launcher.launched(url)
        # Seen once in a CI run (no engine running here at this point; not reproduced alone or with tests/reliability):
        # if it happens again, the message says why the engine is gone or how the job ended.
        assert engine is not None, (launcher.exit_report(url), job.done() and not job.cancelled() and job.exception())
        os.kill(rank_pids(engine.pid)[1], signal.SIGKILL)
        with pytest.raises(RuntimeError) as caught:
            await asyncio.wait_for(job, 60)
        return engine, str(caught.value)

    try:
        with recorder.case("faults"):
            first, message = asyncio.run(kill_rank_mid_job())
            assert message.startswith("H3Forge: ") and "worker processes (ranks) stopped" in message
            assert "Traceback" not in message.split("\n")[0]
            assert first.process.wait(60) != 0
            assert "rank 1 exited with status -9" in first.log_tail()

            frames = asyncio.run(asyncio.wait_for(generate(2), 180))[1]
            second = launcher.launched(url)
            assert frames.shape == (124, 64, 64, 3) and second.pid != first.pid
    finally:
        engine = launcher.launched(url)
        if engine is not None:
            engine.stop()
