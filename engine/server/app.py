"""The engine's HTTP side on rank 0 (aiohttp): /v1/ws, /v1/health, /v1/status, the dashboard at /, and result
MP4s for the dashboard's <video> elements. Every route but /v1/health needs the token; the WebSocket may also
give it in its hello."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

from engine import protocol
from engine.runtime.jobs import ModelSource
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
    started_at: float = field(default_factory=time.time)

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
            "store": {"jobs": len(self.store), "bytes": self.store.nbytes,
                      "max_bytes": self.store.max_bytes, "ttl_s": self.store.ttl_s},
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
    return web.json_response(request.app["service"].status())


async def models(request: web.Request) -> web.Response:
    """The model files this engine can load, by ComfyUI folder, each with its kind and format (headers only)."""
    from engine.models.h3.model_files import list_models

    root = request.app["service"].source.models_dir
    if not root:
        return web.json_response({"root": None, "folders": {}, "note": "this engine serves a preset, no models "
                                                                       "folder"})
    return web.json_response({"root": Path(root).name, "folders": list_models(root)})


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(text=DASHBOARD.read_text(), content_type="text/html")


async def result_mp4(request: web.Request) -> web.StreamResponse:
    service: EngineService = request.app["service"]
    job = request.match_info["job"]
    finished = service.store.get(job) if _JOB_ID.match(job) else None
    if finished is None or finished.state != "done":
        raise web.HTTPNotFound(text=f"No finished result for job {job} (results are kept "
                                    f"{service.store.ttl_s / 60:g} minutes).")
    data = await finished.mp4()
    headers = {"Accept-Ranges": "bytes", "Cache-Control": "private, max-age=3600"}
    start, end = _byte_range(request.headers.get("Range"), len(data))
    if (start, end) == (0, len(data)):
        return web.Response(body=data, content_type="video/mp4", headers=headers)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
    return web.Response(status=206, body=data[start:end], content_type="video/mp4", headers=headers)


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a single `bytes=a-b` range (what <video> asks for); the whole body otherwise."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header or "")
    if m is None or (not m.group(1) and not m.group(2)):
        return 0, size
    if not m.group(1):
        return max(0, size - int(m.group(2))), size
    start = int(m.group(1))
    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    if start >= end:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, end


async def websocket(request: web.Request) -> web.WebSocketResponse:
    service: EngineService = request.app["service"]
    ws = web.WebSocketResponse(max_msg_size=service.limits.max_tensor_bytes + TRANSPORT_SLACK_BYTES, heartbeat=30)
    await ws.prepare(request)
    authorized = token_matches(request_token(request), service.token)
    await Connection(ws, service, authorized, peer=request.remote or "?").serve()
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
