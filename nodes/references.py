"""H3Forge References: ordered reference images, a video and a sound for a Ref2VA generation (task `ref2va`),
taken by H3Forge Text to Video's `references` input; chain several for more, or for another order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from .client import protocol
from .video_io import audio_samples, engine_module, images_to_uint8, video_media

REFERENCES_TYPE = "H3FORGE_REFERENCES"
REFERENCES_INPUT = (REFERENCES_TYPE, {"tooltip":
                    "References from H3Forge References nodes: the video is made from them and the prompt "
                    "(MiniMax-H3 Ref2VA). Not together with first_frame / last_frame."})
SIZES = list(protocol.REFERENCE_SIZES)
LIMITS = "at most 9 images, 3 videos and 3 sounds, 12 in all; a sound never alone"


def downscaled(image, max_pixels: int):
    """uint8 [H, W, 3], shrunk (aspect kept, LANCZOS) when it has more than `max_pixels` (0: no limit)."""
    import numpy as np
    from PIL import Image

    h, w = image.shape[:2]
    if not max_pixels or h * w <= max_pixels:
        return image
    scale = (max_pixels / (h * w)) ** 0.5
    return np.asarray(Image.fromarray(image).resize((max(16, round(w * scale)), max(16, round(h * scale))),
                                                    Image.LANCZOS))


class H3ForgeReferences:
    DESCRIPTION = ("Collects references for H3Forge Text to Video: the images (a batch counts as several), then the "
                   "video (with its sound, if keep_video_sound), then the sound, after those of a connected "
                   f"`references` chain. The order is what the model reads: {LIMITS}. Images show who or what "
                   "appears, a video the motion, a sound the voice or music.")
    CATEGORY = "H3Forge"
    FUNCTION = "collect"
    RETURN_TYPES = (REFERENCES_TYPE,)
    RETURN_NAMES = ("references",)
    OUTPUT_TOOLTIPS = ("The references so far; connect to `references` of H3Forge Text to Video or of another "
                       "H3Forge References.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "image_size": (SIZES, {"default": "diffusers", "tooltip":
                               "How the engine sizes reference images: diffusers = short edge 2048 (the released "
                               "recipe), match = the video's own area, never enlarged (what the Ref2VA Turbo LoRA "
                               "was trained with), max = as given, shrunk only past 2048. In a chain, the last "
                               "node's choice applies to every image."}),
                "max_megapixels": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 64.0, "step": 0.1, "tooltip":
                                   "Images larger than this are shrunk here before they are sent (0 = send as "
                                   "they are). 8 MP covers the diffusers size of a 16:9 image (2048x3648)."}),
                "keep_video_sound": ("BOOLEAN", {"default": True, "tooltip":
                                     "Use the video's soundtrack as a reference too (off: its motion only)."}),
            },
            "optional": {
                "references": (REFERENCES_TYPE, {"tooltip": "References that come before these ones."}),
                "images": ("IMAGE", {"tooltip": "Reference images (every image of the batch, in order)."}),
                "video": ("VIDEO", {"tooltip": "A reference video: resampled to 24 fps, cut to the generated "
                                               "length; at least 13 frames (0.54 s)."}),
                "audio": ("AUDIO", {"tooltip": "A reference sound (voice, music), beside at least one image or "
                                               "video."}),
            },
        }

    async def collect(self, image_size, max_megapixels, keep_video_sound, references=None, images=None, video=None,
                      audio=None):
        # Converting a long video's frames takes a while: off ComfyUI's event loop.
        return await asyncio.to_thread(self._collect, image_size, max_megapixels, keep_video_sound, references,
                                       images, video, audio)

    @staticmethod
    def _collect(image_size, max_megapixels, keep_video_sound, references, images, video, audio) -> tuple:
        items = list((references or {}).get("items", []))
        if images is not None:
            budget = int(max_megapixels * 1e6)
            items += [{"kind": "image", "image": downscaled(image, budget)} for image in images_to_uint8(images)]
        if video is not None:
            frames, fps, sound, rate = video_media(video)
            if not keep_video_sound:
                sound, rate = None, None
            items.append({"kind": "video", "frames": frames, "fps": float(fps), "audio": sound, "sample_rate": rate})
        if audio is not None:
            sound, rate = audio_samples(audio)
            items.append({"kind": "audio", "audio": sound, "sample_rate": rate})
        if not items:
            raise ValueError("H3Forge References: connect images, a video or a sound.")
        try:
            engine_module("engine.models.h3.references").check_references(
                [SimpleNamespace(kind=item["kind"]) for item in items])
        except ValueError as error:
            raise ValueError(f"H3Forge References: {error}") from None
        return ({"items": items, "image_size": image_size},)


def reference_job(references: dict) -> tuple[dict, dict]:
    """(params, tensors) of a ref2va job's references (engine/protocol.py's `references` and ref{i}_* tensors)."""
    entries, tensors = [], {}
    for i, item in enumerate(references["items"]):
        entry = {"kind": item["kind"]}
        if item["kind"] == "image":
            tensors[f"ref{i}_image"] = item["image"]
        if item["kind"] == "video":
            entry["fps"] = item["fps"]
            tensors[f"ref{i}_frames"] = item["frames"]
        if item.get("audio") is not None:
            entry["sample_rate"] = item["sample_rate"]
            tensors[f"ref{i}_audio"] = item["audio"]
        entries.append(entry)
    return {"references": entries, "ref_size": references["image_size"]}, tensors
