"""What the reliability suites share beyond tests/engine_fixture.py and tests/test_server.py: a WebSocket spoken
byte by byte (to stop halfway through a frame), a slow localhost proxy, the engine's processes, and polling."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import time
import urllib.request

from engine import protocol

TEXT, BINARY, CLOSE = 0x1, 0x2, 0x8


async def wait_until(condition, timeout: float, what: str, interval: float = 0.02) -> None:
    """Polls `condition()` until it is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=5) as response:
            return json.load(response)
    except OSError:
        return None


def serving(engine) -> bool:
    return (health(engine.port) or {}).get("state") == "ready"


class RawWebSocket:
    """A client WebSocket written by hand (RFC 6455): the upgrade, masked frames (a zero mask), and frames that
    announce more bytes than they carry, then a hard close, as a client killed mid-upload would leave them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, token: str) -> "RawWebSocket":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        ws = cls(reader, writer)
        await ws.send_json({"type": "hello", "id": "h", "version": protocol.PROTOCOL_VERSION, "token": token})
        assert (await ws.next_control())["type"] == "welcome"
        return ws

    def _frame(self, opcode: int, payload: bytes, declared: int | None = None) -> bytes:
        n = len(payload) if declared is None else declared
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        return head + b"\0\0\0\0" + payload  # a zero masking key leaves the payload as it is

    async def send_json(self, msg: dict) -> None:
        self.writer.write(self._frame(TEXT, json.dumps(msg).encode()))
        await self.writer.drain()

    async def send_partial_binary(self, data: bytes, sent: int) -> None:
        """A binary frame announcing len(data) bytes, of which only the first `sent` go out."""
        self.writer.write(self._frame(BINARY, data[:sent], declared=len(data)))
        await self.writer.drain()

    async def next_control(self, timeout: float = 30) -> dict:
        """The next text frame from the engine, skipping binary frames (previews, result tensors); a close frame
        as {"type": "closed", "code": ...}."""
        while True:
            first, second = await asyncio.wait_for(self.reader.readexactly(2), timeout)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack("!H", await self.reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
            payload = await asyncio.wait_for(self.reader.readexactly(n), timeout)
            if first & 0x0F == TEXT:
                return json.loads(payload)
            if first & 0x0F == CLOSE:
                return {"type": "closed", "code": struct.unpack("!H", payload[:2])[0] if payload else None}

    def kill(self) -> None:
        """Drops the TCP connection without a closing handshake (a reset, as when the client process dies)."""
        self.writer.transport.abort()


class SlowProxy:
    """A localhost TCP proxy that forwards the client's bytes in small, slow chunks (a slow upload) and calls
    `on_upload(total bytes so far)` as they pass; the engine's bytes go back at full speed."""

    def __init__(self, target_port: int, on_upload, chunk: int = 64 * 1024, delay_s: float = 0.02):
        self.target_port, self.on_upload, self.chunk, self.delay_s = target_port, on_upload, chunk, delay_s
        self.uploaded = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def upload():
            while data := await reader.read(self.chunk):
                up_writer.write(data)
                await up_writer.drain()
                self.uploaded += len(data)
                self.on_upload(self.uploaded)
                await asyncio.sleep(self.delay_s)
            up_writer.close()

        async def download():
            while data := await up_reader.read(1 << 20):
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(upload(), download(), return_exceptions=True)


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, IndexError):
                pass
    return children


def rank_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks torchrun started for an engine (`serve --gpus N`)."""
    ranks = {}
    for pid in child_pids(agent_pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _status_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(key))
    return int(line.split()[1]) * 1024


def rss_bytes(pid: int) -> int:
    return _status_bytes(pid, "VmRSS:")


def peak_rss_bytes(pid: int) -> int:
    """The process's RSS high-water mark (VmHWM)."""
    return _status_bytes(pid, "VmHWM:")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


NORMAL_JOB = {"prompt": "a normal job after the fault", "steps": 2, "width": 32, "height": 32}


def normal_job_succeeds(engine) -> None:
    """A small t2va job on `engine` ends with its result."""
    import asyncio

    result = asyncio.run(asyncio.wait_for(engine.client().run("t2va", NORMAL_JOB), 120))
    assert result.frames.shape == (124, 32, 32, 3), result.frames.shape


class Footprint:
    """The engine's RSS and open descriptors around a case: `with Footprint(engine) as f: ...`, then f.growth
    (bytes of RSS added) and f.fds_after."""

    def __init__(self, engine):
        self.pid = engine.process.pid

    def __enter__(self):
        self.rss_before, self.fds_before = rss_bytes(self.pid), open_fds(self.pid)
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.seconds = time.monotonic() - self.started
        self.growth = rss_bytes(self.pid) - self.rss_before
        self.fds_after = open_fds(self.pid)
