"""Structured engine logs: one `key=value` line per event on stderr, or in a size-rotated file (`serve --log-file`),
e.g.

    ts=2026-11-29T11:30:02 level=info rank=0 event=job.finished job=3f2a.. task=t2va duration_s=4.21
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path

LOG_MAX_BYTES = 10 * 2**20  # a log file rotates at this size, keeping LOG_BACKUPS older files beside it
LOG_BACKUPS = 3

logger = logging.getLogger("h3forge")


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    s = str(v)
    return json.dumps(s) if not s or any(c in s for c in ' "=\n') else s


class _KeyValueFormatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", None)
        if fields:
            body = " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
        else:
            body = f"msg={_value(record.getMessage())}"
        line = f"ts={ts} level={record.levelname.lower()} rank={self.rank} {body}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def rank_log_file(path: Path, rank: int) -> Path:
    """Rank 0 logs to `path`, rank r to `path` with `.rank{r}` before its suffix (each rank rotates its own file)."""
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def setup_logging(rank: int = 0, level: str = "info", log_file: Path | None = None,
                  max_bytes: int = LOG_MAX_BYTES) -> None:
    if log_file is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        path = rank_log_file(Path(log_file), rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=LOG_BACKUPS,
                                                       encoding="utf-8")
    handler.setFormatter(_KeyValueFormatter(rank))
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_event(event: str, level: int = logging.INFO, exc_info=None, **fields) -> None:
    logger.log(level, event, exc_info=exc_info, extra={"fields": {"event": event, **fields}})
