"""The H3 block's elementwise work between its GEMMs and attention: one pass each on the GPU, plain PyTorch elsewhere.

Eager PyTorch spends about 30% of a dense block's non-attention time outside the GEMMs on the H200: it gathers
six [S, hidden] AdaLN rows per block, and norm, modulation, residual, RoPE and SwiGLU each read and write the whole
activation again. On CUDA these functions run the Triton kernels of `fused_triton.py`, which read the AdaLN table
rows in place and compute in fp32 with one rounding at the end; on the CPU (or without triton) they run the reference
maths below, which is the eager block exactly (so CPU results do not change).

The plain pre-norm blocks (the video VAE's ViT decoder) have per-channel layer scales instead of AdaLN tables and
keep an fp32 residual stream under half-precision GEMMs: `rms_norm`, `scaled_residual` and `scaled_residual_norm`.
Ahead of an fp8 GEMM their norm can come quantized row by row (`Fp8Rows`): the pass that writes it also takes each
row's abs-max, so the GEMM's input is never written in half precision and read back to be quantized.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import capability

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class Fp8Rows(NamedTuple):
    """An fp8 GEMM's input quantized per row: e4m3 codes [..., K], fp32 scales [..., 1] (q * scale ~ the rows), and
    the dtype the GEMM writes its output in."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def dequantized(self) -> torch.Tensor:
        return (self.q.float() * self.scale).to(self.dtype)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e4m3 codes [..., K], fp32 [..., 1] amax / 448 of each row): the reference maths."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-30)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401  (not in every CUDA build of torch, e.g. on Windows)
    except ImportError:
        return False
    return True


def _triton(x: torch.Tensor) -> bool:
    """The Triton kernels are forward-only: under autograd (training) the torch path runs. They compute in bf16's
    range (SM 8.0 on)."""
    return (x.is_cuda and _have_triton() and not torch.is_grad_enabled()
            and capability.fused_triton(capability.capability(x.device)))


def modulated_rms_norm(x: torch.Tensor, norm: nn.RMSNorm, shift: torch.Tensor, scale: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor:
    """norm(x) * (1 + scale[rows]) + shift[rows]; x [B, S, N], tables [R, N], rows [S] (or per sample [B, S]: the
    torch path only, as training's masked edits give each clip its own mask)."""
    if rows.ndim == 1 and _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, None, None, rows, norm.weight, norm.eps, shift, scale)[1]
    return norm(x) * (1.0 + scale[rows]) + shift[rows]


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x + gate[rows] * y."""
    if rows.ndim == 1 and _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, y, gate, rows)[0]
    return x + gate[rows] * y


def gated_residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor, norm: nn.RMSNorm,
                        shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate[rows] * y, and that normed and modulated): the attention residual and the MLP's input at once."""
    if rows.ndim == 1 and _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, y, gate, rows, norm.weight, norm.eps, shift, scale)
    x = gated_residual(x, y, gate, rows)
    return x, modulated_rms_norm(x, norm, shift, scale, rows)


def rms_norm(x: torch.Tensor, norm: nn.RMSNorm, dtype: torch.dtype, fp8_rows: bool = False) -> torch.Tensor | Fp8Rows:
    """norm(x) computed in fp32, returned in `dtype` (a half-precision GEMM's input), or with `fp8_rows` quantized
    for an fp8 GEMM that writes `dtype`."""
    if _triton(x):
        from engine.kernels import fused_triton

        h = fused_triton.scaled_residual_norm(x, None, None, norm.weight, norm.eps, FP8 if fp8_rows else dtype)[1]
        return Fp8Rows(*h, dtype) if fp8_rows else h
    h = norm(x.float())
    return Fp8Rows(*quantize_fp8_rows(h), dtype) if fp8_rows else h.to(dtype)


def scaled_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate, gate a per-channel [N] layer scale (the result in x's dtype: an fp32 residual stays fp32)."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.scaled_residual_norm(x, y, gate, None, None, None)[0]
    return (x + y * gate).to(x.dtype)


def scaled_residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, norm: nn.RMSNorm, dtype: torch.dtype,
                         fp8_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(x + y * gate, and rms_norm of that as `rms_norm` gives it): the attention residual and the MLP's input at
    once."""
    if _triton(x):
        from engine.kernels import fused_triton

        x, h = fused_triton.scaled_residual_norm(x, y, gate, norm.weight, norm.eps, FP8 if fp8_rows else dtype)
        return x, Fp8Rows(*h, dtype) if fp8_rows else h
    x = scaled_residual(x, y, gate)
    return x, rms_norm(x, norm, dtype, fp8_rows)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half on the leading `cos.shape[-1]` channels of every head of x [B, S, H, D]; the rest pass."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rot, rest], dim=-1)


def qk_norm_rope(qkv: torch.Tensor, heads: int, q_norm: nn.RMSNorm, k_norm: nn.RMSNorm,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, head_major: bool = False) -> tuple[torch.Tensor, ...]:
    """Fused QKV projection [B, S, 3 * heads * D] -> q, k (per-head RMSNorm, then RoPE when given), v; [B, S, H, D].
    `head_major`: the kernel's outputs are views of [B, H, S, D] buffers (dense FA3 reads those faster)."""
    if _triton(qkv):
        from engine.kernels import fused_triton

        return fused_triton.qk_norm_rope(qkv, heads, q_norm.weight, k_norm.weight, q_norm.eps, rope, head_major)
    q, k, v = qkv.unflatten(-1, (3, heads, -1)).unbind(2)
    q, k = q_norm(q), k_norm(k)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k, v


def swiglu(gate_value: torch.Tensor) -> torch.Tensor:
    """[..., 2F] holding [gate; value] -> silu(gate) * value [..., F]."""
    if _triton(gate_value):
        from engine.kernels import fused_triton

        return fused_triton.swiglu(gate_value)
    gate, value = gate_value.chunk(2, dim=-1)
    return F.silu(gate) * value
