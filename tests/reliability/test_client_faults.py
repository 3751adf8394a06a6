"""Clients that die mid-upload or mid-result, and cancel storms: the engine keeps serving, a later client can attach
a job and get its result, and every job ends exactly once."""

import asyncio
import uuid
from collections import Counter

import aiohttp
import numpy as np

from engine import protocol
from nodes.client import EngineError
from test_server import next_control, raw_ws

from .helpers import RawWebSocket, serving

SMALL = {"width": 64, "height": 64, "steps": 2}


def counters(engine) -> Counter:
    return Counter(asyncio.run(engine.client().status())["counters"])


async def attach_or_none(engine, job: str, **kwargs):
    """The job's result through a new client, or None when the engine lost it."""
    try:
        return await engine.client().attach(job, **kwargs)
    except EngineError:
        return None


def test_client_killed_mid_upload_leaves_its_submitted_job_attachable(engine, recorder):
    async def scenario():
        ws = await RawWebSocket.connect(engine.port, engine.token)
        await ws.send_json({"type": "submit", "id": "a", "task": "t2va", "params": {"prompt": "before the crash",
                                                                                     "seed": 11, **SMALL}})
        accepted = await ws.next_control()
        assert accepted["type"] == "accepted"
        await ws.send_json({"type": "submit", "id": "b", "task": "fl2va", "params": {"prompt": "never arrives"},
                            "tensors": ["first_frame"]})
        frame = protocol.encode_tensor("first_frame", np.zeros((512, 512, 3), np.uint8))
        await ws.send_partial_binary(frame, len(frame) // 2)
        ws.kill()
        return accepted["job"], await attach_or_none(engine, accepted["job"])

    with recorder.case("faults"):
        before = counters(engine)
        job, result = asyncio.run(asyncio.wait_for(scenario(), 120))
        recorder.lost("faults", result is None)
        assert result.job == job and result.meta["params"]["prompt"] == "before the crash"
        assert counters(engine)["accepted"] - before["accepted"] == 1  # the half-sent submit made no job
        assert serving(engine)


def test_client_gone_while_its_result_streams_can_attach_it_later(engine, recorder):
    async def scenario():
        ws = await RawWebSocket.connect(engine.port, engine.token)
        await ws.send_json({"type": "submit", "id": "r", "task": "t2va", "mp4": True,
                            "params": {"prompt": "cut off mid-result", "seed": 12, **SMALL}})
        job = (await ws.next_control())["job"]
        while (msg := await ws.next_control(timeout=120))["type"] != "result":
            assert msg["type"] in ("progress", "result_chunk"), msg
        ws.kill()  # the audio and MP4 announced by `result` are still on their way
        return job, await attach_or_none(engine, job, mp4=True)

    with recorder.case("faults"):
        job, result = asyncio.run(asyncio.wait_for(scenario(), 120))
        recorder.lost("faults", result is None)
        assert result.job == job and result.meta["params"]["seed"] == 12
        assert result.frames.shape == (124, 64, 64, 3) and result.mp4[4:8] == b"ftyp"
        assert serving(engine)


STORM_JOBS = 20
KEPT = range(0, STORM_JOBS, 5)  # these run to their end; every other job is cancelled, queued or running


def test_cancel_storm_ends_every_job_exactly_once(engine, recorder):
    """One connection submits jobs in a tight loop and, between submits, cancels queued, running, finished and
    unknown jobs, some several times over; every job gets exactly one result or error."""

    async def scenario():
        endings: dict[str, list[str]] = {}
        jobs: dict[str, asyncio.Future] = {}
        unknown_replies = 0
        all_ended, status = asyncio.Event(), asyncio.get_running_loop().create_future()
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"

            async def read():
                nonlocal unknown_replies
                while (msg := await next_control(ws, timeout=120))["type"] != "closed":
                    if msg["type"] == "accepted":
                        jobs[msg["id"]].set_result(msg["job"])
                    elif msg["type"] in ("result", "error") and "job" in msg:
                        endings.setdefault(msg["job"], []).append(msg.get("code", "done"))
                        if len(endings) == STORM_JOBS:
                            all_ended.set()
                    elif msg["type"] == "error":
                        assert msg["code"] == "unknown_job", msg
                        unknown_replies += 1
                    elif msg["type"] == "status":
                        status.set_result(msg)

            reader = asyncio.create_task(read())
            cancel = lambda job: ws.send_json({"type": "cancel", "id": uuid.uuid4().hex, "job": job})  # noqa: E731
            ids = []
            for i in range(STORM_JOBS):
                submit = f"s{i}"
                jobs[submit] = asyncio.get_running_loop().create_future()
                steps = 3 if i in KEPT else 1000
                await ws.send_json({"type": "submit", "id": submit, "task": "t2va",
                                    "params": {"prompt": f"storm {i}", "seed": i, **SMALL, "steps": steps}})
                job = await jobs[submit]
                ids.append(job)
                if i not in KEPT:
                    for _ in range(3):
                        await cancel(job)
                for finished in [j for j in ids if j in endings][-2:]:  # finished jobs: cancel is a no-op
                    await cancel(finished)
                await cancel(uuid.uuid4().hex)  # unknown
            await all_ended.wait()
            # A second ending of any job would have been sent before this reply (one outbox per connection).
            await ws.send_json({"type": "status", "id": "after"})
            assert (await status)["running"] is None
            await ws.close()
            await reader
        return ids, endings, unknown_replies

    with recorder.case("faults"):
        before = counters(engine)
        ids, endings, unknown_replies = asyncio.run(asyncio.wait_for(scenario(), 180))
        lost = sum(len(endings.get(job, [])) != 1 for job in ids)
        recorder.lost("faults", lost)
        assert lost == 0, endings
        assert [endings[job][0] for i, job in enumerate(ids) if i in KEPT] == ["done"] * len(KEPT)
        assert all(endings[job][0] == "cancelled" for i, job in enumerate(ids) if i not in KEPT)
        assert unknown_replies == STORM_JOBS
        after = counters(engine) - before
        assert after["accepted"] == STORM_JOBS == after["done"] + after["cancelled"] + after["failed"]
        assert serving(engine)
