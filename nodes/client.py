"""Async client of the H3Forge engine (aiohttp). Imports engine.protocol only: no torch, no model code.

    client = EngineClient("ws://127.0.0.1:8190", token=...)
    result = await client.run("t2va", {"prompt": "...", "seconds": 5}, on_progress=print, cancel=event)

`run` submits a job, streams its progress, takes the result's frames as the engine streams them (`on_frames` sees
each chunk), sends `cancel` when the event is set, re-attaches to the job if the connection drops mid-job (asking
only for the frames it lacks), and returns a JobResult. Every failure is an EngineError whose message an artist can
act on.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

try:
    from ..engine import protocol  # inside ComfyUI the pack is loaded as one package
except ImportError:
    from engine import protocol  # the repository root on sys.path (tests, scripts)

RECONNECT_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # one reconnect attempt after each
CONNECT_RETRY_S = 0.5  # pause between connection attempts while nothing listens yet (an engine restarting)
OFF_LOOP_BYTES = 1 << 20  # tensors above this are checked and encoded on a worker thread
DEFLATED_TENSORS = ("mask",)  # sent zlib-compressed: a per-frame mask of a long clip is huge, and mostly runs
CANCEL_GRACE_S = 30.0  # how long to wait for the engine to confirm a cancel (it stops at the next step)
HEARTBEAT_S = 30.0  # WebSocket ping interval; no pong within half of it (a frozen engine) drops the connection


class EngineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class ProgressEvent:
    job: str
    stage: str  # "queued", "starting", "denoising", "decoding", "upscaling"
    step: int
    total: int
    eta_s: float | None
    preview_jpeg: bytes | None = None
    position: int | None = None  # jobs ahead, while queued
    detail: str | None = None  # e.g. "window 2/4" while extending


@dataclass
class JobResult:
    job: str
    # task, params, notes, fps, sample_rate, frames, width, height; timings: the engine's, and this client's
    # client_last_frame_s and client_result_s (seconds from the submit or attach to the last frame, to the result)
    meta: dict
    frames: np.ndarray  # uint8 [F, H, W, 3] (read-only where it is the received buffer itself)
    audio: np.ndarray | None  # float32 [C, S]; None for a silent clip (an upscaled video without sound)
    sample_rate: int
    fps: float  # 24 for MiniMax-H3 results; an upscale keeps its source's rate
    mp4: bytes | None = None


@dataclass
class _JobWatch:
    """One job being followed: what to call, whether a cancel was asked for, the result's frames so far."""

    on_progress: Callable[[ProgressEvent], Awaitable[None] | None] | None
    on_frames: Callable[[int, int, np.ndarray], Awaitable[None] | None] | None
    cancel: asyncio.Event | None
    deadline: float | None
    timeout: float | None
    mp4: bool
    started: float  # loop time of the submit or attach
    job: str | None = None
    ws: aiohttp.ClientWebSocketResponse | None = None
    cancel_deadline: float | None = None  # set once the cancel went out
    ended: bool = False  # the engine sent the job's result or error
    tasks: list[asyncio.Task] = field(default_factory=list)
    frames: np.ndarray | None = None  # uint8 [F, H, W, 3], filled as result_chunks arrive
    received: int = 0  # frames in hand, the first `received` of the result
    last_frame_at: float | None = None

    async def take(self, start: int, total: int, pixels: np.ndarray) -> None:
        """Frames [start, start + n) of the result's `total`; they must follow the ones in hand."""
        if start != self.received or start + len(pixels) > total or (
                self.frames is not None and (total, *pixels.shape[1:]) != self.frames.shape):
            raise EngineError("bad_response", f"The engine sent frames {start} to {start + len(pixels)} of "
                                              f"{total} of job {self.job} after {self.received} frames; expected the "
                                              f"next ones, in order.")
        if self.frames is None:
            self.frames = np.empty((total, *pixels.shape[1:]), np.uint8)
        target = self.frames[start:start + len(pixels)]
        if pixels.nbytes > OFF_LOOP_BYTES:
            await asyncio.to_thread(np.copyto, target, pixels)
        else:
            target[...] = pixels
        self.received += len(pixels)
        if self.received == total:
            self.last_frame_at = asyncio.get_running_loop().time()

    async def result_frames(self, start: int, total: int, rest: np.ndarray | None) -> np.ndarray:
        """All `total` frames of the result: those streamed, then the `rest` the result carries from `start` on."""
        if self.frames is None and start == 0 and rest is not None:  # nothing streamed: the received buffer itself
            self.received, self.last_frame_at = total, asyncio.get_running_loop().time()
            return rest
        if rest is not None:
            await self.take(start, total, rest)
        if self.received != total:
            raise EngineError("bad_response", f"The engine's result of job {self.job} holds {total} frames but "
                                              f"{self.received} arrived.")
        return self.frames


class _Dropped(Exception):
    """The WebSocket closed under us."""


class EngineClient:
    def __init__(self, url: str = protocol.DEFAULT_URL, token: str | None = None, connect_timeout: float = 5.0,
                 token_file: str | None = None, connect_wait: float | None = None):
        """`connect_timeout` bounds one connection attempt; attempts go on for `connect_wait` seconds in all
        (default 4 x connect_timeout) before the engine counts as unreachable."""
        parts = urlsplit(url if "://" in url else f"ws://{url}")
        if parts.scheme not in ("ws", "wss", "http", "https") or not parts.netloc:
            raise EngineError("bad_url", f"Engine URL {url!r} should look like ws://127.0.0.1:8190.")
        secure = parts.scheme in ("wss", "https")
        self.url = urlunsplit(("wss" if secure else "ws", parts.netloc, "", "", ""))
        self.http_url = urlunsplit(("https" if secure else "http", parts.netloc, "", "", ""))
        token_path = token_file or protocol.default_token_file()
        self.token = token or protocol.read_token(token_path)
        if token:
            self.token_source = "the given token"
        elif self.token:
            self.token_source = f"the token from {token_path}"
        else:
            self.token_source = f"a connection without a token (none given, and no token file at {token_path})"
        self.connect_timeout = connect_timeout
        self.connect_wait = 4 * connect_timeout if connect_wait is None else connect_wait

    # ---- HTTP ------------------------------------------------------------------------------------------------
    async def health(self) -> dict:
        return await self._get("/v1/health")

    async def status(self) -> dict:
        return await self._get("/v1/status")

    async def _get(self, path: str) -> dict:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}

        async def attempt():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as session:
                async with session.get(self.http_url + path, headers=headers) as response:
                    if response.status == 401:
                        raise self._auth_error()
                    if response.status != 200:
                        raise EngineError("bad_response", f"The engine at {self.url} answered HTTP {response.status} "
                                                          f"on {path}: is this an H3Forge engine?")
                    return await response.json()

        return await self._with_retries(attempt, f"GET {path}")

    async def _with_retries(self, attempt, what: str, wait: float | None = None):
        """Runs `attempt` until it gets through, for at most `wait` (default connect_wait) seconds. An attempt that
        finds nothing listening and one that reaches something which does not answer in time are told apart."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.connect_wait if wait is None else wait)
        while True:
            try:
                return await attempt()
            except (aiohttp.ClientConnectorError, ConnectionRefusedError):
                silent = False
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError):
                silent = True  # it connected (or the connect hung) but nothing answered within connect_timeout
            if loop.time() >= deadline:
                raise self._unreachable(silent, what)
            if not silent:
                await asyncio.sleep(min(CONNECT_RETRY_S, max(0.0, deadline - loop.time())))

    def _unreachable(self, silent: bool, what: str) -> EngineError:
        waited = f"tried for {self.connect_wait:g} s"
        if silent:
            return EngineError("unreachable", (
                f"Something at {self.url} accepts connections but did not answer {what} within "
                f"{self.connect_timeout:g} s ({waited}): the engine may be frozen or the port taken by another "
                f"program. Check the engine's log, or restart it."))
        return EngineError("unreachable", f"No H3Forge engine answers at {self.url} (nothing accepts connections "
                                          f"there; {waited}): start one with `python -m engine serve` or enable "
                                          f"auto-launch.")

    def _auth_error(self) -> EngineError:
        return EngineError("auth", f"The engine at {self.url} refused {self.token_source}. Use the token "
                                   f"from the engine host's token file (~/.h3forge/token unless it was started "
                                   f"with --token-file).")

    # ---- jobs ------------------------------------------------------------------------------------------------
    async def run(self, task: str, params: dict, tensors: dict[str, np.ndarray] | None = None,
                  on_progress=None, cancel: asyncio.Event | None = None, timeout: float | None = None,
                  mp4: bool = False, on_frames=None) -> JobResult:
        """Runs one job to its end. `on_progress(ProgressEvent)` and `on_frames(start, total, frames)` (the result's
        frames [start, start + n) of `total` as the engine streams them, in order, before the result; read-only) may be
        functions or coroutine functions."""
        tensors = {name: np.asarray(a) for name, a in (tensors or {}).items()}
        large = sum(a.nbytes for a in tensors.values()) > OFF_LOOP_BYTES
        try:  # same rules as the engine, without a round trip
            if large:
                await asyncio.to_thread(protocol.validate_task, task, params, tensors)
            else:
                protocol.validate_task(task, params, tensors)
        except protocol.ProtocolError as exc:
            raise EngineError(exc.code, exc.message) from None
        watch = self._watch(on_progress, on_frames, cancel, timeout, mp4)
        submit_id = uuid.uuid4().hex
        async with self._session() as session:
            watch.ws = await self._open(session)
            try:
                await watch.ws.send_str(protocol.encode_control({
                    "type": "submit", "id": submit_id, "task": task, "params": params,
                    "tensors": list(tensors), "mp4": mp4}))
                for name, array in tensors.items():
                    deflate = name in DEFLATED_TENSORS
                    frame = (await asyncio.to_thread(protocol.encode_tensor, name, array, deflate)
                             if array.nbytes > OFF_LOOP_BYTES else protocol.encode_tensor(name, array, deflate))
                    await watch.ws.send_bytes(frame)  # blocks the loop ~5 ms per MB (masking): frames stay small
                return await self._follow(session, watch)
            finally:
                await self._stop_watch(watch)

    async def attach(self, job_id: str, on_progress=None, cancel: asyncio.Event | None = None,
                     timeout: float | None = None, mp4: bool = False, on_frames=None) -> JobResult:
        """Follows a job submitted earlier (perhaps by another connection) to its end."""
        watch = self._watch(on_progress, on_frames, cancel, timeout, mp4)
        watch.job = job_id
        async with self._session() as session:
            try:
                watch.ws = await self._open(session)
                await self._send_attach(watch)
                return await self._follow(session, watch)
            finally:
                await self._stop_watch(watch)

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout))

    def _watch(self, on_progress, on_frames, cancel, timeout, mp4) -> _JobWatch:
        now = asyncio.get_running_loop().time()
        return _JobWatch(on_progress, on_frames, cancel, now + timeout if timeout else None, timeout, mp4, now)

    async def _open(self, session: aiohttp.ClientSession, wait: float | None = None
                    ) -> aiohttp.ClientWebSocketResponse:
        """Connects and greets (trying for `wait` seconds, default connect_wait); raises EngineError for an absent
        engine, a refused token or another version."""
        async def attempt():
            try:
                # Bounded per attempt: a frozen engine accepts the TCP connection but never answers the upgrade.
                return await asyncio.wait_for(session.ws_connect(
                    self.url + "/v1/ws", heartbeat=HEARTBEAT_S, max_msg_size=protocol.MAX_RESULT_TENSOR_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0)), self.connect_timeout)
            except aiohttp.WSServerHandshakeError as exc:
                raise EngineError("bad_response", f"The server at {self.url} refused the WebSocket (HTTP "
                                                  f"{exc.status}): is this an H3Forge engine?") from None

        ws = await self._with_retries(attempt, "the WebSocket upgrade", wait)
        await ws.send_str(protocol.encode_control({
            "type": "hello", "id": uuid.uuid4().hex, "version": protocol.PROTOCOL_VERSION, "token": self.token}))
        try:
            msg, _ = await _receive(ws, self.connect_timeout)
        except (_Dropped, asyncio.TimeoutError):
            await ws.close()
            raise EngineError("unreachable", f"The engine at {self.url} did not answer the hello within "
                                             f"{self.connect_timeout:g} s.") from None
        if msg["type"] == "error":
            await ws.close()
            if msg["code"] == "auth":
                raise self._auth_error()
            raise EngineError(msg["code"], msg["message"])
        if msg["type"] != "welcome":
            await ws.close()
            raise EngineError("bad_response", f"The engine at {self.url} answered the hello with {msg['type']!r}.")
        return ws

    async def _send_attach(self, watch: _JobWatch) -> None:
        await watch.ws.send_str(protocol.encode_control({"type": "attach", "id": uuid.uuid4().hex, "job": watch.job,
                                                         "mp4": watch.mp4, "frames": watch.received}))

    async def _follow(self, session: aiohttp.ClientSession, watch: _JobWatch) -> JobResult:
        if watch.cancel is not None:
            watch.tasks.append(asyncio.create_task(self._cancel_when_set(watch)))
        reconnects = iter(RECONNECT_DELAYS_S)
        while True:
            try:
                msg, frames = await _receive(watch.ws, self._remaining(watch))
            except asyncio.TimeoutError:
                if watch.cancel_deadline is not None:
                    raise EngineError("cancelled", f"Cancelled (the engine had not confirmed within "
                                                   f"{CANCEL_GRACE_S:g} s).") from None
                raise EngineError("timeout", f"The engine did not finish the job within {watch.timeout:g} s; "
                                             f"it was cancelled.") from None
            except _Dropped:
                if watch.job is None:
                    raise EngineError("disconnected", f"The connection to {self.url} dropped before the engine "
                                                      f"accepted the job.") from None
                delay = next(reconnects, None)
                if delay is None:
                    raise EngineError("disconnected", f"Lost the connection to {self.url} during job {watch.job} "
                                                      f"and could not reconnect.") from None
                await asyncio.sleep(delay)
                try:  # one attempt per delay: the schedule itself spaces the retries
                    watch.ws = await self._open(session, wait=0.0)
                except EngineError as exc:
                    if exc.code != "unreachable":
                        raise
                    continue  # the old socket reports the drop again: next attempt
                await self._send_attach(watch)
                if watch.cancel_deadline is not None:
                    await self._send_cancel(watch)
                continue
            result = await self._handle(watch, msg, frames)
            if result is not None:
                return result

    async def _handle(self, watch: _JobWatch, msg: dict, frames: dict) -> JobResult | None:
        kind = msg["type"]
        if kind == "accepted":
            watch.job = msg["job"]
            if watch.cancel is not None and watch.cancel.is_set() and watch.cancel_deadline is None:
                await self._send_cancel(watch)
        elif kind == "error" and msg.get("job") in (None, watch.job):
            watch.ended = msg.get("job") is not None
            raise EngineError(msg["code"], msg["message"])
        elif kind == "progress" and msg["job"] == watch.job and watch.on_progress is not None:
            preview = frames.get("preview")
            event = ProgressEvent(msg["job"], msg["stage"], msg["step"], msg["total"], msg.get("eta_s"),
                                  preview.tobytes() if preview is not None else None, msg.get("position"),
                                  msg.get("detail"))
            outcome = watch.on_progress(event)
            if inspect.isawaitable(outcome):
                await outcome
        elif kind == "result_chunk" and msg["job"] == watch.job:
            await watch.take(msg["start"], msg["total"], frames["frames"])
            if watch.on_frames is not None:
                outcome = watch.on_frames(msg["start"], msg["total"], frames["frames"])
                if inspect.isawaitable(outcome):
                    await outcome
        elif kind == "result" and msg["job"] == watch.job:
            watch.ended = True
            if watch.cancel_deadline is not None:  # it finished before the cancel took effect
                raise EngineError("cancelled", "Cancelled.")
            meta, mp4 = msg["meta"], frames.get("mp4")
            video = await watch.result_frames(msg["start"], meta["frames"], frames.get("frames"))
            now = asyncio.get_running_loop().time()
            meta["timings"] = {**meta["timings"], "client_last_frame_s": round(watch.last_frame_at - watch.started, 3),
                               "client_result_s": round(now - watch.started, 3)}
            return JobResult(msg["job"], meta, video, frames.get("audio"), int(meta["sample_rate"]),
                             float(meta["fps"]), mp4.tobytes() if mp4 is not None else None)
        return None

    def _remaining(self, watch: _JobWatch) -> float | None:
        ends = [t for t in (watch.deadline, watch.cancel_deadline) if t is not None]
        return max(0.0, min(ends) - asyncio.get_running_loop().time()) if ends else None

    async def _cancel_when_set(self, watch: _JobWatch) -> None:
        await watch.cancel.wait()
        if watch.job is not None and watch.cancel_deadline is None:  # else sent when `accepted` arrives
            await self._send_cancel(watch)

    async def _send_cancel(self, watch: _JobWatch) -> None:
        if watch.cancel_deadline is None:
            watch.cancel_deadline = asyncio.get_running_loop().time() + CANCEL_GRACE_S
        try:
            await watch.ws.send_str(protocol.encode_control(
                {"type": "cancel", "id": uuid.uuid4().hex, "job": watch.job}))
        except (ConnectionError, RuntimeError):
            pass  # sent again after the reconnect

    async def _stop_watch(self, watch: _JobWatch) -> None:
        """Closes the connection; a job abandoned before its end (timeout, task cancelled, callback error) is
        cancelled on the engine, since nobody will collect it."""
        for task in watch.tasks:
            task.cancel()
        if watch.ws is None or watch.ws.closed:
            return
        try:
            if watch.job is not None and not watch.ended:
                await asyncio.wait_for(asyncio.shield(watch.ws.send_str(protocol.encode_control(
                    {"type": "cancel", "id": uuid.uuid4().hex, "job": watch.job}))), 2.0)
            await asyncio.wait_for(asyncio.shield(watch.ws.close()), 5.0)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError, asyncio.CancelledError):
            pass


async def _receive(ws: aiohttp.ClientWebSocketResponse, timeout: float | None) -> tuple[dict, dict[str, np.ndarray]]:
    """The next control message from the engine and the binary frames that follow it."""
    msg = _control(await _next(ws, timeout))
    frames = {}
    for expected in protocol.frames_following(msg):
        data = await _next(ws, timeout)
        if data.type != aiohttp.WSMsgType.BINARY:
            raise EngineError("bad_response", f"The engine sent a control message where tensor {expected!r} "
                                              f"should have come.")
        try:
            name, array = protocol.decode_tensor(data.data)
        except protocol.ProtocolError as exc:
            raise EngineError("bad_response", f"The engine sent a bad tensor: {exc.message}") from None
        frames[name] = array
    return msg, frames


async def _next(ws: aiohttp.ClientWebSocketResponse, timeout: float | None) -> aiohttp.WSMessage:
    message = await ws.receive(timeout=timeout)
    if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                        aiohttp.WSMsgType.ERROR):
        raise _Dropped()
    return message


def _control(message: aiohttp.WSMessage) -> dict:
    if message.type != aiohttp.WSMsgType.TEXT:
        raise EngineError("bad_response", "The engine sent a binary frame where a control message should have come.")
    try:
        return protocol.decode_control(message.data, types=protocol.ENGINE_TYPES)
    except protocol.ProtocolError as exc:
        raise EngineError("bad_response", f"The engine sent a bad message: {exc.message}") from None
