"""Ref2VA: video and sound from a prompt and ordered references (specs/h3.md §2.3, §4, §6).

The references are normalised (engine/models/h3/references.py), presented to the conditioner in order, and
encoded at their own resolutions: each image and video reference becomes frozen video condition rows noised once
to t = 0.999 (one draw per reference, in order, before the generated rows' noise, as the reference
implementation draws), each sound a clean audio condition row block. The loop writes only the generated rows.
"""

from __future__ import annotations

import time

import torch

from engine.models.h3 import layout as L
from engine.models.h3.denoise import Target
from engine.models.h3.references import encoded_frame_count, normalise
from engine.models.h3.request import GenerateRequest, GenerateResult
from engine.models.phases import Phase


def expected_block(ref, pipe) -> L.ReferenceBlock:
    """A reference's rows as its encoding will shape them (the sound's length to within a latent)."""
    audio = 0
    if ref.has_audio:
        audio = -(-ref.audio.shape[1] * pipe.audio_vae.sample_rate // ref.sample_rate // pipe.audio_vae.hop)
    if ref.kind == "audio":
        return L.ReferenceBlock("audio", audio_latents=audio)
    pixels = ref.image if ref.kind == "image" else ref.frames[0]
    count = 1 if ref.kind == "image" else encoded_frame_count(len(ref.frames))
    clips = -(-count // L.CLIP_LENGTH)  # the last one padded; the VAE drops `token_drop` trailing latents
    latent_frames = 1 if count == 1 else clips * L.LATENTS_PER_CHUNK - pipe.video_vae.model.config.token_drop
    height, width = pixels.shape[:2]
    return L.ReferenceBlock(ref.kind, latent_frames, height // L.VAE_SPATIAL, width // L.VAE_SPATIAL, audio)


def run_ref2va(pipe, req: GenerateRequest, frames: int, height: int, width: int, steps: int, notes: list[str],
               on_step=None) -> GenerateResult:
    t0, timings = time.perf_counter(), {}
    if req.first_frame is not None or req.last_frame is not None:
        raise L.LayoutError("Give keyframes (first / last frame) or references, not both: for Ref2VA, give the "
                            "start picture as an image reference instead.")
    canvas = pipe.canvas
    references = normalise(req.references, frames, req.reference_size, height * width, canvas.short_edge,
                           canvas.max_pixels, canvas.reference_short_edge)
    cfg = pipe.dit.config
    T, h, w, Ta = L.latent_frames(frames), height // L.VAE_SPATIAL, width // L.VAE_SPATIAL, L.audio_latents(frames)
    pipe.check_sequence(L.build_ref2va_layout(torch.zeros(0), [expected_block(r, pipe) for r in references], T, h,
                                              w, Ta, cfg.patch_size[1:]))  # before any encoding
    text, tags = pipe.encode_prompt(req.prompt, references=references)
    timings["conditioner_s"] = time.perf_counter() - t0

    done = Phase(on_step, "encoding", len(references), "references")
    visual, sounds, blocks = [], [], []
    for ref in references:
        latents, audio_latents = None, 0
        if ref.has_audio:
            sound = pipe.audio_vae.encode(torch.from_numpy(ref.audio), ref.sample_rate).float()  # [2, 32, Ta]
            sounds.append(L.pack_audio(sound[None].to(pipe.device)))
            audio_latents = sound.shape[-1]
        if ref.kind == "image":
            latents = pipe.video_vae.encode_image(torch.from_numpy(ref.image.copy()).to(pipe.device))
        elif ref.kind == "video":
            clip = torch.from_numpy(ref.frames[:encoded_frame_count(len(ref.frames))].copy())
            latents = pipe.video_vae.encode_frames(clip.to(pipe.device), any_length=True)
        if latents is not None:
            visual.append(latents.float())
        shape = tuple(latents.shape[2:]) if latents is not None else (0, 0, 0)
        blocks.append(L.ReferenceBlock(ref.kind, *shape, audio_latents=audio_latents))
        done()

    layout = L.build_ref2va_layout(tags, blocks, T, h, w, Ta, cfg.patch_size[1:])
    gen = torch.Generator("cpu").manual_seed(int(req.seed))
    noised = [L.CONDITION_TIMESTEP * z + (1 - L.CONDITION_TIMESTEP) * pipe.noise(gen, *z.shape) for z in visual]
    cond_video = torch.cat([L.patchify(z) for z in noised], dim=1)
    video = Target(L.patchify(pipe.noise(gen, 1, cfg.in_channels, T, h, w)))
    audio = Target(pipe.noise(gen, 1, L.AUDIO_CHANNELS * Ta, cfg.audio_in_channels))
    timings["encode_s"] = time.perf_counter() - t0 - timings["conditioner_s"]

    return pipe.denoise_and_decode(layout, text, video, audio, steps, on_step, (T, h, w), frames, notes, timings, t0,
                                   cond_video=cond_video, cond_audio=torch.cat(sounds, dim=1) if sounds else None)
