"""Colour correction of restored frames against the (resized) input frames (specs/seedvr2.md §4.3).

Frames are [N, 3, H, W] in [-1, 1]; everything runs in fp32, frame by frame where statistics are involved.

* wavelet: 5-level a-trous decomposition (3x3 [1,2,1]x[1,2,1]/16 kernel, dilation 2^i, replicate padding); keep the
  restored high bands, take the reference's lowest band.
* lab: wavelet first, then per-frame CIELAB quantile matching of a* and b* to the reference, and of L* blended
  with the restored L* (`luminance_weight` of the restored kept).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("wavelet", "lab", "none")
_KERNEL = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16.0
# sRGB (D65) <-> XYZ
_RGB_TO_XYZ = torch.tensor([[0.4124564, 0.3575761, 0.1804375],
                            [0.2126729, 0.7151522, 0.0721750],
                            [0.0193339, 0.1191920, 0.9503041]])
_WHITE = _RGB_TO_XYZ.sum(dim=1)


def wavelet_blur(x: torch.Tensor, radius: int) -> torch.Tensor:
    c = x.shape[1]
    kernel = _KERNEL.to(x)[None, None].expand(c, 1, 3, 3)
    x = F.pad(x, (radius,) * 4, mode="replicate")
    return F.conv2d(x, kernel, groups=c, dilation=radius)


def wavelet_decomposition(x: torch.Tensor, levels: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the high bands, the lowest band); their sum is x."""
    high = torch.zeros_like(x)
    for i in range(levels):
        low = wavelet_blur(x, 2**i)
        high += x - low
        x = low
    return high, x


def wavelet_fix(frames: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    high, _ = wavelet_decomposition(frames.float())
    _, low = wavelet_decomposition(reference.float())
    return high + low


def _srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] sRGB in [0, 1] -> CIELAB (D65)."""
    linear = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = torch.einsum("ij,njhw->nihw", _RGB_TO_XYZ.to(rgb), linear) / _WHITE.to(rgb)[None, :, None, None]
    f = torch.where(xyz > (6 / 29) ** 3, xyz.clamp_min(1e-12) ** (1 / 3), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    fx, fy, fz = f.unbind(1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=1)


def _lab_to_srgb(lab: torch.Tensor) -> torch.Tensor:
    L, a, b = lab.unbind(1)
    fy = (L + 16) / 116
    f = torch.stack([fy + a / 500, fy, fy - b / 200], dim=1)
    xyz = torch.where(f > 6 / 29, f**3, 3 * (6 / 29) ** 2 * (f - 4 / 29)) * _WHITE.to(lab)[None, :, None, None]
    linear = torch.einsum("ij,njhw->nihw", torch.linalg.inv(_RGB_TO_XYZ).to(lab), xyz).clamp(0.0, 1.0)
    return torch.where(linear > 0.0031308, 1.055 * linear ** (1 / 2.4) - 0.055, 12.92 * linear)


def match_quantiles(source: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Each value of source [N, P] replaced by the reference [N, Q] value at the same quantile, per row."""
    order = source.argsort(dim=1)
    ref_sorted = reference.sort(dim=1).values
    pick = torch.linspace(0, reference.shape[1] - 1, source.shape[1], device=source.device).round().long()
    return torch.empty_like(source).scatter_(1, order, ref_sorted[:, pick])


def lab_fix(frames: torch.Tensor, reference: torch.Tensor, luminance_weight: float = 0.8) -> torch.Tensor:
    fixed = wavelet_fix(frames, reference)
    n = fixed.shape[0]
    lab = _srgb_to_lab(((fixed + 1) / 2).clamp(0.0, 1.0)).flatten(2)
    ref = _srgb_to_lab(((reference.float() + 1) / 2).clamp(0.0, 1.0)).flatten(2)
    matched = torch.stack([match_quantiles(lab[:, i], ref[:, i]) for i in range(3)], dim=1)
    matched[:, 0] = luminance_weight * lab[:, 0] + (1 - luminance_weight) * matched[:, 0]
    return _lab_to_srgb(matched.view(n, 3, *fixed.shape[-2:])) * 2 - 1


def color_fix(frames: torch.Tensor, reference: torch.Tensor, mode: str) -> torch.Tensor:
    """frames, reference [N, 3, H, W] in [-1, 1] (same size) -> corrected frames, fp32."""
    if mode == "wavelet":
        return wavelet_fix(frames, reference)
    if mode == "lab":
        return lab_fix(frames, reference)
    if mode == "none":
        return frames.float()
    raise ValueError(f"colour fix must be one of {MODES}, got {mode!r}")
