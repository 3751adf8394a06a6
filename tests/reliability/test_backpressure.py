"""Backpressure: a client that floods the engine with messages, and one that stops reading its replies. Each is
disconnected with a reason (a close frame where the socket still takes one, and a log line), the engine's memory
stays bounded, other clients' /v1/status and /v1/health answer in under 100 ms throughout, and a normal job runs
after."""

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request

from engine_fixture import REPO

from .helpers import Footprint, RawWebSocket, normal_job_succeeds, serving

MB = 2**20

# Sends {"type": "status"} as fast as the socket takes it for up to 5 s and never reads; prints what it saw.
FLOODER = """
import asyncio, json, sys
sys.path.insert(0, "tests")
from reliability.helpers import RawWebSocket

async def main(port, token):
    ws = await RawWebSocket.connect(port, token)
    frame = ws._frame(0x1, json.dumps({"type": "status", "id": "f"}).encode())
    sent, loop = 0, asyncio.get_running_loop()
    deadline = loop.time() + 5
    try:
        while loop.time() < deadline and not ws.reader.at_eof():
            ws.writer.write(frame * 50)
            sent += 50
            await asyncio.wait_for(ws.writer.drain(), 5)
    except (ConnectionError, asyncio.TimeoutError):
        pass
    close = None
    try:
        while True:
            msg = await ws.next_control(timeout=3)
            if msg["type"] == "closed":
                close = msg["code"]
                break
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        pass
    print(json.dumps({"sent": sent, "close": close}))

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""


def poll_latencies(engine, path, stop: threading.Event, out: list) -> None:
    headers = {"Authorization": f"Bearer {engine.token}"}
    while not stop.is_set():
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(engine.http_url + path, headers=headers),
                                    timeout=5) as response:
            json.load(response)
        out.append(time.perf_counter() - t0)
        time.sleep(0.02)


def test_a_flooding_client_is_disconnected_while_status_stays_fast(engine, recorder):
    with recorder.case("backpressure", "message_flood", engine):
        latencies = {"/v1/status": [], "/v1/health": []}
        stop = threading.Event()
        pollers = [threading.Thread(target=poll_latencies, args=(engine, path, stop, out))
                   for path, out in latencies.items()]
        with Footprint(engine) as footprint:
            for poller in pollers:
                poller.start()
            flood = subprocess.run([sys.executable, "-c", FLOODER, str(engine.port), engine.token], cwd=REPO,
                                   capture_output=True, text=True, timeout=60)
            stop.set()
            for poller in pollers:
                poller.join()
        seen = json.loads(flood.stdout)
        assert seen["close"] in (1008, None), seen  # 1008 when the close frame got through the flooded socket
        assert "reason=rate_limit" in engine.log()
        worst = {path: max(out) for path, out in latencies.items()}
        recorder.note(f"backpressure: flooder sent {seen['sent']} messages; worst latency while flooded: "
                      + ", ".join(f"{path} {1000 * s:.0f} ms ({len(latencies[path])} polls)"
                                  for path, s in worst.items()))
        assert all(len(out) >= 5 for out in latencies.values())
        assert all(s < 0.1 for s in worst.values()), worst
        assert footprint.growth < 100 * MB, footprint.growth / MB
        assert serving(engine)
        normal_job_succeeds(engine)


def test_a_client_that_stops_reading_is_disconnected_when_its_replies_pile_up(engine, recorder):
    result = asyncio.run(asyncio.wait_for(engine.client().run("t2va", {
        "prompt": "attached again and again", "steps": 2, "width": 64, "height": 64}), 120))

    async def scenario():
        ws = await RawWebSocket.connect(engine.port, engine.token)
        for i in range(300):  # 300 results of 1.5 MB each asked for, none read; 100 a second keeps under the rate
            await ws.send_json({"type": "attach", "id": f"a{i}", "job": result.job})
            await asyncio.sleep(0.01)
            if "reason=slow_reader" in engine.log():
                return i
        return None

    with recorder.case("backpressure", "reader_stalled", engine):
        with Footprint(engine) as footprint:
            stalled_after = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert stalled_after is not None and stalled_after >= 256
        assert footprint.growth < 100 * MB, footprint.growth / MB
        assert serving(engine)
        normal_job_succeeds(engine)
