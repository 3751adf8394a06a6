"""Triton kernels for the quantized linear layers: the activation quantizer and the int8 epilogue, one pass each.

`rowwise_quantize`: one program per row reads it once (optionally as the SwiGLU of a [gate; value] row, so the
activation is never written), takes its abs-max, and writes the fp8 or int8 row and its fp32 scale (amax / qmax).
`int8_rescale`: the int32 accumulator times the row and column scales, plus bias, written once in the output dtype.
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
def _int8_rescale_kernel(ACC, SX, SW, BIAS, OUT, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.load(ACC + row * N + cols, mask=ok, other=0).to(tl.float32)
    out = acc * tl.load(SX + row) * tl.load(SW + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(BIAS + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + cols, out.to(OUT.dtype.element_ty), mask=ok)


def int8_rescale(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """int32 [M, N] · x_scale [M, 1] · w_scale [N, 1]ᵀ (+ bias [N]) -> [M, N] in `out_dtype`."""
    rows, n = acc.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=acc.device)
    block = 1024
    if rows:
        _int8_rescale_kernel[(rows, triton.cdiv(n, block))](
            acc.contiguous(), x_scale.contiguous(), w_scale.contiguous(), bias if bias is not None else acc, out, n,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out
