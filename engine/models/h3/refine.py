"""Latent upscale + H3 refine: the fast, stylising alternative to SeedVR2.

The clip's latents are upscaled x1.5 or x2 (bicubic, per frame), re-noised to `strength` (the sigma the second
pass starts from) and denoised by H3 at the larger canvas with the prompt. The soundtrack is kept exactly: its
rows are an edit target with mask 0.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.models.h3 import layout as L
from engine.models.h3.denoise import Target
from engine.models.h3.request import GenerateResult, RefineRequest
from engine.models.h3.schedule import sigmas
from engine.models.h3.source import audio_latents, encode_video, pad_frames, prepare_clip

SCALES = (1.5, 2.0)


def upscale_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[1, C, T, h0, w0] -> [1, C, T, h, w], bicubic per frame."""
    _, C, T, _, _ = latents.shape
    x = latents[0].permute(1, 0, 2, 3)
    x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False)
    return x.permute(1, 0, 2, 3)[None].contiguous()


def refine_schedule(steps: int, strength: float, shift: float) -> tuple[int, int]:
    """(grid points, start index) of the shifted video schedule so that `steps - 1` evaluations run at
    sigma <= strength: the second pass starts from a partly noised clip, not from pure noise."""
    for points in range(max(steps, 2), 4001):
        below = int((sigmas(points, shift) <= strength + 1e-7).sum())
        if below >= steps:
            return points, points - below
    raise L.LayoutError(f"Refine strength {strength:g} is too low for {steps} steps; raise it or use fewer steps.")


def run_refine(pipe, req: RefineRequest, on_step=None) -> GenerateResult:
    t0 = time.perf_counter()
    if float(req.scale) not in SCALES:
        raise L.LayoutError(f"Latent upscale works at x1.5 or x2, got x{req.scale:g}.")
    if not 0 < req.strength <= 1:
        raise L.LayoutError(f"Refine strength must be above 0 and at most 1 (how much is re-noised), "
                            f"got {req.strength}.")
    if not (req.prompt or "").strip():
        raise L.LayoutError("The refine pass needs the prompt of the clip (what it shows and sounds like).")
    steps = pipe.canvas.default_steps if req.steps is None else int(req.steps)
    cfg = pipe.dit.config

    clip = prepare_clip(req.source, pipe.canvas.short_edge, pipe.canvas.max_pixels, on_step)
    source_frames = clip.frames.shape[0]
    frames, _ = L.frames_for_seconds(source_frames / L.FPS)
    height, width, note = L.check_canvas(round(clip.height * req.scale), round(clip.width * req.scale))
    notes = clip.notes + ([note] if note else [])
    T, h, w, Ta = L.latent_frames(frames), height // L.VAE_SPATIAL, width // L.VAE_SPATIAL, L.audio_latents(frames)
    latents = req.source.video_latents
    if latents is None or latents.shape[2] != T:
        latents = encode_video(pipe, pad_frames(clip.frames, frames), on_step)
    up = upscale_latents(latents.float().to(pipe.device), h, w)

    text, tags = pipe.encode_prompt(req.prompt.strip())
    layout = L.build_layout(tags, T, h, w, Ta, cfg.patch_size[1:])
    points, start = refine_schedule(steps, float(req.strength), pipe.video_shift)
    sigma0 = float(sigmas(points, pipe.video_shift)[start])
    gen = torch.Generator("cpu").manual_seed(int(req.seed))
    noise = pipe.noise(gen, 1, cfg.in_channels, T, h, w)
    video = Target(L.patchify((1 - sigma0) * up + sigma0 * noise))
    source_audio, have = audio_latents(pipe, req.source, Ta, on_step)
    audio_noise = pipe.noise(gen, 1, L.AUDIO_CHANNELS * Ta, cfg.audio_in_channels)
    if source_audio is None or have < Ta:
        audio = Target(audio_noise)
        notes.append("the source has no (or too short a) soundtrack, so the sound is generated")
    else:
        clean = L.pack_audio(source_audio[None])
        zeros = torch.zeros(clean.shape[1], device=pipe.device)
        audio = Target(audio_noise, cap=1.0, clean=clean, anchor=clean, model_mask=zeros,
                       restore=torch.zeros_like(clean[0]))

    video_rows, audio_rows = pipe.run_denoise(layout, text, video, audio, points, on_step, (T, h, w), start=start)
    video_latents = L.unpatchify(video_rows, T, h, w, cfg.patch_size)
    audio_out = L.unpack_audio(audio_rows)[0]
    notes.append(f"latents upscaled x{req.scale:g} to {width}x{height}, re-noised to sigma {sigma0:.3f}, "
                 f"{points - 1 - start} refine steps")
    timings = {}
    pixels, waveform, mp4 = pipe.decode(video_latents, audio_out, source_frames, timings, notes, on_step)
    timings["total_s"] = time.perf_counter() - t0
    return GenerateResult(pixels, waveform, pipe.audio_vae.sample_rate, L.FPS, video_latents.cpu(), audio_out.cpu(),
                          notes, timings, mp4)
