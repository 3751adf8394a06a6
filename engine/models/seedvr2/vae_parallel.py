"""The SeedVR2 VAE with its temporal chunks spread over ranks; the result equals one rank's.

One rank runs time in chunks (vae.py `VideoVAE._chunked`): the first chunk, then `encode_chunk` frames /
`decode_chunk` latents at a time, every causal conv carrying its last k - s input frames into the next chunk. Here
chunk g runs on rank g mod P, so round j runs chunks jP .. jP+P-1 side by side:

* inside a round, at every causal conv, rank r receives that carry of chunk g-1 from rank r-1 and sends its own to
  rank r+1 before the conv runs (a forward pre-hook, so the VAE code is untouched);
* after a round, the carries out of its last chunk go from rank P-1 to rank 0, which starts the next round with them.

The chunks and convs are those of one rank, so results match it; each rank holds one chunk's activations at a time
(the same peak as one GPU) and the work splits P ways. Chunks are at least two latent frames long so every chunk
holds the k - s = 2 frames it passes on. The outputs are all-gathered to every rank. With tiling, every tile runs
this way.

`on_chunk()` is called on every rank after every round: at the start of the next round once rank 0 holds the
carries (no send or receive is then pending, so a collective inside `on_chunk`, the job's cancel agreement, cannot
cross them), and after the final gather. Every rank passes the same number of rounds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engine.models.seedvr2.vae import Causal, CausalConv3d, VideoVAE, chunk_count, tile_count, tiled
from engine.parallel.window_sp import gather_rows


class _Relay(Causal):
    """The causal state of one chunk: its carries come from rank `prev` and go to rank `next`, conv by conv."""

    def __init__(self, first: bool, prev: int | None, next_: int | None, group: dist.ProcessGroup):
        super().__init__()
        self.first, self.prev, self.next, self.group = first, prev, next_, group


def _relay(conv: CausalConv3d, args: tuple) -> None:
    x, state = args[0], args[1] if len(args) > 1 else None
    keep = conv.kernel_size[0] - conv.stride[0]
    if not isinstance(state, _Relay) or keep <= 0:
        return
    ops = []
    if state.next is not None:
        ops.append(dist.P2POp(dist.isend, x[:, :, -keep:].contiguous(), state.next, state.group))
    if state.prev is not None:
        b, c, _, h, w = x.shape
        state.memory[conv] = x.new_empty(b, c, keep, h, w)
        ops.append(dist.P2POp(dist.irecv, state.memory[conv], state.prev, state.group))
    _wait(ops)


def _wait(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def chunked(fn: Callable[[torch.Tensor, Causal], torch.Tensor], x: torch.Tensor, chunk: int,
            group: dist.ProcessGroup, on_chunk: Callable[[], None] | None = None) -> torch.Tensor:
    """`VideoVAE._chunked(fn, x, chunk)` with chunk g on rank g mod P; the whole result on every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [x[:, :, :1 + chunk]] + [p for p in x[:, :, 1 + chunk:].split(chunk, dim=2) if p.shape[2]]
    rounds = -(-len(pieces) // world)
    outs, carry = [], None
    for j in range(rounds):
        g, last = j * world + rank, min(len(pieces), (j + 1) * world) - 1  # this rank's and the round's last chunk
        if rank == 0 and j > 0 and world > 1:  # the carries out of the previous round, from its last rank
            carry = {conv: torch.empty_like(t) for conv, t in carry.items()}
            _wait([dist.P2POp(dist.irecv, t, _global(group, world - 1), group) for t in carry.values()])
        if j > 0 and on_chunk is not None:
            on_chunk()
        if g > last:
            break
        state = _Relay(g == 0, _global(group, rank - 1) if rank else None,
                       _global(group, rank + 1) if g < last else None, group)
        state.memory.update(carry if rank == 0 and carry is not None else {})
        outs.append(fn(pieces[g], state))
        carry = state.memory
        if rank == world - 1 and last + 1 < len(pieces) and world > 1:
            _wait([dist.P2POp(dist.isend, t.contiguous(), _global(group, 0), group) for t in carry.values()])
    out = _gather_chunks(outs, x, rounds, group)
    if on_chunk is not None:
        on_chunk()
    return out


def _gather_chunks(outs: list[torch.Tensor], x: torch.Tensor, rounds: int, group: dist.ProcessGroup
                   ) -> torch.Tensor:
    """Every rank's chunk outputs (chunk g: rank g mod P, round g // P) in chunk order, on every rank."""
    world = dist.get_world_size(group)
    shape = outs[0].shape if outs else (0,) * 5  # rank 0 always has chunk 0: its shape serves ranks without any
    info = torch.tensor([o.shape[2] for o in outs] + [0] * (rounds - len(outs)) + [shape[i] for i in (0, 1, 3, 4)],
                        dtype=torch.int64, device=x.device)
    every = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(every, info, group=group)
    every = torch.stack(every).cpu()
    frames = every[:, :rounds]  # [rank, round]
    b, c, h, w = every[0, rounds:].tolist()
    mine = torch.cat(outs, dim=2) if outs else x.new_empty(b, c, 0, h, w)
    parts = gather_rows(mine, frames.sum(1).tolist(), group, dim=2).split(frames.flatten().tolist(), dim=2)
    return torch.cat([parts[r * rounds + j] for j in range(rounds) for r in range(world)], dim=2)


class ParallelVAE:
    """`VideoVAE.encode` / `decode` over `group`."""

    def __init__(self, vae: VideoVAE, group: dist.ProcessGroup):
        self.vae, self.group = vae, group
        tf = vae.config.temporal_factor
        self.encode_chunk = max(vae.encode_chunk, 2 * tf) // tf * tf
        self.decode_chunk = max(vae.decode_chunk, 2)

    def _run(self, fn, x: torch.Tensor, chunk: int, on_chunk) -> torch.Tensor:
        hooks = [m.register_forward_pre_hook(_relay) for m in fn.modules() if isinstance(m, CausalConv3d)]
        try:
            return chunked(fn, x, chunk, self.group, on_chunk)
        finally:
            for hook in hooks:
                hook.remove()

    def _rounds(self, frames: int, chunk: int) -> int:
        return -(-chunk_count(frames, chunk) // dist.get_world_size(self.group))

    def encode_boundaries(self, shape: tuple[int, ...], tiling: bool = False) -> int:
        vae = self.vae
        tiles = tile_count(*shape[-2:], vae.tile_size, vae.tile_overlap) if tiling else 1
        return tiles * self._rounds(shape[2], self.encode_chunk)

    def decode_boundaries(self, shape: tuple[int, ...], tiling: bool = False) -> int:
        vae, s = self.vae, self.vae.config.spatial_factor
        tiles = tile_count(*shape[-2:], vae.tile_size // s, vae.tile_overlap // s) if tiling else 1
        return tiles * self._rounds(shape[2], self.decode_chunk)

    def encode(self, x: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        vae, tf, s = self.vae, self.vae.config.temporal_factor, self.vae.config.spatial_factor
        if (x.shape[2] - 1) % tf:
            raise ValueError(f"the VAE takes {tf}n+1 frames, got {x.shape[2]}")
        x = x.to(vae.dtype)

        def run(part):
            return self._run(vae.encoder, part, self.encode_chunk, on_chunk)

        return tiled(run, x, vae.tile_size, vae.tile_overlap, 1 / s).to(vae.dtype) if tiling else run(x)

    def decode(self, z: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        vae, s = self.vae, self.vae.config.spatial_factor
        z = z.to(vae.dtype)

        def run(part):
            return self._run(vae.decoder, part, self.decode_chunk, on_chunk)

        return tiled(run, z, vae.tile_size // s, vae.tile_overlap // s, s).to(vae.dtype) if tiling else run(z)
