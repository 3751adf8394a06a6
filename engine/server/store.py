"""Finished jobs, kept for a while so a client can `attach` after a reconnect, the dashboard can play them,
and later tasks (extend, upscale) can start from a job's latents without a decode/encode round trip.

Results expire after a time-to-live, failed and cancelled jobs (kept so an `attach` learns why) after a few minutes;
past the byte cap or the entry cap the oldest go first (the newest result always stays). The totals are kept as
entries come and go, so /v1/status never walks the store.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.h3.request import Source
from engine.protocol import ProtocolError
from engine.runtime.log import log_event


@dataclass
class FinishedJob:
    job: str
    task: str
    params: dict
    state: str  # "done" | "failed" | "cancelled"
    submitted_at: float
    started_at: float | None
    finished_at: float
    error_code: str | None = None
    error_message: str | None = None
    frames: np.ndarray | None = None  # uint8 [F, H, W, 3]
    audio: np.ndarray | None = None  # float32 [C, S]; None for a silent clip (an upscaled video without sound)
    sample_rate: int = 0
    fps: float = 0.0  # 24 for H3 results; an upscale keeps its source's rate
    video_latents: torch.Tensor | None = None  # normalised [1, 24, T, h, w], CPU
    audio_latents: torch.Tensor | None = None  # normalised [2, 32, Ta], CPU
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _mp4: "asyncio.Future[bytes] | None" = field(default=None, repr=False)  # done already if the job encoded it

    @property
    def nbytes(self) -> int:
        arrays = [self.frames, self.audio, self.video_latents, self.audio_latents]
        mp4 = self._mp4.result() if self._mp4 is not None and self._mp4.done() and not self._mp4.exception() else b""
        return sum(a.nbytes for a in arrays if a is not None) + len(mp4)

    def meta(self) -> dict:
        return {"task": self.task, "params": self.params, "fps": self.fps, "sample_rate": self.sample_rate,
                "frames": self.frames.shape[0] if self.frames is not None else 0,
                "width": self.frames.shape[2] if self.frames is not None else 0,
                "height": self.frames.shape[1] if self.frames is not None else 0,
                "notes": self.notes, "timings": self.timings,
                "queued_s": round((self.started_at or self.finished_at) - self.submitted_at, 3)}

    def summary(self) -> dict:
        """A row of the dashboard's recent results."""
        row = {"job": self.job, "task": self.task, "state": self.state, "finished_at": self.finished_at,
               "prompt": str(self.params.get("prompt", ""))[:200],
               "duration_s": round(self.finished_at - (self.started_at or self.finished_at), 3)}
        if self.state == "done":
            row.update(frames=int(self.frames.shape[0]), width=int(self.frames.shape[2]),
                       height=int(self.frames.shape[1]), fps=self.fps, notes=self.notes,
                       **{k: self.timings[k] for k in ("last_frame_s", "mp4_ready_s") if k in self.timings})
        else:
            row.update(code=self.error_code, message=self.error_message)
        return row

    async def mp4(self) -> bytes:
        """H.264 + AAC MP4 of the result: the job's own, or encoded on first use (off the event loop) and kept."""
        if self._mp4 is None:
            from engine.io.video import encode_mp4_bytes

            self._mp4 = asyncio.ensure_future(asyncio.to_thread(
                encode_mp4_bytes, self.frames, self.fps, self.audio, self.sample_rate))
        return await asyncio.shield(self._mp4)


class ResultStore:
    def __init__(self, ttl_s: float = 3600.0, max_bytes: int = 4 * 2**30, max_entries: int = 1000,
                 failed_ttl_s: float = 300.0):
        self.ttl_s, self.max_bytes, self.max_entries = ttl_s, max_bytes, max_entries
        self.failed_ttl_s = min(failed_ttl_s, ttl_s)
        self._results: OrderedDict[str, FinishedJob] = OrderedDict()  # state "done", oldest first
        self._failures: OrderedDict[str, FinishedJob] = OrderedDict()  # "failed" | "cancelled", oldest first
        self._bytes: dict[str, int] = {}  # of each result, counted when it is added (and when its MP4 is kept)
        self.nbytes = 0

    def add(self, finished: FinishedJob) -> None:
        if finished.state == "done":
            self._results[finished.job] = finished
            self._count(finished)
        else:
            self._failures[finished.job] = finished
        self.evict()

    def _count(self, finished: FinishedJob) -> None:
        self.nbytes += finished.nbytes - self._bytes.get(finished.job, 0)
        self._bytes[finished.job] = finished.nbytes

    def kept_mp4(self, finished: FinishedJob) -> None:
        """A result's MP4 was encoded on first use: count its bytes too."""
        if finished.job in self._results:
            self._count(finished)
            self.evict()

    def get(self, job: str) -> FinishedJob | None:
        self.evict()
        return self._results.get(job) or self._failures.get(job)

    def source(self, job: str) -> Source:
        """A finished job's result as the source of a later task: frames, sound and latents, no decode/encode."""
        finished = self.get(job)
        if finished is None:
            raise ProtocolError("unknown_job", f"No such job {job!r} on this engine (results are kept "
                                               f"{self.ttl_s / 60:g} minutes): run it again, or send its video.")
        if finished.state != "done":
            raise ProtocolError("invalid_request", f"Job {job!r} {finished.state}; it has no result to start from.")
        return Source(finished.frames, finished.fps, finished.audio, finished.sample_rate,
                      finished.video_latents, finished.audio_latents)

    def recent(self, n: int = 20, failures: int = 5) -> list[FinishedJob]:
        """The newest results, and a few of the newest failures: a flood of cancelled jobs cannot push the real
        results off the dashboard."""
        self.evict()
        rows = [*islice(reversed(self._results.values()), n), *islice(reversed(self._failures.values()), failures)]
        return sorted(rows, key=lambda f: f.finished_at, reverse=True)

    def __len__(self) -> int:
        return len(self._results) + len(self._failures)

    @property
    def results(self) -> int:
        return len(self._results)

    def evict(self) -> None:
        now = time.time()
        while self._failures:
            oldest = next(iter(self._failures.values()))
            expired = now - oldest.finished_at > self.failed_ttl_s
            if not expired and len(self) <= self.max_entries:
                break
            self._failures.popitem(last=False)
        while self._results:
            oldest = next(iter(self._results.values()))
            expired = now - oldest.finished_at > self.ttl_s
            if not expired and (len(self._results) == 1 or (self.nbytes <= self.max_bytes
                                                            and len(self) <= self.max_entries)):
                return
            self._results.popitem(last=False)
            self.nbytes -= self._bytes.pop(oldest.job)
            log_event("result.evicted", job=oldest.job, reason="expired" if expired else "size cap")
