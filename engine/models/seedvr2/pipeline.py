"""SeedVR2 one-step video restoration / upscaling (specs/seedvr2.md §4), end to end.

uint8 frames -> temporal batches of 4n+1 frames (overlapping, crossfaded) -> resize to the output size
(bicubic, antialiased) -> pad to multiples of 16 ("side", cropped back afterwards) or centre-crop to them
("area", the official recipe) -> VAE encode (posterior sample) -> one DiT step at t = 1000 on
[noise | LQ latent | 1] -> x0 = noise - v -> VAE decode -> colour fix against the resized input -> uint8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.io.convert import to_uint8_frames
from engine.models.seedvr2.checkpoint import find_models, load_nadit, load_text_embedding, load_vae
from engine.models.seedvr2.colorfix import MODES as COLOR_FIX_MODES
from engine.models.seedvr2.colorfix import color_fix as apply_color_fix
from engine.models.seedvr2.config import (
    DIT_PRESETS, LATENT_SCALE, TIMESTEP, TINY_TEXT_LEN, TINY_VAE, VAE, NaDiTConfig, VAEConfig,
)
from engine.models.seedvr2.nadit import NaDiT, build_nadit
from engine.models.seedvr2.vae import VideoVAE, build_vae, posterior_sample
from engine.models.seedvr2.vae_parallel import ParallelVAE
from engine.parallel import window_sp

RESOLUTIONS = {"720p": 720, "1080p": 1080, "1440p": 1440, "2k": 1440, "2160p": 2160, "4k": 2160}
RESIZE_MODES = ("side", "area")
MULTIPLE = 16  # VAE x8, then 2x2 patches


class UpscaleError(ValueError):
    """A request the pipeline cannot run; the message is written for an artist."""


@dataclass
class UpscaleStep:
    step: int  # 1-based temporal batches done
    total: int
    preview: torch.Tensor  # uint8 [H, W, 3]: the middle frame of the batch just finished


def _even(x: float) -> int:
    return max(MULTIPLE, 2 * round(x / 2))


def output_size(height: int, width: int, target_height: int | None = None, target_width: int | None = None,
                scale: float | None = None, resolution: str | int | None = None) -> tuple[int, int]:
    """The output (height, width), even: an explicit size, one side (aspect kept), a scale, or a resolution
    ("1080p", "2k", "4k", ... or a number) for the short edge."""
    given = [target_height is not None or target_width is not None, scale is not None, resolution is not None]
    if sum(given) != 1:
        raise UpscaleError("Give exactly one of: a target size, a scale, or a resolution (1080p, 2K, 4K).")
    if given[0]:
        if target_height is not None and target_width is not None:
            return _even(target_height), _even(target_width)
        if target_height is not None:
            return _even(target_height), _even(width * target_height / height)
        return _even(height * target_width / width), _even(target_width)
    if given[1]:
        if not scale > 0:
            raise UpscaleError(f"The scale must be positive, got {scale}.")
        return _even(height * scale), _even(width * scale)
    key = str(resolution).lower()
    if key not in RESOLUTIONS and not key.isdigit():
        raise UpscaleError(f"Unknown resolution {resolution!r}; use one of {', '.join(RESOLUTIONS)} or a number.")
    short = RESOLUTIONS.get(key) or int(key)
    factor = short / min(height, width)
    return _even(height * factor), _even(width * factor)


def snap_frames(n: int) -> int:
    """The largest 4k+1 <= n (at least 1)."""
    return max(1, (n - 1) // 4 * 4 + 1)


def plan_batches(num_frames: int, batch_frames: int | None, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) of every temporal batch: `batch_frames` snapped to 4k+1, consecutive batches overlapping by at
    least `overlap` frames; the last batch ends at the last frame (it may overlap more)."""
    if batch_frames is None or batch_frames >= num_frames:
        return [(0, num_frames)]
    size = snap_frames(batch_frames)
    overlap = min(max(overlap, 0), size - 1)
    starts = list(range(0, num_frames - size, size - overlap)) + [num_frames - size]
    return [(s, s + size) for s in sorted(set(starts))]


def _pad_time(x: torch.Tensor, frames: int) -> torch.Tensor:
    """[N, ...] -> [frames, ...] repeating the last frame."""
    return torch.cat([x, x[-1:].expand(frames - x.shape[0], *x.shape[1:])]) if frames > x.shape[0] else x


class SeedVR2Pipeline:
    def __init__(self, dit: NaDiT, vae: VideoVAE, text: torch.Tensor, device: torch.device, name: str):
        self.dit, self.vae, self.device, self.name = dit, vae, device, name
        self.text = text.to(device)
        # Ranks that share every batch (window-aligned SP for the DiT, temporal chunks for the VAE); None: this one.
        self.group = None

    @classmethod
    def from_preset(cls, preset: str = "tiny", device: str | torch.device = "cpu", seed: int = 0
                    ) -> "SeedVR2Pipeline":
        """`tiny` (= `tiny-3b`) or `tiny-7b`: the real architectures at tiny width, weights drawn from `seed`."""
        key = "tiny-3b" if preset == "tiny" else preset
        if not key.startswith("tiny") or key not in DIT_PRESETS:
            raise ValueError(f"unknown preset {preset!r}: 'tiny', 'tiny-3b' or 'tiny-7b'; real weights come "
                             "from a models directory")
        device = torch.device(device)
        config = DIT_PRESETS[key]
        dit = build_nadit(config, seed=seed, device=device)
        vae = build_vae(TINY_VAE, seed=seed, device=device)
        text = torch.randn(TINY_TEXT_LEN, config.text_dim, generator=torch.Generator().manual_seed(seed))
        return cls(dit, vae, text, device, preset)

    @classmethod
    def from_models(cls, models_dir: str | Path, size: str = "3b", device: str | torch.device = "cuda",
                    dtype: torch.dtype = torch.bfloat16, dit_config: NaDiTConfig | None = None,
                    vae_config: VAEConfig = VAE) -> "SeedVR2Pipeline":
        """Official files from `models_dir` (or its seedvr2/ subfolder): DiT, ema_vae, pos_emb.pt."""
        device = torch.device(device)
        dit_path, vae_path, text_path = find_models(models_dir, size)
        dit = load_nadit(dit_path, dit_config or DIT_PRESETS[size], dtype=dtype, device=device)
        vae = load_vae(vae_path, vae_config, dtype=dtype, device=device)
        text = load_text_embedding(text_path, dit.config.text_dim)
        return cls(dit, vae, text, device, f"{size} ({dit_path.name})")

    def describe(self) -> dict:
        c = self.dit.config
        return {"model": "SeedVR2", "weights": self.name, "device": str(self.device),
                "dit": {"layers": c.num_layers, "dim": c.dim, "heads": c.heads,
                        "dtype": str(self.dit.dtype).removeprefix("torch.")},
                "vae": {"dtype": str(self.vae.dtype).removeprefix("torch.")}}

    # ---- one batch ---------------------------------------------------------------------------------------------
    def predict(self, vid: torch.Tensor) -> torch.Tensor:
        """The DiT on [T, h, w, 33] -> v [T, h, w, 16]."""
        if self.group is not None:
            return window_sp.predict(self.dit, vid, self.text, TIMESTEP, self.group)
        return self.dit(vid, self.text, TIMESTEP)

    @torch.no_grad()
    def restore(self, video: torch.Tensor, seed: int = 0, tiling: bool = True) -> torch.Tensor:
        """video [3, 4n+1, H, W] in [-1, 1], H and W multiples of 16 -> restored video, same shape, fp32."""
        gen = torch.Generator().manual_seed(int(seed))
        vae = self.vae if self.group is None else ParallelVAE(self.vae, self.group)
        moments = vae.encode(video[None], tiling=tiling)
        latent = posterior_sample(moments, gen)[0].permute(1, 2, 3, 0) * LATENT_SCALE  # [T, h, w, 16]
        noise = torch.randn(latent.shape, generator=gen, dtype=torch.float32).to(latent.device)
        cond = torch.cat([noise, latent, torch.ones_like(latent[..., :1])], dim=-1)
        x0 = noise - self.predict(cond)
        return vae.decode((x0 / LATENT_SCALE).permute(3, 0, 1, 2)[None], tiling=tiling)[0].float()

    # ---- clips ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def upscale(self, frames, target_height: int | None = None, target_width: int | None = None,
                scale: float | None = None, resolution: str | int | None = None, color_fix: str = "wavelet",
                seed: int = 0, batch_frames: int | None = None, overlap_frames: int = 4, tiling: bool = True,
                resize: str = "side", on_step: Callable[[UpscaleStep], None] | None = None) -> torch.Tensor:
        """uint8 frames [F, H, W, 3] -> uint8 [F, H', W', 3] on the CPU.

        The output size comes from exactly one of (target_height and/or target_width), `scale` or `resolution`.
        `resize="side"` keeps that size exactly (the model runs on a canvas padded to multiples of 16);
        `resize="area"` is the official recipe (the target area at the input aspect, centre-cropped to multiples
        of 16). `batch_frames` (snapped to 4k+1) splits long clips into batches overlapping by `overlap_frames`,
        crossfaded. `on_step` is called after every batch; raise from it to stop.
        """
        frames = self._check_frames(frames)
        if color_fix not in COLOR_FIX_MODES:
            raise UpscaleError(f"Colour fix must be one of {', '.join(COLOR_FIX_MODES)}, got {color_fix!r}.")
        if resize not in RESIZE_MODES:
            raise UpscaleError(f"Resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}.")
        num, height, width = frames.shape[:3]
        out_h, out_w = output_size(height, width, target_height, target_width, scale, resolution)
        if resize == "area":
            factor = math.sqrt(out_h * out_w / (height * width))
            size = (round(height * factor), round(width * factor))
            out_h, out_w = size[0] // MULTIPLE * MULTIPLE, size[1] // MULTIPLE * MULTIPLE
            if min(out_h, out_w) < MULTIPLE:
                raise UpscaleError(f"The output {size[1]}x{size[0]} is too small; use at least 16x16.")
        else:
            size = (out_h, out_w)

        batches = plan_batches(num, batch_frames, overlap_frames)
        out = torch.empty((num, out_h, out_w, 3), dtype=torch.uint8)
        carry = None
        for i, (start, stop) in enumerate(batches):
            y = self._upscale_batch(frames[start:stop], size, (out_h, out_w), color_fix, seed, tiling)
            if carry is not None:
                w = torch.arange(1, carry.shape[0] + 1, device=y.device).view(-1, 1, 1, 1) / (carry.shape[0] + 1)
                y[:carry.shape[0]] = carry * (1 - w) + y[:carry.shape[0]] * w
            final = (batches[i + 1][0] if i + 1 < len(batches) else stop) - start
            out[start:start + final] = self._to_uint8(y[:final])
            carry = y[final:]
            if on_step is not None:
                on_step(UpscaleStep(i + 1, len(batches), out[start + (final - 1) // 2]))
        return out

    def _check_frames(self, frames) -> torch.Tensor:
        if isinstance(frames, np.ndarray):
            frames = torch.from_numpy(np.ascontiguousarray(frames))
        if not torch.is_tensor(frames) or frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            got = f"{frames.dtype} {tuple(frames.shape)}" if torch.is_tensor(frames) else type(frames).__name__
            raise UpscaleError(f"The video must be uint8 frames [F, H, W, 3], got {got}.")
        if frames.shape[0] == 0 or min(frames.shape[1:3]) < 2:
            raise UpscaleError(f"The video is empty or too small ({tuple(frames.shape)}).")
        return frames

    def _upscale_batch(self, frames: torch.Tensor, size: tuple[int, int], out_size: tuple[int, int],
                       color_fix: str, seed: int, tiling: bool) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> fp32 [n, 3, out_h, out_w] in [-1, 1] on the device."""
        n = frames.shape[0]
        x = frames.to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp_(-1.0, 1.0)
        top, left = (size[0] - out_size[0]) // 2, (size[1] - out_size[1]) // 2  # "area": centre crop
        reference = x[:, :, top:top + out_size[0], left:left + out_size[1]]
        canvas = [-(-s // MULTIPLE) * MULTIPLE for s in out_size]  # "side": pad bottom/right, crop back below
        padded = F.pad(reference, (0, canvas[1] - out_size[1], 0, canvas[0] - out_size[0]), mode="replicate")
        video = _pad_time(padded, (n - 1 + 3) // 4 * 4 + 1).permute(1, 0, 2, 3)
        restored = self.restore(video, seed, tiling).permute(1, 0, 2, 3)[:n, :, :out_size[0], :out_size[1]]
        return apply_color_fix(restored, reference, color_fix).clamp_(-1.0, 1.0)

    @staticmethod
    def _to_uint8(y: torch.Tensor) -> torch.Tensor:
        return to_uint8_frames(((y + 1) / 2).permute(1, 0, 2, 3)).cpu()


__all__ = ["SeedVR2Pipeline", "UpscaleStep", "UpscaleError", "output_size", "plan_batches", "snap_frames"]
