"""SeedVR2 one-step video restoration / upscaling (specs/seedvr2.md §4), end to end.

uint8 frames -> temporal batches of 4n+1 frames (overlapping, crossfaded) -> resize to the output size
(bicubic, antialiased) -> pad to multiples of 16 ("side", cropped back afterwards) or centre-crop to them
("area", the official recipe) -> VAE encode (posterior sample) -> one DiT step at t = 1000 on
[noise | LQ latent | 1] -> x0 = noise - v -> VAE decode -> colour fix against the resized input -> uint8.

Progress: one phase, "upscaling", whose boundaries are every VAE chunk (and tile) of every batch, the DiT step and
the end of each batch (with its middle frame as a preview). The tiny presets map the named resolutions to small
sizes and bound the output area, so that every task stays quick on a CPU (config.TINY_RESOLUTIONS).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.io.convert import to_uint8_frames
from engine.models.seedvr2.checkpoint import find_models, load_nadit, load_text_embedding, load_vae
from engine.models.seedvr2.colorfix import MODES as COLOR_FIX_MODES
from engine.models.seedvr2.colorfix import color_fix as apply_color_fix
from engine.models.phases import Phase
from engine.models.seedvr2.config import (
    DIT_PRESETS, LATENT_SCALE, TIMESTEP, TINY_3B, TINY_MAX_PIXELS, TINY_RESOLUTIONS, TINY_TEXT_LEN, TINY_VAE, VAE,
    NaDiTConfig, VAEConfig,
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


def _even(x: float) -> int:
    return max(MULTIPLE, 2 * round(x / 2))


def output_size(height: int, width: int, target_height: int | None = None, target_width: int | None = None,
                scale: float | None = None, resolution: str | int | None = None,
                resolutions: dict[str, int] = RESOLUTIONS) -> tuple[int, int]:
    """The output (height, width), even: an explicit size, one side (aspect kept), a scale, or a resolution
    ("1080p", "2k", "4k", ... as `resolutions` maps them, or a number) for the short edge."""
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
    short = resolutions.get(key) or int(key)
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


def fit_area(height: int, width: int, max_pixels: int) -> tuple[int, int]:
    """The largest even (height, width) at the same aspect with at most `max_pixels` pixels."""
    factor = math.sqrt(max_pixels / (height * width))
    return max(MULTIPLE, 2 * int(height * factor / 2)), max(MULTIPLE, 2 * int(width * factor / 2))


def _model_frames(n: int) -> int:
    """n frames padded up to 4k + 1."""
    return (n - 1 + 3) // 4 * 4 + 1


def _pad_time(x: torch.Tensor, frames: int) -> torch.Tensor:
    """[N, ...] -> [frames, ...] repeating the last frame."""
    return torch.cat([x, x[-1:].expand(frames - x.shape[0], *x.shape[1:])]) if frames > x.shape[0] else x


class SeedVR2Pipeline:
    def __init__(self, dit: NaDiT, vae: VideoVAE, text: torch.Tensor, device: torch.device, name: str,
                 resolutions: dict[str, int] = RESOLUTIONS, max_pixels: int | None = None):
        self.dit, self.vae, self.device, self.name = dit, vae, device, name
        self.text = text.to(device)
        self.resolutions, self.max_pixels = resolutions, max_pixels  # what "1080p" means; the output area bound
        # Ranks that share every batch (window-aligned SP for the DiT, temporal chunks for the VAE); None: this one.
        self.group = None

    @classmethod
    def from_preset(cls, preset: str = "toy", device: str | torch.device = "cpu", seed: int = 0,
                    on_loaded: Callable[[], None] | None = None, root: str | Path | None = None,
                    dtype: torch.dtype = torch.float32) -> "SeedVR2Pipeline":
        """`toy`: the trained embedded default (tiny 3B architecture; official-layout files in `root`, default
        engine/weights/toy/seedvr2); `tiny` (= `tiny-3b`) or `tiny-7b`: the real architectures at tiny width,
        weights drawn from `seed`. `on_loaded()` after each of the DiT, the VAE and the text embedding."""
        loaded = on_loaded or (lambda: None)
        device = torch.device(device)
        if preset == "toy":
            from engine.models import TOY_WEIGHTS

            dit_path, vae_path, text_path = find_models(root or TOY_WEIGHTS / "seedvr2", "3b")
            dit = load_nadit(dit_path, TINY_3B, dtype=dtype, device=device)
            loaded()
            vae = load_vae(vae_path, TINY_VAE, dtype=dtype, device=device)
            loaded()
            text = load_text_embedding(text_path, TINY_3B.text_dim).float()
            loaded()
            return cls(dit, vae, text, device, "toy", TINY_RESOLUTIONS, TINY_MAX_PIXELS)
        key = "tiny-3b" if preset == "tiny" else preset
        if not key.startswith("tiny") or key not in DIT_PRESETS:
            raise ValueError(f"unknown preset {preset!r}: 'toy' (trained), 'tiny', 'tiny-3b' or 'tiny-7b' "
                             "(random); real weights come from a models directory")
        config = DIT_PRESETS[key]
        dit = build_nadit(config, seed=seed, device=device)
        loaded()
        vae = build_vae(TINY_VAE, seed=seed, device=device)
        loaded()
        text = torch.randn(TINY_TEXT_LEN, config.text_dim, generator=torch.Generator().manual_seed(seed))
        loaded()
        return cls(dit, vae, text, device, preset, TINY_RESOLUTIONS, TINY_MAX_PIXELS)

    @classmethod
    def from_models(cls, models_dir: str | Path, size: str = "3b", device: str | torch.device = "cuda",
                    dtype: torch.dtype = torch.bfloat16, dit_config: NaDiTConfig | None = None,
                    vae_config: VAEConfig = VAE, on_loaded: Callable[[], None] | None = None) -> "SeedVR2Pipeline":
        """Official files from `models_dir` (or its seedvr2/ subfolder): DiT, ema_vae, pos_emb.pt; `on_loaded()`
        after each."""
        loaded = on_loaded or (lambda: None)
        device = torch.device(device)
        dit_path, vae_path, text_path = find_models(models_dir, size)
        dit = load_nadit(dit_path, dit_config or DIT_PRESETS[size], dtype=dtype, device=device)
        loaded()
        vae = load_vae(vae_path, vae_config, dtype=dtype, device=device)
        loaded()
        text = load_text_embedding(text_path, dit.config.text_dim)
        loaded()
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

    def batch_vae(self) -> VideoVAE | ParallelVAE:
        return self.vae if self.group is None else ParallelVAE(self.vae, self.group)

    def batch_boundaries(self, frames: int, height: int, width: int, tiling: bool) -> int:
        """Progress boundaries of one `restore` of [3, frames, height, width]: VAE encode chunks, the DiT, VAE
        decode chunks."""
        vae, s, tf = self.batch_vae(), self.vae.config.spatial_factor, self.vae.config.temporal_factor
        latent = (1, 16, (frames - 1) // tf + 1, height // s, width // s)
        return vae.encode_boundaries((1, 3, frames, height, width), tiling) + 1 + vae.decode_boundaries(latent, tiling)

    @torch.no_grad()
    def restore(self, video: torch.Tensor, seed: int = 0, tiling: bool = True, progress: Phase | None = None,
                label: str = "") -> torch.Tensor:
        """video [3, 4n+1, H, W] in [-1, 1], H and W multiples of 16 -> restored video, same shape, fp32.
        `progress` counts `batch_boundaries` chunks, its detail `label` + the part running."""
        def part(name: str) -> Phase | None:
            if progress is not None:
                progress.detail = label + name
            return progress

        gen = torch.Generator().manual_seed(int(seed))
        vae = self.batch_vae()
        moments = vae.encode(video[None], tiling=tiling, on_chunk=part("VAE encode"))
        latent = posterior_sample(moments, gen)[0].permute(1, 2, 3, 0) * LATENT_SCALE  # [T, h, w, 16]
        noise = torch.randn(latent.shape, generator=gen, dtype=torch.float32).to(latent.device)
        cond = torch.cat([noise, latent, torch.ones_like(latent[..., :1])], dim=-1)
        x0 = noise - self.predict(cond)
        if part("DiT") is not None:
            progress()
        z = (x0 / LATENT_SCALE).permute(3, 0, 1, 2)[None]
        return vae.decode(z, tiling=tiling, on_chunk=part("VAE decode"))[0].float()

    # ---- clips ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def upscale(self, frames, target_height: int | None = None, target_width: int | None = None,
                scale: float | None = None, resolution: str | int | None = None, color_fix: str = "wavelet",
                seed: int = 0, batch_frames: int | None = None, overlap_frames: int = 4, tiling: bool = True,
                resize: str = "side", on_step: Callable | None = None, notes: list[str] | None = None
                ) -> torch.Tensor:
        """uint8 frames [F, H, W, 3] -> uint8 [F, H', W', 3] on the CPU.

        The output size comes from exactly one of (target_height and/or target_width), `scale` or `resolution`.
        `resize="side"` keeps that size exactly (the model runs on a canvas padded to multiples of 16);
        `resize="area"` is the official recipe (the target area at the input aspect, centre-cropped to multiples
        of 16). `batch_frames` (snapped to 4k+1) splits long clips into batches overlapping by `overlap_frames`,
        crossfaded. `on_step` gets a PhaseEvent ("upscaling") at every chunk boundary of every batch; raise from it
        to stop. What a tiny preset changed about the size is appended to `notes`.
        """
        frames = self._check_frames(frames)
        if color_fix not in COLOR_FIX_MODES:
            raise UpscaleError(f"Colour fix must be one of {', '.join(COLOR_FIX_MODES)}, got {color_fix!r}.")
        if resize not in RESIZE_MODES:
            raise UpscaleError(f"Resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}.")
        num, height, width = frames.shape[:3]
        out_h, out_w = self.output_size(height, width, target_height, target_width, scale, resolution,
                                        notes if notes is not None else [])
        if resize == "area":
            factor = math.sqrt(out_h * out_w / (height * width))
            size = (round(height * factor), round(width * factor))
            out_h, out_w = size[0] // MULTIPLE * MULTIPLE, size[1] // MULTIPLE * MULTIPLE
            if min(out_h, out_w) < MULTIPLE:
                raise UpscaleError(f"The output {size[1]}x{size[0]} is too small; use at least 16x16.")
        else:
            size = (out_h, out_w)

        batches = plan_batches(num, batch_frames, overlap_frames)
        canvas = [-(-s // MULTIPLE) * MULTIPLE for s in (out_h, out_w)]
        per_batch = self.batch_boundaries(_model_frames(batches[0][1] - batches[0][0]), *canvas, tiling) + 1
        progress = Phase(on_step, "upscaling", len(batches) * per_batch, f"batch 1/{len(batches)}: VAE encode")
        out = torch.empty((num, out_h, out_w, 3), dtype=torch.uint8)
        carry = None
        for i, (start, stop) in enumerate(batches):
            label = f"batch {i + 1}/{len(batches)}: "
            y = self._upscale_batch(frames[start:stop], size, (out_h, out_w), color_fix, seed, tiling, progress,
                                    label)
            if carry is not None:
                w = torch.arange(1, carry.shape[0] + 1, device=y.device).view(-1, 1, 1, 1) / (carry.shape[0] + 1)
                y[:carry.shape[0]] = carry * (1 - w) + y[:carry.shape[0]] * w
            final = (batches[i + 1][0] if i + 1 < len(batches) else stop) - start
            out[start:start + final] = self._to_uint8(y[:final])
            carry = y[final:]
            progress.detail = label + "done"
            progress(out[start + (final - 1) // 2])
        return out

    def output_size(self, height: int, width: int, target_height: int | None, target_width: int | None,
                    scale: float | None, resolution: str | int | None, notes: list[str]) -> tuple[int, int]:
        """`output_size` with this preset's resolutions and area bound; `notes` gains what the preset changed."""
        out_h, out_w = output_size(height, width, target_height, target_width, scale, resolution, self.resolutions)
        key = str(resolution).lower()
        if key in self.resolutions and self.resolutions is not RESOLUTIONS:
            notes.append(f"{self.name} preset: {resolution} means a {self.resolutions[key]}-px short edge "
                         f"({out_w}x{out_h}) so it runs quickly on a CPU; real SeedVR2 weights upscale to "
                         f"{RESOLUTIONS[key]} px")
        if self.max_pixels is not None and out_h * out_w > self.max_pixels:
            fit_h, fit_w = fit_area(out_h, out_w, self.max_pixels)
            notes.append(f"{self.name} preset: {out_w}x{out_h} is over its {self.max_pixels}-pixel bound (the "
                         f"embedded weights are for CPU demos), so the output is {fit_w}x{fit_h}; real SeedVR2 "
                         f"weights keep the asked size")
            out_h, out_w = fit_h, fit_w
        return out_h, out_w

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
                       color_fix: str, seed: int, tiling: bool, progress: Phase, label: str) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> fp32 [n, 3, out_h, out_w] in [-1, 1] on the device."""
        n = frames.shape[0]
        x = frames.to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp_(-1.0, 1.0)
        top, left = (size[0] - out_size[0]) // 2, (size[1] - out_size[1]) // 2  # "area": centre crop
        reference = x[:, :, top:top + out_size[0], left:left + out_size[1]]
        canvas = [-(-s // MULTIPLE) * MULTIPLE for s in out_size]  # "side": pad bottom/right, crop back below
        padded = F.pad(reference, (0, canvas[1] - out_size[1], 0, canvas[0] - out_size[0]), mode="replicate")
        video = _pad_time(padded, _model_frames(n)).permute(1, 0, 2, 3)
        restored = self.restore(video, seed, tiling, progress, label).permute(1, 0, 2, 3)[:n, :, :out_size[0], :out_size[1]]
        return apply_color_fix(restored, reference, color_fix).clamp_(-1.0, 1.0)

    @staticmethod
    def _to_uint8(y: torch.Tensor) -> torch.Tensor:
        return to_uint8_frames(((y + 1) / 2).permute(1, 0, 2, 3)).cpu()


__all__ = ["SeedVR2Pipeline", "UpscaleError", "output_size", "plan_batches", "snap_frames"]
