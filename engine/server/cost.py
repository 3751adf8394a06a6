"""What a job will cost, worked out at submit from its parameters and its source's size (raw frames' shape, a
video file's container header, a stored result) before anything is decoded or allocated, and checked against this
engine's limits (engine.protocol.Limits, announced in `welcome` and /v1/status): the frames it decodes, resamples
or makes (frames x height x width after resampling), the preset's canvas, and its denoising work (steps x frames x
canvas pixels of one window). A refusal names the limit and what would fit."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np

from engine.io.video import probe_video
from engine.models.h3 import layout as L
from engine.models.h3.pipeline import FULL_CANVAS, TINY_CANVAS, Canvas
from engine.models.h3.references import check_references
from engine.models.h3.request import Source
from engine.models.seedvr2.pipeline import output_size
from engine.protocol import Limits, ProtocolError

MIN_SIDE, MAX_SIDE = 16, 8192  # of a source's frames, as engine.protocol checks raw frames
MAX_UPSCALE_ASPECT = 64  # SeedVR2's windows need both sides of the token grid; 512:1 leaves one with none
TINY_STEP_FACTOR = 20  # the tiny preset takes this many times its default steps at its largest canvas, 15 s


def preset_canvas(preset: str | None) -> Canvas:
    return TINY_CANVAS if preset else FULL_CANVAS


def preset_limits(limits: Limits, preset: str | None) -> Limits:
    """`limits` with the canvas, denoising work and upscale size of the engine's weights: the tiny preset is
    trained at 224x128 and runs on a laptop CPU, so it takes far less work per job than the real model."""
    canvas = preset_canvas(preset)
    if not preset:
        return replace(limits, max_canvas_pixels=canvas.max_pixels)
    longest = L.frames_for_seconds(L.MAX_SECONDS)[0]
    return replace(limits, max_canvas_pixels=canvas.max_pixels,
                   max_step_work=TINY_STEP_FACTOR * canvas.default_steps * longest * canvas.max_pixels,
                   max_upscale_pixels=2048 * 2048)


@dataclass(frozen=True)
class SourceSize:
    frames: int
    height: int
    width: int
    fps: float
    what: str  # "the source video", for messages


def _too_large(message: str):
    raise ProtocolError("too_large", message)


def _invalid(message: str):
    raise ProtocolError("invalid_request", message)


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


def check_cost(task: str, params: dict, tensors: dict, stored: Source | None, limits: Limits,
               canvas: Canvas) -> None:
    """Raises ProtocolError ("too_large" / "invalid_request") when `task` would need more than `limits` allow."""
    if task in ("t2va", "fl2va", "ref2va"):
        if task == "ref2va":
            try:
                check_references([SimpleNamespace(kind=r["kind"]) for r in params["references"]])
            except L.LayoutError as exc:
                _invalid(f"{task}: {exc}")
        frames = _frames(params.get("seconds", 5.0))[0]
        height, width = _generate_canvas(params, tensors, canvas, limits)
        _check_work(params, canvas, limits, frames, height, width, "this clip")
        return
    source = source_size(params, tensors, stored, limits)
    if task == "upscale":
        _check_upscale(params, source, limits)
        return
    frames = _resampled(source, limits)
    try:
        height, width = L.canvas_for_aspect(source.width, source.height, canvas.short_edge, canvas.max_pixels)
    except L.LayoutError as exc:
        _invalid(f"{task}: {exc}")
    if task == "extend":
        added = int(round(float(params["seconds"]) * L.FPS))
        total = frames + added
        _check_video_bytes(total, height, width, limits, f"the extended clip ({total / L.FPS:.1f} s at {width}x"
                                                          f"{height})", "fewer seconds to add or a shorter source")
        window = L.align_num_frames(int(round(min(params.get("window_seconds", 15.0), L.MAX_SECONDS) * L.FPS)))
        _check_work(params, canvas, limits, window, height, width, "each window")
        return
    frames = _frames(frames / L.FPS)[0]  # edit and refine work on one window: 5 to 15 s
    if task == "refine":
        scale = float(params.get("scale", 2.0))
        height, width = round(height * scale), round(width * scale)
    _check_video_bytes(frames, height, width, limits, f"the result ({frames} frames at {width}x{height})",
                       "a shorter source")
    _check_work(params, canvas, limits, frames, height, width, "this clip")


def _frames(seconds) -> tuple[int, str | None]:
    try:
        return L.frames_for_seconds(float(seconds))
    except L.LayoutError as exc:
        _invalid(str(exc))


def _generate_canvas(params: dict, tensors: dict, canvas: Canvas, limits: Limits) -> tuple[int, int]:
    if "width" in params:
        try:
            height, width, _ = L.check_canvas(params["height"], params["width"], max_pixels=L.MAX_PIXELS)
        except L.LayoutError as exc:
            _invalid(str(exc))
        if height * width > limits.max_canvas_pixels * 1.02:
            best = L.canvas_for_aspect(width, height, canvas.short_edge, limits.max_canvas_pixels)
            _too_large(f"{params['width']}x{params['height']} is larger than this engine's canvas of "
                       f"{limits.max_canvas_pixels} pixels (its weights were trained at up to that; at this aspect "
                       f"ratio {best[1]}x{best[0]} fits). Ask for that, or leave width and height out to let the "
                       f"aspect ratio pick the canvas, and upscale afterwards.")
        return height, width
    if "first_frame" in tensors and "aspect" not in params:
        h, w = tensors["first_frame"].shape[:2]
        aspect = (float(w), float(h))
    else:
        w, _, h = str(params.get("aspect", "16:9")).partition(":")
        aspect = (float(w), float(h))
    try:
        return L.canvas_for_aspect(*aspect, canvas.short_edge, canvas.max_pixels)
    except L.LayoutError as exc:
        _invalid(str(exc))


def _check_work(params: dict, canvas: Canvas, limits: Limits, frames: int, height: int, width: int,
                what: str) -> None:
    steps = int(params.get("steps", canvas.default_steps))
    work = steps * frames * height * width
    if work > limits.max_step_work:
        fits = limits.max_step_work // (frames * height * width)
        advice = (f"at most {fits} steps fit at this length and size" if fits >= 2 else
                  "not even 2 steps fit at this length and size")
        _too_large(f"{steps} steps for {what} ({frames} frames at {width}x{height}) is more denoising work than this "
                   f"engine takes for one job ({limits.max_step_work:.3g} step-pixels): {advice}; fewer seconds or a "
                   f"smaller canvas allow more steps.")


def _check_video_bytes(frames: int, height: int, width: int, limits: Limits, what: str, advice: str) -> None:
    need = frames * height * width * 3
    if need > limits.max_video_bytes:
        _too_large(f"{what[0].upper()}{what[1:]} would be {_gb(need)} of frames; this engine holds at most "
                   f"{_gb(limits.max_video_bytes)} of video per job. Try {advice}.")


def source_size(params: dict, tensors: dict, stored: Source | None, limits: Limits) -> SourceSize:
    """The source clip's frame count, size and rate, read without decoding it; its duration and decoded size
    checked."""
    if stored is not None:
        f, h, w = stored.frames.shape[:3]
        size = SourceSize(f, h, w, float(stored.fps), "the stored result")
    elif "source_frames" in tensors:
        f, h, w = tensors["source_frames"].shape[:3]
        size = SourceSize(f, h, w, float(params.get("source_fps", 24.0)), "source_frames")
    else:
        size = _mp4_size(tensors["source_mp4"], limits)
    seconds = size.frames / size.fps
    if seconds > limits.max_source_seconds:
        _too_large(f"{size.what[0].upper()}{size.what[1:]} is {size.frames} frames at {size.fps:g} fps, "
                   f"{seconds:.4g} s; this engine takes sources of up to {limits.max_source_seconds:g} s. Check the "
                   f"frame rate (source_fps) or cut the clip.")
    return size


def _mp4_size(data: np.ndarray, limits: Limits) -> SourceSize:
    try:
        info = probe_video(data.tobytes())
    except ValueError as exc:
        _invalid(f"The source video could not be decoded ({exc}). Send a video file (MP4, MOV, WebM) with a video "
                 f"stream.")
    if not (MIN_SIDE <= info.height <= MAX_SIDE and MIN_SIDE <= info.width <= MAX_SIDE):
        _invalid(f"The source video is {info.width}x{info.height}; videos must be {MIN_SIDE} to {MAX_SIDE} pixels "
                 f"per side.")
    if not info.frames or not (math.isfinite(info.fps) and info.fps > 0):
        _invalid("The source video's header does not say how many frames it has or at what rate; save it again "
                 "as MP4 (H.264).")
    size = SourceSize(info.frames, info.height, info.width, info.fps, "the source video")
    _check_video_bytes(info.frames, info.height, info.width, limits,
                       f"the source video decoded ({info.frames} frames at {info.width}x{info.height})",
                       "a shorter or smaller video")
    return size


def _resampled(source: SourceSize, limits: Limits) -> int:
    """Frames of the source at 24 fps (engine.models.h3.source.frame_index); the resampled frames are held at the
    source's size before they go onto the canvas."""
    if abs(source.fps - L.FPS) <= 1e-3:
        return source.frames
    frames = max(1, int(round(source.frames / source.fps * L.FPS)))
    _check_video_bytes(frames, source.height, source.width, limits,
                       f"{source.what} at 24 fps ({frames} frames at {source.width}x{source.height})",
                       "a shorter clip, or check its frame rate (source_fps)")
    return frames


def _check_upscale(params: dict, source: SourceSize, limits: Limits) -> None:
    try:
        out_h, out_w = output_size(source.height, source.width, params.get("height"), params.get("width"),
                                   params.get("scale"), params.get("resolution"))
    except ValueError as exc:
        _invalid(f"upscale: {exc}")
    if max(out_h, out_w) > MAX_UPSCALE_ASPECT * min(out_h, out_w):
        _invalid(f"upscale: the output {out_w}x{out_h} is longer than {MAX_UPSCALE_ASPECT}:1; SeedVR2 upscales "
                 f"sides of at most that ratio.")
    if out_h * out_w > limits.max_upscale_pixels:
        factor = math.sqrt(limits.max_upscale_pixels / (source.height * source.width))
        _too_large(f"upscale: {out_w}x{out_h} is more than this engine's upscale limit of "
                   f"{limits.max_upscale_pixels} pixels per frame; from {source.width}x{source.height} at most "
                   f"x{math.floor(factor * 100) / 100:g} fits (scale, or a smaller resolution).")
    _check_video_bytes(source.frames, out_h, out_w, limits,
                       f"the upscaled clip ({source.frames} frames at {out_w}x{out_h})",
                       "a shorter clip or a smaller output size")
