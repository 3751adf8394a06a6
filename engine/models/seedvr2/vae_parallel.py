"""The SeedVR2 VAE with its temporal chunks spread over ranks; the result equals one rank's.

One rank runs time in chunks (vae.py `VideoVAE._stream`): the first chunk, then `encode_chunk` frames /
`decode_chunk` latents at a time, every causal conv carrying its last k - s input frames into the next chunk. Here
chunk g runs on rank g mod P, so round j runs chunks jP .. jP+P-1 side by side:

* inside a round, at every causal conv, rank r receives that carry of chunk g-1 from rank r-1 and sends its own to
  rank r+1 before the conv runs (a forward pre-hook, so the VAE code is untouched);
* after a round, the carries out of its last chunk go from rank P-1 to rank 0, which starts the next round with them.

The chunks and convs are those of one rank, so results match it; each rank holds one chunk's activations at a time
(the same peak as one GPU) and the work splits P ways. Chunks are at least two latent frames long so every chunk
holds the k - s = 2 frames it passes on. With tiling, each spatial tile of a chunk carries its own states. Every
round, each rank's finished chunk (`finish`, run where it was decoded) is gathered to every rank and delivered in
chunk order, so nothing of the whole clip stays on a rank unless the caller keeps it.

`on_chunk()` is called on every rank at the end of every round, once rank 0 holds the carries (no send or receive
is then pending, so a collective inside `on_chunk`, the job's cancel agreement, cannot cross them). Every rank
passes the same number of rounds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engine.models.seedvr2.vae import Causal, CausalConv3d, ClipStreams, Deliver, Finish, Read, VideoVAE, layout
from engine.parallel.window_sp import gather_rows


class _Relay(Causal):
    """The causal state of one chunk (and tile): its carries come from rank `prev` and go to rank `next`, conv by
    conv."""

    def __init__(self, first: bool, prev: int | None, next_: int | None, group: dist.ProcessGroup):
        super().__init__()
        self.first, self.prev, self.next, self.group = first, prev, next_, group


def _wire(t: torch.Tensor) -> torch.Tensor:
    """t's elements as one contiguous tensor (gloo sends no other), a view of t where t is dense in its layout."""
    t = t.contiguous(memory_format=layout(t))
    return t.permute(0, 2, 3, 4, 1) if layout(t) == torch.channels_last_3d else t


def _relay(conv: CausalConv3d, args: tuple) -> None:
    x, state = args[0], args[1] if len(args) > 1 else None
    keep = conv.kernel_size[0] - conv.stride[0]
    if not isinstance(state, _Relay) or keep <= 0:
        return
    ops = []
    if state.next is not None:
        ops.append(dist.P2POp(dist.isend, _wire(x[:, :, -keep:]), state.next, state.group))
    if state.prev is not None:
        b, c, _, h, w = x.shape
        state.memory[conv] = torch.empty((b, c, keep, h, w), dtype=x.dtype, device=x.device, memory_format=layout(x))
        ops.append(dist.P2POp(dist.irecv, _wire(state.memory[conv]), state.prev, state.group))
    _wait(ops)


def _wait(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def relayed(code, read: Read, chunks: list[tuple[int, int]], out_start: Callable[[int], int], finish: Finish,
            deliver: Deliver, group: dist.ProcessGroup, device: torch.device,
            on_chunk: Callable[[], None] | None = None) -> None:
    """`VideoVAE._stream` with chunk g on rank g mod P: code(x, state_of) runs the chunks, finish(start, output) the
    chunk's result where it ran, deliver(start, results) every round's results in chunk order on every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    carry: dict[int, dict] = {}  # tile -> conv -> the carry into this rank's next chunk (rank 0: from rank P-1)
    for j in range(-(-len(chunks) // world)):
        g, last = j * world + rank, min(len(chunks), (j + 1) * world) - 1  # this rank's and the round's last chunk
        mine = None
        if g <= last:
            states = {}

            def state_of(tile: int, g=g, last=last, states=states) -> _Relay:
                if tile not in states:
                    states[tile] = _Relay(g == 0, _global(group, rank - 1) if rank else None,
                                          _global(group, rank + 1) if g < last else None, group)
                    states[tile].memory.update(carry.get(tile, {}) if rank == 0 else {})
                return states[tile]

            start, stop = chunks[g]
            mine = finish(out_start(start), code(read(start, stop), state_of))
            carry = {tile: state.memory for tile, state in states.items()}
        if last - j * world + 1 < world:  # a rank without a chunk this round gives no frames, shaped as rank 0's
            mine = _like_rank0(mine, group, device)
        deliver(out_start(chunks[j * world][0]), _gather(mine, group))
        if last + 1 < len(chunks) and world > 1:  # the carries out of the round, from its last rank to rank 0
            if rank == world - 1:
                _wait([dist.P2POp(dist.isend, _wire(t), _global(group, 0), group)
                       for tile in sorted(carry) for t in carry[tile].values()])
            elif rank == 0:
                carry = {tile: {conv: torch.empty_like(t) for conv, t in carry[tile].items()} for tile in carry}
                _wait([dist.P2POp(dist.irecv, _wire(t), _global(group, world - 1), group)
                       for tile in sorted(carry) for t in carry[tile].values()])
        if on_chunk is not None:
            on_chunk()


def _like_rank0(mine: torch.Tensor | None, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """mine, or (on a rank without a chunk) no frames of what rank 0 finished (its shape and dtype)."""
    box = [None if mine is None else (tuple(mine.shape[1:]), mine.dtype)]
    dist.broadcast_object_list(box, src=_global(group, 0), group=group, device=device)
    return mine if mine is not None else torch.empty((0, *box[0][0]), dtype=box[0][1], device=device)


def _gather(mine: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's frames-first `mine`, concatenated in rank order, on every rank."""
    count = torch.tensor([mine.shape[0]], dtype=torch.int64, device=mine.device)
    counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    return gather_rows(mine, [int(c) for c in counts], group)


class ParallelVAE(ClipStreams):
    """`VideoVAE`'s encode / decode (whole or streamed) over `group`."""

    def __init__(self, vae: VideoVAE, group: dist.ProcessGroup):
        self.model, self.group = vae, group
        tf = vae.config.temporal_factor
        self.encode_chunk = max(vae.encode_chunk, 2 * tf) // tf * tf
        self.decode_chunk = max(vae.decode_chunk, 2)

    def _boundaries(self, chunks: int) -> int:
        return -(-chunks // dist.get_world_size(self.group))

    def _stream(self, code, read: Read, chunks: list[tuple[int, int]], out_start: Callable[[int], int],
                finish: Finish, deliver: Deliver, on_chunk: Callable[[], None] | None) -> None:
        hooks = [m.register_forward_pre_hook(_relay) for m in self.model.modules() if isinstance(m, CausalConv3d)]
        try:
            relayed(code, read, chunks, out_start, finish, deliver, self.group, self.model.device, on_chunk)
        finally:
            for hook in hooks:
                hook.remove()
