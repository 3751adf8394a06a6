"""Ulysses sequence parallelism for the SeedVR2 NaDiT: the official scheme (specs/seedvr2.md §6.1), kept to
compare against window-aligned SP (window_sp.py).

Every rank holds a contiguous shard of the tokens in canonical order for all token-wise work. Around each
attention, one all-to-all turns the q/k/v shards into all tokens of heads/P heads, every rank runs all windows for
its heads, and a second all-to-all returns its tokens; the text (replicated) takes its head slice, and the
per-head text sums are all-gathered. The degree must divide the head count (3B: 20 heads, so not 8 ranks).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.kernels.attention import attention
from engine.models.seedvr2.nadit import MAX_ROWS_PER_CALL, NaDiT, apply_rope, patchify, unpatchify
from engine.models.seedvr2.nadit import Attention as WindowAttention
from engine.models.seedvr2.windows import WindowBatch
from engine.parallel.collectives import all_gather
from engine.parallel.ulysses import Shards


def window_attention(attn: WindowAttention, q_v, k_v, v_v, q_t, k_t, v_t, batch: WindowBatch, need_text: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Window attention of all video tokens in canonical order (q/k/v [N, h, D], any head subset) joint with the
    text ([L, h, D], RoPE applied) -> (video out [N, h, D], per-head text output sum over the windows, fp32)."""
    n_txt, device = q_t.shape[0], q_v.device
    out = torch.empty_like(v_v)
    txt_sum = torch.zeros(q_t.shape, dtype=torch.float32, device=device)
    for shape, rows in batch.groups:
        n_tok = math.prod(shape)
        cos, sin = attn.rope.video(shape, n_txt, device)
        for ids in batch.index[rows].view(-1, n_tok).split(max(1, MAX_ROWS_PER_CALL // (n_tok + n_txt))):
            n = ids.shape[0]
            q, k, v = apply_rope(q_v[ids], cos, sin), apply_rope(k_v[ids], cos, sin), v_v[ids]
            k = torch.cat([k, k_t.expand(n, -1, -1, -1)], dim=1)
            v = torch.cat([v, v_t.expand(n, -1, -1, -1)], dim=1)
            if need_text:
                q = torch.cat([q, q_t.expand(n, -1, -1, -1)], dim=1)
            o = attention(q, k, v)
            out[ids.flatten()] = o[:, :n_tok].flatten(0, 1).to(out.dtype)
            if need_text:
                txt_sum += o[:, n_tok:].float().sum(0)
    return out, txt_sum


class HeadParallelAttention(nn.Module):
    """`Attention` of one block with its heads split over the ranks of `shards`' group."""

    def __init__(self, attn: WindowAttention, shards: Shards):
        super().__init__()
        self.attn, self.shards = attn, shards

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, batch: WindowBatch, need_text: bool, text_reduce=None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vid [rows, d]: this rank's token shard (canonical order); `batch` is the whole layout."""
        attn, sp = self.attn, self.shards
        q_v, k_v, v_v = attn._qkv(vid, "vid")
        q_t, k_t, v_t = attn._qkv(txt, "txt")
        if (table := attn.rope.text(txt.shape[0], txt.device)) is not None:
            q_t, k_t = apply_rope(q_t, *table), apply_rope(k_t, *table)
        per = attn.heads // sp.world
        mine = slice(sp.rank * per, (sp.rank + 1) * per)
        txt_sums = []

        def attend(q, k, v):  # [1, N, heads/P, D]: every token of this rank's heads
            out, txt_sum = window_attention(attn, q[0], k[0], v[0], q_t[:, mine], k_t[:, mine], v_t[:, mine],
                                            batch, need_text)
            txt_sums.append(txt_sum)
            return out[None]

        out = Shards(sp.seq_len, sp.group, attend).attention(q_v[None], k_v[None], v_v[None])[0]
        vid_out = attn.proj_out.get("vid")(out.flatten(1))
        if not need_text:
            return vid_out, None
        txt_sum = all_gather(txt_sums[0], sp.group, dim=1)  # heads back in order
        return vid_out, attn.proj_out.get("txt")((txt_sum / batch.num_windows).flatten(1).to(txt.dtype))


def _with_attention(dit: NaDiT, shards: Shards) -> NaDiT:
    """A shallow copy of `dit` (parameters shared) whose blocks use HeadParallelAttention."""
    clone = copy.copy(dit)
    clone._modules = dict(dit._modules)
    blocks = []
    for block in dit.blocks:
        b = copy.copy(block)
        b._modules = {**block._modules, "attn": HeadParallelAttention(block.attn, shards)}
        blocks.append(b)
    clone._modules["blocks"] = nn.ModuleList(blocks)
    return clone


def predict(dit: NaDiT, vid: torch.Tensor, txt: torch.Tensor, timestep: float | torch.Tensor,
            group: dist.ProcessGroup) -> torch.Tensor:
    """`dit(vid, txt, timestep)` with Ulysses over `group` (its size must divide the head count)."""
    c = dit.config
    world = dist.get_world_size(group)
    if c.heads % world:
        raise ValueError(f"Ulysses degree {world} must divide the attention head count {c.heads}; "
                         f"window-aligned SP takes any number of ranks.")
    grid = dit.grid(vid.shape[:3])
    layouts = dit.layouts(grid)
    whole = {layout: layout.batch(device=vid.device) for layout in dict.fromkeys(layouts)}
    rows = patchify(vid, c.patch_size)
    shards = Shards(rows.shape[0], group)
    out = _with_attention(dit, shards).forward_rows(
        shards.split(rows), txt, dit.time_embedding(timestep), [whole[layout] for layout in layouts],
        relayout=lambda x, src, dst: x)  # tokens never move: attention gathers them per head group
    return unpatchify(shards.gather(out).float(), grid, c.patch_size)
