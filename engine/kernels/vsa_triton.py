"""Triton kernels for VSA (engine/kernels/vsa.py).

Cube selection: one program per (batch, head, query cube) finds the top-k scores of its row by a radix select on
the scores' order-preserving integer keys and writes the chosen key cubes in ascending order (ties go to the lower
cube), replacing topk + sort (7.9 ms -> 2.4 ms for 99 792 rows of 1 782 at 362 frames on the H200).

Tiling: one program per (cube, batch, 256 channels) gathers a cube's 64 slots from the packed rows (zeros on the
padding slots) and, for q and k, writes the cube's mean too: one pass instead of a gather, a fill and a pooling
read.

Fine attention: one program per (64-row query cube, batch, head) runs an online softmax over the dense prefix,
then over its selected 64-row key cubes. Blocks arrive by TMA (host tensor descriptors); the next cube's index is
read a step early, so triton issues each cube's loads two steps ahead. The softmax scale rides on the exponent
(exp2(s * c - m * c): one FMA per score). There is no padding mask: the padding keys (prefix rows past P, which TMA
reads as zeros, and a cube's slots past its size, which the tiling zeroes) score exactly 0 and carry zero values,
so each adds only exp2(-m * c) to the softmax sum, taken back out once at the end. A real query row whose max ends
<= 0 (every real score <= 0) could lose its whole sum to that subtraction: its block reruns with the mask. The
rows are stored straight to their places in the packed sequence (no untiling pass). Against masking the partial
cubes, on the H200 with random inputs: 116.8 -> 112.7 ms at 362 frames, 14.9 -> 13.7 ms at 124. At 362 frames it
is bound by L2 bandwidth (~7 TB/s of key and value cubes; loading them alone took 96 ms, the math alone 89).

bf16 (or fp16/fp32) in, fp32 accumulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

BLOCK = 64


@triton.jit
def _select_kernel(SCORES, SEL, C, TOPK, s_bh, s_row, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    scores = tl.load(SCORES + (row // C).to(tl.int64) * s_bh + (row % C) * s_row + cols, mask=cols < C)
    bits = scores.to(tl.float32).to(tl.int32, bitcast=True)
    # Order-preserving int32 key of a float; the padding columns get the smallest key.
    key = tl.where(cols < C, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2**31)
    # The k-th largest key, sign bit first, then bit by bit from the top.
    kth = tl.where(tl.sum((key >= 0).to(tl.int32), axis=0) >= TOPK, 0, -2**31)
    for bit in tl.static_range(30, -1, -1):
        if tl.sum((key >= kth + (1 << bit)).to(tl.int32), axis=0) >= TOPK:
            kth += 1 << bit
    above = key > kth
    tie = key == kth
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= TOPK - tl.sum(above.to(tl.int32), axis=0)))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(SEL + row.to(tl.int64) * TOPK + slot, cols, mask=keep)


def select_cubes(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Same contract as `vsa.select_cubes`: [B, H, C, C] scores (last dim contiguous, rows strided) ->
    [B, H, C, topk] int32 key cubes per query cube, ascending."""
    B, H, C, _ = scores.shape
    if scores.stride(3) != 1 or scores.stride(0) != H * scores.stride(1):
        raise ValueError("cube scores need contiguous columns and packed batch and head dims")
    selected = torch.empty(B, H, C, topk, dtype=torch.int32, device=scores.device)
    block_c = triton.next_power_of_2(C)
    _select_kernel[(B * H * C,)](scores, selected, C, topk, scores.stride(1), scores.stride(2), BLOCK_C=block_c,
                                 num_warps=1 if block_c <= 2048 else 4)
    return selected


@triton.jit
def _tile_kernel(X, T, POOL, ORDER, SIZES, s_xb, s_xs, s_xh, P, CT, N,
                 BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, POOLED: tl.constexpr):
    cube = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK)
    size = tl.load(SIZES + cube)
    src = P + tl.load(ORDER + cube * BLOCK + rows)
    channel = (cols // HEAD_DIM).to(tl.int64) * s_xh + cols % HEAD_DIM  # head-major x: s_xh = S * D
    x = tl.load(X + b * s_xb + src[:, None] * s_xs + channel[None, :],
                mask=(rows < size)[:, None] & (cols < N)[None, :], other=0)
    tl.store(T + (b * CT + cube * BLOCK + rows)[:, None] * N + cols[None, :], x, mask=(cols < N)[None, :])
    if POOLED:
        tl.store(POOL + (b * (CT // BLOCK) + cube) * N + cols, tl.sum(x.to(tl.float32), axis=0) / size, mask=cols < N)


def tile_video(x: torch.Tensor, video_order: torch.Tensor, cube_sizes: torch.Tensor, num_dense: int,
               pool: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`VSAPlan.tile_video` of x [B, S, H, D] (any strides but a contiguous last dim) and, if `pool`,
    `vsa.pool_cubes` of the result, in one pass: (tiled [B, C * 64, H, D], pooled [B, H, C, D] fp32 or None)."""
    B, _, H, D = x.shape
    if x.stride(3) != 1:
        raise ValueError("VSA tiling needs a contiguous head dim")
    CT, N, block_n = video_order.numel(), H * D, 256
    tiled = torch.empty(B, CT, H, D, dtype=x.dtype, device=x.device)
    pooled = torch.empty(B, CT // BLOCK, H, D, dtype=torch.float32, device=x.device) if pool else None
    _tile_kernel[(CT // BLOCK, B, triton.cdiv(N, block_n))](
        x, tiled, pooled if pool else tiled, video_order, cube_sizes, x.stride(0), x.stride(1), x.stride(2), num_dense,
        CT, N, BLOCK=BLOCK, BLOCK_N=block_n, HEAD_DIM=D, POOLED=pool, num_warps=4)
    return tiled, pooled.transpose(1, 2) if pool else None


@triton.jit
def _online_softmax_step(s, v, acc, m_i, l_i, scale_log2):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s * scale_log2 - (m_new * scale_log2)[:, None])
    alpha = tl.math.exp2((m_i - m_new) * scale_log2)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend(q, K, V, KP, VP, SIZES, sel, b, h, cube_row0, col, P, TOPK, scale_log2,
            BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax of one query block over the prefix, then its selected key cubes. MASKED: padding keys
    (prefix rows past P, cube slots past the cube's size) get -inf; otherwise, being zero rows, they score 0."""
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)

    # Buffers are counted so that two CTAs share an SM: the cube loop keeps three in flight, the prefix two and
    # the rare masked rerun one.
    for start in tl.range(0, P, BLOCK, num_stages=1 if MASKED else 2):
        k = KP.load([b, start, h, 0]).reshape(BLOCK, HEAD_DIM)
        v = VP.load([b, start, h, 0]).reshape(BLOCK, HEAD_DIM)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where((start + rows < P)[None, :], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(s, v, acc, m_i, l_i, scale_log2)

    # The next index is read a step early: triton then issues each cube's loads two steps ahead instead of one.
    next_cube = tl.load(sel)
    for j in tl.range(0, TOPK, num_stages=1 if MASKED else 3):
        key_cube = next_cube
        next_cube = tl.load(sel + j + 1, mask=j + 1 < TOPK, other=0)
        k = K.load([cube_row0 + key_cube * BLOCK, col])
        v = V.load([cube_row0 + key_cube * BLOCK, col])
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where((rows < tl.load(SIZES + key_cube))[None, :], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(s, v, acc, m_i, l_i, scale_log2)
    return acc, m_i, l_i


@triton.jit
def _fine_kernel(
    Q, K, V, KP, VP, O, SEL, SIZES, ORDER,
    ssel_b, ssel_h, ssel_c, so_b, so_s,
    H, P, CT, TOPK, scale_log2,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOPK_POW2: tl.constexpr,
):
    cube = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    col = h * HEAD_DIM
    rows = tl.arange(0, BLOCK)
    q = Q.load([b * CT + cube * BLOCK, col])
    sel = SEL + b.to(tl.int64) * ssel_b + h * ssel_h + cube * ssel_c

    acc, m_i, l_i = _attend(q, K, V, KP, VP, SIZES, sel, b, h, b * CT, col, P, TOPK, scale_log2,
                            BLOCK, HEAD_DIM, MASKED=False)
    # Each padding key scored exactly 0: it added exp2(-m * c) to the sum and nothing to acc (its value is zero).
    slots = tl.arange(0, TOPK_POW2)
    sizes = tl.load(SIZES + tl.load(sel + slots, mask=slots < TOPK, other=0), mask=slots < TOPK, other=BLOCK)
    num_pad = (BLOCK - P % BLOCK) % BLOCK + tl.sum(BLOCK - sizes, axis=0)
    l_i -= num_pad * tl.math.exp2(-m_i * scale_log2)
    # A real query row whose max is <= 0 may have scored all its real keys below the padding's 0, and then that
    # subtraction can cancel their whole sum (a row with a real score > 0 keeps l >= 1): rerun the block masked.
    real_rows = rows < tl.load(SIZES + cube)
    exposed = (m_i <= 0) & real_rows
    if tl.max(exposed.to(tl.int32), axis=0) > 0:
        acc, m_i, l_i = _attend(q, K, V, KP, VP, SIZES, sel, b, h, b * CT, col, P, TOPK, scale_log2,
                                BLOCK, HEAD_DIM, MASKED=True)

    # Straight to the rows' places in the packed sequence: no untiling pass.
    dest = tl.load(ORDER + cube * BLOCK + rows)  # int64
    cols = col + tl.arange(0, HEAD_DIM)
    tl.store(O + b.to(tl.int64) * so_b + dest[:, None] * so_s + cols[None, :], (acc / l_i[:, None]).to(q.dtype),
             mask=real_rows[:, None])


def block_sparse_attention(qv: torch.Tensor, kv: torch.Tensor, vv: torch.Tensor, k_prefix: torch.Tensor,
                           v_prefix: torch.Tensor, selected: torch.Tensor, cube_sizes: torch.Tensor,
                           video_order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`vsa.fine_reference` untiled into `out`: qv, kv, vv [B, C * 64, H, D] cube-major, contiguous, with zeros on
    the padding slots of kv and vv (`VSAPlan.tile_video` writes them); k_prefix, v_prefix [B, P, H, D] and out
    [B, S - P, H, D] with contiguous last dims (and out's heads packed); selected [B, H, C, K] int32 key cubes,
    ascending along K (any strides); cube_sizes [C] int32; video_order [C * 64] the video row of each slot
    (`VSAPlan.video_order`). Returns out."""
    B, CT, H, D = qv.shape
    P = k_prefix.shape[1]
    if not all(x.is_contiguous() for x in (qv, kv, vv)) or any(
            x.stride(3) != 1 for x in (k_prefix, v_prefix, out)) or out.stride(2) != D:
        raise ValueError("VSA kernel needs contiguous cube buffers, a contiguous head dim and output rows with "
                         "packed heads")

    def cube_rows(x):  # [B * C * 64, H * D]; a block is one 64-row cube of one head
        return TensorDescriptor(x, [B * CT, H * D], [H * D, 1], [BLOCK, D])

    def prefix_rows(x):  # [B, P, H, D]; a block is 64 rows of one head; rows past P read as zeros
        return TensorDescriptor(x, [B, P, H, D], [x.stride(0), x.stride(1), x.stride(2), 1], [1, BLOCK, 1, D])

    topk = selected.shape[-1]
    _fine_kernel[(CT // BLOCK, B * H)](
        cube_rows(qv), cube_rows(kv), cube_rows(vv), prefix_rows(k_prefix), prefix_rows(v_prefix), out,
        selected, cube_sizes.to(torch.int32), video_order, selected.stride(0), selected.stride(1), selected.stride(2),
        out.stride(0), out.stride(1), H, P, CT, topk, D**-0.5 * math.log2(math.e),
        BLOCK=BLOCK, HEAD_DIM=D, TOPK_POW2=triton.next_power_of_2(topk), num_warps=4,
    )
    return out
