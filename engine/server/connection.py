"""One client WebSocket: the hello handshake, the control messages, the tensor frames that follow a submit,
and an outbox drained by one writer task so a message and its binary frames always go out together.

Bad input never ends the engine: a malformed message, an oversized frame or a bad tensor gets an `error` and
the connection stays usable; only a failed handshake closes it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from engine import protocol
from engine.protocol import ProtocolError
from engine.runtime.jobs import JobSpec
from engine.runtime.log import log_event
from engine.server.auth import token_matches
from engine.server.store import FinishedJob

HELLO_TIMEOUT_S = 10.0
ENCODE_OFF_LOOP_BYTES = 1 << 20  # bigger tensors are encoded on a worker thread


@dataclass
class PendingSubmit:
    """A submit waiting for its tensor frames."""

    msg: dict
    names: list[str]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: ProtocolError | None = None
    received: int = 0


class Connection:
    def __init__(self, ws: web.WebSocketResponse, service, authorized: bool, peer: str):
        self.ws, self.service, self.peer = ws, service, peer
        self.authorized = authorized  # the upgrade request already carried the token
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pending: PendingSubmit | None = None
        self.discard = 0  # tensor frames of a rejected submit still to skip

    # ---- Subscriber ------------------------------------------------------------------------------------------
    def send(self, msg: dict, tensors: list[tuple[str, np.ndarray]] = ()) -> None:
        if not self.ws.closed:
            self.outbox.put_nowait((msg, list(tensors)))

    def deliver(self, finished: FinishedJob, mp4: bool) -> None:
        if self.ws.closed:
            return
        if finished.state == "done":
            self.outbox.put_nowait((finished, mp4))
        else:
            self.send(error_message(finished.error_code, finished.error_message, job=finished.job))

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        if not await self._handshake():
            return
        writer = asyncio.create_task(self._write_loop())
        try:
            await self._read_loop()
        finally:
            self.service.scheduler.unsubscribe(self)
            writer.cancel()

    async def _refuse(self, code: str, message: str) -> bool:
        log_event("connection.refused", logging.WARNING, peer=self.peer, code=code)
        try:
            await self.ws.send_str(protocol.encode_control(error_message(code, message)))
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=code.encode())
        except ConnectionError:
            pass  # the client is already gone
        return False

    async def _handshake(self) -> bool:
        try:
            first = await self.ws.receive(timeout=HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            return await self._refuse("bad_message", f"No hello within {HELLO_TIMEOUT_S:g} s.")
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
        log_event("connection.closed", peer=self.peer, code=self.ws.close_code)

    async def _write_loop(self) -> None:
        try:
            while True:
                item, extra = await self.outbox.get()
                if isinstance(item, FinishedJob):
                    msg, tensors = await result_message(item, extra)
                else:
                    msg, tensors = item, extra
                await self.ws.send_str(protocol.encode_control(msg))
                for name, array in tensors:
                    if array.nbytes > ENCODE_OFF_LOOP_BYTES:
                        data = await asyncio.to_thread(protocol.encode_tensor, name, array)
                    else:
                        data = protocol.encode_tensor(name, array)
                    await self.ws.send_bytes(data)
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
            params = protocol.validate_task(msg.get("task"), msg.get("params", {}), pending.tensors)
            if params.get("loras") and self.service.source.models_dir is None:
                raise ProtocolError("invalid_request", "This engine runs a preset and has no models folder, so it "
                                                       "takes no LoRA files: start it with --models DIR (LoRA paths "
                                                       "are read inside that folder only).")
            source = self.service.store.source(params["source_job"]) if "source_job" in params else None
            spec = JobSpec(self.service.scheduler.new_job_id(), msg["task"], params, pending.tensors, source,
                           mp4=bool(msg.get("mp4")))
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
        if not self.service.scheduler.cancel(str(msg.get("job"))):
            raise ProtocolError("unknown_job", f"No job {msg.get('job')!r} on this engine.")

    def _on_attach(self, msg: dict) -> None:
        job_id, scheduler = str(msg.get("job")), self.service.scheduler
        job = scheduler.active(job_id)
        if job is not None:
            job.subscribers[self] = bool(msg.get("mp4"))
            self.send({"type": "accepted", "id": msg.get("id"), "job": job.id, "position": scheduler.position(job)})
            if job.last_progress is not None:
                progress, preview = job.last_progress
                self.send(progress, [("preview", np.frombuffer(preview, np.uint8))] if preview else [])
            return
        finished = self.service.store.get(job_id)
        if finished is None:
            raise ProtocolError("unknown_job", (
                f"No job {job_id!r} on this engine: it never ran here, or its result expired (results are kept "
                f"{self.service.store.ttl_s / 60:g} minutes)."))
        self.deliver(finished, bool(msg.get("mp4")))


def error_message(code: str, message: str, **fields) -> dict:
    return {"type": "error", **{k: v for k, v in fields.items() if v is not None}, "code": code, "message": message}


async def result_message(finished: FinishedJob, mp4: bool) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    meta = finished.meta()
    tensors = [("frames", finished.frames)] + ([("audio", finished.audio)] if finished.audio is not None else [])
    if mp4:
        try:
            tensors.append(("mp4", np.frombuffer(await finished.mp4(), dtype=np.uint8)))
        except Exception as exc:  # the frames and audio still arrive
            log_event("result.mp4_failed", logging.ERROR, exc_info=exc, job=finished.job)
            meta["notes"] = [*meta["notes"], f"No MP4 with this result: encoding failed ({exc})."]
    return {"type": "result", "job": finished.job, "meta": meta, "tensors": [n for n, _ in tensors]}, tensors
