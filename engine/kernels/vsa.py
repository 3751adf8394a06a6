"""Video Sparse Attention (VSA) over the H3 packed sequence (notes/kernels_h200.md §1).

The target video rows, a frame-major (T, H/2, W/2) token grid, are cut into 4x4x4 = 64-token cubes; edge cubes
are padded to 64 slots, real tokens first, zeros after. The rows before the target video (text, condition, audio)
are the dense prefix: they attend to every key, and every query attends to them. Each video query cube attends
to the prefix plus its top-k video key cubes, ranked by pooled scores (mean q of the query cube . mean k of the
key cube / sqrt(d)); this fine branch is exact softmax attention over the kept keys.

Trained-gate mode (FastH3 VSA checkpoints) adds the coarse branch as FastVideo's VSA-H3 backend does
(`fastvideo/attention/backends/video_sparse_attn_h3.py`, `fastvideo/models/dits/minimax_h3.py`):

    out = fine + gate * coarse,   gate = to_gate_compress(h)  (Linear(hidden -> heads*head_dim, no bias),
                                                               raw: no sigmoid; h = the attention block input)
    coarse[tile] = softmax(q_pool k_pool^T / sqrt(d)) v_pool   over every tile, broadcast to the tile's rows

where the tiles are the video cubes plus the prefix cut into segment-pure 64-row chunks (text, condition and
audio never share a chunk), and the coarse term reaches every row, prefix rows included. Without a gate
(the base H3 checkpoint has none) the output is the fine branch alone, so top-k = all cubes is dense attention.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass, fields
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import attention as attn
from engine.models.h3.layout import PackedLayout

CUBE = 4  # cube edge along t, h and w
TILE = CUBE**3


@dataclass
class VSAPlan:
    """Tiling of one request's packed sequence, built once and shared by every layer and step."""

    seq_len: int  # S
    num_dense: int  # P: rows [0, P) are the dense prefix, rows [P, S) the target video in frame-major order
    grid: tuple[int, int, int]  # (T, H/2, W/2) target video token grid
    video_slot: torch.Tensor  # [S - P] long: slot of each video row in the cube-major buffer [num_cubes * 64]
    video_order: torch.Tensor  # [num_cubes * 64] long: video row in each slot (padding slots: row 0, then zeroed)
    pad_slots: torch.Tensor  # [num padding slots] long
    cube_sizes: torch.Tensor  # [num_cubes] int32: real tokens per cube (the rest of its 64 slots are padding)
    prefix_tile: torch.Tensor  # [P] long: segment-pure 64-row chunk of each prefix row (coarse branch)
    prefix_tile_sizes: torch.Tensor  # [num_prefix_tiles] rows per chunk

    @property
    def num_cubes(self) -> int:
        return self.cube_sizes.numel()

    @property
    def cube_valid(self) -> torch.Tensor:
        """[num_cubes, 64] bool: False on padding slots."""
        return torch.arange(TILE, device=self.cube_sizes.device) < self.cube_sizes[:, None]

    @property
    def slot(self) -> torch.Tensor:
        """[S] position of every packed row in the tiled sequence [prefix | cubes]; its inverse is a gather."""
        prefix = torch.arange(self.num_dense, device=self.video_slot.device)
        return torch.cat([prefix, self.num_dense + self.video_slot])

    def to(self, device) -> "VSAPlan":
        return VSAPlan(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                          for f in fields(self)})

    def tile_video(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> video rows cube-major [B, num_cubes * 64, ...], zeros on padding slots."""
        # A gather then a small fill: 2.7x faster than scattering into a zeroed buffer (index_copy_) on the H200.
        tiled = x[:, self.num_dense:].index_select(1, self.video_order)
        return tiled.index_fill_(1, self.pad_slots, 0)

    def untile_video(self, tiled: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.index_select(tiled, 1, self.video_slot, out=out)

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [B, P + num_cubes * 64, ...]: [dense rows | video rows cube-major, padded]."""
        return torch.cat([x[:, :self.num_dense], self.tile_video(x)], dim=1)

    def untile(self, tiled: torch.Tensor) -> torch.Tensor:
        return tiled.index_select(1, self.slot)


def build_plan(layout: PackedLayout, patch: tuple[int, int] = (2, 2)) -> VSAPlan:
    """The plan for a packed layout whose target video rows close the sequence (every H3 task)."""
    S = layout.seq_len
    T, h, w = layout.num_latent_frames, layout.latent_height // patch[0], layout.latent_width // patch[1]
    P = S - T * h * w
    target = layout.video_indices[layout.num_condition_video_rows:].cpu()
    if not torch.equal(target, torch.arange(P, S)):
        raise ValueError("VSA needs the target video rows at the end of the packed sequence, frame-major")

    # Cubes in (t, h, w) order; inside a cube its real tokens in (t, h, w) order, then the padding slots.
    ct, ch, cw = math.ceil(T / CUBE), math.ceil(h / CUBE), math.ceil(w / CUBE)
    grid = torch.full((ct * CUBE, ch * CUBE, cw * CUBE), -1, dtype=torch.long)
    grid[:T, :h, :w] = torch.arange(T * h * w).view(T, h, w)
    cubes = grid.view(ct, CUBE, ch, CUBE, cw, CUBE).permute(0, 2, 4, 1, 3, 5).reshape(-1, TILE)
    cubes = cubes.gather(1, (cubes < 0).to(torch.int8).argsort(dim=1, stable=True))
    real = cubes >= 0
    video_slot = torch.empty(T * h * w, dtype=torch.long)
    video_slot[cubes[real]] = torch.arange(cubes.numel()).view_as(cubes)[real]

    # Prefix segments (text, condition, audio) as the rows of each kind that lie next to each other.
    kind = torch.zeros(P, dtype=torch.long)
    kind[layout.video_indices[:layout.num_condition_video_rows].cpu()] = 1
    kind[layout.audio_indices.cpu()] = 2
    starts = [0] + (torch.nonzero(kind[1:] != kind[:-1]).flatten() + 1).tolist()
    prefix_tile, sizes = torch.empty(P, dtype=torch.long), []
    for start, end in zip(starts, starts[1:] + [P]):
        if end > start:
            prefix_tile[start:end] = len(sizes) + torch.arange(end - start) // TILE
            sizes += [min(TILE, end - s) for s in range(start, end, TILE)]

    pad_slots = torch.nonzero(~real.flatten()).flatten()
    return VSAPlan(S, P, (T, h, w), video_slot, cubes.flatten().clamp(min=0), pad_slots, real.sum(1).to(torch.int32),
                   prefix_tile, torch.tensor(sizes, dtype=torch.long)).to(layout.position_ids.device)


def topk_for_sparsity(sparsity: float, num_cubes: int) -> int:
    """Video key cubes kept per query cube: ceil((1 - sparsity) * num_cubes) in [1, num_cubes] (FastVideo's rule)."""
    return max(1, min(math.ceil((1.0 - sparsity) * num_cubes), num_cubes))


def pool_cubes(tiled: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens of each cube, fp32: [B, C * 64, H, D] (zero padding) -> [B, H, C, D]."""
    sums = tiled.unflatten(1, (-1, TILE)).sum(dim=2, dtype=torch.float32)
    return (sums / sizes.view(1, -1, 1, 1)).transpose(1, 2)


def pool_prefix(x: torch.Tensor, plan: VSAPlan) -> torch.Tensor:
    """Mean of each segment-pure prefix chunk, fp32: [B, S, H, D] -> [B, H, num_prefix_tiles, D]."""
    B, _, H, D = x.shape
    sums = x.new_zeros(B, plan.prefix_tile_sizes.numel(), H, D, dtype=torch.float32)
    sums.index_add_(1, plan.prefix_tile, x[:, :plan.num_dense].float())
    return (sums / plan.prefix_tile_sizes.view(1, -1, 1, 1)).transpose(1, 2)


def tile_and_pool(x: torch.Tensor, plan: VSAPlan, pool: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(plan.tile_video(x), pool_cubes of it if `pool` else None); one pass over x on the GPU."""
    if x.is_cuda:
        from engine.kernels import vsa_triton

        return vsa_triton.tile_video(x, plan.video_order, plan.cube_sizes, plan.num_dense, pool)
    tiled = plan.tile_video(x)
    return tiled, pool_cubes(tiled, plan.cube_sizes) if pool else None


def select_cubes(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, H, C, C] cube scores -> [B, H, C, topk] int32 key cubes per query cube, ascending (memory order)."""
    if scores.is_cuda:
        from engine.kernels import vsa_triton

        return vsa_triton.select_cubes(scores, topk)
    return scores.topk(topk, dim=-1, sorted=False).indices.sort(dim=-1).values.to(torch.int32)


def fine_reference(qv, kv, vv, k_prefix, v_prefix, selected, cube_sizes) -> torch.Tensor:
    """Fine branch in PyTorch: each query cube over the dense prefix and its selected key cubes.

    qv, kv, vv: [B, C * 64, H, D] cube-major; k_prefix, v_prefix: [B, P, H, D]; selected: [B, H, C, K].
    Returns [B, C * 64, H, D] (rows on padding slots are garbage; untiling drops them).
    """
    B, CT, H, D = qv.shape
    C, K, P = CT // TILE, selected.shape[-1], k_prefix.shape[1]
    q, kc, vc = (x.unflatten(1, (C, TILE)).permute(0, 3, 1, 2, 4) for x in (qv, kv, vv))  # [B, H, C, 64, D]
    b = torch.arange(B, device=qv.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=qv.device).view(1, H, 1, 1)
    sel = selected.long()
    keys = kc[b, h, sel].flatten(3, 4)  # [B, H, C, K * 64, D]
    values = vc[b, h, sel].flatten(3, 4)
    real = (torch.arange(TILE, device=qv.device) < cube_sizes[:, None])[sel].flatten(3, 4)
    kp, vp = (x.permute(0, 2, 1, 3)[:, :, None].expand(B, H, C, P, D) for x in (k_prefix, v_prefix))
    keys, values = torch.cat([kp, keys], dim=3), torch.cat([vp, values], dim=3)
    mask = torch.cat([real.new_ones(B, H, C, P), real], dim=3)[..., None, :]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.permute(0, 2, 3, 1, 4).reshape(B, CT, H, D)


def _fine(qv, kv, vv, k_prefix, v_prefix, selected, plan: VSAPlan, out: torch.Tensor) -> torch.Tensor:
    """The fine branch written untiled into out [B, S - P, H, D]."""
    if qv.is_cuda:
        from engine.kernels.vsa_triton import block_sparse_attention

        return block_sparse_attention(qv, kv, vv, k_prefix, v_prefix, selected, plan.cube_sizes, plan.video_order,
                                      out)
    return plan.untile_video(fine_reference(qv, kv, vv, k_prefix, v_prefix, selected, plan.cube_sizes), out=out)


def vsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VSAPlan, topk: int,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """VSA over the packed sequence; q, k, v and gate are [B, S, H, D], the result too.

    `topk` video key cubes per query cube (sparsity = 1 - topk / num_cubes); `gate` (trained-gate mode) is
    to_gate_compress(h) and adds gate * coarse.
    """
    P, C = plan.num_dense, plan.num_cubes
    if q.shape[1] != plan.seq_len:
        raise ValueError(f"VSA plan is for {plan.seq_len} rows, got {q.shape[1]}")
    if not 1 <= topk <= C:
        raise ValueError(f"topk must be in [1, {C}], got {topk}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match q {tuple(q.shape)} (under Ulysses SP it needs the "
                         "same all-to-all as q)")
    scored = topk < C or gate is not None
    (qv, q_pool), (kv, k_pool) = (tile_and_pool(x, plan, scored) for x in (q, k))
    vv, v_pool = tile_and_pool(v, plan, gate is not None)

    scores = None  # [B, H, tiles, tiles]: the video cubes, after the prefix chunks in trained-gate mode
    if scored:
        if gate is not None:
            q_pool = torch.cat([pool_prefix(q, plan), q_pool], dim=2)
            k_pool = torch.cat([pool_prefix(k, plan), k_pool], dim=2)
        scores = (q_pool / math.sqrt(q.shape[-1])) @ k_pool.transpose(-1, -2)  # scaling the small operand
    if topk == C:
        selected = torch.arange(C, device=q.device, dtype=torch.int32).expand(q.shape[0], q.shape[2], C, C)
    else:
        first_cube = scores.shape[-1] - C
        selected = select_cubes(scores[..., first_cube:, first_cube:], topk)

    out = q.new_empty(q.shape)  # heads packed whatever q's layout: the output projection reads rows
    if P:
        out[:, :P] = attn.dense(q[:, :P], k, v)
    _fine(qv, kv, vv, k[:, :P], v[:, :P], selected, plan, out[:, P:])
    if gate is None:
        return out

    v_pool = torch.cat([pool_prefix(v, plan), v_pool], dim=2)
    coarse = (scores.softmax(dim=-1) @ v_pool).transpose(1, 2).to(out.dtype)  # [B, tiles, H, D]
    tile_of_row = torch.cat([plan.prefix_tile, plan.prefix_tile_sizes.numel() + plan.video_slot // TILE])
    return out + gate * coarse.index_select(1, tile_of_row)


def block_gates(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[nn.Module, torch.Tensor]:
    """FastH3 `…blocks.N.attn.to_gate_compress.weight` [heads*head_dim, hidden] keyed by block N's attention,
    on that attention's device and dtype."""
    pattern = re.compile(r"(?:^|\.)(?:transformer_)?blocks\.(\d+)\.attn\.to_gate_compress\.weight$")
    gates = {}
    for key, weight in state_dict.items():
        if match := pattern.search(key):
            module = model.blocks[int(match.group(1))].attn
            gates[module] = weight.to(module.qkv_proj.weight)
    return gates


@contextlib.contextmanager
def active(plan: VSAPlan, topk: int, gates: Mapping[nn.Module, torch.Tensor] | None = None):
    """Inside the block, `engine.kernels.attention.attention` runs VSA on sequences of `plan.seq_len` rows (other
    calls, e.g. the token refiner's text-only attention, stay dense).

    `gates` maps attention modules (the DiT's `blocks[i].attn`) to their `to_gate_compress` weight (see
    `block_gates`); a forward pre-hook computes the gate from the module's input for its attention call.
    All-zero weights (the base checkpoint's zero-initialised gate) are skipped: their branch adds exactly zero.
    """
    pending: list[torch.Tensor] = []

    def route(q, k, v):
        if q.shape[1] != plan.seq_len:
            return None
        return vsa_attention(q, k, v, plan, topk, pending.pop() if pending else None)

    def stash(weight, module, args):
        pending[:] = [F.linear(args[0], weight).unflatten(-1, (module.heads, -1))]

    hooks = [module.register_forward_pre_hook(functools.partial(stash, weight))
             for module, weight in (gates or {}).items() if bool(weight.any())]
    previous, attn._sparse = attn._sparse, route
    try:
        yield
    finally:
        attn._sparse = previous
        for hook in hooks:
            hook.remove()
