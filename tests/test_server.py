"""The engine service end to end: a real engine process on a free localhost port (tiny preset, CPU), driven by
the real client (nodes/client.py) and, for protocol abuse, by a raw WebSocket."""

import asyncio
import io
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
from PIL import Image

from engine import protocol
from engine.io.video import read_video
from engine.models.h3.layout import LayoutError
from engine.models.h3.request import Cancelled
from engine.runtime.agreement import PeerFailed
from engine.server.scheduler import describe_failure
from engine.server.store import FinishedJob, ResultStore
import nodes.client
from engine_fixture import REPO
from nodes.client import EngineClient, EngineError

ENGINE_ARGS = ["--max-tensor-mb", "1"]  # small, so the oversized-frame test sends little
SMALL = {"width": 64, "height": 64}  # the VAE decode dominates a tiny job's time: keep the canvas small
FRAMES, SAMPLE_RATE = 124, 32000  # 5 s snaps to 124 frames at 24 fps


def run(coro):
    return asyncio.run(coro)


def http_get(engine, path, token=None):
    request = urllib.request.Request(engine.http_url + path)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


async def raw_ws(session, engine, hello=True, **hello_fields):
    ws = await session.ws_connect(engine.url + "/v1/ws", max_msg_size=0)
    if hello:
        await ws.send_json({"type": "hello", "id": "h", "version": protocol.PROTOCOL_VERSION,
                            "token": engine.token, **hello_fields})
    return ws


async def next_control(ws, timeout=30):
    """The next control message, skipping binary frames (previews, results)."""
    while True:
        message = await ws.receive(timeout=timeout)
        if message.type == aiohttp.WSMsgType.TEXT:
            return json.loads(message.data)
        if message.type != aiohttp.WSMsgType.BINARY:
            return {"type": "closed", "code": ws.close_code}


def check_result(result):
    assert result.frames.dtype == np.uint8 and result.frames.shape == (FRAMES, 64, 64, 3)
    assert result.audio.dtype == np.float32 and result.audio.shape[0] == 2
    assert abs(result.audio.shape[1] - FRAMES / 24 * SAMPLE_RATE) <= SAMPLE_RATE / 24
    assert (result.fps, result.sample_rate) == (24, SAMPLE_RATE)


def joined(chunks) -> np.ndarray:
    """Streamed (start, frames) chunks joined, each checked to start where the one before stopped."""
    held = 0
    for start, frames in chunks:
        assert start == held, (start, held)
        held += len(frames)
    return np.concatenate([frames for _, frames in chunks])


def test_t2va_job_streams_progress_and_its_frames_as_they_decode(engine):
    events, chunks, happened = [], [], []

    def on_progress(event):
        events.append(event)
        happened.append((event.stage, event.step, event.total))

    def on_frames(start, total, frames):
        chunks.append((start, frames.copy()))
        happened.append(("frames", start))

    result = run(engine.client().run("t2va", {"prompt": "a red fox runs through snow, wind", "steps": 4, **SMALL},
                                     on_progress=on_progress, on_frames=on_frames))
    check_result(result)
    # Every frame once, in order, in the 8 VAE chunks of 124 frames; the first before the decode's last chunk.
    assert [len(frames) for _, frames in chunks] == [17] * 7 + [5]
    assert np.array_equal(joined(chunks), result.frames)
    decoded = happened.index(("decoding", 9, 9))  # the sound, then 8 video chunks
    assert happened.index(("decoding", 1, 9)) < happened.index(("frames", 0)) < decoded
    timings = result.meta["timings"]
    assert 0 < timings["last_frame_s"] <= timings["total_s"] + 1 and "mp4_ready_s" not in timings  # no MP4 asked
    assert 0 < timings["client_last_frame_s"] <= timings["client_result_s"]
    stored = run(engine.client().attach(result.job))  # from the result store, all frames with the result
    assert np.array_equal(stored.frames, result.frames) and np.array_equal(stored.audio, result.audio)
    assert result.meta["notes"] and "124 frames" in result.meta["notes"][0]
    assert not any(n.startswith("MP4 encoded") for n in result.meta["notes"])  # nobody asked for it: not encoded
    denoising = [e for e in events if e.stage == "denoising"]
    assert sorted({e.step for e in denoising}) == [0, 1, 2, 3] and all(e.total == 3 for e in denoising)
    assert all(e.eta_s is not None and e.eta_s >= 0 for e in denoising if e.step)  # 0: the loop starts
    previews = [e.preview_jpeg for e in events if e.preview_jpeg]
    assert previews
    Image.open(io.BytesIO(previews[0])).verify()
    assert events[-1].stage == "decoding"
    status = run(engine.client().status())
    assert status["recent"][0]["job"] == result.job and status["recent"][0]["state"] == "done"
    assert status["engine"]["state"] == "ready" and status["models"]["weights"] == "tiny"


def test_extend_streams_its_frames_in_order_and_a_client_attaching_mid_job_gets_the_rest_once(engine):
    # On the tiny preset's 1:1 canvas, which the extension keeps: the source's frames come back pixel for pixel.
    source = run(engine.client().run("t2va", {"prompt": "a kite over a beach", "steps": 2, "aspect": "1:1"}))
    chunks, late_chunks = [], []

    async def scenario():
        ids, attached = [], []

        def on_frames(start, total, frames):
            chunks.append((start, frames.copy()))
            if len(chunks) == 1:  # the job goes on: the rest of window 1's decode, then window 2
                attached.append(asyncio.create_task(engine.client().attach(
                    ids[0], on_frames=lambda start, total, f: late_chunks.append((start, f.copy())))))

        result = await engine.client().run(
            "extend", {"source_job": source.job, "prompts": ["the kite dives"], "seconds": 8, "window_seconds": 5,
                       "steps": 2}, on_progress=lambda event: ids.append(event.job), on_frames=on_frames)
        return result, await attached[0]

    result, late = run(scenario())
    frames = result.frames.shape[0]
    assert frames == FRAMES + 2 * 102 and any("2 window(s)" in note for note in result.meta["notes"])
    # The source's frames first, then each decoded chunk's final frames, every one once and in order: the result
    # carried none of them, and the client that attached after the first chunk got them all too, none twice.
    assert chunks[0][0] == 0 and np.array_equal(chunks[0][1], source.frames) and len(chunks) >= 2
    assert np.array_equal(joined(chunks), result.frames)
    assert len(late_chunks) >= 2 and np.array_equal(joined(late_chunks), result.frames)
    assert np.array_equal(late.frames, result.frames) and np.array_equal(late.audio, result.audio)
    stored = run(engine.client().attach(result.job))
    assert np.array_equal(stored.frames, result.frames) and np.array_equal(stored.audio, result.audio)


def test_finished_result_mp4_over_websocket_and_http(engine):
    client = engine.client()
    job = run(client.status())["recent"][0]["job"]
    result = run(client.attach(job, mp4=True))
    assert result.mp4[4:8] == b"ftyp"
    status, body, headers = http_get(engine, f"/v1/results/{job}.mp4?token={engine.token}")
    assert status == 200 and body == result.mp4 and headers["Content-Type"] == "video/mp4"
    request = urllib.request.Request(f"{engine.http_url}/v1/results/{job}.mp4", headers={
        "Authorization": f"Bearer {engine.token}", "Range": "bytes=0-99"})
    with urllib.request.urlopen(request) as response:
        assert response.status == 206 and response.read() == result.mp4[:100]


def test_mp4_asked_at_submit_is_encoded_during_the_decode(engine):
    result = run(engine.client().run("t2va", {"prompt": "rain on a tin roof", "steps": 2, **SMALL}, mp4=True))
    check_result(result)
    assert result.meta["notes"][-1].startswith("MP4 encoded with libx264") and "mp4_s" in result.meta["timings"]
    frames, fps, audio, rate = read_video(result.mp4)
    assert frames.shape == result.frames.shape and fps == 24 and rate == SAMPLE_RATE


def test_a_job_picks_its_own_attention_and_sparsity_and_the_next_gets_the_engines(engine):
    client = engine.client()
    base = {"prompt": "a kite over the dunes", "steps": 3, "seed": 11, **SMALL}
    with pytest.raises(EngineError) as err:
        run(client.run("t2va", {**base, "attention": "fa3"}))
    assert err.value.code == "invalid_request" and "'fa3' is not available on this engine (cpu)" in err.value.message
    assert "sdpa" in err.value.message
    dense = run(client.run("t2va", base))
    sparse = run(client.run("t2va", {**base, "attention": "flex", "vsa_sparsity": 0.5}))
    again = run(client.run("t2va", base))
    assert sparse.meta["params"]["vsa_sparsity"] == 0.5 and not np.array_equal(sparse.frames, dense.frames)
    assert np.array_equal(again.frames, dense.frames)  # the engine's own settings are back


def test_cancel_stops_a_running_job_and_the_engine_serves_the_next(engine):
    async def scenario():
        cancel = asyncio.Event()
        client = engine.client()

        def on_progress(event):
            if event.stage == "denoising":
                cancel.set()

        with pytest.raises(EngineError) as err:
            await client.run("t2va", {"prompt": "a long one", "steps": 1000, **SMALL}, on_progress=on_progress,
                             cancel=cancel)
        assert err.value.code == "cancelled" and "Cancelled after step" in err.value.message
        status = await client.status()
        assert status["recent"][0]["state"] == "cancelled" and status["running"] is None
        check_result(await client.run("t2va", {"prompt": "the next one", "steps": 3, **SMALL}))

    run(scenario())


def test_disconnect_mid_job_then_attach_gets_the_result(engine):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"
            await ws.send_json({"type": "submit", "id": "s1", "task": "t2va",
                                "params": {"prompt": "gone midway", "steps": 3, "seed": 5, **SMALL}})
            accepted = await next_control(ws)
            assert accepted["type"] == "accepted" and accepted["id"] == "s1"
            while (await next_control(ws))["type"] != "progress":
                pass
            await ws.close()  # the job keeps running without us
        check_result(await engine.client().attach(accepted["job"]))

    run(scenario())


class CuttableProxy:
    """A localhost TCP proxy whose open connections can be cut, as a flaky network would."""

    def __init__(self, target_port):
        self.target_port, self.writers = target_port, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.cut()
        self.server.close()

    async def _handle(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src, dst):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    def cut(self):
        for writer in self.writers:
            writer.transport.abort()
        self.writers = []


def test_client_reconnects_and_reattaches_when_the_connection_drops(engine):
    async def scenario():
        async with CuttableProxy(engine.port) as proxy:
            client = EngineClient(f"ws://127.0.0.1:{proxy.port}", token=engine.token)
            stages = []

            def on_progress(event):
                stages.append(event.stage)
                if stages.count("denoising") == 1:
                    proxy.cut()

            check_result(await client.run("t2va", {"prompt": "flaky network", "steps": 3, **SMALL},
                                          on_progress=on_progress))

    run(scenario())


def test_a_connection_dropped_mid_stream_resumes_with_the_frames_it_lacks(engine, monkeypatch):
    monkeypatch.setattr(nodes.client, "RECONNECT_DELAYS_S", (0.0, 0.5, 1.0))  # back while the VAE still decodes
    chunks = []

    async def scenario():
        async with CuttableProxy(engine.port) as proxy:
            client = EngineClient(f"ws://127.0.0.1:{proxy.port}", token=engine.token)

            def on_frames(start, total, frames):
                chunks.append((start, frames.copy()))
                if len(chunks) == 1:
                    proxy.cut()

            # The tiny preset's largest canvas: its decode lasts long past the re-attach (milliseconds)
            return await client.run("t2va", {"prompt": "a paper boat in the gutter", "steps": 2, "width": 224,
                                             "height": 128}, on_frames=on_frames, mp4=True)

    result = run(scenario())
    # Cut after the first chunk, the client re-attached saying how many frames it held and got the rest streamed
    # (the client takes only the next frames, in order): none twice, none missing.
    assert len(chunks) == 8 and np.array_equal(joined(chunks), result.frames)
    assert np.array_equal(run(engine.client().attach(result.job)).frames, result.frames)
    assert result.mp4[4:8] == b"ftyp" and 0 < result.meta["timings"]["mp4_ready_s"]


def test_attaching_to_a_finished_job_with_frames_in_hand_gets_only_the_rest(engine):
    job = next(row["job"] for row in run(engine.client().status())["recent"] if row["state"] == "done")
    clip = run(engine.client().attach(job))

    async def attach(frames):
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"
            await ws.send_json({"type": "attach", "id": "a", "job": clip.job, "frames": frames})
            reply = await next_control(ws)
            tensors = [protocol.decode_tensor((await ws.receive()).data) for _ in reply.get("tensors", [])]
            return reply, dict(tensors)

    reply, tensors = run(attach(100))
    assert reply["type"] == "result" and reply["start"] == 100 and reply["tensors"] == ["frames", "audio"]
    assert np.array_equal(tensors["frames"], clip.frames[100:]) and reply["meta"]["frames"] == FRAMES
    reply, _ = run(attach(FRAMES))
    assert reply["start"] == FRAMES and reply["tensors"] == ["audio"]  # every frame in hand: none sent again
    for bad in (FRAMES + 1, -1, "12", True):
        reply, _ = run(attach(bad))
        assert reply["type"] == "error" and reply["code"] == "invalid_request", reply


def test_wrong_or_missing_token_is_refused_and_health_is_open(engine, tmp_path):
    status, body, _ = http_get(engine, "/v1/health")
    assert status == 200 and json.loads(body)["state"] == "ready"
    assert http_get(engine, "/v1/status")[0] == 401
    assert http_get(engine, "/v1/status", token="wrong")[0] == 401
    assert http_get(engine, "/v1/status", token=engine.token)[0] == 200
    assert http_get(engine, "/")[0] == 401
    status, body, _ = http_get(engine, f"/?token={engine.token}")
    assert status == 200 and b"H3Forge engine" in body
    assert http_get(engine, "/v1/results/0123456789abcdef0123456789abcdef.mp4")[0] == 401

    for client in (engine.client(token="wrong"), EngineClient(engine.url, token_file=str(tmp_path / "none"))):
        with pytest.raises(EngineError) as err:
            run(client.run("t2va", {"prompt": "x", "steps": 2, **SMALL}))
        assert err.value.code == "auth" and "refused" in err.value.message
        with pytest.raises(EngineError) as err:
            run(client.status())
        assert err.value.code == "auth"

    async def hello_with(token):
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine, token=token)
            return await next_control(ws), await next_control(ws)

    for token in (None, "wrong", ""):
        error, closed = run(hello_with(token))
        assert error["type"] == "error" and error["code"] == "auth" and closed["type"] == "closed"


def test_unreachable_engine_and_version_mismatch_are_explained(engine):
    with pytest.raises(EngineError) as err:
        run(EngineClient("ws://127.0.0.1:9", token="x", connect_timeout=1).run("t2va", {"prompt": "x"}))
    assert err.value.code == "unreachable" and "python -m engine serve" in err.value.message

    async def old_client():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine, version=0)
            return await next_control(ws)

    error = run(old_client())
    assert error["code"] == "version" and "update" in error["message"]


def test_bad_input_gets_errors_and_the_engine_keeps_serving(engine):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            welcome = await next_control(ws)
            assert welcome["limits"]["max_tensor_bytes"] == 2**20

            async def expect(code, *, job=False):
                reply = await next_control(ws)
                assert reply["type"] == "error" and reply["code"] == code, reply
                assert ("job" in reply) == job
                return reply

            await ws.send_str("{this is not json")
            await expect("bad_message")
            await ws.send_json({"type": "launch"})
            await expect("bad_message")
            await ws.send_str(json.dumps({"type": "status", "pad": "x" * 300_000}))
            await expect("too_large")
            await ws.send_bytes(protocol.encode_tensor("stray", np.zeros(4, np.uint8)))
            await expect("bad_message")

            async def submit(task, params, tensors=()):
                await ws.send_json({"type": "submit", "id": "s", "task": task, "params": params,
                                    "tensors": [name for name, _ in tensors]})
                for _, data in tensors:
                    await ws.send_bytes(data)

            big = np.zeros((1024, 1024, 3), np.uint8)  # 3 MiB, over the 1 MiB limit
            await submit("fl2va", {"prompt": "x"}, [("first_frame", protocol.encode_tensor("first_frame", big))])
            assert "1.0 MiB" in (await expect("too_large"))["message"]
            lying = bytearray(protocol.encode_tensor("first_frame", np.zeros((64, 64, 3), np.uint8)))[:-100]
            await submit("fl2va", {"prompt": "x"}, [("first_frame", bytes(lying))])
            await expect("bad_tensor")
            await submit("t2va", {"prompt": "x", "seconds": -2})
            assert "'seconds'" in (await expect("invalid_request"))["message"]
            await submit("t2va", {"prompt": "x", "seconds": "five"})
            await expect("invalid_request")
            await submit("t2v_typo", {"prompt": "x"})
            assert "Unknown task" in (await expect("invalid_request"))["message"]
            await submit("t2va", {"seconds": 5})
            assert "prompt" in (await expect("invalid_request"))["message"]
            await ws.send_json({"type": "cancel", "id": "c", "job": "nope"})
            await expect("unknown_job")
            await ws.send_json({"type": "attach", "id": "a", "job": "nope"})
            await expect("unknown_job")

            # The model's rules are checked at submit, before the job queues (engine.server.cost).
            await submit("t2va", {"prompt": "x", "seconds": 30, **SMALL})
            assert "5 to 15 s" in (await expect("invalid_request"))["message"]

            # Passes the protocol and the cost check, fails inside the job: an error for that job.
            await submit("t2va", {"prompt": "x", "attention": "fa3", **SMALL})
            accepted = await next_control(ws)
            assert accepted["type"] == "accepted"
            while (reply := await next_control(ws))["type"] == "progress":
                pass
            assert reply["type"] == "error" and reply["job"] == accepted["job"]
            assert reply["code"] == "invalid_request" and "not available" in reply["message"]

            await ws.send_json({"type": "status", "id": "st"})  # the same connection still works
            reply = await next_control(ws)
            assert reply["type"] == "status" and reply["id"] == "st"

        with pytest.raises(EngineError) as err:  # the client checks specs before sending
            await engine.client().run("t2va", {"prompt": "x", "width": 64})
        assert err.value.code == "invalid_request"
        check_result(await engine.client().run("t2va", {"prompt": "still serving", "steps": 3, **SMALL}))
        counters = (await engine.client().status())["counters"]
        assert counters["failed"] >= 1 and counters["done"] >= 1

    run(scenario())


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_in_a_browser_shows_the_running_job_and_finished_videos(engine):
    def rendered_dashboard():
        out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                              "--dump-dom", f"{engine.http_url}/?token={engine.token}"],
                             capture_output=True, text=True, timeout=120)
        return out.stdout

    async def scenario():
        client = engine.client()
        if not any(r["state"] == "done" for r in (await client.status())["recent"]):
            await client.run("t2va", {"prompt": "a finished one", "steps": 2, **SMALL})
        cancel, denoising = asyncio.Event(), asyncio.Event()
        job = asyncio.create_task(client.run("t2va", {"prompt": "shown while running", "steps": 1000, **SMALL},
                                             cancel=cancel, on_progress=lambda e: e.stage == "denoising"
                                             and denoising.set()))
        await denoising.wait()
        dom = await asyncio.to_thread(rendered_dashboard)
        cancel.set()
        with pytest.raises(EngineError):
            await job
        return dom

    dom = run(scenario())
    assert 'id="running-job"' in dom and "shown while running" in dom and "denoising · step" in dom
    assert "<video" in dom and ".mp4?token=" in dom
    assert 'id="weights">weights: H3 tiny (float32)</div>' in dom  # which weights, formats and precisions


@pytest.mark.parametrize("exc, code, words", [
    (Cancelled("Cancelled after step 3 of 9."), "cancelled", "after step 3"),
    (LayoutError("MiniMax-H3 supports aspect ratios from 1:4 to 4:1, got 9:1."), "invalid_request", "1:4 to 4:1"),
    (MemoryError(), "out_of_memory", "ran out of memory"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"), "out_of_memory", "ran out of memory"),
    (PeerFailed("another rank failed this job (see the engine log)"), "internal", "another rank failed"),
    (KeyError("blocks.3.attn"), "internal", "internal engine error: KeyError"),
])
def test_job_failures_are_explained_for_artists(exc, code, words):
    state, got_code, message = describe_failure(exc)
    assert got_code == code and words in message
    assert state == ("cancelled" if code == "cancelled" else "failed")


def test_result_store_expires_and_caps_by_size(monkeypatch):
    def finished(job, finished_at, nbytes):
        return FinishedJob(job, "t2va", {}, "done", finished_at, finished_at, finished_at,
                           frames=np.zeros((1, 1, nbytes, 1), np.uint8), audio=np.zeros((2, 0), np.float32))

    store = ResultStore(ttl_s=100, max_bytes=250)
    now = 1000.0
    monkeypatch.setattr("engine.server.store.time.time", lambda: now)
    for i in range(3):
        store.add(finished(f"j{i}", now - 10 + i, 100))
    assert [f.job for f in store.recent()] == ["j2", "j1"]  # j0 went over the byte cap
    now += 95
    store.add(finished("big", now, 1000))  # over the cap alone: still kept, as the newest
    assert [f.job for f in store.recent()] == ["big"]
    now += 200
    assert store.get("big") is None and len(store) == 0


def test_result_store_caps_entries_expires_failures_early_and_lists_real_results(monkeypatch):
    def finished(job, finished_at, state="done"):
        frames = np.zeros((1, 1, 10, 1), np.uint8) if state == "done" else None
        return FinishedJob(job, "t2va", {}, state, finished_at, finished_at, finished_at, frames=frames,
                           error_code=None if state == "done" else state)

    store = ResultStore(ttl_s=3600, max_bytes=10**6, max_entries=10, failed_ttl_s=60)
    now = 1000.0
    monkeypatch.setattr("engine.server.store.time.time", lambda: now)
    store.add(finished("real", now))
    for i in range(30):
        store.add(finished(f"c{i}", now + i, "cancelled"))
    assert len(store) == 10 and store.get("real") is not None  # the failures went first
    assert store.nbytes == 10 and store.get("c0") is None and store.get("c29") is not None
    recent = [f.job for f in store.recent(n=20, failures=5)]
    assert "real" in recent and len(recent) == 6
    now += 100  # past the failures' TTL, inside the results'
    assert [f.job for f in store.recent()] == ["real"] and len(store) == 1
    for i in range(12):
        store.add(finished(f"r{i}", now + i))
    assert len(store) == 10 and store.get("real") is None and store.nbytes == 100  # entries cap results too


@pytest.mark.parametrize("rate", ["0", "-5", "fast"])
def test_serve_refuses_a_message_rate_that_is_not_above_zero(rate):
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--max-messages-per-s", rate], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--max-messages-per-s: must be above 0, got {rate}" in proc.stderr, proc.stderr
