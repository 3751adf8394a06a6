"""The engine's limits under pressure: a memory cap (out of memory made reproducible on CPU), a full queue, and a
result store smaller than one result. Each ends the job or the request with an error an artist can act on, and the
engine keeps serving.

The result store is in memory only (nothing is written to disk, so there is no full disk to fill). Past its byte cap
the oldest results go first; a single result larger than the whole cap is still delivered, and kept only while it
is the newest result: the next one evicts it, and attaching to it then says the result expired (failed jobs hold no
bytes; they are capped by count and time instead)."""

import argparse
import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from engine.runtime.jobs import JobSpec
from engine.server.cli import add_serve_args
from engine.server.scheduler import OverMemoryCap, check_memory_cap
from nodes.client import EngineError
from test_server import next_control, raw_ws

from .helpers import serving

# 0.02 GB of working memory per job: 124 frames at 64x64 (8 MB estimated) fit, 128x128 (32 MB) do not.
# 0.0025 GB (2.6 MB) of kept results: a 32x32 result (1.7 MB) fits, two do not, a 64x64 one (2.8 MB) alone does not.
ENGINE_ARGS = ["--max-queue", "2", "--memory-cap-gb", "0.02", "--result-cache-gb", "0.0025"]


@pytest.fixture(scope="module")
def client(engine):
    return engine.client()


def run(client, params):
    return asyncio.run(asyncio.wait_for(client.run("t2va", {"prompt": "limits", "steps": 2, **params}), 120))


def test_job_over_the_memory_cap_fails_as_out_of_memory_and_says_what_to_reduce(engine, client, recorder):
    with recorder.case("faults"):
        with pytest.raises(EngineError) as err:
            run(client, {"width": 128, "height": 128})
        assert err.value.code == "out_of_memory"
        assert "Out of memory" in err.value.message and "128x128" in err.value.message
        assert "fewer seconds or a smaller width and height" in err.value.message
        assert run(client, {"width": 64, "height": 64}).frames.shape == (124, 64, 64, 3)
        assert serving(engine)


def test_memory_cap_comes_from_the_flag_or_the_environment(monkeypatch):
    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_serve_args(parser.add_subparsers())
        return parser.parse_args(["serve", *argv]).memory_cap_gb

    monkeypatch.delenv("H3FORGE_MEMORY_CAP_GB", raising=False)
    assert parse() is None and parse("--memory-cap-gb", "2") == 2
    monkeypatch.setenv("H3FORGE_MEMORY_CAP_GB", "1.5")
    assert parse() == 1.5 and parse("--memory-cap-gb", "2") == 2


def test_memory_estimate_takes_the_largest_canvas_when_the_aspect_ratio_picks_it():
    pipeline = SimpleNamespace(canvas=SimpleNamespace(max_pixels=128 * 224))
    spec = JobSpec("j", "t2va", {"prompt": "x", "seconds": 15, "aspect": "16:9"})
    check_memory_cap(spec, 362 * 128 * 224 * 16, pipeline)  # 15 s = 362 frames: just fits
    with pytest.raises(OverMemoryCap, match=r"362 frames at up to 28672 pixels"):
        check_memory_cap(spec, 362 * 128 * 224 * 16 - 1, pipeline)
    check_memory_cap(JobSpec("j", "upscale", {"seconds": 15}), 1, pipeline)  # only generations are estimated


def test_full_queue_refuses_with_a_busy_error_naming_the_queue_length(engine, recorder):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"
            jobs, replies = [], []
            for i in range(4):  # one runs, two wait, the fourth finds the queue full
                await ws.send_json({"type": "submit", "id": f"q{i}", "task": "t2va", "params": {
                    "prompt": f"queue {i}", "steps": 1000, "width": 64, "height": 64}})
                while (reply := await next_control(ws))["type"] == "progress":
                    pass
                replies.append(reply)
                if reply["type"] == "accepted":
                    jobs.append(reply["job"])
            for job in jobs:
                await ws.send_json({"type": "cancel", "id": "c", "job": job})
            ended = set()
            while len(ended) < len(jobs):
                if (msg := await next_control(ws))["type"] == "error" and msg.get("job") in jobs:
                    ended.add(msg["job"])
            return replies

    with recorder.case("faults"):
        replies = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert [r["type"] for r in replies] == ["accepted", "accepted", "accepted", "error"]
        assert replies[3]["id"] == "q3" and replies[3]["code"] == "queue_full"
        assert "queue is full (2 jobs waiting)" in replies[3]["message"]
        assert serving(engine)


def test_result_store_evicts_oldest_first_and_keeps_an_oversized_result_only_while_newest(engine, client, recorder):
    async def attach(job):  # the result, or the error saying why there is none
        try:
            return await asyncio.wait_for(client.attach(job), 30)
        except EngineError as err:
            return err

    with recorder.case("faults"):
        first = run(client, {"width": 32, "height": 32, "seed": 1})
        second = run(client, {"width": 32, "height": 32, "seed": 2})
        expired = asyncio.run(attach(first.job))
        assert isinstance(expired, EngineError) and expired.code == "unknown_job" and "expired" in expired.message
        assert asyncio.run(attach(second.job)).meta["params"]["seed"] == 2

        big = run(client, {"width": 64, "height": 64, "seed": 3})  # over the whole cap: delivered all the same
        assert big.frames.shape == (124, 64, 64, 3)
        status = asyncio.run(client.status())["store"]
        assert status["results"] == 1 and status["bytes"] > status["max_bytes"]
        assert asyncio.run(attach(big.job)).meta["params"]["seed"] == 3  # still the newest, still kept
        with pytest.raises(EngineError):
            run(client, {"width": 128, "height": 128})  # a failed job holds no bytes: the big result stays
        assert asyncio.run(attach(big.job)).meta["params"]["seed"] == 3
        run(client, {"width": 32, "height": 32, "seed": 4})  # the next result evicts it
        assert asyncio.run(attach(big.job)).code == "unknown_job"
        assert serving(engine)
