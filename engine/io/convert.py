"""Float video -> uint8 frames on the device the video lives on (before any device-to-host copy)."""

from __future__ import annotations

import torch


def to_uint8_frames(x: torch.Tensor) -> torch.Tensor:
    """[1, C, F, H, W] or [C, F, H, W] float in [0, 1] -> contiguous uint8 [F, H, W, C], same device.

    Clamp, scale and round to nearest (ties to even, as numpy) in fp32; the BCTHW -> THWC layout change and the
    cast to uint8 happen in one copy into the output buffer.
    """
    if x.dim() == 5:
        if x.shape[0] != 1:
            raise ValueError(f"expected one video, got a batch of {x.shape[0]}")
        x = x[0]
    if x.dim() != 4:
        raise ValueError(f"expected [C, F, H, W] or [1, C, F, H, W], got shape {tuple(x.shape)}")
    y = x.float().clamp(0.0, 1.0).mul_(255.0).round_()
    c, f, h, w = y.shape
    out = torch.empty((f, h, w, c), dtype=torch.uint8, device=y.device)
    out.copy_(y.permute(1, 2, 3, 0))
    return out
