"""Triton kernels for VSA (engine/kernels/vsa.py).

Cube selection: one program per (batch, head, query cube) finds the top-k scores of its row by a radix select on
the scores' order-preserving integer keys and writes the chosen key cubes in ascending order (ties go to the lower
cube), replacing topk + sort (7.9 ms -> 2.4 ms for 99 792 rows of 1 782 at 362 frames on the H200).

Fine attention: one program per (64-row query cube, batch, head) runs an online softmax over the dense prefix,
then over its selected 64-row key cubes. Blocks arrive by TMA (host tensor descriptors). The plan puts the full
cubes first, so a query cube's ascending selection is its full cubes, then the partial ones: only the latter
(and the prefix's last block) pay for the padding mask, and no per-block size is read before them. The softmax
scale rides on the exponent (exp2(s * c - m * c): one FMA per score). Without the mask and the size load in the
main loop the kernel runs at ~400 instead of ~320 TFLOP/s of kept work at 362 frames on the H200. There it moves
~6.8 TB/s of keys and values out of L2: loading the cubes alone takes 96 ms of its 115 ms, the math alone 89 ms.

bf16 (or fp16/fp32) in, fp32 accumulation; padding key slots of a cube (offset >= its size) are masked to -inf.
Every block it visits holds at least one real key, so the running max is finite after the first block.
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
def _online_softmax_step(s, v, acc, m_i, l_i, scale_log2):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s * scale_log2 - (m_new * scale_log2)[:, None])
    alpha = tl.math.exp2((m_i - m_new) * scale_log2)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _fine_kernel(
    Q, K, V, KP, VP, O, SEL, SIZES,
    ssel_b, ssel_h, ssel_c,
    H, P, CT, TOPK, NUM_FULL, scale_log2,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOPK_POW2: tl.constexpr, PREFETCH: tl.constexpr,
):
    cube = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    rows = tl.arange(0, BLOCK)
    col = h * HEAD_DIM

    q = Q.load([b * CT + cube * BLOCK, col])
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)

    # Two stages for the prefix when the main loop prefetches: both CTAs of an SM keep fitting in shared memory.
    for start in tl.range(0, P - BLOCK + 1, BLOCK, num_stages=2 if PREFETCH else 3):
        k = KP.load([b, start, col]).reshape(BLOCK, HEAD_DIM)
        v = VP.load([b, start, col]).reshape(BLOCK, HEAD_DIM)
        acc, m_i, l_i = _online_softmax_step(tl.dot(q, tl.trans(k)), v, acc, m_i, l_i, scale_log2)
    if P % BLOCK:
        start = P - P % BLOCK
        k = KP.load([b, start, col]).reshape(BLOCK, HEAD_DIM)
        v = VP.load([b, start, col]).reshape(BLOCK, HEAD_DIM)
        s = tl.where((start + rows < P)[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(s, v, acc, m_i, l_i, scale_log2)

    sel = SEL + b.to(tl.int64) * ssel_b + h * ssel_h + cube * ssel_c
    slots = tl.arange(0, TOPK_POW2)
    num_full = tl.sum((tl.load(sel + slots, mask=slots < TOPK, other=NUM_FULL) < NUM_FULL).to(tl.int32), axis=0)
    if PREFETCH:
        next_cube = tl.load(sel)
    for j in range(0, num_full):
        if PREFETCH:  # the index a step early: triton then issues each cube's loads two steps ahead instead of one
            key_cube = next_cube
            next_cube = tl.load(sel + j + 1, mask=j + 1 < TOPK, other=0)
        else:
            key_cube = tl.load(sel + j)
        k = K.load([b * CT + key_cube * BLOCK, col])
        v = V.load([b * CT + key_cube * BLOCK, col])
        acc, m_i, l_i = _online_softmax_step(tl.dot(q, tl.trans(k)), v, acc, m_i, l_i, scale_log2)
    for j in range(num_full, TOPK):
        key_cube = tl.load(sel + j)
        k = K.load([b * CT + key_cube * BLOCK, col])
        v = V.load([b * CT + key_cube * BLOCK, col])
        s = tl.where((rows < tl.load(SIZES + key_cube))[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(s, v, acc, m_i, l_i, scale_log2)

    O.store([b * CT + cube * BLOCK, col], (acc / l_i[:, None]).to(q.dtype))


def block_sparse_attention(qv: torch.Tensor, kv: torch.Tensor, vv: torch.Tensor, k_prefix: torch.Tensor,
                           v_prefix: torch.Tensor, selected: torch.Tensor, cube_sizes: torch.Tensor,
                           num_full: int = 0, prefetch: bool | None = None, num_warps: int = 4,
                           num_stages: int = 3) -> torch.Tensor:
    """Same contract as `vsa.fine_reference`: qv, kv, vv [B, C * 64, H, D] cube-major, contiguous; k_prefix,
    v_prefix [B, P, H, D] with (H, D) packed (row and batch strides free: slices of the fused QKV work);
    selected [B, H, C, K] int32 key cubes, ascending along K (any strides); cube_sizes [C] int32.
    `num_full`: cubes [0, num_full) hold 64 real tokens each, so they need no padding mask (0 is always right).
    `prefetch`: issue the full cubes' loads two steps ahead; by default when one head's keys and values fit in the
    L2 cache (H200: 15.5 -> 14.8 ms at 124 frames, where they take 22 MB; 114.9 -> 118.4 ms at 362, 58 MB)."""
    B, CT, H, D = qv.shape
    P = k_prefix.shape[1]
    if not all(x.is_contiguous() for x in (qv, kv, vv)) or any(
            x.stride(3) != 1 or x.stride(2) != D for x in (k_prefix, v_prefix)):
        raise ValueError("VSA kernel needs contiguous cube buffers and prefix rows with packed heads")
    out = torch.empty_like(qv)

    def cube_rows(x):  # [B * C * 64, H * D]; a block is one 64-row cube of one head
        return TensorDescriptor(x, [B * CT, H * D], [H * D, 1], [BLOCK, D])

    def prefix_rows(x):  # [B, P, H * D]; rows past P read as zeros
        return TensorDescriptor(x, [B, P, H * D], [x.stride(0), x.stride(1), 1], [1, BLOCK, D])

    if prefetch is None:
        head_kv_bytes = 2 * CT * D * qv.element_size()
        prefetch = qv.is_cuda and head_kv_bytes <= torch.cuda.get_device_properties(qv.device).L2_cache_size
    topk = selected.shape[-1]
    _fine_kernel[(CT // BLOCK, B * H)](
        cube_rows(qv), cube_rows(kv), cube_rows(vv), prefix_rows(k_prefix), prefix_rows(v_prefix), cube_rows(out),
        selected, cube_sizes.to(torch.int32), selected.stride(0), selected.stride(1), selected.stride(2),
        H, P, CT, topk, num_full, D**-0.5 * math.log2(math.e),
        BLOCK=BLOCK, HEAD_DIM=D, TOPK_POW2=triton.next_power_of_2(topk), PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
