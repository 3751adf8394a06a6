"""Live preview of a running job: the middle latent frame of the DiT's clean estimate, projected linearly from
the 24 latent channels to RGB and JPEG-encoded. No VAE: cheap enough for every step, on any device. SeedVR2
batches preview a finished output frame (`frame_jpeg`).

The projection is a fixed pseudo-random one (seeded), not colours fitted to the real VAE: it shows layout and
motion, not true colour. A fitted 24x3 matrix can replace it without changing anything else.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

LATENT_CHANNELS = 24
_PROJECTION = torch.randn(LATENT_CHANNELS, 3, generator=torch.Generator().manual_seed(24)) * (0.6 / LATENT_CHANNELS**0.5)


def preview_jpeg(video_x0: torch.Tensor, max_side: int = 384, quality: int = 75) -> bytes:
    """video_x0: normalised latents [1, 24, T, h, w] -> JPEG bytes (long side scaled to `max_side`)."""
    latent = video_x0[0, :, video_x0.shape[2] // 2].detach().float().cpu()  # [24, h, w]
    rgb = torch.einsum("chw,cr->hwr", latent, _PROJECTION)
    return frame_jpeg(((rgb + 1) * 127.5).clamp(0, 255).to(torch.uint8), max_side, quality)


def frame_jpeg(frame: torch.Tensor, max_side: int = 384, quality: int = 75) -> bytes:
    """uint8 [H, W, 3] -> JPEG bytes (long side scaled to `max_side`)."""
    image = Image.fromarray(frame.detach().cpu().numpy())
    scale = max_side / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()
