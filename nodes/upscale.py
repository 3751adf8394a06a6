"""H3Forge Upscale: SeedVR2 one-step restoration (task `upscale`) or latent upscale + an H3 second pass (task
`refine`) on the engine. The output keeps the source's sound and exact frame rate."""

from __future__ import annotations

import asyncio
from fractions import Fraction

from . import comfy_compat as comfy
from .t2v import (CLIP_OUTPUT_TOOLTIPS, CLIP_RETURN_NAMES, CLIP_RETURN_TYPES, ENGINE_INPUT, MAX_STEPS, SEED_INPUT,
                  SourceJobGone, video_job)
from .video_io import source_of

METHODS = ["SeedVR2", "H3 latent refine"]
MODELS = ["3B", "7B"]
RESOLUTIONS = ["1080p", "2K", "4K", "custom", "scale"]
COLOR_FIXES = ["wavelet", "lab", "none"]
REFINE_SCALES = (1.5, 2.0)
MAX_SIDE = 8192


def settings_problem(method: str, resolution: str, width: int, height: int, scale: float,
                     refine_prompt: str | None, refine_steps: int = 0) -> str | None:
    """Why a combination of settings cannot run, or None (ComfyUI skips its range checks of the inputs
    VALIDATE_INPUTS names, so they are here)."""
    for name, value in (("width", width), ("height", height)):
        if not 0 <= value <= MAX_SIDE:
            return f"{name} must be from 0 to {MAX_SIDE}, got {value}"
    if not 1.0 <= scale <= 8.0:
        return f"scale must be from 1 to 8, got {scale:g}"
    if refine_steps != 0 and not 2 <= refine_steps <= MAX_STEPS:
        return f"refine_steps must be 0 (engine default) or between 2 and {MAX_STEPS}, got {refine_steps}"
    if method == "H3 latent refine":
        if scale not in REFINE_SCALES:
            return f"H3 latent refine upscales by 1.5 or 2; set scale to one of them (got {scale:g})"
        if refine_prompt is not None and not refine_prompt.strip():
            return "H3 latent refine needs refine_prompt: describe what the clip shows and sounds like"
    elif resolution == "custom" and not (width or height):
        return "set width and/or height for a custom size (0 keeps the aspect ratio from the other side)"
    return None


def task_of(method, model, resolution, width, height, scale, color_fix, seed, batch_frames, tiling, refine_prompt,
            strength, refine_steps) -> tuple[str, dict]:
    """(engine task, params) for the node's settings."""
    if method == "H3 latent refine":
        return "refine", {"prompt": refine_prompt, "scale": float(scale), "strength": float(strength),
                          "steps": int(refine_steps) or None, "seed": int(seed)}
    params = {"model": model.lower(), "color_fix": color_fix, "seed": int(seed), "tiling": bool(tiling)}
    if batch_frames:
        params["batch_frames"] = int(batch_frames)
    if resolution == "custom":
        params.update({k: int(v) for k, v in (("width", width), ("height", height)) if v})
    elif resolution == "scale":
        params["scale"] = float(scale)
    else:
        params["resolution"] = resolution
    return "upscale", params


class H3ForgeUpscale:
    DESCRIPTION = ("Upscales a video on the H3Forge engine. SeedVR2 (3B or 7B) restores it in one step to 1080p, "
                   "2K, 4K or any size, spread over every GPU of the engine. H3 latent refine enlarges the H3 "
                   "latents x1.5 or x2 and runs a second, prompted H3 pass: faster, and it restyles more. The "
                   "sound and the exact frame rate of the source are kept.")
    CATEGORY = "H3Forge"
    FUNCTION = "upscale"
    RETURN_TYPES, RETURN_NAMES, OUTPUT_TOOLTIPS = CLIP_RETURN_TYPES, CLIP_RETURN_NAMES, CLIP_OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "source": ("VIDEO", {"tooltip": "The video to upscale, e.g. from H3Forge Text to Video or Load "
                                                "Video."}),
                "method": (METHODS, {"default": "SeedVR2", "tooltip":
                           "SeedVR2: faithful one-step restoration at any output size. H3 latent refine: x1.5 or "
                           "x2 latent upscale and a second H3 pass guided by refine_prompt."}),
                "model": (MODELS, {"default": "3B", "tooltip":
                          "SeedVR2 size: 3B is faster and lighter; 7B restores more detail."}),
                "resolution": (RESOLUTIONS, {"default": "1080p", "tooltip":
                               "SeedVR2 output size: 1080p / 2K / 4K set the short side (aspect kept), custom "
                               "uses width and height, scale multiplies the source size."}),
                "width": ("INT", {"default": 1920, "min": 0, "max": MAX_SIDE, "step": 2, "tooltip":
                          "Output width for resolution = custom; 0 = from height and the source's aspect."}),
                "height": ("INT", {"default": 1080, "min": 0, "max": MAX_SIDE, "step": 2, "tooltip":
                           "Output height for resolution = custom; 0 = from width and the source's aspect."}),
                "scale": ("FLOAT", {"default": 2.0, "min": 1.0, "max": 8.0, "step": 0.5, "tooltip":
                          "Size factor for resolution = scale, and for H3 latent refine (1.5 or 2)."}),
                "color_fix": (COLOR_FIXES, {"default": "wavelet", "tooltip":
                              "SeedVR2 colour correction against the source: wavelet keeps its colours and "
                              "takes the new detail; lab matches colour statistics; none leaves the output "
                              "as is."}),
                "seed": SEED_INPUT,
                "batch_frames": ("INT", {"default": 0, "min": 0, "max": 100000, "tooltip":
                                 "SeedVR2 frames per batch, snapped to 4n+1 (5, 9, ..., 81, ...); batches overlap "
                                 "by 4 frames and are crossfaded. 0 = the whole clip in one batch (best temporal "
                                 "consistency, most memory)."}),
                "tiling": ("BOOLEAN", {"default": True, "tooltip":
                           "Encode and decode with the SeedVR2 VAE in 1024 px tiles: much less memory at "
                           "1080p and above, faint seams possible."}),
                "refine_prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                                  "H3 latent refine: what the clip shows and sounds like."}),
                "strength": ("FLOAT", {"default": 0.5, "min": 0.05, "max": 1.0, "step": 0.05, "tooltip":
                             "H3 latent refine: how much the second pass may change (the noise level it starts "
                             "from). Low keeps the source; high invents more detail."}),
                "refine_steps": ("INT", {"default": 0, "min": 0, "max": MAX_STEPS, "tooltip":
                                 "H3 latent refine: sampling steps of the whole schedule, counted like the "
                                 "MiniMax-H3 releases; the pass runs the part below strength. 0 = the engine's "
                                 "default; a 4-step Turbo LoRA on the engine needs 5."}),
            },
            "optional": {
                "engine": ENGINE_INPUT,
                "source_job": ("STRING", {"forceInput": True, "tooltip":
                               "job_id of the node that made the source video. The engine then reuses its stored "
                               "result instead of receiving the video; if it no longer has it, the video is "
                               "sent."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, method=None, resolution=None, width=0, height=0, scale=2.0, refine_prompt=None,
                        refine_steps=0):
        if method is None:  # linked from another node: checked when it runs
            return True
        return settings_problem(method, resolution, int(width), int(height), float(scale), refine_prompt,
                                int(refine_steps)) or True

    async def upscale(self, source, method, model, resolution, width, height, scale, color_fix, seed,
                      batch_frames, tiling, refine_prompt, strength, refine_steps, engine=None, source_job=None,
                      unique_id=None):
        problem = settings_problem(method, resolution, width, height, scale, refine_prompt, refine_steps)
        if problem:
            raise ValueError(f"H3Forge: {problem}")
        task, params = task_of(method, model, resolution, width, height, scale, color_fix, seed, batch_frames,
                               tiling, refine_prompt, strength, refine_steps)
        outputs = None
        if source_job and source_job.strip():
            try:
                outputs = await video_job(engine, task, {**params, "source_job": source_job.strip()}, {}, unique_id)
            except SourceJobGone as gone:
                comfy.send_progress_text(f"{gone} Sending the video instead.", unique_id)
        if outputs is None:
            source_params, tensors = await asyncio.to_thread(source_of, source)
            outputs = await video_job(engine, task, {**params, **source_params}, tensors, unique_id)
        video, frames, audio, job = outputs
        rate = Fraction(source.get_frame_rate())
        if task == "upscale" and video.get_frame_rate() != rate:  # the wire carries it as a float
            video = comfy.VideoFromComponents(comfy.VideoComponents(
                images=frames, audio=video.get_components().audio, frame_rate=rate))
        return video, frames, audio, job
