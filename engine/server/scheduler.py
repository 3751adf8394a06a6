"""The job queue on rank 0: FIFO with queue positions, one job at a time on a dedicated pipeline thread (so the
event loop keeps serving), per-step progress with throttled previews fanned out to every subscriber, and the
mapping of whatever a job raises to an error an artist can read. No request can take the engine down."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from engine.models.h3.request import Cancelled, GenerateResult, StepEvent
from engine.protocol import ProtocolError
from engine.runtime.agreement import PeerFailed
from engine.runtime.jobs import JobRunner, JobSpec
from engine.runtime.log import log_event
from engine.server.preview import preview_jpeg
from engine.server.store import FinishedJob, ResultStore

PREVIEW_INTERVAL_S = 0.25  # at most 4 previews a second


class Subscriber(Protocol):
    """A client connection following a job."""

    def send(self, msg: dict, tensors: list[tuple[str, np.ndarray]] = ()) -> None: ...

    def deliver(self, finished: FinishedJob, mp4: bool) -> None: ...


@dataclass(eq=False)
class Job:
    spec: JobSpec
    submitted_at: float = field(default_factory=time.time)
    state: str = "queued"  # -> "running"
    started_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    subscribers: dict[Subscriber, bool] = field(default_factory=dict)  # -> wants the MP4 with the result
    last_progress: tuple[dict, bytes | None] | None = None  # replayed to a client that attaches

    @property
    def id(self) -> str:
        return self.spec.job

    def publish(self, msg: dict, preview: bytes | None = None) -> None:
        self.last_progress = (msg, preview)
        tensors = [("preview", np.frombuffer(preview, dtype=np.uint8))] if preview else []
        for subscriber in list(self.subscribers):
            subscriber.send(msg, tensors)

    def status(self, position: int) -> dict:
        row = {"job": self.id, "task": self.spec.task, "state": self.state, "position": position,
               "prompt": str(self.spec.params.get("prompt", ""))[:200], "submitted_at": self.submitted_at}
        if self.last_progress is not None:
            msg = self.last_progress[0]
            row.update(stage=msg["stage"], step=msg["step"], total=msg["total"], eta_s=msg["eta_s"])
        if self.started_at is not None:
            row.update(started_at=self.started_at, elapsed_s=round(time.time() - self.started_at, 3))
        return row


def progress_message(job: str, stage: str, step: int = 0, total: int = 0, eta_s: float | None = None,
                     has_preview: bool = False, **extra) -> dict:
    return {"type": "progress", "job": job, "stage": stage, "step": step, "total": total, "eta_s": eta_s,
            "has_preview": has_preview, **extra}


class ProgressReporter:
    """The pipeline's step callback on rank 0 (runs on the pipeline thread): ETA from step times (plus the decode,
    estimated from the last job's decode time per latent voxel), a preview at most every PREVIEW_INTERVAL_S, and
    the events handed to the event loop."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop, decode_s_per_voxel: float):
        self.job, self.loop, self.decode_s_per_voxel = job, loop, decode_s_per_voxel
        self.started = time.perf_counter()
        self.first_step_at: float | None = None
        self.last_step_at = self.started
        self.last_preview_at = -float("inf")

    def __call__(self, event: StepEvent) -> None:
        now = time.perf_counter()
        step_s, self.last_step_at = now - self.last_step_at, now
        if self.first_step_at is None:
            self.first_step_at = now
            per_step = now - self.started  # includes prompt encoding: a rough first guess
        else:
            per_step = (now - self.first_step_at) / (event.step - 1)
        preview = None
        if now - self.last_preview_at >= PREVIEW_INTERVAL_S:
            preview, self.last_preview_at = preview_jpeg(event.video_x0), now
        decode_s = self.decode_s_per_voxel * latent_voxels(event.video_x0)
        eta = round(per_step * (event.total - event.step) + decode_s, 2)
        msg = progress_message(self.job.id, "denoising", event.step, event.total, eta, preview is not None)
        self.loop.call_soon_threadsafe(self.job.publish, msg, preview)
        if event.step == event.total:
            decoding = progress_message(self.job.id, "decoding", event.step, event.total, round(decode_s, 2) or None)
            self.loop.call_soon_threadsafe(self.job.publish, decoding)
        log_event("job.step", job=self.job.id, step=event.step, total=event.total, step_s=step_s)


def latent_voxels(video_latents: torch.Tensor) -> int:
    """T * h * w of normalised latents [1, 24, T, h, w]."""
    return video_latents[0, 0].numel()


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def describe_failure(exc: BaseException) -> tuple[str, str, str]:
    """(state, code, message for the artist) for an exception out of a job."""
    if isinstance(exc, Cancelled):
        return "cancelled", "cancelled", str(exc) or "Cancelled."
    if isinstance(exc, ProtocolError):
        return "failed", exc.code, exc.message
    if isinstance(exc, ValueError):  # engine.models.h3.layout.LayoutError and other request rules
        return "failed", "invalid_request", str(exc)
    if is_out_of_memory(exc):
        return "failed", "out_of_memory", ("The engine ran out of memory on this job. Try fewer seconds, a smaller "
                                           "canvas, or an engine with more GPUs.")
    if isinstance(exc, PeerFailed):
        return "failed", "internal", f"internal engine error: {exc}"
    return "failed", "internal", f"internal engine error: {type(exc).__name__}: {str(exc)[:200]}"


class Scheduler:
    def __init__(self, load_runner: Callable[[], JobRunner], store: ResultStore, max_queue: int = 32):
        self.load_runner, self.store, self.max_queue = load_runner, store, max_queue
        self.state = "loading"  # -> "ready" | "failed" | "stopping"
        self.runner: JobRunner | None = None
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.counters: Counter[str] = Counter()
        self.decode_s_per_voxel = 0.0  # measured on the last finished job
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-pipeline")
        self._wake = asyncio.Event()

    # ---- requests from connections (event loop) ------------------------------------------------------------
    def submit(self, spec: JobSpec, subscriber: Subscriber, mp4: bool) -> tuple[Job, int]:
        if self.state in ("failed", "stopping"):
            raise ProtocolError("unavailable", f"The engine is {self.state}; it takes no new jobs.")
        if len(self.queue) >= self.max_queue:
            self.counters["rejected"] += 1
            raise ProtocolError("queue_full", f"The engine's queue is full ({len(self.queue)} jobs waiting); "
                                              f"try again when some have finished.")
        job = Job(spec)
        job.subscribers[subscriber] = mp4
        self.queue.append(job)
        self.counters["accepted"] += 1
        position = self.position(job)
        log_event("job.accepted", job=job.id, task=spec.task, position=position)
        self._wake.set()
        return job, position

    @staticmethod
    def new_job_id() -> str:
        return uuid.uuid4().hex

    def active(self, job_id: str) -> Job | None:
        if self.running is not None and self.running.id == job_id:
            return self.running
        return next((job for job in self.queue if job.id == job_id), None)

    def position(self, job: Job) -> int:
        if job is self.running:
            return 0
        return (self.running is not None) + self.queue.index(job)

    def cancel(self, job_id: str) -> bool:
        """False when the job is unknown; a finished job is left as it is."""
        job = self.active(job_id)
        if job is None:
            return self.store.get(job_id) is not None
        if job.state == "queued":
            self.queue.remove(job)
            self._finish(job, error=Cancelled("Cancelled before it started."))
            self._announce_positions()
        else:
            job.cancel.set()
            log_event("job.cancel_requested", job=job.id)
        return True

    def unsubscribe(self, subscriber: Subscriber) -> None:
        for job in [*self.queue, *([self.running] if self.running else [])]:
            job.subscribers.pop(subscriber, None)

    def describe_models(self) -> dict | None:
        pipeline = self.runner.pipeline if self.runner is not None else None
        describe = getattr(pipeline, "describe", None)
        return describe() if describe is not None else None

    # ---- the worker ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Loads the pipeline, then runs queued jobs forever. Raises if the models cannot be loaded."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            self.runner = await loop.run_in_executor(self._executor, self.load_runner)
        except Exception as exc:
            self.state = "failed"
            log_event("engine.load_failed", logging.ERROR, exc_info=exc)
            while self.queue:
                self._finish(self.queue.popleft(), error=ProtocolError(
                    "unavailable", f"The engine could not load its models: {exc}"))
            raise
        self.state = "ready"
        log_event("engine.ready", load_s=time.perf_counter() - t0, models=self.describe_models())
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self.queue.popleft()
            self.running, job.state, job.started_at = job, "running", time.time()
            self._announce_positions()
            await self._run(job, loop)

    async def _run(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        log_event("job.started", job=job.id, task=job.spec.task, waited_s=job.started_at - job.submitted_at)
        job.publish(progress_message(job.id, "starting"))
        try:
            result = await loop.run_in_executor(self._executor, self.runner.run, job.spec, job.cancel,
                                                ProgressReporter(job, loop, self.decode_s_per_voxel))
        except Exception as exc:
            self._finish(job, error=exc)
        else:
            self._finish(job, result=result)
        finally:
            self.running = None

    def _finish(self, job: Job, result: GenerateResult | None = None, error: BaseException | None = None) -> None:
        now = time.time()
        common = dict(job=job.id, task=job.spec.task, params=job.spec.params, submitted_at=job.submitted_at,
                      started_at=job.started_at, finished_at=now)
        if error is None:
            if "decode_s" in result.timings:
                self.decode_s_per_voxel = result.timings["decode_s"] / latent_voxels(result.video_latents)
            finished = FinishedJob(**common, state="done", frames=result.frames.numpy(), audio=result.audio.numpy(),
                                   sample_rate=int(result.sample_rate), fps=int(result.fps),
                                   video_latents=result.video_latents, audio_latents=result.audio_latents,
                                   notes=list(result.notes), timings=dict(result.timings))
        else:
            state, code, message = describe_failure(error)
            finished = FinishedJob(**common, state=state, error_code=code, error_message=message)
            if code == "internal":
                log_event("job.internal_error", logging.ERROR, exc_info=error, job=job.id)
            if code == "out_of_memory":
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        self.store.add(finished)
        self.counters[finished.state] += 1
        log_event(f"job.{finished.state}", logging.INFO if error is None else logging.WARNING, job=job.id,
                  task=job.spec.task, duration_s=now - (job.started_at or now), code=finished.error_code,
                  message=finished.error_message)
        for subscriber, mp4 in job.subscribers.items():
            subscriber.deliver(finished, mp4)

    def _announce_positions(self) -> None:
        for job in self.queue:
            job.publish(progress_message(job.id, "queued", position=self.position(job)))

    async def close(self) -> None:
        """Stops taking jobs, cancels the running one at its next step, fails the queued ones, and releases the
        other ranks."""
        self.state = "stopping"
        if self.running is not None:
            self.running.cancel.set()
        while self.queue:
            self._finish(self.queue.popleft(), error=ProtocolError("unavailable", "The engine shut down."))
        if self.runner is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.shutdown)
            except Exception as exc:  # other ranks already gone (e.g. torchrun stopped them)
                log_event("engine.shutdown_incomplete", logging.WARNING, error=str(exc))
        self._executor.shutdown(wait=True)
