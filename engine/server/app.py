"""The engine's HTTP side on rank 0 (aiohttp): /v1/ws, /v1/health, /v1/status, the dashboard at /, and result
MP4s for the dashboard's <video> elements. Every route but /v1/health needs the token; the WebSocket may also
give it in its hello."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

from engine import protocol
from engine.runtime.jobs import ModelSource
from engine.models.h3.pipeline import Canvas
from engine.runtime.ranks import RankContext
from engine.server.auth import request_token, token_matches
from engine.server.connection import Connection
from engine.server.scheduler import Scheduler
from engine.server.store import ResultStore

DASHBOARD = Path(__file__).with_name("dashboard.html")
OPEN_ROUTES = ("/v1/health", "/v1/ws")  # the WebSocket checks its token in the hello
TRANSPORT_SLACK_BYTES = 8 * 2**20  # frames up to limit + slack get a polite `error`; past that aiohttp closes (1009)
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class EngineService:
    """Everything the routes need."""

    ctx: RankContext
    source: ModelSource
    token: str
    limits: protocol.Limits
    scheduler: Scheduler
    store: ResultStore
    canvas: Canvas
    started_at: float = field(default_factory=time.time)
    connections: set = field(default_factory=set)  # open WebSocket Connections (closed with a reason on shutdown)
    max_connections: int | None = None  # TCP connections at once (engine.server.guard), announced in status

    def engine_info(self) -> dict:
        return {"state": self.scheduler.state, "source": self.source.describe(), "device": str(self.ctx.device),
                "ranks": self.ctx.world_size, "backend": self.ctx.backend,
                "uptime_s": round(time.time() - self.started_at, 1)}

    def status(self) -> dict:
        scheduler = self.scheduler
        running = scheduler.running
        return {
            "version": protocol.PROTOCOL_VERSION,
            "engine": self.engine_info(),
            "models": scheduler.describe_models(),
            "gpu": gpu_memory(self.ctx.device),
            "running": running.status(0) if running is not None else None,
            "queue": [job.status(scheduler.position(job)) for job in scheduler.queue],
            "recent": [finished.summary() for finished in self.store.recent()],
            "store": {"jobs": len(self.store), "results": self.store.results, "bytes": self.store.nbytes, "max_bytes": self.store.max_bytes,
                      "max_jobs": self.store.max_entries, "ttl_s": self.store.ttl_s,
                      "failed_ttl_s": self.store.failed_ttl_s},
            "connections": {"open": len(self.connections), "max": self.max_connections},
            "counters": dict(scheduler.counters),
            "limits": self.limits.to_dict(),
        }


def gpu_memory(device: torch.device) -> dict | None:
    """Memory of this rank's GPU (rank 0's; other ranks' GPUs are not queried from here)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"name": torch.cuda.get_device_name(device), "used_bytes": total - free, "total_bytes": total,
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device)}


@web.middleware
async def require_token(request: web.Request, handler):
    if (guard := request.app.get("guard")) is not None:
        guard.saw_request(request)
    if request.path in OPEN_ROUTES or token_matches(request_token(request), request.app["service"].token):
        return await handler(request)
    if request.path == "/":
        return web.Response(status=401, content_type="text/html", text=(
            "<!doctype html><title>H3Forge engine</title><p>This engine needs its token. Open the dashboard link "
            "the engine printed when it started (<code>http://host:port/?token=...</code>), or add "
            "<code>?token=</code> with the contents of the engine's token file.</p>"))
    return web.json_response({"error": {"code": "auth", "message": "Missing or wrong token: send "
                              "'Authorization: Bearer <token>' or ?token=<token>."}}, status=401)


async def health(request: web.Request) -> web.Response:
    service: EngineService = request.app["service"]
    return web.json_response({"ok": service.scheduler.state in ("loading", "ready"), "engine": "h3forge",
                              "state": service.scheduler.state, "version": protocol.PROTOCOL_VERSION})


async def status(request: web.Request) -> web.Response:
    """`?tensors=1` adds the tensors held since the models loaded (slow: it walks the heap)."""
    body = request.app["service"].status()
    if request.query.get("tensors") == "1":
        body["tensors"] = await asyncio.to_thread(held_tensors)
    return web.json_response(body)


def held_tensors() -> dict:
    """Count and bytes of the tensor storages alive beyond the models: the engine froze the objects it had once
    its models loaded (gc.freeze), so the collector's generations hold only what jobs and results made since; a
    failed job must leave this where it was."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
    return {"count": len(storages), "bytes": sum(storages.values())}


async def models(request: web.Request) -> web.Response:
    """The model files this engine can load, by ComfyUI folder, each with its kind and format (headers only)."""
    source = request.app["service"].source
    roots = source.roots()
    if not any(roots.folders.values()):
        return web.json_response({"root": None, "folders": {}, "note": "this engine was given no models folder"})
    listing = await asyncio.to_thread(roots.listing)  # reads a header per file: keep the loop free
    return web.json_response({"root": Path(source.models_dir).name if source.models_dir else None,
                              "folders": listing})


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(text=DASHBOARD.read_text(), content_type="text/html")


async def result_mp4(request: web.Request) -> web.StreamResponse:
    service: EngineService = request.app["service"]
    job = request.match_info["job"]
    finished = service.store.get(job) if _JOB_ID.match(job) else None
    if finished is None or finished.state != "done":
        raise web.HTTPNotFound(text=f"No finished result for job {protocol.shown(job)} (results are kept "
                                    f"{service.store.ttl_s / 60:g} minutes).")
    data = await finished.mp4()
    service.store.kept_mp4(finished)
    headers = {"Accept-Ranges": "bytes", "Cache-Control": "private, max-age=3600"}
    start, end = _byte_range(request.headers.get("Range"), len(data))
    if (start, end) == (0, len(data)):
        return web.Response(body=data, content_type="video/mp4", headers=headers)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
    return web.Response(status=206, body=data[start:end], content_type="video/mp4", headers=headers)


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a single `bytes=a-b` range (what <video> asks for), by RFC 9110 14.1: a last position past
    the end means the end, a range that starts past the end or a suffix of 0 bytes is unsatisfiable (416); a header
    that is not one such range is ignored (the whole body)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "", re.IGNORECASE)
    if m is None or (not m.group(1) and not m.group(2)):
        return 0, size
    first, last = (_position(g, size) for g in m.groups())
    if not m.group(1):  # the last `last` bytes
        start, end = max(0, size - last), size
        satisfiable = last > 0
    else:
        start, end = first, min(size, last + 1) if m.group(2) else size
        if m.group(2) and last < first:
            return 0, size  # an invalid range: ignored
        satisfiable = start < size
    if not satisfiable or start >= end:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _position(digits: str, size: int) -> int:
    """A byte position of a Range header; one of more digits than the body's size has stands for 'past the end'
    (Python would refuse to parse thousands of digits)."""
    digits = digits.lstrip("0") or ("0" if digits else "")
    return int(digits) if digits and len(digits) <= len(str(size)) else (size + 1 if digits else 0)


async def websocket(request: web.Request) -> web.WebSocketResponse:
    service: EngineService = request.app["service"]
    ws = web.WebSocketResponse(max_msg_size=service.limits.max_tensor_bytes + TRANSPORT_SLACK_BYTES, heartbeat=30)
    await ws.prepare(request)
    authorized = token_matches(request_token(request), service.token)
    await Connection(ws, service, authorized, peer=request.remote or "?", transport=request.transport).serve()
    return ws


def make_app(service: EngineService) -> web.Application:
    app = web.Application(middlewares=[require_token])
    app["service"] = service
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/ws", websocket)
    app.router.add_get("/v1/results/{job}.mp4", result_mp4)
    app.router.add_get("/", dashboard)
    return app
