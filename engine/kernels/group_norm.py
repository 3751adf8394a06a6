"""GroupNorm of every video frame on its own (statistics never mix frames), then SiLU: the norm of causal video
encoders; and the residual sum of their ResNet blocks. On CUDA a channels-last activation takes two Triton passes
(`group_norm_triton.py`): statistics, then normalise + affine + SiLU written once, straight into the caller's buffer
(e.g. the interior of the next convolution's padded input, whose reflected border one more launch writes), instead of
the fold, norm, SiLU, unfold and pad copies of the eager path. Elsewhere the eager path runs, which is the per-frame
GroupNorm of the reference exactly. `residual_bias` adds a block's output, its skip and the biases its convolutions
left out in one pass, written where the next convolution reads it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import fused


def _channels_last(x: torch.Tensor) -> bool:
    return x.permute(0, 2, 3, 4, 1).is_contiguous()


def reflect_border(buffer: torch.Tensor, top: int = 1, bottom: int = 1, left: int = 1, right: int = 1) -> torch.Tensor:
    """The named one-pixel borders of buffer [N, C, T, H, W] as the reflection of its interior, as
    F.pad(..., mode="reflect")'s (on CUDA one Triton launch; else rows first, so that the corners reflect both
    ways)."""
    if fused._triton(buffer):
        from engine.kernels import group_norm_triton

        group_norm_triton.reflect_border(buffer, top, bottom, left, right)
        return buffer
    if top:
        buffer[..., 0, :] = buffer[..., 2, :]
    if bottom:
        buffer[..., -1, :] = buffer[..., -3, :]
    if left:
        buffer[..., 0] = buffer[..., 2]
    if right:
        buffer[..., -1] = buffer[..., -3]
    return buffer


def frame_group_norm_silu(x: torch.Tensor, norm: nn.GroupNorm, out: torch.Tensor,
                          bias: torch.Tensor | None = None, reflect: bool = False) -> torch.Tensor:
    """out = silu(GroupNorm of each frame of x [N, C, T, H, W]) in out's dtype; out [N, C, T, H, W], any strides.
    `bias` [C]: the norm's input is x + bias (a convolution's bias folded in here: no pass of its own). `reflect`:
    out is [N, C, T, H + 2, W + 2], the norm goes in its interior and its border is the interior reflected (the
    padding of a k3 convolution)."""
    interior = out[..., 1:-1, 1:-1] if reflect else out
    if fused._triton(x) and _channels_last(x):
        frame_group_norm_silu_triton(x, norm, interior, bias)
    else:
        x = x if bias is None else x + bias.view(-1, 1, 1, 1)
        n, c, t, h, w = x.shape
        folded = x.permute(0, 2, 1, 3, 4).reshape(n * t, c, h, w)
        y = F.silu(F.group_norm(folded, norm.num_groups, norm.weight, norm.bias, norm.eps))
        interior.copy_(y.view(n, t, c, h, w).permute(0, 2, 1, 3, 4))
    return reflect_border(out) if reflect else out


def frame_group_norm_silu_triton(x: torch.Tensor, norm: nn.GroupNorm, out: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path of `frame_group_norm_silu`, for a channels-last x. A bias leaves the shifted sums as they are
    (they are taken from each channel's first pixel): it moves the channel means, and the shift applied below."""
    from engine.kernels import group_norm_triton

    n, c, t, h, w = x.shape
    rows = x.permute(0, 2, 3, 4, 1).view(n * t, h * w, c)
    s1, s2 = group_norm_triton.shifted_sums(rows)
    pixels, groups = h * w, norm.num_groups
    bias = torch.zeros(c, device=x.device) if bias is None else bias.float()
    channel_mean = rows[:, 0].float() + bias + s1 / pixels
    channel_m2 = (s2 - s1 * s1 / pixels).view(n * t, groups, -1)
    channel_mean = channel_mean.view(n * t, groups, -1)
    mean = channel_mean.mean(-1, keepdim=True)
    # Chan et al.'s combination of per-channel moments into the group's.
    m2 = channel_m2.sum(-1, keepdim=True) + pixels * (channel_mean - mean).square().sum(-1, keepdim=True)
    rstd = torch.rsqrt(m2 / (pixels * channel_m2.shape[-1]) + norm.eps)
    a = (rstd * norm.weight.float().view(groups, -1)).view(n * t, c)
    b = norm.bias.float() - (mean * a.view(n * t, groups, -1)).view(n * t, c) + bias * a
    group_norm_triton.scale_shift_silu(rows, a.contiguous(), b.contiguous(), out)
    return out


def residual_bias(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None,
                  bottom: int = 0, right: int = 0) -> torch.Tensor:
    """x + y + bias, x and y [N, C, T, H, W] of one layout, bias [C]: in place into x, or into `out` [N, C, T,
    H + bottom, W + right] whose interior gets the sum and whose extra bottom row / right column (0 or 1 each) its
    reflection (a strided convolution's padding). Returns what was written."""
    if out is None:
        out, interior = x, x
    else:
        interior = out[..., :out.shape[-2] - bottom, :out.shape[-1] - right]
    if fused._triton(x) and _channels_last(x) and x.stride() == y.stride():
        from engine.kernels import group_norm_triton

        group_norm_triton.residual_bias(x, y, bias.float().contiguous(), interior)
    else:
        interior.copy_(x.add(y).add_(bias.view(-1, 1, 1, 1)))
    return reflect_border(out, 0, bottom, 0, right) if bottom or right else out
