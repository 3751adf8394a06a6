"""SeedVR2 one-step video restoration / upscaling (specs/seedvr2.md §4), end to end.

uint8 frames -> resize to the output size (bicubic, antialiased) -> pad to multiples of 16 ("side", cropped back
afterwards) or centre-crop to them ("area", the official recipe) -> VAE encode of the clip (posterior sample) -> one
DiT step at t = 1000 on [noise | LQ latent | 1] per temporal batch, x0 = noise - v -> the batches' latents joined, the
shared ones crossfaded -> VAE decode of the clip -> colour fix against the resized input -> uint8.

Whole-clip tensors exist once: the source and the result as uint8 in host memory (the result on the group's rank 0
alone), the latents on the device. Pixels exist one VAE chunk at a time: the encoder reads its chunks from the uint8
source, and every decoded chunk is colour-fixed and converted to uint8 where it was decoded, then copied out.

Temporal batches (ComfyUI's SeedVR2 chunk / merge): the clip's latents are split into batches of `batch_frames`
(4n+1 frames: n+1 latents) that share the latents covering `overlap_frames` (4 frames each, rounded up). The DiT
runs per batch; where two batches share latents, the earlier one's weight falls linearly across them. Latents
outside the overlaps are each batch's own, and the clip is decoded in one causal pass, so no seam comes from the VAE
either.

Progress: one phase, "upscaling", whose boundaries are every VAE encode chunk, every batch's DiT step and every VAE
decode chunk; a decode boundary carries the frames it finished (streamed to the job's clients while the rest decodes)
and the last of them as a preview. The tiny presets map the named resolutions to small sizes and bound the output
area, so that every task stays quick on a CPU (config.TINY_RESOLUTIONS).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.io.convert import to_uint8_frames
from engine.models.seedvr2.checkpoint import (find_models, load_nadit, load_text_embedding, load_vae,
                                              recorded_config)
from engine.models.seedvr2.colorfix import MODES as COLOR_FIX_MODES
from engine.models.seedvr2.colorfix import color_fix as apply_color_fix
from engine.models.phases import DecodedFrames, Phase
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


def plan_batches(num_latents: int, batch_latents: int | None, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) of every temporal batch of latent frames: `batch_latents` long, consecutive batches sharing at
    least `overlap` latents; the last batch ends at the last latent (it may share more)."""
    if batch_latents is None or batch_latents >= num_latents:
        return [(0, num_latents)]
    overlap = min(max(overlap, 0), batch_latents - 1)
    starts = list(range(0, num_latents - batch_latents, batch_latents - overlap)) + [num_latents - batch_latents]
    return [(s, s + batch_latents) for s in sorted(set(starts))]


def batch_latents(num_frames: int, batch_frames: int | None, overlap_frames: int) -> list[tuple[int, int]]:
    """`plan_batches` for a clip of `num_frames` and the user's options: batches of `batch_frames` snapped to 4n+1
    (n+1 latents), sharing the latents that cover `overlap_frames` (4 frames each, rounded up)."""
    size = None if batch_frames is None else (snap_frames(batch_frames) - 1) // 4 + 1
    return plan_batches((_model_frames(num_frames) - 1) // 4 + 1, size, -(-max(overlap_frames, 0) // 4))


def crossfade(x0: torch.Tensor, latents: torch.Tensor, start: int, shared_until: int) -> None:
    """Writes a batch's latents [n, ...] into the clip's x0 from latent `start`; those it shares with the previous
    batch (up to `shared_until`) are blended with what that batch wrote, whose weight falls from k/(k+1) to 1/(k+1)
    across the k shared latents."""
    k = max(shared_until - start, 0)
    weight = torch.arange(1, k + 1, dtype=x0.dtype, device=x0.device).view(-1, *[1] * (x0.dim() - 1)) / (k + 1)
    x0[start:start + k] = torch.lerp(x0[start:start + k], latents[:k], weight)
    x0[start + k:start + latents.shape[0]] = latents[k:]


def fit_area(height: int, width: int, max_pixels: int) -> tuple[int, int]:
    """The largest even (height, width) at the same aspect with at most `max_pixels` pixels."""
    factor = math.sqrt(max_pixels / (height * width))
    return max(MULTIPLE, 2 * int(height * factor / 2)), max(MULTIPLE, 2 * int(width * factor / 2))


def _model_frames(n: int) -> int:
    """n frames padded up to 4k + 1."""
    return (n - 1 + 3) // 4 * 4 + 1


class SourceFrames:
    """A uint8 clip [F, H, W, 3] (host memory) and what the VAE and the colour fix read from it, made on the device a
    few frames at a time: frames resized to `size` (and centre-cropped to `out_size` for "area"), in [-1, 1]; for
    the VAE, on a canvas padded to multiples of 16 (bottom and right, replicated) and past the last frame its
    repetition (4n+1 frames)."""

    def __init__(self, frames: torch.Tensor, size: tuple[int, int], out_size: tuple[int, int],
                 device: torch.device):
        self.frames, self.size, self.out_size, self.device = frames, size, out_size, device
        self.canvas = [-(-s // MULTIPLE) * MULTIPLE for s in out_size]

    def reference(self, start: int, stop: int) -> torch.Tensor:
        """Frames [start, stop) at the output size: fp32 [n, 3, H, W] in [-1, 1]."""
        index = torch.arange(start, stop).clamp_(max=self.frames.shape[0] - 1)
        x = self.frames[index].to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = F.interpolate(x, size=self.size, mode="bicubic", antialias=True, align_corners=False).clamp_(-1.0, 1.0)
        top, left = (self.size[0] - self.out_size[0]) // 2, (self.size[1] - self.out_size[1]) // 2
        return x[:, :, top:top + self.out_size[0], left:left + self.out_size[1]]

    def model_input(self, start: int, stop: int) -> torch.Tensor:
        """Frames [start, stop) for the VAE: [1, 3, n, canvas H, canvas W]."""
        pad = (0, self.canvas[1] - self.out_size[1], 0, self.canvas[0] - self.out_size[0])
        return F.pad(self.reference(start, stop), pad, mode="replicate").transpose(0, 1)[None]


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
            # The files' headers record their architecture (training/train_seedvr2.py); none: the tiny preset's.
            dit_config = recorded_config(dit_path, NaDiTConfig) or TINY_3B
            dit = load_nadit(dit_path, dit_config, dtype=dtype, device=device)
            loaded()
            vae = load_vae(vae_path, recorded_config(vae_path, VAEConfig) or TINY_VAE, dtype=dtype, device=device)
            loaded()
            text = load_text_embedding(text_path, dit_config.text_dim).float()
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

    # ---- model space -------------------------------------------------------------------------------------------
    def predict(self, vid: torch.Tensor) -> torch.Tensor:
        """The DiT on [T, h, w, 33] -> v [T, h, w, 16]."""
        if self.group is not None:
            return window_sp.predict(self.dit, vid, self.text, TIMESTEP, self.group)
        return self.dit(vid, self.text, TIMESTEP)

    def group_vae(self) -> VideoVAE | ParallelVAE:
        return self.vae if self.group is None else ParallelVAE(self.vae, self.group)

    def encode(self, read, frames: int, generator: torch.Generator, tiling: bool, progress: Phase) -> torch.Tensor:
        """LQ latents [T, h, w, 16] (DiT scale), sampled from the posterior, of a `frames`-long clip read a VAE chunk
        at a time (`read(start, stop)` -> [1, 3, n, H, W] in [-1, 1])."""
        progress.detail = "VAE encode"
        moments = self.group_vae().encode_stream(read, frames, tiling, on_chunk=progress)
        return posterior_sample(moments, generator)[0].permute(1, 2, 3, 0) * LATENT_SCALE

    def denoise(self, latents: torch.Tensor, generator: torch.Generator, batches: list[tuple[int, int]],
                progress: Phase) -> torch.Tensor:
        """x0 [T, h, w, 16] of the LQ latents: one DiT step per batch [start, stop) of latents (one noise draw for
        the clip), joined by `crossfade`."""
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
        x0 = torch.empty_like(noise)
        for i, (start, stop) in enumerate(batches):
            progress.detail = f"batch {i + 1}/{len(batches)}: DiT"
            lq = latents[start:stop]
            cond = torch.cat([noise[start:stop], lq, torch.ones_like(lq[..., :1])], dim=-1)
            crossfade(x0, noise[start:stop] - self.predict(cond), start, batches[i - 1][1] if i else start)
            progress()
        return x0

    @torch.no_grad()
    def restore(self, video: torch.Tensor, seed: int = 0, tiling: bool = True) -> torch.Tensor:
        """video [3, 4n+1, H, W] in [-1, 1], H and W multiples of 16 -> restored video, same shape, fp32 (one batch,
        no colour fix)."""
        gen, progress = torch.Generator().manual_seed(int(seed)), Phase(None, "upscaling", 0)
        latents = self.encode(lambda start, stop: video[None, :, start:stop], video.shape[1], gen, tiling, progress)
        x0 = self.denoise(latents, gen, [(0, latents.shape[0])], progress)
        return self.group_vae().decode(_vae_scale(x0), tiling=tiling)[0].float()

    # ---- clips ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def upscale(self, frames, target_height: int | None = None, target_width: int | None = None,
                scale: float | None = None, resolution: str | int | None = None, color_fix: str = "wavelet",
                seed: int = 0, batch_frames: int | None = None, overlap_frames: int = 4, tiling: bool = True,
                resize: str = "side", on_step: Callable | None = None, notes: list[str] | None = None
                ) -> torch.Tensor:
        """uint8 frames [F, H, W, 3] -> uint8 [F, H', W', 3] in host memory (on the group's rank 0; other ranks get a
        placeholder of that shape that holds nothing).

        The output size comes from exactly one of (target_height and/or target_width), `scale` or `resolution`.
        `resize="side"` keeps that size exactly (the model runs on a canvas padded to multiples of 16);
        `resize="area"` is the official recipe (the target area at the input aspect, centre-cropped to multiples
        of 16). `batch_frames` (snapped to 4k+1) splits long clips into DiT batches sharing the latents of
        `overlap_frames`, crossfaded. `on_step` gets a PhaseEvent ("upscaling") at every boundary; raise from it to
        stop. What a tiny preset changed about the size is appended to `notes`.
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

        source = SourceFrames(frames, size, (out_h, out_w), self.device)
        batches = batch_latents(num, batch_frames, overlap_frames)
        vae = self.group_vae()
        total = vae.encode_boundaries(_model_frames(num)) + len(batches) + vae.decode_boundaries(batches[-1][1])
        progress = Phase(on_step, "upscaling", total, "VAE encode")
        gen = torch.Generator().manual_seed(int(seed))
        latents = self.encode(source.model_input, _model_frames(num), gen, tiling, progress)
        x0 = self.denoise(latents, gen, batches, progress)
        del latents
        return self.decode(x0, source, color_fix, tiling, progress)

    def decode(self, x0: torch.Tensor, source: SourceFrames, color_fix: str, tiling: bool, progress: Phase
               ) -> torch.Tensor:
        """uint8 frames [F, H, W, 3] of the clip's x0 (host memory, rank 0): decoded a chunk at a time, each chunk
        cropped, colour-fixed against the resized source and converted to uint8 where it was decoded. Every
        boundary hands rank 0's newly finished frames on (PhaseEvent.frames, streamed to the job's clients) with the
        last of them as the preview."""
        num, (out_h, out_w) = source.frames.shape[0], source.out_size
        keep = self.group is None or dist.get_rank(self.group) == 0
        out = torch.empty((num, out_h, out_w, 3), dtype=torch.uint8) if keep else None
        finished: list[DecodedFrames] = []  # since the last boundary (one delivery per boundary)

        def finish(start: int, pixels: torch.Tensor) -> torch.Tensor:
            n = min(pixels.shape[2], num - start)  # the time padding (at most 3 frames) never fills a chunk
            restored = pixels[0, :, :n, :out_h, :out_w].transpose(0, 1)  # [n, 3, H, W], fp32 NCHW for the colour fix
            restored = restored.to(torch.float32, memory_format=torch.contiguous_format)
            fixed = apply_color_fix(restored, source.reference(start, start + n), color_fix).clamp_(-1.0, 1.0)
            return to_uint8_frames(((fixed + 1) / 2).transpose(0, 1))

        def deliver(start: int, chunk: torch.Tensor) -> None:
            if out is not None:
                frames = out[start:start + chunk.shape[0]]
                frames.copy_(chunk)
                finished.append(DecodedFrames(start, num, frames))

        def boundary() -> None:
            frames = finished.pop() if finished else None
            progress(None if frames is None else frames.pixels[-1], frames)

        progress.detail = "VAE decode"
        self.group_vae().decode_stream(_vae_scale(x0), deliver, finish, tiling, on_chunk=boundary)
        return out if out is not None else torch.zeros((), dtype=torch.uint8).expand(num, out_h, out_w, 3)

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


def _vae_scale(x0: torch.Tensor) -> torch.Tensor:
    """DiT-scale latents [T, h, w, 16] -> the VAE's [1, 16, T, h, w]."""
    return (x0 / LATENT_SCALE).permute(3, 0, 1, 2)[None]


__all__ = ["SeedVR2Pipeline", "UpscaleError", "batch_latents", "output_size", "plan_batches", "snap_frames"]
