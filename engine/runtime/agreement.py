"""All ranks agree, at every step or chunk boundary, whether a job goes on, is cancelled, or has failed on some rank.

Only rank 0 hears a client's cancel, and any rank may fail; stopping on one rank alone would strand the others
in their next collective. So each rank calls `at_step` after every step (`at_boundary` after every chunk of
another long phase: a VAE chunk, a SeedVR2 batch part, ...) and `at_end` once when its job ends
(normally or by an exception), and each call is one MAX all-reduce of its verdict over the control group, until
a call returns a verdict other than GO. A rank that fails mid-step makes its `at_end` call, which meets the
others' next `at_step`: they all see FAILED and stop. After a non-GO verdict no rank calls again.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from engine.models.h3.request import Cancelled
from engine.runtime.ranks import RankContext

GO, CANCEL, FAILED = 0, 1, 2


class PeerFailed(RuntimeError):
    """Another rank failed this job; its log has the traceback."""


class StepAgreement:
    def __init__(self, ctx: RankContext, cancel: threading.Event | None = None):
        self.ctx, self.cancel = ctx, cancel
        self.settled = False  # a non-GO verdict was reached: no more collective calls for this job

    def _agree(self, verdict: int) -> int:
        if self.ctx.control is not None:
            flag = torch.tensor([verdict], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.control)
            verdict = int(flag.item())
        self.settled = verdict != GO
        return verdict

    def at_step(self, step: int, total: int) -> None:
        self.at_boundary(f"after step {step} of {total}")

    def at_boundary(self, where: str) -> None:
        """Raises Cancelled ("Cancelled {where}.") or PeerFailed unless every rank goes on."""
        verdict = self._agree(CANCEL if self.cancel is not None and self.cancel.is_set() else GO)
        if verdict == CANCEL:
            raise Cancelled(f"Cancelled {where}.")
        if verdict == FAILED:
            raise PeerFailed("another rank failed this job (see the engine log)")

    def at_end(self, failed: bool) -> None:
        """Called once when this rank's job ends; raises PeerFailed if it succeeded here but not elsewhere."""
        if self.settled:
            return
        if self._agree(FAILED if failed else GO) == FAILED and not failed:
            raise PeerFailed("another rank failed this job (see the engine log)")
