"""What a caller asks the H3 pipeline for, what it gets back, and the per-step event it sees."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class Cancelled(Exception):
    """Raised out of `H3Pipeline.generate` when the step callback asks to stop."""


@dataclass
class GenerateRequest:
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


@dataclass
class StepEvent:
    step: int  # 1-based DiT evaluations done
    total: int
    video_x0: torch.Tensor  # current clean estimate, normalised latents [1, 24, T, h, w] (for previews)


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
