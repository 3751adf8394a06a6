"""Store growth: a flood of submitted-and-cancelled jobs. The result store keeps at most --max-results entries,
failed and cancelled jobs expire after --failed-ttl-min, the dashboard's recent list keeps the real results, and
/v1/status (built from counters) answers in under 100 ms with the store full."""

import asyncio
import json
import time

import aiohttp

from test_server import http_get, next_control, raw_ws

from .helpers import Footprint, normal_job_succeeds, serving, wait_until

ENGINE_ARGS = ["--max-results", "40", "--failed-ttl-min", "0.05", "--max-queue", "8"]
CONNECTIONS, JOBS_EACH = 4, 60


async def submit_and_cancel(engine, worker: int) -> int:
    """JOBS_EACH jobs submitted and cancelled while queued, one after another; how many ended cancelled."""
    cancelled = 0
    async with aiohttp.ClientSession() as session:
        ws = await raw_ws(session, engine)
        assert (await next_control(ws))["type"] == "welcome"
        for i in range(JOBS_EACH):
            await ws.send_json({"type": "submit", "id": f"s{worker}.{i}", "task": "t2va",
                                "params": {"prompt": f"flood {worker}.{i}", "steps": 2, "width": 32, "height": 32}})
            while (accepted := await next_control(ws))["type"] == "progress":
                pass
            assert accepted["type"] == "accepted", accepted
            await ws.send_json({"type": "cancel", "id": "c", "job": accepted["job"]})
            while (msg := await next_control(ws))["type"] != "error":
                pass
            cancelled += msg["code"] == "cancelled"
    return cancelled


def status_seconds(engine) -> tuple[dict, float]:
    started = time.perf_counter()
    code, body, _ = http_get(engine, "/v1/status", engine.token)
    seconds = time.perf_counter() - started
    assert code == 200
    return json.loads(body), seconds


def test_cancelled_floods_are_capped_expire_and_leave_real_results_listed(engine, recorder):
    real = asyncio.run(asyncio.wait_for(engine.client().run("t2va", {
        "prompt": "the real result", "steps": 2, "width": 32, "height": 32}), 120))

    async def flood():
        stop = asyncio.Event()
        blocker = asyncio.create_task(engine.client().run("t2va", {  # keeps the flood's jobs queued
            "prompt": "the long one", "steps": 1000, "width": 64, "height": 64}, cancel=stop))
        await asyncio.sleep(1)
        counts = await asyncio.gather(*(submit_and_cancel(engine, w) for w in range(CONNECTIONS)))
        stop.set()
        await asyncio.gather(blocker, return_exceptions=True)
        return sum(counts)

    with recorder.case("store", "cancelled_flood", engine):
        with Footprint(engine) as footprint:
            cancelled = asyncio.run(asyncio.wait_for(flood(), 180))
        status, seconds = status_seconds(engine)
        assert cancelled == CONNECTIONS * JOBS_EACH
        assert status["store"]["jobs"] <= 40 and status["store"]["max_jobs"] == 40
        assert real.job in [row["job"] for row in status["recent"]]
        assert footprint.growth < 100 * 2**20
    with recorder.case("store", "status_with_full_store", engine):
        worst = max(status_seconds(engine)[1] for _ in range(10))
        recorder.note(f"store: {cancelled} cancelled jobs; /v1/status with the store full: worst of 10 "
                      f"{1000 * worst:.0f} ms")
        assert seconds < 0.1 and worst < 0.1, (seconds, worst)
    with recorder.case("store", "failures_expire", engine):
        asyncio.run(wait_until(lambda: status_seconds(engine)[0]["store"]["jobs"] <= 2, 30,
                               "the cancelled jobs to expire (--failed-ttl-min 0.05)"))
        status = status_seconds(engine)[0]
        assert real.job in [row["job"] for row in status["recent"]]
        normal_job_succeeds(engine)
        assert serving(engine)
