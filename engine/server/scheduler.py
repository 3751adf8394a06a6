"""The job queue on rank 0: FIFO with queue positions, one job at a time on a dedicated pipeline thread (so the
event loop keeps serving), progress at every step and chunk boundary with throttled previews fanned out to every
subscriber, and the mapping of whatever a job raises to an error an artist can read. No request can take the
engine down."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import re
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from engine.models.h3 import layout as L
from engine.models.h3.partitions import partition_for
from engine.models.h3.request import Cancelled, GenerateResult, StepEvent
from engine.models.h3.vae import VIDEO_LATENT_RGB_BIAS, VIDEO_LATENT_RGB_FACTORS
from engine.models.phases import PhaseEvent
from engine.protocol import ProtocolError
from engine.runtime.agreement import PeerFailed
from engine.runtime.jobs import JobRunner, JobSpec
from engine.runtime.log import log_event
from engine.runtime.planner import DoesNotFit
from engine.server.preview import frame_jpeg, preview_jpeg
from engine.server.store import FinishedJob, ResultStore

PREVIEW_INTERVAL_S = 0.25  # at most 4 previews a second
MAX_OVERTAKEN = 2  # a waiting job lets at most this many later jobs of the loaded DiT partition go first
# Working memory of a t2va / fl2va job per output pixel (all frames): the decoded frames in float32 and uint8 plus
# headroom for the VAE decoder. A cheap, generous estimate for --memory-cap-gb, not a measurement.
WORKING_BYTES_PER_PIXEL = 16


class Subscriber(Protocol):
    """A client connection following a job."""

    def send(self, msg: dict, tensors: list[tuple[str, np.ndarray]] = ()) -> None: ...

    def deliver(self, finished: FinishedJob, mp4: bool, start: int = 0) -> None: ...


@dataclass(eq=False)
class Job:
    spec: JobSpec
    submitted_at: float = field(default_factory=time.time)
    state: str = "queued"  # -> "running"
    started_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    overtaken: int = 0  # later jobs run before this one (next_job)
    subscribers: dict[Subscriber, bool] = field(default_factory=dict)  # -> wants the MP4 with the result
    last_progress: tuple[dict, bytes | None] | None = None  # replayed to a client that attaches
    # The result's frames streamed so far, (start, uint8 [n, H, W, 3]) views of the pipeline's result (not copies),
    # replayed to a client that attaches mid-stream
    chunks: list[tuple[int, np.ndarray]] = field(default_factory=list)
    total_frames: int = 0
    last_frame_at: float | None = None  # when the last frame went out to the subscribers

    @property
    def id(self) -> str:
        return self.spec.job

    @property
    def streamed(self) -> int:
        """Frames sent so far; every subscriber has them (or is sent them), so the result starts there."""
        start, pixels = self.chunks[-1] if self.chunks else (0, ())
        return start + len(pixels)

    def publish(self, msg: dict, preview: bytes | None = None) -> None:
        self.last_progress = (msg, preview)
        tensors = [("preview", np.frombuffer(preview, dtype=np.uint8))] if preview else []
        for subscriber in list(self.subscribers):
            subscriber.send(msg, tensors)

    def publish_frames(self, start: int, total: int, pixels: np.ndarray) -> None:
        self.chunks.append((start, pixels))
        self.total_frames = total
        if self.streamed == total:
            self.last_frame_at = time.time()
        for subscriber in list(self.subscribers):
            subscriber.send(*chunk_message(self.id, start, total, pixels))

    def chunks_after(self, held: int) -> list[tuple[dict, list[tuple[str, np.ndarray]]]]:
        """The result_chunk messages of the streamed frames past the first `held` (for a client that attaches)."""
        return [chunk_message(self.id, max(start, held), self.total_frames, pixels[max(0, held - start):])
                for start, pixels in self.chunks if start + len(pixels) > held]

    def status(self, position: int) -> dict:
        row = {"job": self.id, "task": self.spec.task, "state": self.state, "position": position,
               "prompt": str(self.spec.params.get("prompt", ""))[:200], "submitted_at": self.submitted_at}
        if self.last_progress is not None:
            msg = self.last_progress[0]
            row.update(stage=msg["stage"], step=msg["step"], total=msg["total"], eta_s=msg["eta_s"])
            if "detail" in msg:
                row["detail"] = msg["detail"]
        if self.started_at is not None:
            row.update(started_at=self.started_at, elapsed_s=round(time.time() - self.started_at, 3))
        return row


def progress_message(job: str, stage: str, step: int = 0, total: int = 0, eta_s: float | None = None,
                     has_preview: bool = False, **extra) -> dict:
    return {"type": "progress", "job": job, "stage": stage, "step": step, "total": total, "eta_s": eta_s,
            "has_preview": has_preview, **extra}


def chunk_message(job: str, start: int, total: int, pixels: np.ndarray) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    return ({"type": "result_chunk", "job": job, "start": start, "stop": start + len(pixels), "total": total,
             "tensors": ["frames"]}, [("frames", pixels)])


def latent_rgb(runner) -> tuple:
    """The previews' latent -> RGB projection of the runner's video VAE (the released one's when it has none)."""
    vae = getattr(getattr(runner, "pipeline", None), "video_vae", None)
    return getattr(vae, "latent_rgb", (VIDEO_LATENT_RGB_FACTORS, VIDEO_LATENT_RGB_BIAS))


class ProgressReporter:
    """The pipeline's boundary callback on rank 0 (runs on the pipeline thread): every event becomes a progress
    message (stage, done/total, ETA, detail), with a preview at most every PREVIEW_INTERVAL_S where one exists; a
    decoded chunk's final frames (PhaseEvent.frames) go to the job's clients first, as a result_chunk.

    Denoise steps (StepEvent) report "denoising", an extension's window ("window 2/4") as `detail`, a preview of
    the clean estimate; their ETA is the steps left (all windows) at the rate so far plus the decode, estimated
    from the last job's decode time per latent voxel. Every other boundary (PhaseEvent: loading, reading source,
    encoding, decoding, upscaling, muxing) reports its own stage and detail; its ETA comes from that phase's rate
    so far or, before its first chunk, from the seconds per chunk the last job measured for the stage (`rates`,
    kept by the scheduler). SeedVR2 previews every decoded chunk."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop, decode_s_per_voxel: float,
                 rates: dict[str, float] | None = None,
                 latent_rgb: tuple[torch.Tensor, torch.Tensor] = (VIDEO_LATENT_RGB_FACTORS, VIDEO_LATENT_RGB_BIAS)):
        self.job, self.loop, self.decode_s_per_voxel = job, loop, decode_s_per_voxel
        self.latent_rgb = tuple(torch.as_tensor(v, dtype=torch.float32) for v in latent_rgb)  # preview projection
        self.rates = rates if rates is not None else {}  # stage -> seconds per chunk, carried to the next job
        self.started = time.perf_counter()  # of the job, then of its denoise loop
        self.first_step_at: float | None = None
        self.last_step_at = self.started
        self.last_preview_at = -float("inf")
        self.steps_done = 0  # over all windows of an extension
        self.phases: dict[str, tuple[float, int]] = {}  # stage -> (when, done) at the start of its latest phase

    def __call__(self, event) -> None:
        decoded = getattr(event, "frames", None)
        if decoded is not None:
            self.loop.call_soon_threadsafe(self.job.publish_frames, decoded.start, decoded.total,
                                           decoded.pixels.numpy())
        now = time.perf_counter()
        msg = self._step(event, now) if isinstance(event, StepEvent) else self._phase(event, now)
        preview = None
        if now - self.last_preview_at >= PREVIEW_INTERVAL_S:
            latents = getattr(event, "video_x0", None)
            if latents is not None:
                preview = preview_jpeg(latents, self.latent_rgb)
            elif getattr(event, "preview", None) is not None:
                preview = frame_jpeg(event.preview)
            if preview is not None:
                self.last_preview_at = now
        msg["has_preview"] = preview is not None
        self.loop.call_soon_threadsafe(self.job.publish, msg, preview)

    def _step(self, event: StepEvent, now: float) -> dict:
        step_s, self.last_step_at = now - self.last_step_at, now
        self.steps_done += 1
        if self.first_step_at is None:
            self.first_step_at = now
            per_step = now - self.started
        else:
            per_step = (now - self.first_step_at) / (self.steps_done - 1)
        self.rates["denoising"] = per_step
        decode_s = self.decode_s_per_voxel * latent_voxels(event.video_x0)
        extra = {"detail": event.stage} if event.stage != "denoising" else {}
        log_event("job.step", job=self.job.id, stage="denoising", step=event.step, total=event.total, step_s=step_s,
                  **extra)
        return progress_message(self.job.id, "denoising", event.step, event.total,
                                round(per_step * steps_left(event) + decode_s, 2), **extra)

    def _phase(self, event: PhaseEvent, now: float) -> dict:
        if event.stage == "denoising" and self.first_step_at is None:
            self.started = self.last_step_at = now  # the first step's time leaves out what came before the loop
        if event.done == 0 or event.stage not in self.phases:
            self.phases[event.stage] = (now, event.done)
        began, done_then = self.phases[event.stage]
        if event.done > done_then:
            self.rates[event.stage] = (now - began) / (event.done - done_then)
        rate = self.rates.get(event.stage)
        eta = round(rate * (event.total - event.done), 2) if rate is not None and event.total else None
        if event.done == event.total and event.total:
            log_event("job.phase", job=self.job.id, stage=event.stage, detail=event.detail, chunks=event.total,
                      phase_s=round(now - began, 3))
        extra = {"detail": event.detail} if event.detail else {}
        return progress_message(self.job.id, event.stage, event.done, event.total, eta, **extra)


def delivery_timings(job: Job, result: GenerateResult, now: float) -> dict[str, float]:
    """Seconds from the job's start to its last frame going out to the clients (streamed, or with the result) and,
    when the job encoded one, to its finished MP4."""
    timings = {"last_frame_s": round((job.last_frame_at or now) - job.started_at, 3)}
    if result.mp4 is not None:
        timings["mp4_ready_s"] = round(now - job.started_at, 3)
    return timings


def steps_left(event) -> int:
    """Steps after this one, counting the windows of an extension still to come (stage "window k/K")."""
    left = event.total - event.step
    window = re.fullmatch(r"window (\d+)/(\d+)", getattr(event, "stage", ""))
    if window:
        left += (int(window.group(2)) - int(window.group(1))) * event.total
    return left


def latent_voxels(video_latents: torch.Tensor) -> int:
    """T * h * w of normalised latents [1, 24, T, h, w]."""
    return video_latents[0, 0].numel()


def pick(waiting: list[Job], active: str | None, overtaken: dict[Job, int]) -> int:
    """Index of the job to run next: the first one on the loaded DiT partition (no swap), unless that would
    overtake a job already overtaken MAX_OVERTAKEN times; then the oldest."""
    for i, job in enumerate(waiting):
        if partition_for(job.spec.task) in (None, active):
            return i if all(overtaken[earlier] < MAX_OVERTAKEN for earlier in waiting[:i]) else 0
    return 0


def next_job(queue: deque[Job], active: str | None) -> Job:
    """`pick`'s job, removed from the queue; the jobs it overtook count it."""
    waiting = list(queue)
    i = pick(waiting, active, {job: job.overtaken for job in waiting})
    for earlier in waiting[:i]:
        earlier.overtaken += 1
    del queue[i]
    return waiting[i]


def run_order(queue: deque[Job], active: str | None) -> list[Job]:
    """The order `next_job` will run the waiting jobs in, from the partition `active` on (nothing changes)."""
    waiting, overtaken, order = list(queue), {job: job.overtaken for job in queue}, []
    while waiting:
        i = pick(waiting, active, overtaken)
        for earlier in waiting[:i]:
            overtaken[earlier] += 1
        order.append(waiting.pop(i))
        active = partition_for(order[-1].spec.task) or active
    return order


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class OverMemoryCap(MemoryError):
    """A job whose estimated working memory is over the engine's --memory-cap-gb; the message says what to reduce."""


def check_memory_cap(spec: JobSpec, cap_bytes: int | None, pipeline) -> None:
    """Raises OverMemoryCap before a t2va / fl2va / ref2va job runs when its estimate (frames x canvas) is over the
    cap; a canvas left to the aspect ratio counts as the model's largest."""
    p = spec.params
    if cap_bytes is None or spec.task not in ("t2va", "fl2va", "ref2va"):
        return
    max_pixels = pipeline.canvas.max_pixels
    frames = L.align_num_frames(max(1, round(float(p.get("seconds", 5.0)) * L.FPS)))
    pixels = p["width"] * p["height"] if "width" in p else max_pixels
    canvas = f"{p['width']}x{p['height']}" if "width" in p else f"up to {max_pixels} pixels"
    need = frames * pixels * WORKING_BYTES_PER_PIXEL
    if need > cap_bytes:
        raise OverMemoryCap(
            f"Out of memory: this job needs about {need / 2**30:.2f} GB ({frames} frames at {canvas}) and this engine "
            f"may use {cap_bytes / 2**30:.2f} GB per job (--memory-cap-gb). Ask for fewer seconds or a smaller "
            f"width and height.")


def failed_in_collective(exc: BaseException) -> bool:
    """The exception came out of torch.distributed: a rank died or lost contact mid-job."""
    return any(frame.f_globals.get("__name__", "").startswith("torch.distributed")
               for frame, _ in traceback.walk_tb(exc.__traceback__))


def describe_failure(exc: BaseException) -> tuple[str, str, str]:
    """(state, code, message for the artist) for an exception out of a job."""
    if isinstance(exc, Cancelled):
        return "cancelled", "cancelled", str(exc) or "Cancelled."
    if isinstance(exc, ProtocolError):
        return "failed", exc.code, exc.message
    if isinstance(exc, ValueError):  # engine.models.h3.layout.LayoutError and other request rules
        return "failed", "invalid_request", str(exc)
    if isinstance(exc, (OverMemoryCap, DoesNotFit)):
        return "failed", "out_of_memory", str(exc)
    if is_out_of_memory(exc):
        return "failed", "out_of_memory", ("The engine ran out of memory on this job. Try fewer seconds, a smaller "
                                           "canvas, or an engine with more GPUs.")
    if isinstance(exc, PeerFailed):
        return "failed", "internal", f"internal engine error: {exc}"
    if failed_in_collective(exc):
        return "failed", "rank_lost", ("One of the engine's worker processes (ranks) stopped or lost contact during "
                                       "this job. Run the prompt again: a bundled engine that stopped is started "
                                       "again (restart a separately started one). The engine log says why.")
    return "failed", "internal", f"internal engine error: {type(exc).__name__}: {str(exc)[:200]}"


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS after a job (glibc keeps them otherwise, so a long-running engine's
    RSS would only ever grow)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Scheduler:
    def __init__(self, load_runner: Callable[[], JobRunner], store: ResultStore, max_queue: int = 32,
                 memory_cap_bytes: int | None = None):
        self.load_runner, self.store, self.max_queue = load_runner, store, max_queue
        self.memory_cap_bytes = memory_cap_bytes  # per job, estimated before it runs (check_memory_cap)
        self.state = "loading"  # -> "ready" | "failed" | "stopping"
        self.load_error: str | None = None  # why the models could not be loaded (state "failed")
        self.runner: JobRunner | None = None
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.counters: Counter[str] = Counter()
        self.decode_s_per_voxel = 0.0  # measured on the last finished job
        self.phase_rates: dict[str, float] = {}  # stage -> seconds per chunk, as the last job that ran it measured
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-pipeline")
        self._wake = asyncio.Event()

    # ---- requests from connections (event loop) ------------------------------------------------------------
    def submit(self, spec: JobSpec, subscriber: Subscriber, mp4: bool) -> tuple[Job, int]:
        if self.state == "failed":
            raise ProtocolError("unavailable", f"The engine could not load its models ({self.load_error}); it takes "
                                               f"no jobs and is exiting.")
        if self.state == "stopping":
            raise ProtocolError("unavailable", "The engine is stopping; it takes no new jobs.")
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
        return (self.running is not None) + run_order(self.queue, self.active_partition()).index(job)

    def active_partition(self) -> str | None:
        """The DiT partition loaded when the next job starts: the running job's, else the pipeline's."""
        if self.running is not None and partition_for(self.running.spec.task):
            return partition_for(self.running.spec.task)
        partitions = getattr(getattr(self.runner, "pipeline", None), "partitions", None)
        return partitions.active if partitions else None

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
        return self.runner.describe() if self.runner is not None else None

    # ---- the worker ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Loads the pipeline, then runs queued jobs forever. Raises if the models cannot be loaded."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            self.runner = await loop.run_in_executor(self._executor, self.load_runner)
        except Exception as exc:
            self.state, self.load_error = "failed", str(exc)
            log_event("engine.load_failed", logging.ERROR, exc_info=exc)
            while self.queue:
                self._finish(self.queue.popleft(), error=ProtocolError(
                    "unavailable", f"The engine could not load its models: {exc}"))
            raise
        # The libraries and models just loaded live as long as the engine: frozen out of the collector, a full
        # collection no longer walks their millions of objects on the event loop's thread (a ~0.4 s stall).
        gc.collect()
        gc.freeze()
        self.state = "ready"
        log_event("engine.ready", load_s=time.perf_counter() - t0, models=self.describe_models())
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            job = next_job(self.queue, self.active_partition())
            self.running, job.state, job.started_at = job, "running", time.time()
            self._announce_positions()
            await self._run(job, loop)

    async def _run(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        log_event("job.started", job=job.id, task=job.spec.task, waited_s=job.started_at - job.submitted_at)
        job.publish(progress_message(job.id, "starting"))
        try:
            check_memory_cap(job.spec, self.memory_cap_bytes, self.runner.pipeline)
            result = await loop.run_in_executor(self._executor, self.runner.run, job.spec, job.cancel,
                                                ProgressReporter(job, loop, self.decode_s_per_voxel,
                                                                 self.phase_rates, latent_rgb(self.runner)))
        except Exception as exc:
            self._finish(job, error=exc)
        else:
            self._finish(job, result=result)
        finally:
            self.running = None
            release_freed_memory()

    def _finish(self, job: Job, result: GenerateResult | None = None, error: BaseException | None = None) -> None:
        now = time.time()
        common = dict(job=job.id, task=job.spec.task, params=job.spec.params, submitted_at=job.submitted_at,
                      started_at=job.started_at, finished_at=now)
        delivered = delivery_timings(job, result, now) if error is None else {}
        if error is None:
            if "decode_s" in result.timings:
                self.decode_s_per_voxel = result.timings["decode_s"] / latent_voxels(result.video_latents)
            audio = result.audio.numpy() if result.audio is not None else None  # an upscaled silent clip
            mp4 = None
            if result.mp4 is not None:  # encoded during the decode; extend and upscale leave it to `mp4()`
                mp4 = asyncio.get_running_loop().create_future()
                mp4.set_result(result.mp4)
            finished = FinishedJob(**common, state="done", frames=result.frames.numpy(), audio=audio,
                                   sample_rate=int(result.sample_rate), fps=float(result.fps),
                                   video_latents=result.video_latents, audio_latents=result.audio_latents,
                                   notes=list(result.notes), timings={**result.timings, **delivered}, _mp4=mp4)
        else:
            if isinstance(error, Cancelled) and self.state == "stopping":  # close() stopped it, not the artist
                error = ProtocolError("unavailable", "The engine shut down during this job; run it again once the "
                                                     "engine is back.")
            state, code, message = describe_failure(error)
            finished = FinishedJob(**common, state=state, error_code=code, error_message=message)
            if code in ("internal", "rank_lost"):
                log_event("job.internal_error", logging.ERROR, exc_info=error, job=job.id)
            if code == "out_of_memory":
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        self.store.add(finished)
        self.counters[finished.state] += 1
        log_event(f"job.{finished.state}", logging.INFO if error is None else logging.WARNING, job=job.id,
                  task=job.spec.task, duration_s=now - (job.started_at or now), code=finished.error_code,
                  message=finished.error_message, **delivered)
        for subscriber, mp4 in job.subscribers.items():
            subscriber.deliver(finished, mp4, job.streamed)

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
