"""Chunk boundaries of a job's long phases other than the denoise steps (which are StepEvents).

A pipeline hands every boundary to the job's callback (`on_step`); the job runner makes each one a point where
all ranks agree to go on or stop (cancel, engine shutdown) and where rank 0 reports progress. Every rank must
pass the same boundaries in the same order, so a pipeline emits them only where all ranks run the same chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

STAGES = ("loading", "reading source", "encoding", "denoising", "decoding", "upscaling", "muxing")


@dataclass
class DecodedFrames:
    """Final frames [start, start + n) of a result of `total` frames, handed out as the decode makes them: rank 0
    streams them to the job's clients while the rest decodes."""

    start: int
    total: int
    pixels: torch.Tensor  # uint8 [n, H, W, 3] on the CPU; a view of the result's frames, never written again


@dataclass
class PhaseEvent:
    stage: str  # one of STAGES
    done: int  # chunks finished (0: the phase starts)
    total: int
    detail: str | None = None  # e.g. "video", "batch 1/2: VAE decode"
    preview: torch.Tensor | None = None  # uint8 [H, W, 3], where the phase has pixels to show
    collective: bool = True  # False: only rank 0 passes here (its MP4 mux); it reports, no rank agrees or stops
    frames: DecodedFrames | None = None  # a "decoding" chunk's final frames


class Phase:
    """Counts the boundaries of one phase: reports done 0 at once, then one more chunk per call."""

    def __init__(self, on_step: Callable[[PhaseEvent], None] | None, stage: str, total: int,
                 detail: str | None = None, collective: bool = True):
        self.on_step, self.stage, self.total, self.detail, self.collective = on_step, stage, total, detail, collective
        self.done = 0
        self._emit(None)

    def __call__(self, preview: torch.Tensor | None = None, frames: DecodedFrames | None = None) -> None:
        self.done += 1
        self._emit(preview, frames)

    def _emit(self, preview: torch.Tensor | None, frames: DecodedFrames | None = None) -> None:
        if self.on_step is not None:
            self.on_step(PhaseEvent(self.stage, self.done, self.total, self.detail, preview, self.collective, frames))
