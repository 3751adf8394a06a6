"""H3Forge Text to Video (+ audio): a t2va / fl2va / ref2va job on the engine, with progress, preview and cancel.

Also the plumbing every engine-job node shares: the common inputs (steps, seed, engine, LoRAs), `run_job` (progress
bar, live preview, status text, interrupt -> engine cancel, readable errors) and `video_job` (-> VIDEO, IMAGE,
AUDIO and the engine's job id, which later nodes pass as `source_job` to start from the stored result).
"""

from __future__ import annotations

import asyncio
import io
import time
from functools import partial

from . import comfy_compat as comfy
from .client import EngineError
from .engine_node import ENGINE_TYPE, connect, readable_error, speed_params
from .lora import LORAS_INPUT
from .references import REFERENCES_INPUT, reference_job
from .video_io import ResultImages, images_to_uint8, result_outputs

ASPECTS = ["16:9", "9:16", "1:1", "4:3", "3:4", "21:9", "auto"]
MAX_SIDE = 4096
MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
PREVIEW_MAX_SIZE = 512
INTERRUPT_POLL_S = 0.1

# Inputs shared by the engine-job nodes.
STEPS_INPUT = ("INT", {"default": 0, "min": 0, "max": MAX_STEPS, "tooltip":
               "Sampling steps, counted like the MiniMax-H3 releases (sigma grid points: N steps = N-1 model "
               "evaluations). 0 = the engine's default for the loaded model. About 50 for the base model; a "
               "4-step Turbo LoRA needs 5. More is slower."})
SEED_INPUT = ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "tooltip":
              "Random seed; the same seed and inputs give the same video."})
ENGINE_INPUT = (ENGINE_TYPE, {"tooltip":
                "Engine settings from an H3Forge Engine node. Without it: the local engine at "
                "ws://127.0.0.1:8190, started automatically if needed."})
LORA_INPUT = ("STRING", {"multiline": True, "default": "", "tooltip":
              "More LoRAs (older workflows; the H3Forge LoRA node picks them from a list), one per line as "
              "file.safetensors:scale, with paths inside the engine's models or loras folders. Example: "
              "turbo.safetensors:1.0"})
# Outputs of every node that gets a clip from the engine.
CLIP_RETURN_TYPES = ("VIDEO", "IMAGE", "AUDIO", "STRING")
CLIP_RETURN_NAMES = ("video", "frames", "audio", "job_id")
CLIP_OUTPUT_TOOLTIPS = ("The video with its audio track.", "The video frames as an image batch.", "The soundtrack.",
                        "The engine's id for this result. Connect it to source_job of H3Forge Extend Video (or an "
                        "upscaler) to start from the stored result without sending and re-encoding the video.")


def parse_lora_list(text: str) -> list[list]:
    """One `file.safetensors:scale` per line (scale optional, default 1.0); blank lines and `#` comments skipped."""
    loras = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        path, sep, scale = line.rpartition(":")
        if not sep:
            path, scale = line, "1.0"
        try:
            value = float(scale)
        except ValueError:
            raise ValueError(f"LoRA line {number} ({line!r}): write it as file.safetensors:scale, "
                             f"e.g. turbo.safetensors:1.0") from None
        if not path.strip():
            raise ValueError(f"LoRA line {number} ({line!r}) has no file name")
        loras.append([path.strip(), value])
    return loras


def job_loras(chain, lora_list: str) -> list[list]:
    """The job's LoRAs: the H3Forge LoRA chain, then the lines of lora_list."""
    return [list(entry) for entry in (chain or [])] + parse_lora_list(lora_list)


def check_settings(width: int, height: int, steps: int) -> str | None:
    """Why a width/height/steps choice is not usable, or None. 0 means: the engine decides."""
    if steps != 0 and not 2 <= steps <= MAX_STEPS:
        return f"steps must be 0 (engine default) or between 2 and {MAX_STEPS}, got {steps}"
    if (width == 0) != (height == 0):
        return "set both width and height, or leave both at 0 to use the aspect ratio"
    for name, value in (("width", width), ("height", height)):
        if value < 0 or value > MAX_SIDE or value % 32:
            return f"{name} must be a multiple of 32 between 32 and {MAX_SIDE} (or 0), got {value}"
    return None


def lora_problem(text: str) -> str | None:
    """Why a LoRA list cannot be parsed, or None."""
    try:
        parse_lora_list(text)
    except ValueError as error:
        return str(error)
    return None


def image_to_uint8(image, name: str):
    """First image of a ComfyUI IMAGE batch [B,H,W,C] float 0..1 as uint8 [H,W,3] numpy."""
    batch = image[None] if image.ndim == 3 else image
    if batch.ndim != 4 or batch.shape[-1] not in (3, 4):
        raise ValueError(f"H3Forge: {name} must be an RGB image, got shape {tuple(image.shape)}")
    return images_to_uint8(batch[:1])[0]


def describe(event) -> str:
    """Status text for a progress event, e.g. "H3Forge: denoising 3/49 (window 2/4), about 40 s left"; every phase
    of a job (loading, reading source, encoding, denoising, decoding, upscaling, muxing) counts its chunks."""
    text = event.stage
    if event.stage == "queued" and event.position is not None:
        text += f", {event.position} job{'s' if event.position != 1 else ''} ahead"
    elif event.total:
        text += f" {event.step}/{event.total}"
        if event.detail:
            text += f" ({event.detail})"
        if event.eta_s is not None:
            text += f", about {event.eta_s:.0f} s left"
    return f"H3Forge: {text}"


class H3ForgeTextToVideo:
    DESCRIPTION = ("Generates a video with a matching soundtrack from a prompt on the H3Forge engine (MiniMax-H3). "
                   "Connect first_frame and/or last_frame to start or end on given images, or references (H3Forge "
                   "References: images, videos, sounds) to generate from them (Ref2VA). Shows step progress with a "
                   "live preview; Cancel stops the engine job at the next step.")
    CATEGORY = "H3Forge"
    FUNCTION = "generate"
    RETURN_TYPES, RETURN_NAMES, OUTPUT_TOOLTIPS = CLIP_RETURN_TYPES, CLIP_RETURN_NAMES, CLIP_OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                           "What happens and what it sounds like: scene, action, camera, dialogue, music."}),
                "seconds": ("FLOAT", {"default": 5.0, "min": 5.0, "max": 15.0, "step": 0.1, "tooltip":
                            "Length of the clip. Rounded up to the model's frame grid (24 fps, 17n+5 "
                            "frames: 5 s gives 124 frames)."}),
                "aspect": (ASPECTS, {"default": "16:9", "tooltip":
                           "Aspect ratio of the canvas when width and height are 0. auto = the first "
                           "frame's aspect ratio (16:9 without a first frame)."}),
                "width": ("INT", {"default": 0, "min": 0, "max": MAX_SIDE, "step": 32, "tooltip":
                          "Frame width in pixels, a multiple of 32. 0 = from the aspect ratio at the "
                          "model's default resolution (set height too)."}),
                "height": ("INT", {"default": 0, "min": 0, "max": MAX_SIDE, "step": 32, "tooltip":
                           "Frame height in pixels, a multiple of 32. 0 = from the aspect ratio."}),
                "steps": STEPS_INPUT,
                "seed": SEED_INPUT,
            },
            "optional": {
                "engine": ENGINE_INPUT,
                "first_frame": ("IMAGE", {"tooltip":
                                "Image the video starts on (first image of the batch), resized to the "
                                "canvas; set aspect to auto to keep its proportions."}),
                "last_frame": ("IMAGE", {"tooltip":
                               "Image the video ends on (first image of the batch), cropped to cover the "
                               "canvas."}),
                "lora_list": LORA_INPUT,
                "loras": LORAS_INPUT,
                "references": REFERENCES_INPUT,
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, width=0, height=0, steps=0, lora_list=""):
        # Naming an input here turns off ComfyUI's own range check for it, so check_settings does it.
        return check_settings(int(width), int(height), int(steps)) or lora_problem(lora_list) or True

    async def generate(self, prompt, seconds, aspect, width, height, steps, seed,
                       engine=None, first_frame=None, last_frame=None, lora_list="", loras=None,
                       references=None, unique_id=None):
        problem = check_settings(width, height, steps)
        if problem:
            raise ValueError(f"H3Forge: {problem}")
        if references is not None and (first_frame is not None or last_frame is not None):
            raise ValueError("H3Forge: connect references or first_frame / last_frame, not both (give a start "
                             "image as a reference image instead).")
        params = {
            "prompt": prompt, "seconds": float(seconds), "aspect": None if aspect == "auto" else aspect,
            "width": width or None, "height": height or None, "steps": steps or None, "seed": int(seed),
            "loras": job_loras(loras, lora_list),
        }
        if references is not None:
            extra, tensors = reference_job(references)
            return await video_job(engine, "ref2va", {**params, **extra}, tensors, unique_id)
        tensors = await asyncio.to_thread(keyframe_tensors, first_frame, last_frame)
        return await video_job(engine, "fl2va" if tensors else "t2va", params, tensors, unique_id)


def keyframe_tensors(first_frame, last_frame) -> dict:
    """The keyframes of an fl2va job as uint8 images (none: t2va)."""
    tensors = {}
    if first_frame is not None:
        tensors["first_frame"] = image_to_uint8(first_frame, "first_frame")
    if last_frame is not None:
        tensors["last_frame"] = image_to_uint8(last_frame, "last_frame")
    return tensors


class SourceJobGone(ValueError):
    """The engine no longer has the result a `source_job` names (it restarted, or the result expired)."""


async def video_job(engine, task: str, params: dict, tensors: dict, unique_id) -> tuple:
    """Runs an engine task that returns a clip: (VIDEO, IMAGE, AUDIO, job id). Everything heavy here (the
    conversion of each streamed chunk of frames as it arrives, then of the rest of the result) runs on a worker
    thread: ComfyUI runs its nodes on one event loop, whose other nodes' network timers must keep running."""
    comfy.send_progress_text("H3Forge: connecting to the engine", unique_id)
    client = await connect(engine)
    if task != "upscale":  # SeedVR2 has its own attention and no VSA
        params = {**params, **speed_params(engine)}
    images = ResultImages()
    result = await run_job(client, task, params, tensors, unique_id, partial(asyncio.to_thread, images.convert))
    return (*await asyncio.to_thread(result_outputs, result, images), result.job)


async def run_job(client, task: str, params: dict, tensors: dict, unique_id, on_frames=None):
    """Runs one engine job with ComfyUI progress, live preview, status text and interrupt → engine cancel;
    `on_frames` goes to the client. Raises SourceJobGone when the engine has no result for params["source_job"]."""
    from PIL import Image

    cancel = asyncio.Event()
    interrupted: list[BaseException] = []  # an interrupt raised by ComfyUI's progress hook
    bar = comfy.ProgressBar(max((params.get("steps") or 2) - 1, 1), node_id=unique_id)
    started = time.monotonic()

    def on_progress(event):
        comfy.send_progress_text(describe(event), unique_id)
        if not event.total or cancel.is_set():  # queued / starting: nothing to count yet
            return
        preview = None
        if event.preview_jpeg:
            preview = ("JPEG", Image.open(io.BytesIO(event.preview_jpeg)).convert("RGB"), PREVIEW_MAX_SIZE)
        try:
            bar.update_absolute(event.step, event.total, preview)
        except comfy.InterruptProcessingException as error:
            interrupted.append(error)
            cancel.set()

    async def watch_interrupt():
        while not cancel.is_set():
            if comfy.processing_interrupted():
                cancel.set()
                return
            await asyncio.sleep(INTERRUPT_POLL_S)

    watcher = asyncio.create_task(watch_interrupt())
    try:
        result = await client.run(task, params, tensors or None, on_progress=on_progress, cancel=cancel,
                                  on_frames=on_frames)
    except EngineError as error:
        if cancel.is_set():
            _raise_interrupt(interrupted)
        if error.code == "unknown_job":
            raise SourceJobGone(f"H3Forge: {error.message}") from None
        raise await readable_error(error, client.url) from None
    finally:
        watcher.cancel()
    if cancel.is_set():  # the job finished before the engine saw the cancel: still honour the Stop
        _raise_interrupt(interrupted)
    notes = "".join(f"; {note}" for note in result.meta.get("notes", []))
    comfy.send_progress_text(f"H3Forge: done in {time.monotonic() - started:.1f} s{notes}", unique_id)
    return result


def _raise_interrupt(interrupted: list[BaseException]):
    if interrupted:
        raise interrupted[0]
    comfy.throw_exception_if_processing_interrupted()
    raise comfy.InterruptProcessingException()
