"""Live preview of a running job: a sheet of latent frames spread over the whole clip, each the DiT's clean
estimate projected linearly from the 24 latent channels to RGB, JPEG-encoded. No VAE: cheap enough for every
step, on any device. The projection is the video VAE's own (`VideoVAE.latent_rgb`: ComfyUI's factors for the
released VAE, fitted ones for the embedded default), so colours are true to what the decode will show. SeedVR2
batches preview a finished output frame (`frame_jpeg`).
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from PIL import Image

GRID = 2  # a GRID x GRID sheet of latent frames, first to last, read row by row
GAP = 2  # light pixels between the sheet's frames


def preview_jpeg(video_x0: torch.Tensor, latent_rgb: tuple[torch.Tensor, torch.Tensor], max_side: int = 512,
                 quality: int = 75) -> bytes:
    """video_x0: normalised latents [1, C, T, h, w]; latent_rgb: (factors [C, 3], bias [3]) -> JPEG bytes of a
    sheet of GRID x GRID latent frames evenly spread from the first to the last (one frame when T is 1)."""
    latents = video_x0[0].detach().float().cpu()  # [C, T, h, w]
    count = GRID * GRID if latents.shape[1] >= GRID * GRID else 1
    picks = torch.linspace(0, latents.shape[1] - 1, count).round().long()
    factors, bias = latent_rgb
    rgb = torch.einsum("cthw,cr->trhw", latents[:, picks], factors) + bias.view(1, 3, 1, 1)
    rgb = F.pad(F.interpolate(rgb, scale_factor=4, mode="nearest"), (0, GAP, 0, GAP), value=1.0)
    side = int(count ** 0.5)
    sheet = torch.cat([torch.cat(list(rgb[r * side:(r + 1) * side]), dim=2) for r in range(side)], dim=1)
    sheet = sheet[:, :-GAP, :-GAP]  # [3, side * (4h + GAP) - GAP, side * (4w + GAP) - GAP]
    return frame_jpeg(((sheet.permute(1, 2, 0) + 1) * 127.5).clamp(0, 255).to(torch.uint8), max_side, quality)


def frame_jpeg(frame: torch.Tensor, max_side: int = 384, quality: int = 75) -> bytes:
    """uint8 [H, W, 3] -> JPEG bytes (long side scaled to `max_side`)."""
    image = Image.fromarray(frame.detach().cpu().numpy())
    scale = max_side / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()
