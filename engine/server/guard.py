"""The engine's TCP connections: at most a cap kept below the process's file-descriptor limit, so accepting never
runs out of descriptors (which would stop the engine accepting anyone, and the model files, logs and encodes from
opening). When the cap is reached the oldest connection that has not finished a request yet (a client stuck in its
headers, or one holding a socket open) is closed to make room; when every connection is serving a request the new
one gets a short 503 and is closed.

Headers that never finish are ended by aiohttp's keep-alive timer (its idle timeout also runs from the moment a
connection is accepted), which the engine sets to --client-timeout-s."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from engine.runtime.log import log_event

BODY_TIMEOUT_S = 2.0  # aiohttp's lingering close: how long an unread request body is drained before closing
FD_RESERVE = 64  # descriptors kept free for model files, logs, MP4 encodes, torch and the ranks' sockets
# asyncio accepts up to `backlog` connections in one go before any reaches the guard: a small backlog keeps the
# descriptors taken past the cap (at most about two batches) well inside FD_RESERVE
ACCEPT_BACKLOG = 16
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: 60\r\n"
        b"\r\nThe H3Forge engine has too many connections; try again soon.")


def connection_cap(requested: int) -> int:
    """`requested`, or fewer so that every connection can have its descriptor under RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(4, min(requested, soft - in_use - FD_RESERVE))


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.write(BUSY)
        transport.close()


class ConnectionGuard:
    """The protocol factory given to `loop.create_server` in place of aiohttp's `web.Server`."""

    def __init__(self, server: web.Server, cap: int):
        self.server, self.cap = server, cap
        self.served: set[RequestHandler] = set()  # connections that got at least one request through
        self.refused = self.evicted = 0
        self._last_log = 0.0

    def saw_request(self, request: web.Request) -> None:
        """Called for every request (the app's middleware)."""
        self.served.add(request.protocol)

    @property
    def open(self) -> int:
        return len(self.server.connections)

    def __call__(self) -> asyncio.Protocol:
        connections = self.server.connections
        self.served.intersection_update(connections)
        if len(connections) >= self.cap:
            idle = next((c for c in connections if c not in self.served), None)
            if idle is None:
                self.refused += 1
                self._log("refused")
                return _Busy()
            self.evicted += 1
            self._log("evicted_idle")
            idle.force_close()
        return self.server()

    def _log(self, action: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 1.0:  # one line a second at most, with the totals so far
            self._last_log = now
            log_event("connection.cap_reached", logging.WARNING, action=action, cap=self.cap,
                      refused=self.refused, evicted_idle=self.evicted)
