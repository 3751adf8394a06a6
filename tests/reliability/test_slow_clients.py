"""Slow and half-open clients, and file-descriptor exhaustion: HTTP headers that never finish, a body that never
comes, a WebSocket that never says hello; and 300 half-open connections against an engine started with
`ulimit -n 256`. Each is cut off by a timeout or by the connection cap (kept below the fd limit, the oldest idle
connection closed to make room), /v1/health keeps answering, the log stays small, and a normal job runs after."""

import asyncio
import logging
import resource
import socket
import time

import aiohttp
import pytest

from engine_fixture import start_engine
from test_server import next_control

from engine.server.guard import ACCEPT_BACKLOG

from .helpers import Footprint, health, normal_job_succeeds, open_fds, serving

ENGINE_ARGS = ["--client-timeout-s", "2"]
PARTIAL_HEADERS = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def half_open(port: int, count: int, payload: bytes = PARTIAL_HEADERS) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(payload)
        socks.append(s)
    return socks


def closed_by_engine(sock: socket.socket, timeout: float) -> bool:
    """The engine closed `sock` (EOF or a reset) within `timeout` s; whatever it answered first is read past."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_headers_that_never_finish_are_cut_off(engine, recorder):
    with recorder.case("slow_clients", "headers_never_finish", engine):
        with Footprint(engine) as footprint:
            socks = half_open(engine.port, 20)
            assert serving(engine)  # answered meanwhile
            closed = [closed_by_engine(s, 6) for s in socks]
        for s in socks:
            s.close()
        assert all(closed), closed.count(False)
        assert footprint.fds_after <= footprint.fds_before + 2
        normal_job_succeeds(engine)


def test_a_body_that_never_comes_is_not_waited_for(engine, recorder):
    with recorder.case("slow_clients", "body_never_sent", engine):
        (sock,) = half_open(engine.port, 1, b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
                                             b"1000000\r\n\r\npartial")
        started = time.monotonic()
        assert closed_by_engine(sock, 8)
        assert time.monotonic() - started < 6
        sock.close()
        assert serving(engine)


def test_a_websocket_without_hello_is_closed_after_the_timeout(engine, recorder):
    async def silent():
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(engine.url + "/v1/ws")
            started = time.monotonic()
            refused, closed = await next_control(ws, timeout=10), await next_control(ws, timeout=10)
            return refused, closed, time.monotonic() - started

    with recorder.case("slow_clients", "hello_never_sent", engine):
        refused, closed, seconds = asyncio.run(silent())
        assert refused["code"] == "bad_message" and "No hello within 2 s" in refused["message"]
        assert closed == {"type": "closed", "code": aiohttp.WSCloseCode.POLICY_VIOLATION} and seconds < 5
        assert serving(engine)


@pytest.fixture(scope="module")
def low_fd_engine(tmp_path_factory):
    """An engine whose fd limit is 256 (`ulimit -n 256`: set here, inherited by its process, restored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with start_engine(tmp_path_factory.mktemp("low_fd")) as running:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            yield running
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_300_half_open_connections_under_ulimit_256_leave_health_answering(low_fd_engine, recorder):
    engine = low_fd_engine
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= 400, "the test process itself needs room for 300 sockets"
    with open(f"/proc/{engine.process.pid}/limits") as f:
        assert any(line.startswith("Max open files") and line.split()[3] == "256" for line in f)
    cap = asyncio.run(engine.client().status())["connections"]["max"]
    with recorder.case("fd_exhaustion", "half_open_300_ulimit_256", engine):
        log_before = len(engine.log())
        socks = half_open(engine.port, 300)
        started = time.monotonic()
        answered = health(engine.port)
        health_s = time.monotonic() - started
        fds_held = open_fds(engine.process.pid)
        settle = time.monotonic() + 5  # on a loaded machine the engine may still be closing the over-cap ones
        while (open_now := sum(not closed_by_engine(s, 0.01) for s in socks)) > cap + ACCEPT_BACKLOG + 1:
            if time.monotonic() > settle:
                break
            time.sleep(0.2)
        for s in socks:
            s.close()
        log = engine.log()[log_before:]
        recorder.note(f"fd_exhaustion: ulimit -n 256, connection cap {cap}; with 300 half-open connections the "
                      f"engine held {fds_held} fds ({open_now} of the 300 still open), /v1/health answered in "
                      f"{1000 * health_s:.0f} ms; {len(log.splitlines())} log lines ({len(log)} bytes)")
        assert answered is not None and answered["state"] == "ready"
        # Connections still waiting in the kernel's accept queue are open from the client's side, not yet the engine's.
        assert fds_held < 256 and open_now <= cap + ACCEPT_BACKLOG + 1
        assert len(log.splitlines()) < 20 and "Traceback" not in log, log[-2000:]
        normal_job_succeeds(engine)
        assert serving(engine)


def test_accept_errors_are_logged_once_a_second_with_a_count(recorder, caplog, monkeypatch):
    from engine.server import cli

    now = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    handler, logger = cli.ThrottledExceptionLog(), logging.getLogger("h3forge")
    monkeypatch.setattr(logger, "propagate", False)  # caplog's handler sees each record once
    logger.addHandler(caplog.handler)
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with recorder.case("fd_exhaustion", "accept_error_flood"):
        try:
            for _ in range(10_000):  # what an exhausted listener reports in a tight loop
                handler(None, context)
            now[0] += 1.0
            handler(None, context)
        finally:
            logger.removeHandler(caplog.handler)
        lines = [r.fields for r in caplog.records if r.fields.get("event") == "loop.error"]
        assert [line["repeats"] for line in lines] == [0, 9_999]
        assert "Too many open files" in lines[0]["error"]
