"""Running one job on every rank: rank 0 broadcasts it, all ranks run the same pipeline call, and all agree
at each step boundary (engine.runtime.agreement). Ranks other than 0 sit in `follower_loop`."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch.distributed as dist

from engine.models.h3.request import Cancelled, GenerateRequest, GenerateResult, StepEvent
from engine.runtime.agreement import PeerFailed, StepAgreement
from engine.runtime.log import log_event
from engine.runtime.ranks import RankContext


@dataclass
class JobSpec:
    """What every rank needs to run a job; pickled in the dispatch broadcast."""

    job: str
    task: str
    params: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSource:
    preset: str | None = None
    models_dir: str | None = None

    def describe(self) -> str:
        return f"preset {self.preset}" if self.preset else f"models {self.models_dir}"


def load_pipeline(source: ModelSource, ctx: RankContext):
    from engine.models.h3.pipeline import H3Pipeline  # heavy (torch, diffusers): only inside the engine

    if source.preset:
        return H3Pipeline.from_preset(source.preset, device=ctx.device)
    return H3Pipeline.from_models(source.models_dir, device=ctx.device)


def generate_request(spec: JobSpec) -> GenerateRequest:
    """Task params (already checked by engine.protocol.validate_task) -> the pipeline's request."""
    p = spec.params
    images = {name: np.array(a) for name, a in spec.tensors.items()}  # writable copies of the wire buffers
    return GenerateRequest(
        prompt=p["prompt"], seconds=p.get("seconds", 5.0), width=p.get("width"), height=p.get("height"),
        aspect=p.get("aspect"), steps=p.get("steps"), seed=p.get("seed", 0),
        first_frame=images.get("first_frame"), last_frame=images.get("last_frame"),
        loras=[(path, scale) for path, scale in p.get("loras", [])])


class JobRunner:
    def __init__(self, ctx: RankContext, pipeline):
        self.ctx, self.pipeline = ctx, pipeline

    def run(self, spec: JobSpec, cancel: threading.Event | None = None,
            on_step: Callable[[StepEvent], None] | None = None) -> GenerateResult:
        """Runs `spec` on this rank (rank 0 first sends it to the others). Raises Cancelled, PeerFailed, or the
        pipeline's own exception."""
        if self.ctx.rank == 0 and self.ctx.world_size > 1:
            dist.broadcast_object_list([spec], src=0, group=self.ctx.control)
        agreement = StepAgreement(self.ctx, cancel)

        def step_boundary(event: StepEvent) -> None:
            agreement.at_step(event.step, event.total)
            if on_step is not None:
                on_step(event)

        try:
            result = self.pipeline.generate(generate_request(spec), on_step=step_boundary)
        except BaseException:
            agreement.at_end(failed=True)
            raise
        agreement.at_end(failed=False)
        return result

    def shutdown(self) -> None:
        """Rank 0: releases the followers from their loop."""
        if self.ctx.rank == 0 and self.ctx.world_size > 1:
            dist.broadcast_object_list([None], src=0, group=self.ctx.control)


def follower_loop(runner: JobRunner) -> None:
    """Ranks > 0: run every job rank 0 dispatches until it sends the shutdown (None)."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=runner.ctx.control)
        spec = box[0]
        if spec is None:
            return
        try:
            runner.run(spec)
        except (Cancelled, PeerFailed) as exc:
            log_event("job.stopped", job=spec.job, reason=str(exc))
        except Exception as exc:
            log_event("job.failed", logging.ERROR, exc_info=exc, job=spec.job, error=type(exc).__name__)
