"""Rectified-flow schedule and Euler step (specs/h3.md §5.1).

x_t = t*x0 + (1-t)*noise, sigma = 1 - t; the DiT predicts the data-ward velocity v = x0 - noise.
N grid points (terminal 0 included) drive N - 1 model evaluations. Video uses shift 12, audio shift 3,
both on the same base grid.
"""

from __future__ import annotations

import torch

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0


def sigmas(num_points: int, shift: float) -> torch.Tensor:
    """Shifted sigma grid on linspace(1, 0, N) in fp32, float32 collisions collapsed."""
    if num_points < 2:
        raise ValueError(f"steps must be at least 2 grid points (1 model evaluation), got {num_points}.")
    base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


def euler_blend(x: torch.Tensor, x0: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """Euler (eta 0) as the blend x_next = r*x + (1-r)*x0, r = sigma_next / sigma, in fp32."""
    ratio = (torch.tensor(sigma_next, dtype=torch.float32) / torch.tensor(sigma, dtype=torch.float32)).to(x.device)
    return (ratio * x.float() + (1.0 - ratio) * x0.float()).to(x.dtype)


def euler_step(x: torch.Tensor, v: torch.Tensor, t: float, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler step from the velocity: x0 = x + (1 - t) v with sigma taken from the fp32 timestep itself."""
    x0 = x.float() + (1 - torch.tensor(t, dtype=torch.float32)).to(x.device) * v.float()
    return euler_blend(x, x0, sigma, sigma_next)
