"""Token auth: one shared secret in a 0600 file, created with a random token on first start.

Every WebSocket (in its `hello`, or on the upgrade request) and every HTTP route but /v1/health must carry it,
as `Authorization: Bearer <token>` or `?token=<token>` (the dashboard link and its <video> sources).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from aiohttp import web


def load_or_create_token(path: Path) -> str:
    path = Path(path).expanduser()
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another engine created it meanwhile: use theirs
            return load_or_create_token(path)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)  # a secret readable by others is no secret
    if not token:
        raise SystemExit(f"The token file {path} is empty: delete it to get a new token, or write one into it.")
    return token


def token_matches(given, expected: str) -> bool:
    """Constant-time comparison; anything but a string (a hello's token may be any JSON value) does not match."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def request_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        return header[len("Bearer "):].strip()
    return request.query.get("token")
