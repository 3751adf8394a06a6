"""Triton kernels behind engine/kernels/fused.py: one program per packed row, fp32 maths, one rounding per output.

AdaLN tables are read in place through the row's table address (`rows[s]`), so the six [S, hidden] gathers of the
eager block never exist. Rows of a [B, S, ...] activation are flattened to B * S; position s = row % S.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _residual_norm_kernel(
    X, Y, GATE, ROWS, W, SHIFT, SCALE, OUT_X, OUT_H,
    S, N, table_stride, eps,
    RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    table_row = tl.load(ROWS + row % S) * table_stride
    x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        gate = tl.load(GATE + table_row + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(Y + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        stored = (x + gate * y).to(OUT_X.dtype.element_ty)
        tl.store(OUT_X + row * N + cols, stored, mask=ok)
        x = stored.to(tl.float32)  # the norm sees the residual stream as stored
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + table_row + cols, mask=ok, other=0.0).to(tl.float32)
        shift = tl.load(SHIFT + table_row + cols, mask=ok, other=0.0).to(tl.float32)
        h = x * rstd * w * (1.0 + scale) + shift
        tl.store(OUT_H + row * N + cols, h.to(OUT_H.dtype.element_ty), mask=ok)


def _table(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if t is not None and (t.dim() != 2 or t.shape[1] != n):
        raise ValueError(f"AdaLN table must be [rows, {n}], got {tuple(t.shape)}")
    return t if t is None or t.stride(1) == 1 else t.contiguous()


def residual_norm(x, y, gate, rows, weight=None, eps=None, shift=None, scale=None):
    """(x + gate[rows] * y when `y` is given, else x; and rms_norm(that) * weight * (1 + scale[rows]) + shift[rows]
    when `weight` is given, else None)."""
    x = x.contiguous()
    N = x.shape[-1]
    S, M = x.shape[-2], x.numel() // N
    residual, norm = y is not None, weight is not None
    gate, shift, scale = (_table(t, N) for t in (gate, shift, scale))
    strides = {t.stride(0) for t in (gate, shift, scale) if t is not None}
    if len(strides) > 1:  # one row stride for every table
        gate, shift, scale = (None if t is None else t.contiguous() for t in (gate, shift, scale))
        strides = {N}
    out_x = torch.empty_like(x) if residual else x
    out_h = torch.empty_like(x) if norm else None
    _residual_norm_kernel[(M,)](
        x, y.contiguous() if residual else x, gate if residual else x, rows, weight if norm else x,
        shift if norm else x, scale if norm else x, out_x, out_h if norm else x,
        S, N, strides.pop(), float(eps or 0.0),
        RESIDUAL=residual, NORM=norm, BLOCK=triton.next_power_of_2(N), num_warps=8,
    )
    return out_x, out_h


@triton.jit
def _scaled_residual_norm_kernel(X, Y, GATE, W, OUT_X, OUT_H, OUT_SCALE, N, eps,
                                 RESIDUAL: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        gate = tl.load(GATE + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(Y + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        stored = (x + y * gate).to(OUT_X.dtype.element_ty)
        tl.store(OUT_X + row * N + cols, stored, mask=ok)
        x = stored.to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        h = x * rstd * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if FP8:  # the row quantized for an fp8 GEMM: e4m3 codes and the row's scale amax / 448
            scale = tl.maximum(tl.max(tl.abs(h), axis=0) / 448.0, 1e-30)
            h = tl.minimum(tl.maximum(h / scale, -448.0), 448.0)
            tl.store(OUT_SCALE + row, scale)
        tl.store(OUT_H + row * N + cols, h.to(OUT_H.dtype.element_ty), mask=ok)


def scaled_residual_norm(x, y, gate, weight, eps, out_dtype):
    """(x + y * gate when `y` is given, else x; and rms_norm(that) * weight when `weight` is given, else None); gate
    and weight are per-channel [N] vectors. The norm comes in `out_dtype`, or for float8_e4m3fn as (its rows quantized,
    fp32 scales [rows, 1]) for an fp8 GEMM."""
    x = x.contiguous()
    N = x.shape[-1]
    residual, norm, fp8 = y is not None, weight is not None, out_dtype == torch.float8_e4m3fn
    out_x = torch.empty_like(x) if residual else x
    out_h = torch.empty_like(x, dtype=out_dtype) if norm else None
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device) if norm and fp8 else None
    _scaled_residual_norm_kernel[(x.numel() // N,)](
        x, y.contiguous() if residual else x, gate if residual else x, weight if norm else x, out_x,
        out_h if norm else x, scale if scale is not None else x, N, float(eps or 0.0),
        RESIDUAL=residual, NORM=norm, FP8=scale is not None, BLOCK=triton.next_power_of_2(N), num_warps=8,
    )
    return out_x, (out_h, scale) if scale is not None else out_h


@triton.jit
def _qk_norm_rope_kernel(
    QKV, Q, K, V, QW, KW, COS, SIN,
    S, H, eps,
    ROPE_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    ok = (head < H) & (d < HEAD_DIM)
    inner = H * HEAD_DIM
    half = ROPE_DIM // 2
    # Rotate-half partner of each rotated channel: x1 <-> x2 within the leading ROPE_DIM channels.
    partner = tl.where(d < half, d + half, tl.where(d < ROPE_DIM, d - half, d))
    if HEAD_MAJOR:  # [B, H, S, D] outputs
        dst_offset = (row // S * H + head) * S * HEAD_DIM + row % S * HEAD_DIM + d
    else:
        dst_offset = row * inner + head * HEAD_DIM + d
    sign = tl.where(d < half, -1.0, 1.0)
    if ROPE_DIM > 0:
        s = row % S
        cos = tl.load(COS + s * ROPE_DIM + d, mask=d < ROPE_DIM, other=1.0)
        sin = tl.load(SIN + s * ROPE_DIM + d, mask=d < ROPE_DIM, other=0.0)
    for part in tl.static_range(2):
        src = QKV + row * 3 * inner + part * inner + head * HEAD_DIM
        w_ptr = QW if part == 0 else KW
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        out = x * rstd * tl.load(w_ptr + d).to(tl.float32)
        if ROPE_DIM > 0:
            other = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32) * rstd
            other = other * tl.load(w_ptr + partner).to(tl.float32)
            out = out * cos + sign * other * sin
        dst = (Q if part == 0 else K) + dst_offset
        tl.store(dst, out.to(dst.dtype.element_ty), mask=ok)
    # v is copied out too: FA3 runs ~9% faster on a contiguous v than on the strided slice of qkv (S = 37 774).
    v = tl.load(QKV + row * 3 * inner + 2 * inner + head * HEAD_DIM + d, mask=ok)
    tl.store(V + dst_offset, v, mask=ok)


def qk_norm_rope(qkv, heads, q_weight, k_weight, eps, rope, head_major):
    """[B, S, 3 * H * D] -> q, k normed and rotated, v; [B, S, H, D] each, contiguous or, if `head_major`, views of
    [B, H, S, D] buffers: FA3 reads those 1.8 % faster (510 vs 519 ms at S = 109 126 on the H200); the VSA block
    at 362 frames was slower with them (2.99-3.00x diffusers vs 3.02-3.09x row-major)."""
    qkv = qkv.contiguous()
    B, S = qkv.shape[:2]
    D = qkv.shape[-1] // (3 * heads)
    q, k, v = (qkv.new_empty((B, heads, S, D) if head_major else (B, S, heads, D)) for _ in range(3))
    cos, sin = (t.float().contiguous() for t in rope) if rope is not None else (qkv, qkv)
    _qk_norm_rope_kernel[(B * S,)](
        qkv, q, k, v, q_weight, k_weight, cos, sin, S, heads, float(eps),
        ROPE_DIM=rope[0].shape[-1] if rope is not None else 0, HEAD_DIM=D, HEADS=triton.next_power_of_2(heads),
        HEAD_MAJOR=head_major, num_warps=8,
    )
    return tuple(t.transpose(1, 2) for t in (q, k, v)) if head_major else (q, k, v)


@triton.jit
def _swiglu_kernel(X, OUT, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(X + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(X + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * value
    tl.store(OUT + row * F + cols, out.to(OUT.dtype.element_ty), mask=ok)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    F = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], F)
    block = min(2048, triton.next_power_of_2(F))
    _swiglu_kernel[(x.numel() // (2 * F), triton.cdiv(F, block))](x, out, F, BLOCK=block, num_warps=4)
    return out
