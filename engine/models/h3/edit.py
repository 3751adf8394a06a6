"""Masked edit (object removal, replacement, repaint) as a latent task over one window (specs/h3.md §6).

The source is encoded once; its latents are the clean rows of an edited `Target` (engine/models/h3/denoise.py),
the mask (engine/models/h3/mask.py) says how much of each cell to regenerate. Cells with mask 0 come back
bit-identical to the source encoding, and after decoding every pixel the mask leaves at 0 is the source's own (so
the unedited area is the source exactly, not the decoder's reconstruction of it); an all-ones mask is plain
generation with the same seed.
"""

from __future__ import annotations

import time

import torch

from engine.models.h3 import layout as L
from engine.models.h3 import mask as M
from engine.models.h3.denoise import Target
from engine.models.h3.request import EDIT_PRESETS, EditRequest, GenerateResult
from engine.models.h3.source import audio_latents, encode_video, pad_frames, prepare_clip


def run_edit(pipe, req: EditRequest, on_step=None) -> GenerateResult:
    t0 = time.perf_counter()
    if req.preset not in EDIT_PRESETS:
        raise L.LayoutError(f"Unknown edit preset {req.preset!r}; use one of: {', '.join(EDIT_PRESETS)}.")
    default_strength, default_prompt = EDIT_PRESETS[req.preset]
    strength = default_strength if req.strength is None else float(req.strength)
    if not 0 < strength <= 1:
        raise L.LayoutError(f"Edit strength must be above 0 and at most 1, got {strength}.")
    prompt = (req.prompt or "").strip() or default_prompt
    if not prompt:
        raise L.LayoutError(f"A {req.preset} edit needs a prompt describing the new content of the masked area.")
    steps = pipe.canvas.default_steps if req.steps is None else int(req.steps)
    if steps < 2:
        raise L.LayoutError(f"Steps must be at least 2 sigma grid points, got {steps}.")

    clip = prepare_clip(req.source, pipe.canvas.short_edge, pipe.canvas.max_pixels, on_step)
    source_frames = clip.frames.shape[0]
    frames, _ = L.frames_for_seconds(source_frames / L.FPS)
    notes = clip.notes + ([f"source padded from {source_frames} to {frames} frames (17n + 5); the result is cut "
                           f"back to {source_frames}"] if frames != source_frames else [])
    height, width = clip.height, clip.width
    mask = torch.as_tensor(req.mask)
    (mask_h, mask_w), (source_h, source_w) = mask.shape[-2:], req.source.frames.shape[1:3]
    if (mask_h, mask_w) != (source_h, source_w):
        notes.append(f"mask {mask_w}x{mask_h} resized to the video's {source_w}x{source_h}")
    if mask.ndim == 3 and len(clip.frame_index) != mask.shape[0] and mask.shape[0] == len(req.source.frames):
        mask = mask[clip.frame_index]  # a per-frame mask follows the source's fps resampling
    drawn, cells = M.edit_cells(mask, strength, frames, height, width)
    if cells.max() == 0:
        raise M.MaskError("The mask is empty (all 0): nothing would change. Paint the area to regenerate "
                          "with 1 (white); 0 keeps the source.")

    cfg = pipe.dit.config
    T, h, w, Ta = L.latent_frames(frames), height // L.VAE_SPATIAL, width // L.VAE_SPATIAL, L.audio_latents(frames)
    text, tags = pipe.encode_prompt(prompt)
    layout = L.build_layout(tags, T, h, w, Ta, cfg.patch_size[1:])
    latents = req.source.video_latents
    if latents is None or tuple(latents.shape[2:]) != (T, h, w):
        latents = encode_video(pipe, pad_frames(clip.frames, frames), on_step)
    clean = L.patchify(latents.float().to(pipe.device))
    source_audio, have = audio_latents(pipe, req.source, Ta, on_step)

    # Same draws as plain generation first (video, then audio noise), so an all-ones mask reproduces it.
    gen = torch.Generator("cpu").manual_seed(int(req.seed))
    video_noise = L.patchify(pipe.noise(gen, 1, cfg.in_channels, T, h, w))
    audio_noise = pipe.noise(gen, 1, L.AUDIO_CHANNELS * Ta, cfg.audio_in_channels)
    anchor = L.CONDITION_TIMESTEP * clean + (1 - L.CONDITION_TIMESTEP) * L.patchify(
        pipe.noise(gen, 1, cfg.in_channels, T, h, w))
    video = Target(video_noise, cap=L.CONDITION_TIMESTEP, clean=clean, anchor=anchor,
                   model_mask=M.token_mask(cells).to(pipe.device),
                   restore=M.restore_rows(cells, cfg.in_channels).to(pipe.device))
    audio = Target(audio_noise)
    if source_audio is not None:
        audio_mask = 0.0 if req.audio_mask is None else req.audio_mask
        rows = M.audio_rows(audio_mask, Ta).view(L.AUDIO_CHANNELS, Ta)
        rows[:, have:] = 1.0  # no source sound there: generate it
        rows = rows.reshape(-1)
        clean_audio = L.pack_audio(source_audio[None])
        audio = Target(audio_noise, cap=1.0, clean=clean_audio, anchor=clean_audio,
                       model_mask=(torch.ceil(rows * M.LEVELS) / M.LEVELS).to(pipe.device),
                       restore=rows[:, None].expand(-1, cfg.audio_in_channels).to(pipe.device))
    elif req.audio_mask is not None and float(torch.as_tensor(req.audio_mask).min()) < 1:
        notes.append("the source has no sound, so the audio is generated")

    t_loop = time.perf_counter()
    # Guided as text-to-video is (the DiT file's scale): the regenerated cells are the prompt's to fill. The toy DiT
    # unguided drew a replacement box as a thin blob and kept a repainted sky blue (README, stop 66).
    video_rows, audio_rows = pipe.run_denoise(layout, text, video, audio, steps, on_step, (T, h, w),
                                              guidance=pipe.guidance)
    video_latents = L.unpatchify(video_rows, T, h, w, cfg.patch_size)
    audio_latents_out = L.unpack_audio(audio_rows)[0]
    t_dec = time.perf_counter()
    timings = {"denoise_s": t_dec - t_loop}
    pixels, waveform, mp4 = pipe.decode(video_latents, audio_latents_out, source_frames, timings, notes, on_step,
                                        keep=(clip.frames, drawn[:source_frames] == 0))
    timings |= {"decode_s": time.perf_counter() - t_dec, "total_s": time.perf_counter() - t0}
    return GenerateResult(pixels, waveform, pipe.audio_vae.sample_rate, L.FPS, video_latents.cpu(),
                          audio_latents_out.cpu(), notes, timings, mp4)
