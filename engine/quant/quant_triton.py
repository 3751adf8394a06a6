"""Triton kernels for the quantized linear layers: the activation quantizer and the int8 GEMM.

`rowwise_quantize`: one program per row reads it once (optionally as the SwiGLU of a [gate; value] row, so the
activation is never written), takes its abs-max, and writes the fp8 or int8 row and its fp32 scale (amax / qmax).
`int8_linear`: the exact int8 GEMM with the row and column scales and the bias applied to the int32 accumulator in
registers, written once in the output dtype (`torch._int_mm` writes int32 [M, N] to memory and a second pass reads
it back: at 149 k rows that round trip costs more than int8 saves over bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _rowwise_quantize_kernel(X, Q, SCALE, K, QMAX: tl.constexpr, SWIGLU: tl.constexpr, INT8: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    if SWIGLU:  # [gate; value] rows of width 2K
        gate = tl.load(X + row * 2 * K + cols, mask=ok, other=0.0).to(tl.float32)
        value = tl.load(X + row * 2 * K + K + cols, mask=ok, other=0.0).to(tl.float32)
        x = gate * tl.sigmoid(gate) * value
    else:
        x = tl.load(X + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / QMAX, 1e-30)
    q = x / scale
    if INT8:
        q = tl.where(q >= 0, tl.floor(q + 0.5), tl.ceil(q - 0.5))  # half away from zero
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    else:
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(Q + row * K + cols, q.to(Q.dtype.element_ty), mask=ok)
    tl.store(SCALE + row, scale)


def rowwise_quantize(x: torch.Tensor, dtype: torch.dtype, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (or [M, 2K] [gate; value] rows with `swiglu`) -> (q [M, K] in `dtype` (int8 or float8_e4m3fn),
    fp32 scales [M, 1])."""
    x = x.contiguous()
    rows, width = x.shape
    k = width // 2 if swiglu else width
    q = torch.empty(rows, k, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    int8 = dtype == torch.int8
    block = triton.next_power_of_2(k)
    if rows:  # a whole row per program: 16 warps keep a 16 K-wide fp32 row in registers
        _rowwise_quantize_kernel[(rows,)](x, q, scale, k, QMAX=127.0 if int8 else FP8_MAX, SWIGLU=swiglu, INT8=int8,
                                          BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return q, scale


@triton.jit
def _int8_linear_kernel(X, W, SX, SW, BIAS, OUT, M, N, K, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # Tiles in groups of GROUP_M row blocks, so neighbouring programs share W tiles in L2.
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # Rows and columns past the edge read row/column 0 (never stored): no masks in the K loop; K % BK == 0.
    xs = X + (rm % M).to(tl.int64)[:, None] * K + rk[None, :]
    ws = W + (rn % N).to(tl.int64)[None, :] * K + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for _ in range(0, K // BK):
        acc = tl.dot(tl.load(xs), tl.load(ws), acc, out_dtype=tl.int32)
        xs += BK
        ws += BK
    out = acc.to(tl.float32) * tl.load(SX + rm % M)[:, None] * tl.load(SW + rn % N)[None, :]
    if HAS_BIAS:
        out += tl.load(BIAS + rn % N).to(tl.float32)[None, :]
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(OUT + rm.to(tl.int64)[:, None] * N + rn[None, :], out.to(OUT.dtype.element_ty), mask=ok)


LINEAR_TILE = dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=3)  # H200: int8 wgmma, 144 KB smem


def int8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, tile: dict = LINEAR_TILE) -> torch.Tensor:
    """(xq [M, K] · wq [N, K]ᵀ exact in int32) · x_scale [M, 1] · w_scale [N, 1]ᵀ (+ bias [N]) -> [M, N] in
    `out_dtype`: one kernel, the int32 accumulator never leaves the chip. K must be a multiple of tile["BK"]."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % tile["BK"]:
        raise ValueError(f"int8_linear wants K divisible by {tile['BK']}, got {k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m:
        grid = (triton.cdiv(m, tile["BM"]) * triton.cdiv(n, tile["BN"]),)
        _int8_linear_kernel[grid](xq.contiguous(), wq.contiguous(), x_scale.contiguous(), w_scale.contiguous(),
                                  bias if bias is not None else out, out, m, n, k, HAS_BIAS=bias is not None, **tile)
    return out
