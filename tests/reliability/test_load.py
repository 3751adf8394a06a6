"""Load: 16 concurrent clients x 8 jobs each on the tiny preset. Every job ends with exactly one result or one error
at the client that submitted it, each result is that client's own (the prompt and seed echoed in its meta), the
engine's memory comes back to its baseline, and the queue latency is reported.

Each client's 8 jobs: 5 generations (steps 2, 32x32, 5 s: the audio and video decode dominate, ~0.2 s each on two
idle cores), one the model refuses inside the job (30 s is over the 15 s window), one cancelled while it runs and one
cancelled as soon as it is accepted (usually still queued). The engine keeps at most ~10 results
(--result-cache-gb 0.02); memory is compared without them."""

import asyncio
import statistics
import time

from nodes.client import EngineError

from .helpers import rss_bytes, serving

ENGINE_ARGS = ["--result-cache-gb", "0.02"]
CLIENTS, JOBS = 16, 8
CANCELLED_RUNNING, REFUSED, CANCELLED_QUEUED = 2, 5, 7  # the job numbers (of 0..7) of each client ending in an error
PARAMS = {"steps": 2, "width": 32, "height": 32, "seconds": 5}
# Memory the engine may keep after the load beyond its baseline (heap growth; measured: under 20 MiB). A leaked
# result would be ~1.7 MB per generation: ~136 MiB over this run.
RSS_TOLERANCE = 64 * 2**20


def engine_memory(engine) -> int:
    """The engine's resident memory, less what its result store keeps on purpose."""
    store = asyncio.run(engine.client().status())["store"]
    return rss_bytes(engine.process.pid) - store["bytes"]


def cancel_when_denoising(cancel: asyncio.Event):
    return lambda event: event.stage == "denoising" and cancel.set()


async def client_jobs(engine, number: int) -> list[tuple[int, str, object]]:
    """One client's jobs, one after another: (job number, submitted prompt, JobResult or EngineError)."""
    client, outcomes = engine.client(), []
    for j in range(JOBS):
        prompt = f"client {number} job {j}"
        params, cancel, on_progress = {"prompt": prompt, "seed": number * 100 + j, **PARAMS}, asyncio.Event(), None
        if j == REFUSED:
            params["seconds"] = 30
        elif j == CANCELLED_RUNNING:
            params["steps"] = 1000  # long enough that the cancel always lands while it runs
            on_progress = cancel_when_denoising(cancel)
        elif j == CANCELLED_QUEUED:
            cancel.set()
        try:
            outcome = await client.run("t2va", params, cancel=cancel, on_progress=on_progress, timeout=600)
        except EngineError as error:
            outcome = error
        outcomes.append((j, prompt, outcome))
    return outcomes


def test_sixteen_clients_times_eight_jobs_each_get_their_own_results(engine, recorder):
    async def warm_up():  # one concurrent round first: the heap grows once under concurrency (by up to ~50 MiB)
        await asyncio.gather(*(engine.client().run("t2va", {"prompt": f"warm-up {c}", "seed": c, **PARAMS})
                               for c in range(CLIENTS)))

    asyncio.run(asyncio.wait_for(warm_up(), 300))
    baseline = engine_memory(engine)

    async def load():
        return await asyncio.gather(*(client_jobs(engine, c) for c in range(CLIENTS)))

    started = time.monotonic()
    per_client = asyncio.run(asyncio.wait_for(load(), 900))
    elapsed = time.monotonic() - started

    lost, queued_s = 0, []
    for number, outcomes in enumerate(per_client):
        assert [j for j, _, _ in outcomes] == list(range(JOBS))  # each job ended exactly once at its client
        for j, prompt, outcome in outcomes:
            with recorder.case("load"):
                if j == REFUSED:
                    assert isinstance(outcome, EngineError) and outcome.code == "invalid_request", outcome
                elif j in (CANCELLED_RUNNING, CANCELLED_QUEUED):
                    assert isinstance(outcome, EngineError) and outcome.code == "cancelled", outcome
                else:
                    mine = not isinstance(outcome, EngineError) and outcome.meta["params"]["prompt"] == prompt \
                        and outcome.meta["params"]["seed"] == number * 100 + j
                    lost += not mine
                    assert mine, f"client {number} job {j} got {outcome}"
                    assert outcome.frames.shape == (124, 32, 32, 3)
                    queued_s.append(outcome.meta["queued_s"])
    recorder.lost("load", lost)

    status = asyncio.run(engine.client().status())
    assert status["running"] is None and status["queue"] == []
    grown = engine_memory(engine) - baseline
    p50, p99 = statistics.median(queued_s), statistics.quantiles(queued_s, n=100)[98]
    recorder.note(f"load: {CLIENTS} clients x {JOBS} jobs in {elapsed:.0f} s; queue latency p50 {p50:.1f} s, "
                  f"p99 {p99:.1f} s; engine memory {grown / 2**20:+.0f} MiB over its baseline (tolerance "
                  f"{RSS_TOLERANCE / 2**20:.0f} MiB)")
    assert grown < RSS_TOLERANCE
    assert serving(engine)
