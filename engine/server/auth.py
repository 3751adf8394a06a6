"""Token auth: one shared secret in a 0600 file, created with a random token on first start.

Every WebSocket (in its `hello`, or on the upgrade request) and every HTTP route but /v1/health must carry it,
as `Authorization: Bearer <token>` or `?token=<token>` (the dashboard link and its <video> sources).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from aiohttp import web

from engine.runtime.log import log_event

MAX_TOKEN_CHARS = 512  # it travels in every request's Authorization header
_TOKEN = re.compile(r"[\x21-\x7e]+")  # one word of printable ASCII, as an HTTP header value can carry it


def load_or_create_token(path: Path) -> str:
    """The token in `path`, or a new random one written there (mode 0600). Refuses (SystemExit with the reason) a
    link, a directory, a file too large or not one printable word; a file others could read is tightened to 0600
    with a warning, since the token may have leaked."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_token(path)
    except OSError as exc:
        if path.is_symlink():
            raise SystemExit(f"The token file {path} is a symbolic link; the engine reads and protects its secret "
                             f"only in a plain file: give --token-file the file itself.") from None
        raise SystemExit(f"The token file {path} cannot be read ({exc.strerror or exc}).") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise SystemExit(f"The token file {path} is {kind}: give --token-file a file (it is created with a new "
                         f"token when missing).")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_TOKEN_CHARS + 2)
        if info.st_mode & 0o077:  # fchmod on the file opened, never on what a link would point at
            os.fchmod(f.fileno(), 0o600)
            log_event("token.permissions_tightened", logging.WARNING, file=str(path), mode=oct(info.st_mode & 0o777),
                      warning="the token file was readable by other users and is now 0600; the token may have "
                              "leaked: delete the file and restart for a new token if others use this machine")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        token = None
    if token is not None and not token:
        raise SystemExit(f"The token file {path} is empty: delete it to get a new token, or write one into it.")
    if token is None or len(token) > MAX_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise SystemExit(f"The token file {path} does not hold a token: it must be one word of at most "
                         f"{MAX_TOKEN_CHARS} printable ASCII characters (no spaces). Delete it to get a new token.")
    return token


def _create_token(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another engine created it meanwhile: use theirs
        return load_or_create_token(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def token_matches(given, expected: str) -> bool:
    """Constant-time comparison; anything but a string (a hello's token may be any JSON value) does not match."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def request_token(request: web.Request) -> str | None:
    scheme, _, credentials = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
        return credentials.strip()
    return request.query.get("token")
