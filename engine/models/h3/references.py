"""Ref2VA references (specs/h3.md §2.3, §4, §6): ordered images, videos (with or without their sound) and sounds,
the limits the released model was trained for, and their normalisation onto the model's rates and sizes.

The order is the request: it numbers the `<Picture i>` / `<Video k>` / `<Audio j>` labels of the presentation and
lays the references out on the shared rotary clock. Every message here is written for an artist.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from engine.models.h3 import layout as L
from engine.protocol import MAX_REFERENCES
from engine.protocol import REFERENCE_SIZES as RESIZE_MODES

MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS = 9, 3, 3
REFERENCE_SHORT_EDGE = 2048  # the released image-reference resolution ("diffusers" and "max" modes)
# The conditioner reads a reference video at 2 fps (every 12th frame at 24 fps) in pairs of frames: frames 0 and 12.
MIN_VIDEO_FRAMES = 13


@dataclass
class ImageReference:
    image: np.ndarray  # uint8 [H, W, 3]

    kind = "image"
    has_audio = False


@dataclass
class VideoReference:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float = 24.0
    audio: np.ndarray | None = None  # float32 [C, S], its own soundtrack; None: motion only
    sample_rate: int = 32000

    kind = "video"

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


@dataclass
class AudioReference:
    audio: np.ndarray  # float32 [C, S]
    sample_rate: int = 32000

    kind = "audio"
    has_audio = True


Reference = ImageReference | VideoReference | AudioReference


def check_image(what: str, image) -> np.ndarray:
    """An RGB uint8 [H, W, 3] image (grey and RGBA accepted), at least 16x16; `what` names it in the message."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    if image.ndim != 3 or image.shape[-1] not in (3, 4) or image.dtype != np.uint8:
        raise L.LayoutError(f"{what} must be an RGB image (uint8 H x W x 3), got {image.dtype} {list(image.shape)}.")
    if min(image.shape[:2]) < 16:
        raise L.LayoutError(f"{what} is too small ({image.shape[1]}x{image.shape[0]}); use at least 16x16.")
    return np.ascontiguousarray(image[..., :3])


def check_references(references) -> None:
    """The released limits: at most 9 images, 3 videos, 3 sounds, 12 in all, and never sound alone."""
    if not references:
        raise L.LayoutError("Reference to Video needs at least one reference image, video or sound.")
    kinds = [getattr(r, "kind", None) for r in references]
    for i, kind in enumerate(kinds, 1):
        if kind not in ("image", "video", "audio"):
            raise L.LayoutError(f"Reference {i} is a {type(references[i - 1]).__name__}; a reference is an image, "
                                "a video or a sound.")
    counts = {kind: kinds.count(kind) for kind in ("image", "video", "audio")}
    for kind, limit, word in (("image", MAX_IMAGES, "images"), ("video", MAX_VIDEOS, "videos"),
                              ("audio", MAX_AUDIOS, "sounds")):
        if counts[kind] > limit:
            raise L.LayoutError(f"{counts[kind]} reference {word} given; MiniMax-H3 takes at most {limit} "
                                f"(and {MAX_REFERENCES} references in all). Remove {counts[kind] - limit}.")
    if len(kinds) > MAX_REFERENCES:
        raise L.LayoutError(f"{len(kinds)} references given; MiniMax-H3 takes at most {MAX_REFERENCES} in all "
                            f"({MAX_IMAGES} images, {MAX_VIDEOS} videos, {MAX_AUDIOS} sounds).")
    if counts["audio"] == len(kinds):
        raise L.LayoutError("Sound references need at least one image or video reference beside them: MiniMax-H3 "
                            "cannot take sound alone (for sound only, describe it in the prompt).")


def reference_size(height: int, width: int, mode: str, target_pixels: int,
                   short_edge: int = REFERENCE_SHORT_EDGE) -> tuple[int, int]:
    """(height, width) an image reference is encoded at, aspect kept, both sides rounded to 32.

    "diffusers": short edge `short_edge` (upscaling allowed, no area cap), the released recipe; "match": the
    target canvas' area, never upscaled (what the ModelTC Ref2VA Turbo LoRA was trained with); "max": the image's
    own size, downscaled only past `short_edge`.
    """
    if mode == "diffusers":
        scale = short_edge / min(height, width)
    elif mode == "match":
        scale = min(1.0, (target_pixels / (height * width)) ** 0.5)
    elif mode == "max":
        scale = min(1.0, short_edge / min(height, width))
    else:
        check_mode(mode)
    m = L.CANVAS_MULTIPLE
    return max(m, round(height * scale / m) * m), max(m, round(width * scale / m) * m)


def check_mode(mode: str) -> None:
    if mode not in RESIZE_MODES:
        raise L.LayoutError(f"Reference resize mode {mode!r} is not one of {', '.join(RESIZE_MODES)}.")


def normalise_image(image, index: int, mode: str, target_pixels: int, short_edge: int) -> np.ndarray:
    image = check_image(f"Reference {index} (an image)", image)
    h, w = image.shape[:2]
    if not L.MIN_ASPECT <= w / h <= L.MAX_ASPECT:
        raise L.LayoutError(f"Reference {index} (an image) is {w}x{h}; MiniMax-H3 takes references from 1:4 to "
                            "4:1. Crop it.")
    height, width = reference_size(h, w, mode, target_pixels, short_edge)
    if (height, width) == (h, w):
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), Image.LANCZOS))


def normalise_video(frames, fps: float, index: int, num_frames: int, short_edge: int, max_pixels: int
                    ) -> np.ndarray:
    """Onto 24 fps (whole frames dropped or held, as ffmpeg's fps filter), truncated to the target's frame count,
    on the canvas of its own aspect ratio (LANCZOS)."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise L.LayoutError(f"Reference {index} (a video) must be uint8 RGB frames [F, H, W, 3], got "
                            f"{frames.dtype} {list(frames.shape)}.")
    if not np.isfinite(fps) or fps <= 0:
        raise L.LayoutError(f"Reference {index} (a video) needs a positive frame rate, got {fps}.")
    shown = np.arange(frames.shape[0])  # the source frame each 24 fps frame shows
    if fps != L.FPS:  # each frame held until the 24 fps slot of the next one, the last to where the stream ends
        scale = L.FPS / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        shown = np.repeat(shown, np.diff(slots, append=int(np.floor(frames.shape[0] * scale + 0.5))))
    if len(shown) < MIN_VIDEO_FRAMES:
        raise L.LayoutError(f"Reference {index} (a video) is {len(shown)} frames at 24 fps; a reference video "
                            f"needs at least {MIN_VIDEO_FRAMES} ({MIN_VIDEO_FRAMES / L.FPS:.2f} s): the model reads "
                            "it at 2 fps, in pairs of frames. Use a longer clip or give a frame as an image.")
    frames = frames[shown[:num_frames]]
    h, w = frames.shape[1:3]
    if not L.MIN_ASPECT <= w / h <= L.MAX_ASPECT:
        raise L.LayoutError(f"Reference {index} (a video) is {w}x{h}; MiniMax-H3 takes references from 1:4 to 4:1.")
    height, width = L.canvas_for_aspect(w, h, short_edge, max_pixels)
    if (height, width) == (h, w):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.LANCZOS)) for f in frames])


def encoded_frame_count(num_frames: int) -> int:
    """Frames of a reference video the VAE encodes: snapped down to 17n + 5, at least 22 (the reference
    implementation's rule; a shorter clip is padded by the VAE's own last-frame repetition)."""
    return min(num_frames, max(1, (num_frames - L.LATENTS_PER_CHUNK) // L.CLIP_LENGTH) * L.CLIP_LENGTH
               + L.LATENTS_PER_CHUNK)


def normalise_audio(audio, sample_rate: int, index: int, seconds: float) -> np.ndarray:
    """float32 [C, S] (mono or stereo), finite, truncated to the target's duration at its own sample rate."""
    wave = np.asarray(audio, dtype=np.float32)
    if wave.ndim == 1:
        wave = wave[None]
    if wave.ndim != 2 or wave.shape[0] not in (1, 2) or wave.shape[1] == 0 or not np.isfinite(wave).all():
        raise L.LayoutError(f"Reference {index} (a sound) must be finite mono or stereo samples [channels, "
                            f"samples], got {list(wave.shape)}.")
    return wave[:, :int(seconds * sample_rate)]


def normalise(references, num_frames: int, mode: str, target_pixels: int, short_edge: int, max_pixels: int,
              reference_short_edge: int = REFERENCE_SHORT_EDGE) -> list[Reference]:
    """The references checked and put on the model's grid, in order (sounds keep their own sample rate; the audio
    VAE resamples them to 32 kHz as it encodes)."""
    check_references(references)
    check_mode(mode)
    seconds = num_frames / L.FPS
    out = []
    for i, ref in enumerate(references, 1):
        audio = None
        if ref.has_audio:
            audio = normalise_audio(ref.audio, int(ref.sample_rate), i, seconds)
        if ref.kind == "image":
            out.append(ImageReference(normalise_image(ref.image, i, mode, target_pixels, reference_short_edge)))
        elif ref.kind == "video":
            out.append(VideoReference(normalise_video(ref.frames, float(ref.fps), i, num_frames, short_edge,
                                                      max_pixels), float(L.FPS), audio, int(ref.sample_rate)))
        else:
            out.append(AudioReference(audio, int(ref.sample_rate)))
    return out
