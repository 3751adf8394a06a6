"""The H3 block's elementwise work between its GEMMs and attention: one pass each on the GPU, plain PyTorch elsewhere.

Eager PyTorch spends about 30% of a dense block's non-attention time outside the GEMMs on the H200: it gathers
six [S, hidden] AdaLN rows per block, and norm, modulation, residual, RoPE and SwiGLU each read and write the whole
activation again. On CUDA these functions run the Triton kernels of `fused_triton.py`, which read the AdaLN table
rows in place and compute in fp32 with one rounding at the end; on the CPU (or without triton) they run the reference
maths below, which is the eager block exactly (so CPU results do not change).

The plain pre-norm blocks (the video VAE's ViT decoder) have per-channel layer scales instead of AdaLN tables and
keep an fp32 residual stream under half-precision GEMMs: `rms_norm`, `scaled_residual` and `scaled_residual_norm`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import capability


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
    """norm(x) * (1 + scale[rows]) + shift[rows]; x [B, S, N], tables [R, N], rows [S]."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, None, None, rows, norm.weight, norm.eps, shift, scale)[1]
    return norm(x) * (1.0 + scale.index_select(0, rows)) + shift.index_select(0, rows)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x + gate[rows] * y."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, y, gate, rows)[0]
    return x + gate.index_select(0, rows) * y


def gated_residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor, norm: nn.RMSNorm,
                        shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate[rows] * y, and that normed and modulated): the attention residual and the MLP's input at once."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.residual_norm(x, y, gate, rows, norm.weight, norm.eps, shift, scale)
    x = gated_residual(x, y, gate, rows)
    return x, modulated_rms_norm(x, norm, shift, scale, rows)


def rms_norm(x: torch.Tensor, norm: nn.RMSNorm, dtype: torch.dtype) -> torch.Tensor:
    """norm(x) computed in fp32, returned in `dtype` (a half-precision GEMM's input)."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.scaled_residual_norm(x, None, None, norm.weight, norm.eps, dtype)[1]
    return norm(x.float()).to(dtype)


def scaled_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate, gate a per-channel [N] layer scale (the result in x's dtype: an fp32 residual stays fp32)."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.scaled_residual_norm(x, y, gate, None, None, None)[0]
    return (x + y * gate).to(x.dtype)


def scaled_residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, norm: nn.RMSNorm,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y * gate, and rms_norm of that in `dtype`): the attention residual and the MLP's input at once."""
    if _triton(x):
        from engine.kernels import fused_triton

        return fused_triton.scaled_residual_norm(x, y, gate, norm.weight, norm.eps, dtype)
    x = scaled_residual(x, y, gate)
    return x, rms_norm(x, norm, dtype)


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
