"""H3Forge Masked Edit: object removal, replacement and repaint of a video region on the engine (task `edit`)."""

from __future__ import annotations

import asyncio

from .t2v import (CLIP_OUTPUT_TOOLTIPS, CLIP_RETURN_NAMES, CLIP_RETURN_TYPES, ENGINE_INPUT, LORA_INPUT, SEED_INPUT,
                  STEPS_INPUT, check_settings, job_loras, lora_problem, video_job)
from .lora import LORAS_INPUT
from .video_io import mask_to_uint8, source_of

PRESETS = ["remove", "replace", "repaint"]


class H3ForgeMaskedEdit:
    DESCRIPTION = ("Regenerates the masked part of a video with MiniMax-H3 on the H3Forge engine and keeps the rest "
                   "exactly: remove an object (the prompt may stay empty), replace it with what the prompt "
                   "describes, or repaint the area. White (1) in the mask is regenerated, black (0) kept, grey "
                   "blends; the engine works on 16x16-pixel cells, so check the mask with H3Forge Mask Preview.")
    CATEGORY = "H3Forge"
    FUNCTION = "edit"
    RETURN_TYPES, RETURN_NAMES, OUTPUT_TOOLTIPS = CLIP_RETURN_TYPES, CLIP_RETURN_NAMES, CLIP_OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "source": ("VIDEO", {"tooltip":
                           "The video to edit, 5 to 15 s (e.g. from Load Video). It is resampled to 24 fps and "
                           "resized to the model's canvas; its sound is kept unless keep_audio is off."}),
                "mask": ("MASK", {"tooltip":
                         "Where to regenerate: 1 (white) regenerate, 0 (black) keep; a mask of another size is "
                         "resized to the video. One mask for all frames, or one per frame (e.g. from H3Forge Mask "
                         "Track Box)."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                           "What the masked area should show (and how the clip sounds). May stay empty for "
                           "remove: the engine then asks for the empty background."}),
                "preset": (PRESETS, {"default": "remove", "tooltip":
                           "remove: fill the area with the background. replace: put the prompt's object there. "
                           "repaint: restyle the area, keeping some of its structure."}),
                "strength": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                             "How much of the masked area is regenerated (the mask is multiplied by it). 0 = the "
                             "preset's default: 1.0 for remove and replace, 0.75 for repaint."}),
                "keep_audio": ("BOOLEAN", {"default": True, "tooltip":
                               "Keep the source's sound exactly. Off: generate a new soundtrack from the prompt."}),
                "steps": STEPS_INPUT,
                "seed": SEED_INPUT,
            },
            "optional": {
                "engine": ENGINE_INPUT,
                "lora_list": LORA_INPUT,
                "loras": LORAS_INPUT,
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, prompt=None, preset=None, steps=0, lora_list=""):
        # Naming preset and steps here turns off ComfyUI's own checks for them, so they are checked here.
        if preset is not None and preset not in PRESETS:
            return f"preset must be one of {', '.join(PRESETS)}, got {preset!r}"
        if prompt is not None and preset in ("replace", "repaint") and not prompt.strip():
            return f"a {preset} edit needs a prompt describing the new content of the masked area"
        return check_settings(0, 0, int(steps)) or lora_problem(lora_list) or True

    async def edit(self, source, mask, prompt, preset, strength, keep_audio, steps, seed, engine=None,
                   lora_list="", loras=None, unique_id=None):
        problem = check_settings(0, 0, steps)
        if problem:
            raise ValueError(f"H3Forge: {problem}")
        params, tensors = await asyncio.to_thread(source_of, source)  # decoding and converting: off the loop
        tensors["mask"] = await asyncio.to_thread(mask_to_uint8, mask)
        params.update(prompt=prompt.strip() or None, preset=preset, strength=strength or None,
                      audio_mask=0.0 if keep_audio else 1.0, steps=steps or None, seed=int(seed),
                      loras=job_loras(loras, lora_list))
        return await video_job(engine, "edit", params, tensors, unique_id)
