"""The Triton kernel behind engine/kernels/conv_fp8.py: a k3 stride-1 3-D convolution as one fp8 GEMM whose A
operand is never materialised.

The input is the convolution's padded buffer, channels-last [N, T + 2, H + 2, W + 2, C], read as a [rows, C] matrix.
Output pixel (h, w) of frame t reads the 27 rows at padded (t + dt, h + dh, w + dw); in that matrix they are row
r(t, h, w) + dt * (H + 2) * (W + 2) + dh * (W + 2) + dw. So a block of output pixels laid out along the padded rows
of one frame reads, for each tap, one contiguous [BLOCK_M, BLOCK_K] tile, shifted by the tap: a TMA load. The rows
that fall on the padding (the last two columns of each padded row) are computed and not stored.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _conv3d_k3_kernel(X, Wt, SCALE, OUT, T, H, W, C, N_OUT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    frame = tl.program_id(0)  # n * T + t
    block_m = tl.program_id(1)
    block_n = tl.program_id(2)
    plane = (H + 2) * (W + 2)
    first = ((frame // T) * (T + 2) + frame % T) * plane + block_m * BLOCK_M
    k_blocks = C // BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, 27 * k_blocks, num_stages=STAGES):
        tap = i // k_blocks
        k = (i % k_blocks) * BLOCK_K
        row = first + (tap // 9) * plane + (tap // 3 % 3) * (W + 2) + tap % 3
        a = X.load([row, k])
        b = Wt.load([block_n * BLOCK_N, tap * C + k])
        acc = tl.dot(a, b.T, acc)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    acc = acc * tl.load(SCALE + cols, mask=col_ok, other=0.0)[None, :]
    q = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # position in the padded plane
    h, w = q // (W + 2), q % (W + 2)
    out_row = (frame.to(tl.int64) * H + h) * W + w
    ok = ((h < H) & (w < W))[:, None] & col_ok[None, :]
    tl.store(OUT + out_row[:, None] * N_OUT + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


# (BLOCK_M, BLOCK_N cap, BLOCK_K cap, stages, warps), measured on an H200 over the H3 encoder's shapes (8 tiles of
# 17 frames of 256 px): 1370-1430 TFLOP/s at levels 0-2 with the large tile (cuDNN bf16: 700-810), 900-1300 at
# levels 3-5 with the small one.
LARGE = (256, 128, 128, 4, 8)
SMALL = (128, 128, 128, 5, 4)


def conv3d_k3(padded: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
              config: tuple[int, int, int, int, int] | None = None) -> None:
    """out [N, T, H, W, N_OUT] (contiguous) = the convolution of padded [N, T + 2, H + 2, W + 2, C] (fp8,
    contiguous) with weight [N_OUT, 27 * C] (fp8; K ordered tap-major, taps (dt, dh, dw) row-major) times scale
    [N_OUT] (fp32) per output channel."""
    n, tp, hp, wp, c = padded.shape
    t, h, w = tp - 2, hp - 2, wp - 2
    n_out = weight.shape[0]
    block_m, block_n, block_k, stages, warps = config or (LARGE if n * t * hp * wp >= 1 << 18 else SMALL)
    block_n = min(block_n, max(16, triton.next_power_of_2(n_out)))
    block_k = math.gcd(block_k, c)
    if block_k < 32:  # the K of one fp8 tensor-core MMA
        raise ValueError(f"{c} input channels: a multiple of 32 is needed")
    x = TensorDescriptor.from_tensor(padded.view(-1, c), [block_m, block_k])
    wt = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    rows = (h - 1) * wp + w  # the last output pixel's position in its padded plane, plus one
    grid = (n * t, triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))
    _conv3d_k3_kernel[grid](x, wt, scale, out, t, h, w, c, n_out, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k, STAGES=stages, num_warps=warps)
