"""H3Forge Extend Video: continue a clip past one 15 s window on the engine (task `extend`)."""

from __future__ import annotations

import asyncio

from . import comfy_compat as comfy
from .t2v import (CLIP_OUTPUT_TOOLTIPS, CLIP_RETURN_NAMES, CLIP_RETURN_TYPES, ENGINE_INPUT, LORA_INPUT, SEED_INPUT,
                  STEPS_INPUT, SourceJobGone, check_settings, job_loras, lora_problem, video_job)
from .lora import LORAS_INPUT
from .video_io import source_of


def prompt_lines(text: str) -> list[str]:
    """One prompt per non-empty line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


class H3ForgeExtendVideo:
    DESCRIPTION = ("Continues a video past MiniMax-H3's 15 s window on the H3Forge engine: each new window "
                   "regenerates the last latent frames of the one before and continues picture and sound from "
                   "there. The source's own frames come back unchanged. Connect job_id from the node that made "
                   "the video to skip sending and re-encoding it.")
    CATEGORY = "H3Forge"
    FUNCTION = "extend"
    RETURN_TYPES, RETURN_NAMES, OUTPUT_TOOLTIPS = CLIP_RETURN_TYPES, CLIP_RETURN_NAMES, CLIP_OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "source": ("VIDEO", {"tooltip":
                           "The video to continue (at least about 1 s; resampled to 24 fps and resized to the "
                           "model's canvas)."}),
                "prompts": ("STRING", {"multiline": True, "default": "", "tooltip":
                            "What happens next, one prompt per line: line 1 for the first new window, line 2 for "
                            "the second, ...; the last line repeats for any further windows."}),
                "seconds": ("FLOAT", {"default": 10.0, "min": 1.0, "max": 600.0, "step": 0.5, "tooltip":
                            "Seconds to add. Windows end on the model's frame grid, so a little more may come."}),
                "overlap": ("INT", {"default": 7, "min": 2, "max": 12, "step": 5, "tooltip":
                            "Latent frames of the previous window each new one continues from: 2, 7 or 12 "
                            "(5, 22 or 39 video frames). More overlap: smoother joins, more work per window."}),
                "window_seconds": ("FLOAT", {"default": 15.0, "min": 5.0, "max": 15.0, "step": 0.5, "tooltip":
                                   "Length of each generated window, overlap included. Shorter windows need "
                                   "less memory; 15 s is the model's longest."}),
                "steps": STEPS_INPUT,
                "seed": SEED_INPUT,
            },
            "optional": {
                "engine": ENGINE_INPUT,
                "source_job": ("STRING", {"forceInput": True, "tooltip":
                               "job_id of the node that made the source video. The engine then reuses its stored "
                               "frames, sound and latents; if it no longer has them, the video is sent instead."}),
                "lora_list": LORA_INPUT,
                "loras": LORAS_INPUT,
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, prompts=None, steps=0, lora_list=""):
        if prompts is not None and not prompt_lines(prompts):
            return "write at least one prompt describing what happens next"
        return check_settings(0, 0, int(steps)) or lora_problem(lora_list) or True

    async def extend(self, source, prompts, seconds, overlap, window_seconds, steps, seed, engine=None,
                     source_job=None, lora_list="", loras=None, unique_id=None):
        lines = prompt_lines(prompts)
        if not lines:
            raise ValueError("H3Forge: write at least one prompt describing what happens next")
        problem = check_settings(0, 0, steps)
        if problem:
            raise ValueError(f"H3Forge: {problem}")
        params = {"prompts": lines, "seconds": float(seconds), "overlap_latents": int(overlap),
                  "window_seconds": float(window_seconds), "steps": steps or None, "seed": int(seed),
                  "loras": job_loras(loras, lora_list)}
        if source_job and source_job.strip():
            try:
                return await video_job(engine, "extend", {**params, "source_job": source_job.strip()}, {}, unique_id)
            except SourceJobGone as gone:
                comfy.send_progress_text(f"{gone} Sending the video instead.", unique_id)
        source_params, tensors = await asyncio.to_thread(source_of, source)
        return await video_job(engine, "extend", {**params, **source_params}, tensors, unique_id)
