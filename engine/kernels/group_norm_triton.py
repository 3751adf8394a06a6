"""Triton kernels behind engine/kernels/group_norm.py, for channels-last video activations: frame f's pixels are
the rows of a contiguous [P, C] block at f * P * C.

`shifted_sums`: per frame and channel, the sums of (x - x0) and (x - x0)^2 over a chunk of pixels (x0: the frame's
first pixel, so the variance never comes from a difference of two large sums). `scale_shift_silu`: silu(x * a + b)
with one (a, b) row per frame, and `residual_bias`: x + y + bias, each written through any output strides (the interior
of the next convolution's padded input). `reflect_border`: that buffer's one-pixel border as the interior's reflection,
in one launch that touches the border alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # pixels per statistics program


@triton.jit
def _shifted_sums_kernel(X, S1, S2, P, C, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    frame = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    base = X + frame * P * C
    shift = tl.load(base + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc1 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, P), BLOCK_P):
        pix = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        ok = (pix < P)[:, None] & col_ok[None, :]
        x = tl.load(base + pix[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, x - shift[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    out = (frame * tl.num_programs(1) + chunk) * C + cols
    tl.store(S1 + out, tl.sum(acc1, axis=0), mask=col_ok)
    tl.store(S2 + out, tl.sum(acc2, axis=0), mask=col_ok)


def _blocks(C: int) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(C), 128)
    return max(16, 4096 // block_c), block_c


def shifted_sums(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [F, P, C] contiguous -> (sum of x - x[:, :1], sum of its square), fp32 [F, C] each."""
    F, P, C = rows.shape
    block_p, block_c = _blocks(C)
    chunks = triton.cdiv(P, CHUNK)
    s1 = torch.empty(F, chunks, C, dtype=torch.float32, device=rows.device)
    s2 = torch.empty_like(s1)
    _shifted_sums_kernel[(F, chunks, triton.cdiv(C, block_c))](
        rows, s1, s2, P, C, CHUNK=CHUNK, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)
    return s1.sum(1), s2.sum(1)


@triton.jit
def _reflect_border_kernel(BUF, H, W, C, T, b_n, b_c, b_t, b_h, b_w, top, bottom, left, right,
                           BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # Border pixels of one frame in padded coordinates [H + top + bottom, W + left + right]: the top and bottom rows
    # (full width), then the left and right columns between them; each reads its reflection in the interior.
    frame = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    width = W + left + right
    rows_done = (top + bottom) * width
    in_rows = i < rows_done
    row = tl.where(in_rows, tl.where(i < top * width, 0, H + top + bottom - 1), top + (i - rows_done) % H)
    col = tl.where(in_rows, i % width, tl.where((i - rows_done) < left * H, 0, W + left + right - 1))
    # padded -> interior coordinates, reflected: -1 -> 1, H -> H - 2
    r, c = row - top, col - left
    r = tl.where(r < 0, -r, tl.where(r >= H, 2 * H - 2 - r, r))
    c = tl.where(c < 0, -c, tl.where(c >= W, 2 * W - 2 - c, c))
    ok = (i < rows_done + (left + right) * H)[:, None] & (cols < C)[None, :]
    base = BUF + (frame // T) * b_n + (frame % T) * b_t + cols[None, :] * b_c
    value = tl.load(base + ((r + top) * b_h + (c + left) * b_w).to(tl.int64)[:, None], mask=ok)
    tl.store(base + (row * b_h + col * b_w).to(tl.int64)[:, None], value, mask=ok)


def reflect_border(buffer: torch.Tensor, top: int, bottom: int, left: int, right: int) -> None:
    """The named one-pixel borders of buffer [N, C, T, H, W] (any strides) as the reflection of its interior, in one
    launch: F.pad(..., mode="reflect") of buffer[..., top:H - bottom, left:W - right]."""
    n, c, t, h, w = buffer.shape
    h, w = h - top - bottom, w - left - right
    border = (top + bottom) * (w + left + right) + (left + right) * h
    block_p, block_c = _blocks(c)
    _reflect_border_kernel[(triton.cdiv(border, block_p), n * t, triton.cdiv(c, block_c))](
        buffer, h, w, c, t, *(buffer.stride(i) for i in range(5)), top, bottom, left, right, BLOCK_P=block_p,
        BLOCK_C=block_c, num_warps=4)


@triton.jit
def _pointwise_kernel(X, Y, A, B, OUT, P, C, T, W, ab_frame, o_n, o_c, o_t, o_h, o_w,
                      SILU: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # SILU: silu(x * a + b), (a, b) a row per frame; else x + y + b, b one row (ab_frame 0).
    pix = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    frame = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = (pix < P)[:, None] & col_ok[None, :]
    src = frame * P * C + pix[:, None] * C + cols[None, :]
    x = tl.load(X + src, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + frame * ab_frame + cols, mask=col_ok, other=0.0)
    if SILU:
        a = tl.load(A + frame * ab_frame + cols, mask=col_ok, other=0.0)
        v = x * a[None, :] + b[None, :]
        v = v * tl.sigmoid(v)
    else:
        v = x + tl.load(Y + src, mask=ok, other=0.0).to(tl.float32) + b[None, :]
    dst = (frame // T) * o_n + (frame % T) * o_t + (pix // W * o_h + pix % W * o_w)[:, None] + cols[None, :] * o_c
    tl.store(OUT + dst, v.to(OUT.dtype.element_ty), mask=ok)


def _pointwise(x_rows: torch.Tensor, y_rows: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor,
               out: torch.Tensor) -> None:
    F, P, C = x_rows.shape
    block_p, block_c = _blocks(C)
    silu = y_rows is None
    _pointwise_kernel[(triton.cdiv(P, block_p), F, triton.cdiv(C, block_c))](
        x_rows, x_rows if silu else y_rows, a if silu else b, b, out, P, C, out.shape[2], out.shape[4],
        C if silu else 0, *(out.stride(i) for i in range(5)), SILU=silu, BLOCK_P=block_p, BLOCK_C=block_c,
        num_warps=4)


def scale_shift_silu(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, :, t, h, w] = silu(rows[n * T + t, h * W + w] * a[n * T + t] + b[n * T + t]); rows [F, P, C]
    contiguous, a and b fp32 [F, C], out [N, C, T, H, W] with any strides."""
    _pointwise(rows, None, a, b, out)


def residual_bias(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> None:
    """out = x + y + bias; x and y [N, C, T, H, W] channels-last, bias fp32 [C], out [N, C, T, H, W] with any
    strides (x itself: in place)."""
    n, c, t, h, w = x.shape
    _pointwise(*(v.permute(0, 2, 3, 4, 1).view(n * t, h * w, c) for v in (x, y)), None, bias, out)
