"""Ulysses sequence parallelism for the H3 DiT (DeepSpeed-Ulysses; notes/kernels_h200.md §5).

Between attention calls each of P ranks holds one contiguous shard of the packed sequence, [B, S/P, ...], and
every per-row input (RoPE positions, AdaLN row addresses) is sharded alongside. Around attention one all-to-all
turns the sequence shards of q, k, v into head shards of the whole sequence, [B, S, H/P, D], and a second one
turns the output back. The attention function therefore sees every row of its heads, so the dense dispatch or a
sparse plan that reorders rows (VSA) runs there unchanged. P must divide the head count (56 heads: 1, 2, 4, 7, 8); under
tensor parallelism, the heads left on the rank (engine/parallel/mesh.py).

S need not divide by P: shards are ceil(S/P) rows and the last ones are zero-padded. Pad rows only ride along
in per-row work; they are cut before attention (never keys) and at the final gather.

    with ulysses.parallel(group):
        video, audio = dit(...)
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.kernels.attention import attention
from engine.parallel.collectives import all_gather, all_to_all

_group: ContextVar[dist.ProcessGroup | None] = ContextVar("ulysses_group", default=None)


@contextlib.contextmanager
def parallel(group: dist.ProcessGroup | None):
    """DiT forwards inside the block run sequence-parallel over `group` (None: one rank, no change)."""
    token = _group.set(group)
    try:
        yield
    finally:
        _group.reset(token)


class Shards:
    """One forward's split of a `seq_len`-row packed sequence over `group`; the identity without a group."""

    def __init__(self, seq_len: int, group: dist.ProcessGroup | None = None, attend=attention):
        self.seq_len, self.group, self.attend = seq_len, group, attend
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.rows = -(-seq_len // self.world)  # rows per rank, padding included

    def split(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor (rows along `dim`), zero-padded to `self.rows`."""
        if self.world == 1:
            return t
        start = min(self.rank * self.rows, self.seq_len)
        part = t.narrow(dim, start, min(self.rows, self.seq_len - start))
        if part.shape[dim] < self.rows:
            shape = list(part.shape)
            shape[dim] = self.rows - part.shape[dim]
            part = torch.cat([part, part.new_zeros(shape)], dim)
        return part

    def gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The full sequence from every rank's shard (padding dropped)."""
        if self.world == 1:
            return t
        return all_gather(t, self.group, dim).narrow(dim, 0, self.seq_len)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sequence shards [B, rows, H, D] in and out; `attend` runs on [B, S, H/P, D]."""
        if self.world == 1:
            return self.attend(q, k, v)
        B, s, H, D = q.shape
        P, S = self.world, self.seq_len
        if H % P:
            raise ValueError(f"Ulysses degree {P} must divide the attention head count {H}.")
        # Send head group p to rank p; receive every rank's rows of our head group, in rank (= row) order.
        qkv = torch.stack([q, k, v]).view(3, B, s, P, H // P, D).permute(3, 0, 1, 2, 4, 5)
        qkv = all_to_all(qkv, self.group).permute(1, 2, 0, 3, 4, 5).reshape(3, B, P * s, H // P, D)
        out = self.attend(*qkv[:, :, :S].unbind(0))
        out = F.pad(out, (0, 0, 0, 0, 0, P * s - S)).reshape(B, P, s, H // P, D).transpose(0, 1)
        # Send rank p its rows; receive our rows of every head group, in head order.
        return all_to_all(out, self.group).permute(1, 2, 0, 3, 4).reshape(B, s, H, D)


def shards(seq_len: int, attend=attention) -> Shards:
    """The split for a forward over `seq_len` rows under the current `parallel` group. `attend` is the attention
    over the whole sequence of a head shard (the dense dispatch by default)."""
    return Shards(seq_len, _group.get(), attend)
