"""Edit masks: from what an artist paints (0 keep, 1 regenerate, fractions blend) to what the DiT sees.

A pixel mask [F, H, W] (or [H, W], broadcast over time) on the canvas reduces to the latent *cell* grid
[T, H/16, W/16] by taking the max over each 16x16 pixel block and over the pixel frames each latent frame folds
(1, 4, 4, 4, 4 per 17-frame chunk): any regenerated pixel regenerates its latent. The *token* mask is the max
over each 2x2 patch of cells, quantised up to 1/256 so a request has at most 257 distinct AdaLN rows. The cell
mask, expanded to the packed row features, decides what is restored from the source after every step.
Mask Preview overlays exactly `cell_mask`, so what the artist sees is what the engine uses. After decoding, the
pixels the mask leaves at 0 are the source's own (`canvas_mask`): the decoder's reconstruction of unedited cells
is close to the source but not equal to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.h3 import layout as L

LEVELS = 256
CHUNK_ELEMENTS = 1 << 22  # mask pixels converted and resized at a time


class MaskError(ValueError):
    """A mask that cannot be used; the message is written for an artist."""


def latent_frame_spans(num_frames: int) -> list[tuple[int, int]]:
    """[start, stop) pixel frames folded into each latent frame of a 17n + 5 clip."""
    spans, start = [], 0
    for k in range(L.latent_frames(num_frames)):
        stop = start + L.FRAMES_PER_LATENT[k % 5]
        spans.append((start, stop))
        start = stop
    return spans


def check_mask(mask, frames: int, name: str = "mask") -> torch.Tensor:
    """Validate a mask, float 0..1 or uint8 0..255 (as the wire carries it), 2-D [H, W] or per frame [F, H, W] with
    F at most `frames`; returned 3-D in its own dtype."""
    mask = torch.as_tensor(mask)
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim != 3:
        raise MaskError(f"The {name} must be 2-D [H, W] or per frame [frames, H, W], got shape {list(mask.shape)}.")
    if mask.dtype != torch.uint8:
        mask = mask.float()
        low, high = torch.aminmax(mask)  # one pass over a real-size mask; a NaN anywhere makes both NaN
        if not (torch.isfinite(low) and torch.isfinite(high)):
            raise MaskError(f"The {name} contains NaN or infinite values.")
        if low < 0 or high > 1:
            raise MaskError(f"The {name} must hold values from 0 (keep) to 1 (regenerate), "
                            f"got {low.item():g} to {high.item():g}.")
    if mask.shape[0] > frames:
        raise MaskError(f"The {name} has {mask.shape[0]} frames but the video has {frames}.")
    return mask


def canvas_mask(mask, frames: int, height: int, width: int) -> torch.Tensor:
    """A mask as drawn (on the source's own size or the canvas; `check_mask`) -> float [frames, height, width] on
    the canvas. A single-frame mask covers every frame; a shorter one repeats its last frame, as a clip padded up
    to 17n + 5 does. A real-size mask goes a few frames at a time: as one float tensor a 1080p mask of 15 s
    would take 3 GB."""
    mask = check_mask(mask, frames)
    out = torch.empty(mask.shape[0], height, width)
    shrink = mask.shape[1] >= height and mask.shape[2] >= width
    per = max(1, CHUNK_ELEMENTS // (mask.shape[1] * mask.shape[2]))
    for i in range(0, mask.shape[0], per):
        x = mask[i:i + per].float()
        if mask.dtype == torch.uint8:
            x.div_(255)
        if x.shape[1:] != (height, width):
            x = F.interpolate(x[None], size=(height, width), mode="area" if shrink else "nearest-exact")[0]
        out[i:i + per] = x
    if len(out) == 1:
        return out.expand(frames, -1, -1)
    return torch.cat([out, out[-1:].expand(frames - len(out), -1, -1)])


def cell_mask(mask: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """Pixel mask -> latent cell mask [T, height/16, width/16]."""
    mask = canvas_mask(mask, frames, height, width)
    s = L.VAE_SPATIAL
    cells = F.max_pool2d(mask[:, None], kernel_size=s, stride=s)[:, 0]
    return torch.stack([cells[a:b].amax(dim=0) for a, b in latent_frame_spans(frames)])


def edit_cells(mask: torch.Tensor, strength: float, frames: int, height: int,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An edit's mask as drawn -> (the mask on the canvas [frames, height, width], which keeps the source's pixels
    where it is 0, and the latent cells it regenerates at `strength`): the engine's edit and Mask Preview alike."""
    drawn = canvas_mask(mask, frames, height, width)
    return drawn, cell_mask(drawn * strength, frames, height, width)


def token_mask(cells: torch.Tensor) -> torch.Tensor:
    """Cell mask [T, h, w] -> per-row model mask [T*(h/2)*(w/2)], max over 2x2, quantised up to 1/256."""
    tokens = F.max_pool2d(cells[:, None], kernel_size=2, stride=2)[:, 0]
    return (torch.ceil(tokens * LEVELS) / LEVELS).reshape(-1)


def restore_rows(cells: torch.Tensor, channels: int = 24) -> torch.Tensor:
    """Cell mask [T, h, w] -> restore weights in packed row layout [T*(h/2)*(w/2), channels*4]."""
    T, h, w = cells.shape
    return L.patchify(cells[None, None].expand(1, channels, T, h, w))[0]


def audio_rows(mask: float | torch.Tensor, num_audio_latents: int) -> torch.Tensor:
    """Audio mask: a scalar, [Ta] or [2, Ta] over the 40 Hz latents -> channel-major rows [2*Ta]."""
    m = torch.as_tensor(mask, dtype=torch.float32)
    if not torch.isfinite(m).all() or m.min() < 0 or m.max() > 1:
        raise MaskError("The audio mask must hold values from 0 (keep the source sound) to 1 (regenerate).")
    if m.ndim == 0:
        m = m.expand(num_audio_latents)
    if m.shape[-1] != num_audio_latents or m.ndim > 2 or (m.ndim == 2 and m.shape[0] != L.AUDIO_CHANNELS):
        raise MaskError(f"The audio mask must be a number, [{num_audio_latents}] or [2, {num_audio_latents}] "
                        f"(40 values a second), got shape {list(m.shape)}.")
    return m.expand(L.AUDIO_CHANNELS, num_audio_latents).reshape(-1).contiguous()
