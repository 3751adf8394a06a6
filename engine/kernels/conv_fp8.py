"""k3 stride-1 3-D convolutions in float8 e4m3: weights quantized per output channel (amax / 448), activations
taken as they are (the GroupNorm + SiLU before such a convolution writes its padded input in fp8 directly; its values
sit far inside e4m3's +-448). Where the GPU has fp8 tensor cores one Triton kernel runs the convolution as an
implicit GEMM over the padded input (`conv_fp8_triton.py`), with Hopper's fast fp8 accumulation (not promoted to
fp32 every few k-blocks, like the decoder's fp8 tier; ~1 % of the output's range on random data); elsewhere the
same fp8 values are convolved in fp32 by PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import capability, fused
from engine.kernels.fused import FP8, FP8_MAX


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv3d weight [N, C, 3, 3, 3] -> (fp8 [N, 27 * C] with K ordered (dt, dh, dw, c), fp32 [N] scales)."""
    w = weight.detach().float().permute(0, 2, 3, 4, 1).flatten(1)
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale.contiguous()


def _kernel(x: torch.Tensor) -> bool:
    return fused._triton(x) and capability.fp8_gemm(x.device.type, capability.capability(x.device))


def conv3d_k3(padded: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The convolution of padded [N, C, T + 2, H + 2, W + 2] (fp8; channels-last and C a multiple of 32 for the
    kernel) with a quantized weight (`quantize_weight`): [N, N_OUT, T, H, W] in `dtype`, channels-last when the
    kernel ran."""
    n, c, t, h, w = padded.shape
    n_out = weight.shape[0]
    if _kernel(padded) and c % 32 == 0 and padded.permute(0, 2, 3, 4, 1).is_contiguous():
        from engine.kernels import conv_fp8_triton

        out = torch.empty(n, t - 2, h - 2, w - 2, n_out, dtype=dtype, device=padded.device)
        conv_fp8_triton.conv3d_k3(padded.permute(0, 2, 3, 4, 1), weight, scale, out)
        return out.permute(0, 4, 1, 2, 3)
    w = (weight.float() * scale[:, None]).view(n_out, 3, 3, 3, c).permute(0, 4, 1, 2, 3)
    return F.conv3d(padded.float(), w).to(dtype)
