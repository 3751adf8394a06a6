"""One client WebSocket: the hello handshake, the control messages, the tensor frames that follow a submit,
and an outbox drained by one writer task so a message and its binary frames always go out together.

Bad input never ends the engine: a malformed message, an oversized frame or a bad tensor gets an `error` and
the connection stays usable. A failed handshake closes it, and so does a client that sends more messages a second
than the engine's limits allow or lets more replies pile up than it may (it does not read them): each with a close
frame giving the reason.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass, field

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from engine import protocol
from engine.protocol import ProtocolError
from engine.runtime.jobs import JobSpec
from engine.runtime.log import log_event
from engine.server.auth import token_matches
from engine.server.cost import check_cost
from engine.server.store import FinishedJob

ENCODE_OFF_LOOP_BYTES = 1 << 20  # bigger tensors are encoded on a worker thread
CLOSE_TIMEOUT_S = 1.0  # for the close handshake of a connection the engine ends; then the socket is dropped


@dataclass
class Delivery:
    """A finished job's result for this client: with the MP4 or not, its frames from `start` on."""

    finished: FinishedJob
    mp4: bool
    start: int


@dataclass
class PendingSubmit:
    """A submit waiting for its tensor frames."""

    msg: dict
    names: list[str]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: ProtocolError | None = None
    received: int = 0


class RateLimit:
    """A token bucket: `rate` messages a second on average, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.allowance, self.last = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.allowance = min(self.burst, self.allowance + (now - self.last) * self.rate)
        self.last = now
        if self.allowance < 1:
            return False
        self.allowance -= 1
        return True


class Connection:
    def __init__(self, ws: web.WebSocketResponse, service, authorized: bool, peer: str,
                 transport: asyncio.Transport | None = None):
        self.ws, self.service, self.peer, self.transport = ws, service, peer, transport
        self.authorized = authorized  # the upgrade request already carried the token
        self.outbox: asyncio.Queue = asyncio.Queue()  # bounded by limits.max_pending_replies (see _queue)
        self.pending: PendingSubmit | None = None
        self.discard = 0  # tensor frames of a rejected submit still to skip
        limits = service.limits
        self.rate = RateLimit(limits.max_messages_per_s, limits.message_burst)
        self.closing: asyncio.Task | None = None
        self.sending = False  # the writer holds a message taken from the outbox

    # ---- Subscriber ------------------------------------------------------------------------------------------
    def send(self, msg: dict, tensors: list[tuple[str, np.ndarray]] = ()) -> None:
        self._queue((msg, list(tensors)))

    def deliver(self, finished: FinishedJob, mp4: bool, start: int = 0) -> None:
        if finished.state == "done":
            self._queue(Delivery(finished, mp4, start))
        else:
            self.send(error_message(finished.error_code, finished.error_message, job=finished.job))

    def _queue(self, item) -> None:
        if self.ws.closed or self.closing is not None:
            return
        limit = self.service.limits.max_pending_replies
        if self.outbox.qsize() >= limit:
            self.close(WSCloseCode.POLICY_VIOLATION, "slow_reader", f"the client left {limit} replies unread")
            return
        self.outbox.put_nowait(item)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        if not await self._handshake():
            return
        self.service.connections.add(self)
        writer = asyncio.create_task(self._write_loop())
        try:
            await self._read_loop()
        finally:
            self.service.connections.discard(self)
            self.service.scheduler.unsubscribe(self)
            writer.cancel()
            if self.closing is not None:
                await asyncio.shield(self.closing)

    def close(self, code: int, reason: str, detail: str) -> asyncio.Task:
        """Ends this connection with a close frame carrying `reason` (a short code for the client to show); a
        client that does not take the close frame within CLOSE_TIMEOUT_S loses its socket."""
        if self.closing is None:
            log_event("connection.closing", logging.WARNING if code != WSCloseCode.GOING_AWAY else logging.INFO,
                      peer=self.peer, reason=reason, detail=detail)
            self.closing = asyncio.create_task(self._close(code, reason))
        return self.closing

    async def _close(self, code: int, reason: str) -> None:
        try:
            if code == WSCloseCode.POLICY_VIOLATION:  # a flood or a client not reading: no close handshake to wait for
                frame = struct.pack("!H", code) + reason.encode()
                await asyncio.wait_for(self.ws.send_frame(frame, WSMsgType.CLOSE), CLOSE_TIMEOUT_S)
            else:
                await asyncio.wait_for(self.ws.close(code=code, message=reason.encode()), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            pass
        if self.transport is not None:
            self.transport.abort()

    async def flush(self, timeout: float) -> None:
        """Waits up to `timeout` s for the replies already queued to go out."""
        deadline = time.monotonic() + timeout
        while (self.outbox.qsize() or self.sending) and time.monotonic() < deadline and not self.ws.closed:
            await asyncio.sleep(0.02)

    async def _refuse(self, code: str, message: str) -> bool:
        log_event("connection.refused", logging.WARNING, peer=self.peer, code=code)
        try:
            await self.ws.send_str(protocol.encode_control(error_message(code, message)))
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=code.encode())
        except ConnectionError:
            pass  # the client is already gone
        return False

    async def _handshake(self) -> bool:
        timeout = self.service.limits.hello_timeout_s
        try:
            first = await self.ws.receive(timeout=timeout)
        except asyncio.TimeoutError:
            return await self._refuse("bad_message", f"No hello within {timeout:g} s.")
        if first.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            return False
        if first.type != WSMsgType.TEXT:
            return await self._refuse("bad_message", "The first message must be a hello.")
        try:
            msg = protocol.decode_control(first.data, self.service.limits)
        except ProtocolError as exc:
            return await self._refuse(exc.code, exc.message)
        if msg["type"] != "hello":
            return await self._refuse("bad_message", f"The first message must be a hello, got {msg['type']!r}.")
        if not (self.authorized or token_matches(msg.get("token"), self.service.token)):
            return await self._refuse("auth", "The engine refused the token: it is missing or wrong.")
        if msg.get("version") != protocol.PROTOCOL_VERSION:
            return await self._refuse("version", (
                f"This engine speaks protocol version {protocol.PROTOCOL_VERSION} and the client "
                f"{msg.get('version')}: update the H3Forge nodes and engine to the same release."))
        await self.ws.send_str(protocol.encode_control({
            "type": "welcome", "id": msg.get("id"), "version": protocol.PROTOCOL_VERSION,
            "limits": self.service.limits.to_dict(), "engine": self.service.engine_info()}))
        log_event("connection.open", peer=self.peer)
        return True

    async def _read_loop(self) -> None:
        async for message in self.ws:
            if self.closing is not None:
                break  # what the client still sends is not even read
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY) and not self.rate.take():
                limits = self.service.limits
                self.close(WSCloseCode.POLICY_VIOLATION, "rate_limit", (
                    f"more than {limits.max_messages_per_s:g} messages a second (bursts of {limits.message_burst})"))
                continue
            if message.type == WSMsgType.TEXT:
                if self.pending is not None:
                    self._reply_error(self.pending.msg, ProtocolError("bad_message", (
                        f"The submit announced {len(self.pending.names)} tensor frame(s) but sent "
                        f"{self.pending.received} before its next control message.")))
                    self.pending = None
                self.discard = 0
                self._on_control(message.data)
            elif message.type == WSMsgType.BINARY:
                self._on_tensor(message.data)
            elif message.type == WSMsgType.ERROR:
                log_event("connection.error", logging.WARNING, peer=self.peer, error=str(self.ws.exception()))
            await asyncio.sleep(0)  # messages already buffered would otherwise be handled without a pause for others
        log_event("connection.closed", peer=self.peer, code=self.ws.close_code)

    async def _write_loop(self) -> None:
        try:
            while True:
                item = await self.outbox.get()
                self.sending = True
                if isinstance(item, Delivery):
                    msg, tensors = await result_message(item)
                    if item.mp4:
                        self.service.store.kept_mp4(item.finished)
                else:
                    msg, tensors = item
                await self.ws.send_str(protocol.encode_control(msg))
                for name, array in tensors:
                    if array.nbytes > ENCODE_OFF_LOOP_BYTES:
                        data = await asyncio.to_thread(protocol.encode_tensor, name, array)
                    else:
                        data = protocol.encode_tensor(name, array)
                    await self.ws.send_bytes(data)
                self.sending = False
        except (ConnectionError, RuntimeError) as exc:  # the client went away mid-send
            log_event("connection.send_failed", logging.WARNING, peer=self.peer, error=str(exc))
            await self.ws.close()

    # ---- incoming --------------------------------------------------------------------------------------------
    def _reply_error(self, request: dict | None, exc: ProtocolError) -> None:
        self.send(error_message(exc.code, exc.message, id=(request or {}).get("id")))

    def _on_control(self, text: str) -> None:
        try:
            msg = protocol.decode_control(text, self.service.limits)
        except ProtocolError as exc:
            log_event("request.rejected", logging.WARNING, peer=self.peer, code=exc.code)
            self._reply_error(None, exc)
            return
        handler = getattr(self, f"_on_{msg['type']}")
        try:
            handler(msg)
        except ProtocolError as exc:
            log_event("request.rejected", logging.WARNING, peer=self.peer, type=msg["type"], code=exc.code,
                      message=exc.message)
            self._reply_error(msg, exc)

    def _on_hello(self, msg: dict) -> None:
        raise ProtocolError("bad_message", "Already greeted: send hello once, first.")

    def _on_status(self, msg: dict) -> None:
        self.send({"type": "status", "id": msg.get("id"), **self.service.status()})

    def _on_submit(self, msg: dict) -> None:
        names = msg.get("tensors") or []
        limits = self.service.limits
        self.discard = len(names) if isinstance(names, list) else 0  # if rejected here, skip its frames quietly
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ProtocolError("bad_message", "'tensors' must be a list of distinct names.")
        if len(names) > limits.max_tensors:
            raise ProtocolError("too_large", f"A submit may carry at most {limits.max_tensors} tensors, "
                                             f"got {len(names)}.")
        self.pending, self.discard = PendingSubmit(msg, names), 0
        if not names:
            self._submit_ready()

    def _on_tensor(self, data: bytes) -> None:
        pending = self.pending
        if pending is None:
            if self.discard:
                self.discard -= 1
                return
            self._reply_error(None, ProtocolError("bad_message", "Unexpected binary frame: no submit is waiting "
                                                                 "for tensors."))
            return
        expected = pending.names[pending.received]
        pending.received += 1
        if pending.error is None:
            try:
                name, array = protocol.decode_tensor(data, self.service.limits)
                if name != expected:
                    raise ProtocolError("bad_tensor", f"Expected tensor {expected!r} next, got {name!r}.")
                pending.tensors[name] = array
            except ProtocolError as exc:
                pending.error = exc
        if pending.received == len(pending.names):
            self._submit_ready()

    def _submit_ready(self) -> None:
        pending, self.pending = self.pending, None
        msg = pending.msg
        try:
            if pending.error is not None:
                raise pending.error
            mp4 = protocol.flag_field(msg, "mp4")
            params = protocol.validate_task(msg.get("task"), msg.get("params", {}), pending.tensors)
            if params.get("loras") and not self.service.source.lora_roots():
                raise ProtocolError("invalid_request", "This engine has no models folder, so it takes no LoRA "
                                                       "files: start it with --models DIR or --model-path "
                                                       "loras=DIR (LoRA files are read inside those folders only).")
            source = self.service.store.source(params["source_job"]) if "source_job" in params else None
            check_cost(msg["task"], params, pending.tensors, source, self.service.limits, self.service.canvas)
            spec = JobSpec(self.service.scheduler.new_job_id(), msg["task"], params, pending.tensors, source,
                           mp4=mp4)
            job, position = self.service.scheduler.submit(spec, self, spec.mp4)
        except ProtocolError as exc:
            log_event("request.rejected", logging.WARNING, peer=self.peer, type="submit", code=exc.code,
                      message=exc.message)
            self._reply_error(msg, exc)
            return
        except Exception as exc:  # a rule tripped over input it did not foresee: this submit fails, not the connection
            log_event("request.failed", logging.ERROR, exc_info=exc, peer=self.peer, type="submit")
            self._reply_error(msg, ProtocolError("bad_message", f"The engine could not read this submit "
                                                                f"({type(exc).__name__}: {str(exc)[:200]})."))
            return
        self.send({"type": "accepted", "id": msg.get("id"), "job": job.id, "position": position})

    def _on_cancel(self, msg: dict) -> None:
        job_id = protocol.job_id(msg.get("job"))
        if not self.service.scheduler.cancel(job_id):
            raise ProtocolError("unknown_job", f"No job {job_id} on this engine.")

    def _on_attach(self, msg: dict) -> None:
        """Follows a job again: what it streamed past the client's `frames` first, then as it goes on."""
        job_id, scheduler = protocol.job_id(msg.get("job")), self.service.scheduler
        mp4, held = protocol.flag_field(msg, "mp4"), protocol.count_field(msg, "frames")
        job = scheduler.active(job_id)
        if job is not None:
            _check_held(job_id, held, job.streamed)
            job.subscribers[self] = mp4
            self.send({"type": "accepted", "id": msg.get("id"), "job": job.id, "position": scheduler.position(job)})
            for chunk in job.chunks_after(held):
                self.send(*chunk)
            if job.last_progress is not None:
                progress, preview = job.last_progress
                self.send(progress, [("preview", np.frombuffer(preview, np.uint8))] if preview else [])
            return
        finished = self.service.store.get(job_id)
        if finished is None:
            raise ProtocolError("unknown_job", (
                f"No job {job_id!r} on this engine: it never ran here, or its result expired (results are kept "
                f"{self.service.store.ttl_s / 60:g} minutes)."))
        if finished.state == "done":
            _check_held(job_id, held, len(finished.frames))
        self.deliver(finished, mp4, held)


def _check_held(job_id: str, held: int, available: int) -> None:
    if held > available:
        raise ProtocolError("invalid_request", f"The attach says the client holds {held} frames of job {job_id}, "
                                               f"but the engine has made {available}.")


def error_message(code: str, message: str, **fields) -> dict:
    return {"type": "error", **{k: v for k, v in fields.items() if v is not None}, "code": code, "message": message}


async def result_message(delivery: Delivery) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    finished, start = delivery.finished, delivery.start
    meta = finished.meta()
    tensors = [("frames", finished.frames[start:])] if start < len(finished.frames) else []
    tensors += [("audio", finished.audio)] if finished.audio is not None else []
    if delivery.mp4:
        try:
            tensors.append(("mp4", np.frombuffer(await finished.mp4(), dtype=np.uint8)))
        except Exception as exc:  # the frames and audio still arrive
            log_event("result.mp4_failed", logging.ERROR, exc_info=exc, job=finished.job)
            meta["notes"] = [*meta["notes"], f"No MP4 with this result: encoding failed ({exc})."]
    return {"type": "result", "job": finished.job, "start": start, "meta": meta,
            "tensors": [n for n, _ in tensors]}, tensors
