"""What a caller asks the H3 pipeline for, what it gets back, and the per-step event it sees."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class Cancelled(Exception):
    """Raised out of a pipeline task when the step callback asks to stop."""


@dataclass
class GenerateRequest:
    """t2va; fl2va when a first and/or last frame is given; ref2va when references are."""

    prompt: str
    seconds: float = 5.0
    width: int | None = None  # both or neither; default: the preset's canvas for `aspect`
    height: int | None = None
    aspect: str | None = None  # "16:9", "9:16", "1:1", ...; ignored when width/height are given
    steps: int | None = None  # sigma grid points incl. the terminal 0 (N points = N-1 DiT evaluations)
    seed: int = 0
    first_frame: np.ndarray | None = None  # uint8 [H, W, 3]
    last_frame: np.ndarray | None = None
    loras: list[tuple[str, float]] = field(default_factory=list)  # (path inside the models dir, scale)
    references: list = field(default_factory=list)  # ref2va: engine.models.h3.references types, in order
    reference_size: str = "diffusers"  # image references: "diffusers" | "match" | "max" (references.py)


@dataclass
class Source:
    """A clip to edit, extend or refine: pixels at `fps`, optional sound, optional latents of a previous job."""

    frames: np.ndarray | torch.Tensor  # uint8 [F, H, W, 3]
    fps: float = 24.0
    audio: np.ndarray | torch.Tensor | None = None  # float32 [C, S]
    sample_rate: int = 32000
    video_latents: torch.Tensor | None = None  # normalised [1, 24, T, h, w], when it came from our store
    audio_latents: torch.Tensor | None = None  # normalised [2, 32, Ta]


EDIT_PRESETS = {  # preset -> (default strength, default prompt when none is given)
    "remove": (1.0, "the empty scene behind, clean background, nothing in the masked area"),
    "replace": (1.0, None),
    "repaint": (0.75, None),
}


@dataclass
class EditRequest:
    """Masked edit: 0 keeps the source, 1 regenerates it, fractions blend (scaled by `strength`)."""

    source: Source
    mask: np.ndarray | torch.Tensor  # [H, W] or [F, H, W] (float 0..1 or uint8 0..255), source or canvas size
    prompt: str = ""
    preset: str = "replace"  # remove | replace | repaint
    strength: float | None = None  # default from the preset
    audio_mask: float | np.ndarray | torch.Tensor | None = None  # default: keep the source's sound, if any
    steps: int | None = None
    seed: int = 0
    loras: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ExtendRequest:
    """Continue a clip past one window: each window regenerates `overlap` latent frames of the previous tail."""

    source: Source
    seconds: float  # seconds to add
    prompts: list[str] = field(default_factory=list)  # one per window; the last one repeats
    overlap_latents: int = 7  # 7 latent frames = 22 pixel frames
    window_seconds: float = 15.0
    steps: int | None = None
    seed: int = 0
    loras: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class RefineRequest:
    """Latent upscale x1.5 / x2, re-noise to `strength`, second H3 pass at the larger canvas."""

    source: Source
    prompt: str
    scale: float = 2.0
    strength: float = 0.5
    steps: int | None = None
    seed: int = 0
    loras: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class StepEvent:
    step: int  # 1-based DiT evaluations done
    total: int
    video_x0: torch.Tensor  # current clean estimate, normalised latents [1, 24, T, h, w] (for previews)
    stage: str = "denoising"  # or e.g. "window 2/4"


@dataclass
class GenerateResult:
    frames: torch.Tensor  # uint8 [F, H, W, 3], CPU
    audio: torch.Tensor  # float32 [2, S], CPU
    sample_rate: int
    fps: int
    video_latents: torch.Tensor  # normalised [1, 24, T, h, w], CPU
    audio_latents: torch.Tensor  # normalised [2, 32, Ta], CPU
    notes: list[str] = field(default_factory=list)  # what was snapped, e.g. "5.2 s snapped to 124 frames"
    timings: dict[str, float] = field(default_factory=dict)
    mp4: bytes | None = None  # the H.264 + AAC file of frames and audio, when encoded during the decode
