"""Running one job on every rank: rank 0 broadcasts it, all ranks run the same pipeline call, and all agree
at each boundary (engine.runtime.agreement): every denoise step (StepEvent) and every chunk of the other long
phases (PhaseEvent: loading SeedVR2, reading a source video, VAE encode and decode, SeedVR2 batches). Ranks other
than 0 sit in `follower_loop`.

Tasks: t2va / fl2va / edit / extend / refine on the H3 pipeline; upscale on SeedVR2, loaded on first use (one
model size at a time). Edit, extend, refine and upscale start from a source clip: a stored job's result (resolved
on rank 0 when the job is submitted), a video file's bytes (decoded here, on every rank) or raw frames.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from engine.models.h3.layout import LayoutError
from engine.models.h3.mask import MaskError
from engine.models.h3.references import AudioReference, ImageReference, VideoReference
from engine.models.h3.request import (Cancelled, EditRequest, ExtendRequest, GenerateRequest, GenerateResult,
                                      RefineRequest, Source, StepEvent)
from engine.models.phases import Phase, PhaseEvent
from engine.kernels import attention
from engine import protocol
from engine.protocol import ProtocolError, mask_mismatch
from engine.runtime.agreement import PeerFailed, StepAgreement
from engine.runtime.log import log_event
from engine.runtime.placement import check_job, out_of_memory_message
from engine.runtime.planner import DoesNotFit
from engine.runtime.ranks import RankContext

DEFAULT_SAMPLE_RATE = 32000  # of a source given without sound


@dataclass
class JobSpec:
    """What every rank needs to run a job; pickled in the dispatch broadcast."""

    job: str
    task: str
    params: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    source: Source | None = None  # the stored result named by params["source_job"], resolved on rank 0
    mp4: bool = False  # the submitter wants the MP4: rank 0 encodes it while the VAE decodes


@dataclass(frozen=True)
class ModelSource:
    preset: str | None = None
    models_dir: str | None = None
    attention: str | None = None  # force an attention backend (None: per device)
    vsa_sparsity: float = 0.0  # H3 video sparse attention; 0 = dense
    # Comfy-Org single files, as (role, path) pairs: dit, text_encoder, video_vae, audio_vae, optionally ref_dit (the
    # Ref2VA DiT) and tokenizer_dir (the tokenizer the files lack), each already resolved inside the model roots.
    files: tuple[tuple[str, str], ...] = ()
    # More roots per ComfyUI folder, (folder, directory) pairs (`--model-path`); models_dir's subfolders come first.
    model_paths: tuple[tuple[str, str], ...] = ()
    dit_precision: str = "bf16"  # fp8 / int8: the block GEMMs quantized at load; auto: the memory planner's choice
    resident_blocks: int = 0  # > 0: the DiT streamed from host memory, at most this many units on the device
    gpu_memory_gb: float | None = None  # plan for this much per GPU (None: a GPU's own; no plan on a CPU)
    host_memory_gb: float | None = None  # plan for this much host memory (None: what the host has available)
    text_encoder_precision: str = "bf16"  # fp8 / int8: its decoder GEMMs stored quantized (engine.models.h3.precision)
    vae_precision: str = "bf16"  # fp8: the video VAE's decoder GEMMs and encoder block convolutions in float8
    # Tensor-parallel degree; the ranks / tp groups run Ulysses (engine/parallel/mesh.py). None: the memory
    # planner's choice (1 without a plan).
    tp: int | None = None

    def describe(self) -> str:
        if self.files:
            return "files " + ", ".join(f"{role} {Path(path).name}" for role, path in self.files)
        return f"preset {self.preset}" if self.preset else f"models {self.models_dir}"

    def roots(self):
        """Where this engine may read model files (GET /v1/models lists them; LoRA names resolve there)."""
        from engine.models.h3.model_files import ModelRoots

        return ModelRoots(self.models_dir, self.model_paths)

    def embedded(self) -> str | None:
        """The preset, or "tiny" when single files have the embedded default's architecture,
        whose canvas and work limits are small; None for the released model."""
        from engine.models.h3.conditioner import tiny_text_encoder_shape

        if self.preset:
            return self.preset
        text_encoder = dict(self.files).get("text_encoder")
        return "tiny" if text_encoder and tiny_text_encoder_shape(text_encoder) else None

    def lora_roots(self) -> list[Path]:
        return [*self.roots().folders["loras"], *([Path(self.models_dir)] if self.models_dir else [])]


def load_pipeline(source: ModelSource, ctx: RankContext):
    """The H3 pipeline on this rank. On a GPU (or with --gpu-memory) the memory planner places it: real weights
    load in host memory first, then the plan's precision, streamed units and the move to the GPU follow."""
    from engine.models.h3.pipeline import H3Pipeline  # heavy (torch, diffusers): only inside the engine
    from engine.models.h3.precision import set_precision, set_text_encoder_precision
    from engine.parallel.mesh import Parallel, plan
    from engine.runtime.placement import apply_plan, hardware, held_on_host, plan_engine

    planning = source.gpu_memory_gb is not None or ctx.device.type == "cuda"
    load_on = torch.device("cpu") if planning and not source.preset else ctx.device  # a preset is small
    if source.preset:
        pipe = H3Pipeline.from_preset(source.preset, device=load_on, lora_roots=source.lora_roots())
    elif source.files:
        pipe = H3Pipeline.from_files(**dict(source.files), device=load_on, lora_roots=source.lora_roots())
    else:
        pipe = H3Pipeline.from_models(source.models_dir, device=load_on)
    # ValueError, naming what is possible, for a --tp these ranks cannot run.
    mesh = plan(ctx.world_size, source.tp, pipe.dit.config) if source.tp is not None else None
    set_text_encoder_precision(pipe.conditioner, source.text_encoder_precision)
    pipe.video_vae.decode_fp8 = pipe.video_vae.encode_fp8 = source.vae_precision == "fp8"
    precision = source.dit_precision
    if planning:
        hw = hardware(ctx.device, ctx.world_size, source.gpu_memory_gb, source.host_memory_gb, held_on_host(pipe),
                      ctx.control, ctx.host_ranks)
        planned = plan_engine(pipe, hw, precision, source.resident_blocks, source.tp)  # without --tp, its TP
        mesh = plan(ctx.world_size, planned.plan.tp, pipe.dit.config)
    pipe.parallel = Parallel.build(mesh or plan(ctx.world_size, 1, pipe.dit.config), ctx.group)  # TP, Ulysses groups
    if planning:
        pipe.parallel.shard(pipe.dit)  # in host memory: the GPU only ever holds this rank's part
        apply_plan(pipe, planned, ctx.device)
        precision = planned.plan.precision
        log_event("engine.memory_plan", plan=planned.describe())
    quantized = precision if precision in ("fp8", "int8") else "bf16"  # bf16: the stored float weights
    if not planning:
        set_precision(pipe.parallel.shard(pipe.dit), quantized)
        if source.resident_blocks:
            pipe.stream_blocks(source.resident_blocks)
    pipe.partitions.prepare = lambda dit: set_precision(pipe.parallel.shard(dit), quantized)
    if ctx.world_size > 1:
        pipe.adaln_cache.group = ctx.control  # every rank agrees on a hit before using its tables
    attention.set_backend(source.attention)
    pipe.vsa_sparsity = source.vsa_sparsity
    return pipe


@contextlib.contextmanager
def speed_options(pipe, params: dict, device: torch.device):
    """The job's own attention backend and VSA sparsity, when it names them; else the engine's (--attention,
    --vsa-sparsity)."""
    name = params.get("attention", "auto")
    available = attention.backends(device)
    if name != "auto" and name not in available:
        raise ProtocolError("invalid_request", f"The attention backend {name!r} is not available on this engine "
                                               f"({device.type}); it has {', '.join(available)} (or auto).")
    sparsity = params.get("vsa_sparsity")
    if sparsity is not None:
        engine_sparsity, pipe.vsa_sparsity = pipe.vsa_sparsity, sparsity
    try:
        with attention.use_backend(name) if name != "auto" else contextlib.nullcontext():
            yield
    finally:
        if sparsity is not None:
            pipe.vsa_sparsity = engine_sparsity


def sequence_parallel(pipeline):
    """Ulysses over the pipeline's sequence-parallel group (engine/parallel/mesh.py), if it has one."""
    parallel = getattr(pipeline, "parallel", None)
    return parallel.sequence_parallel() if parallel is not None else contextlib.nullcontext()


def load_upscaler(source: ModelSource, ctx: RankContext, model: str, on_loaded=None):
    """SeedVR2 `model` ("3b" / "7b"): the tiny architectures for a preset engine, else the official files. With
    several ranks every batch is shared over them (window-aligned sequence parallelism). `on_loaded()` after
    each component."""
    from engine.models.seedvr2.pipeline import SeedVR2Pipeline

    if source.preset:
        preset = f"tiny-{model}" if model != "3b" else "toy" if source.preset == "toy" else "tiny"  # no toy 7B
        pipe = SeedVR2Pipeline.from_preset(preset, device=ctx.device, on_loaded=on_loaded)
    else:
        try:
            pipe = SeedVR2Pipeline.from_models(source.models_dir, size=model, device=ctx.device, on_loaded=on_loaded)
        except (OSError, ValueError) as exc:
            raise ProtocolError("unavailable", f"SeedVR2 {model.upper()} could not be loaded from "
                                               f"{source.models_dir}: {exc}") from None
    if ctx.world_size > 1:
        pipe.group = ctx.group
    return pipe


# ---- task params (already checked by engine.protocol.validate_task) -> pipeline requests -------------------------


def _loras(params: dict) -> list[tuple[str, float]]:
    return [(path, scale) for path, scale in params.get("loras", [])]


def generate_request(spec: JobSpec) -> GenerateRequest:
    p = spec.params
    images = {name: np.array(a) for name, a in spec.tensors.items()}  # writable copies of the wire buffers
    return GenerateRequest(
        prompt=p["prompt"], seconds=p.get("seconds", 5.0), width=p.get("width"), height=p.get("height"),
        aspect=p.get("aspect"), steps=p.get("steps"), seed=p.get("seed", 0),
        first_frame=images.get("first_frame"), last_frame=images.get("last_frame"), loras=_loras(p),
        references=wire_references(p.get("references", []), images), reference_size=p.get("ref_size", "diffusers"))


def wire_references(entries: list[dict], tensors: dict) -> list:
    """ref2va's `references` param and its ref{i}_* tensors (engine.protocol) -> reference objects, in order."""
    out = []
    for i, entry in enumerate(entries):
        audio, rate = tensors.get(f"ref{i}_audio"), entry.get("sample_rate", DEFAULT_SAMPLE_RATE)
        if entry["kind"] == "image":
            out.append(ImageReference(tensors[f"ref{i}_image"]))
        elif entry["kind"] == "video":
            out.append(VideoReference(tensors[f"ref{i}_frames"], entry.get("fps", 24.0), audio, rate))
        else:
            out.append(AudioReference(audio, rate))
    return out


def job_source(spec: JobSpec, on_step=None) -> Source:
    """The clip an edit / extend / refine / upscale starts from."""
    if spec.source is not None:
        return spec.source
    p, t = spec.params, spec.tensors
    if "source_mp4" in t:
        return decode_source(t["source_mp4"], on_step)
    audio = t.get("source_audio")
    return Source(np.array(t["source_frames"]), float(p.get("source_fps", 24.0)),
                  None if audio is None else np.array(audio), int(p.get("source_sample_rate", DEFAULT_SAMPLE_RATE)))


def decode_source(data: np.ndarray, on_step=None) -> Source:
    """A video file's bytes -> frames, frame rate and sound, in one demux pass; a boundary ("reading source")
    every 16 frames."""
    import av

    from engine.io.video import read_video

    def on_frames(decoded: int, expected: int) -> None:
        on_step(PhaseEvent("reading source", decoded, expected, "decoding the video file"))

    if on_step is not None:
        on_step(PhaseEvent("reading source", 0, 0, "decoding the video file"))
    try:
        frames, fps, audio, rate = read_video(data.tobytes(), on_frames if on_step is not None else None,
                                              max_bytes=protocol.MAX_VIDEO_BYTES)
    except (ValueError, OSError, av.FFmpegError) as exc:
        raise LayoutError(f"The source video could not be decoded ({exc}). Send a video file (MP4, MOV, WebM) "
                          f"with a video stream.") from None
    return Source(frames, float(fps), audio, rate or DEFAULT_SAMPLE_RATE)


def edit_request(spec: JobSpec, source: Source) -> EditRequest:
    p, mask = spec.params, spec.tensors["mask"]
    problem = mask_mismatch(mask.shape, tuple(source.frames.shape))
    if problem:
        raise MaskError(problem)
    mask = np.array(mask)  # writable (torch wants it); uint8 stays uint8, converted a few frames at a time
    return EditRequest(source, mask, prompt=p.get("prompt", ""), preset=p.get("preset", "replace"),
                       strength=p.get("strength"), audio_mask=p.get("audio_mask"), steps=p.get("steps"),
                       seed=p.get("seed", 0), loras=_loras(p))


def extend_request(spec: JobSpec, source: Source) -> ExtendRequest:
    p = spec.params
    return ExtendRequest(source, seconds=p["seconds"], prompts=p.get("prompts") or [p["prompt"]],
                         overlap_latents=p.get("overlap_latents", 7), window_seconds=p.get("window_seconds", 15.0),
                         steps=p.get("steps"), seed=p.get("seed", 0), loras=_loras(p))


def refine_request(spec: JobSpec, source: Source) -> RefineRequest:
    p = spec.params
    return RefineRequest(source, p["prompt"], scale=p.get("scale", 2.0), strength=p.get("strength", 0.5),
                         steps=p.get("steps"), seed=p.get("seed", 0), loras=_loras(p))


SOURCE_REQUESTS = {"edit": edit_request, "extend": extend_request, "refine": refine_request}  # H3Pipeline methods


class JobRunner:
    def __init__(self, ctx: RankContext, pipeline, models: ModelSource | None = None):
        self.ctx, self.pipeline, self.models = ctx, pipeline, models  # models: where SeedVR2 comes from
        self._upscaler: tuple[str, object] | None = None  # (model, SeedVR2Pipeline), loaded on first upscale
        # Fault injection for the reliability tests, "STEP@JOB": the JOB-th job (from 1) runs out of memory at
        # denoise step STEP.
        step, _, job = os.environ.get("H3FORGE_INJECT_OOM", "").partition("@")
        self.inject_oom = (int(step), int(job or 1)) if step else None
        self.jobs_run = 0

    def run(self, spec: JobSpec, cancel: threading.Event | None = None,
            on_step: Callable[[StepEvent | PhaseEvent], None] | None = None) -> GenerateResult:
        """Runs `spec` on this rank (rank 0 first sends it to the others). Raises Cancelled, PeerFailed, or the
        pipeline's own exception."""
        if self.ctx.rank == 0 and self.ctx.world_size > 1:
            dist.broadcast_object_list([spec], src=0, group=self.ctx.control)
        agreement = StepAgreement(self.ctx, cancel)
        self.jobs_run += 1

        def step_boundary(event: StepEvent | PhaseEvent) -> None:
            if isinstance(event, StepEvent):
                if self.inject_oom == (event.step, self.jobs_run):
                    held = torch.ones(64 * 2**20, dtype=torch.uint8, device=self.ctx.device)  # what the job had
                    raise torch.OutOfMemoryError(f"out of memory: tried to allocate 2.00 GiB with {held.numel()} "
                                                 f"bytes held (injected by H3FORGE_INJECT_OOM)")
                agreement.at_step(event.step, event.total)
            elif event.collective:
                agreement.at_boundary(f"while {event.stage}" + (f" ({event.detail})" if event.detail else "")
                                      + (f", at {event.done} of {event.total}" if event.total else ""))
            if on_step is not None:
                on_step(event)

        try:
            result = self.execute(spec, step_boundary)
        except BaseException:
            agreement.at_end(failed=True)
            raise
        agreement.at_end(failed=False)
        return result

    def execute(self, spec: JobSpec, on_step) -> GenerateResult:
        if spec.task == "upscale":
            return self.upscale(spec.params, job_source(spec, on_step), on_step)
        self.pipeline.encode_mp4 = spec.mp4 and self.ctx.rank == 0
        generation = generate_request(spec) if spec.task in ("t2va", "fl2va", "ref2va") else None
        if generation is not None:
            check_job(self.pipeline, generation)  # DoesNotFit before any work
        try:
            with speed_options(self.pipeline, spec.params, self.ctx.device), \
                    sequence_parallel(self.pipeline):
                if generation is not None:
                    return self.pipeline.generate(generation, on_step=on_step)
                source = job_source(spec, on_step)
                return getattr(self.pipeline, spec.task)(SOURCE_REQUESTS[spec.task](spec, source), on_step=on_step)
        except torch.OutOfMemoryError:
            pass  # raised again below, out of this handler: its traceback (and the tensors it holds) freed first
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise DoesNotFit(out_of_memory_message(self.pipeline, generation))

    def upscaler(self, model: str, on_step=None):
        """The SeedVR2 pipeline for `model`, loaded on first use (a boundary, "loading", after each component);
        loading another size frees the first."""
        if self._upscaler is None or self._upscaler[0] != model:
            if self.models is None:
                raise ProtocolError("unavailable", "This engine has no SeedVR2 models configured.")
            self._upscaler = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            loaded = Phase(on_step, "loading", 3, f"SeedVR2 {model.upper()}")
            self._upscaler = (model, load_upscaler(self.models, self.ctx, model, loaded))
            log_event("upscaler.loaded", model=model, load_s=time.perf_counter() - t0)
        return self._upscaler[1]

    def upscale(self, p: dict, source: Source, on_step) -> GenerateResult:
        """SeedVR2 on the source's frames; the sound and the exact frame rate are kept."""
        t0 = time.perf_counter()
        model = p.get("model", "3b")
        pipe = self.upscaler(model, on_step)
        frames = torch.as_tensor(np.asarray(source.frames))
        notes = []
        out = pipe.upscale(frames, target_height=p.get("height"), target_width=p.get("width"), scale=p.get("scale"),
                           resolution=p.get("resolution"), color_fix=p.get("color_fix", "wavelet"),
                           seed=p.get("seed", 0), batch_frames=p.get("batch_frames"),
                           overlap_frames=p.get("overlap_frames", 4), tiling=p.get("tiling", True), on_step=on_step,
                           notes=notes)
        audio = None if source.audio is None else torch.as_tensor(np.asarray(source.audio, dtype=np.float32))
        notes = notes + [f"SeedVR2 {model.upper()}: {frames.shape[2]}x{frames.shape[1]} upscaled to {out.shape[2]}x"
                 f"{out.shape[1]}, {out.shape[0]} frames at {source.fps:g} fps"]
        return GenerateResult(out, audio, int(source.sample_rate), source.fps, None, None, notes,
                              {"total_s": time.perf_counter() - t0})

    def describe(self) -> dict | None:
        """The loaded models, for /v1/status."""
        describe = getattr(self.pipeline, "describe", None)
        models = describe() if describe is not None else None
        if models is not None and self._upscaler is not None:
            models = {**models, "upscaler": self._upscaler[1].describe()}
        parallel = getattr(self.pipeline, "parallel", None)
        if models is not None and parallel is not None and self.ctx.world_size > 1:
            models["parallel"] = parallel.mesh.describe()  # e.g. "tensor parallel x2 · ulysses x2"
        return models

    def shutdown(self) -> None:
        """Rank 0: releases the followers from their loop."""
        if self.ctx.rank == 0 and self.ctx.world_size > 1:
            dist.broadcast_object_list([None], src=0, group=self.ctx.control)


def follower_loop(runner: JobRunner) -> None:
    """Ranks > 0: run every job rank 0 dispatches until it sends the shutdown (None)."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=runner.ctx.control)
        spec = box[0]
        if spec is None:
            return
        try:
            runner.run(spec)
        except (Cancelled, PeerFailed) as exc:
            log_event("job.stopped", job=spec.job, reason=str(exc))
        except Exception as exc:
            log_event("job.failed", logging.ERROR, exc_info=exc, job=spec.job, error=type(exc).__name__)
