"""Video extension past one window (specs/h3.md §2.4, notes/peers.md §3c).

Each new window starts `overlap` latent frames before the current end. The previous tail's latents (video, noised
once to the condition level) and its audio latents (clean, cut at 40 Hz boundaries) become frozen condition rows at
the times of the window's first latents; all media rows of the window sit on the global clock, shifted by s * 40/24
rotary units (s = the window's first pixel frame, fraction kept), after the longest prompt. The overlap is
regenerated, then dropped. Each window is guided at the DiT file's scale, as text-to-video and edits are (the
embedded default names 1.5: unguided, its movers slow to about half their speed over the first new frames; a
released DiT is guidance-distilled and names none, one forward a step). Windows are decoded one at a time with one
VAE chunk of context, so memory per window is bounded and the source's own frames come back untouched; a window's
first frames take over the frame before them as it stands and fade into their own decode (`carry_seam`), and its
last TAIL_FRAMES wait for the next window, which decodes them again with its first chunk after them. The result's
frames stream out in order as they become final (PhaseEvent.frames): the source's with the first decoded chunk,
then each chunk's new ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.models.h3 import layout as L
from engine.models.h3.denoise import Target
from engine.models.h3.request import ExtendRequest, GenerateResult
from engine.models.h3.source import audio_latents, encode_video, prepare_clip
from engine.models.h3.vae import VideoVAE
from engine.models.phases import DecodedFrames, Phase

AUDIO_PER_FRAME = L.AUDIO_LATENTS_PER_SECOND / L.FPS  # 5/3 audio latents per pixel frame
CONTEXT_CHUNKS = 1  # VAE chunks (17 frames / 5 latents) decoded before a window's new frames
# A window's first new frames carry the difference between the frame before them as it stands (the source's own
# pixels, or the previous window's decode) and as this decode makes it, fading out over this many frames: without
# it the VAE's reconstruction error of the source (or the other decode context) steps in at once at the boundary.
SEAM_FRAMES = 12
# A decode's last 5 frames (its last two latents) have no next clip to cross-fade with and barely move (the toy
# default's movers at 0.2-0.3 of their speed there, in a whole clip's VAE round trip too): a window before another
# holds them back, and the next one decodes them again from the same latents with its own first chunk after them.
TAIL_FRAMES = 5
AUDIO_CONTEXT = 40  # audio latents decoded before a window's new sound


@dataclass(frozen=True)
class Window:
    start: int  # first pixel frame on the global timeline (where the overlap begins)
    frames: int  # pixel frames generated, 17n + 5, overlap included
    audio_start: int  # first audio latent on the global timeline
    audio_latents: int

    @property
    def time_shift(self) -> float:
        return self.start * L.AUDIO_LATENTS_PER_SECOND / L.FPS


def plan_windows(source_frames: int, add_frames: int, overlap_latents: int, window_frames: int) -> list[Window]:
    """Windows that add at least `add_frames` after a 17n + 5 source, each at most `window_frames` long."""
    overlap = L.FRAMES_PER_LATENT[0] + sum(L.FRAMES_PER_LATENT[k % 5] for k in range(1, overlap_latents))
    longest = window_frames - (window_frames - 5) % 17
    if longest - overlap < 17:
        raise L.LayoutError(f"Windows of {window_frames} frames leave no room after a {overlap}-frame overlap.")
    windows, end = [], source_frames
    while end < source_frames + add_frames:
        need = source_frames + add_frames - end
        frames = min(longest, L.align_num_frames(need + overlap))
        start = end - overlap
        a0 = round(start * AUDIO_PER_FRAME)
        windows.append(Window(start, frames, a0, round((start + frames) * AUDIO_PER_FRAME) - a0))
        end = start + frames
    return windows


def window_layout(tags: torch.Tensor, window: Window, overlap_latents: int, guide_audio: int, h: int, w: int,
                  media_origin: float) -> L.PackedLayout:
    return L.build_layout(tags, L.latent_frames(window.frames), h, w, window.audio_latents,
                          media_origin=media_origin, time_shift=window.time_shift, guide_frames=overlap_latents,
                          guide_audio=guide_audio)


def run_extend(pipe, req: ExtendRequest, on_step=None) -> GenerateResult:
    t0 = time.perf_counter()
    ov = int(req.overlap_latents)
    if ov < 2 or ov % 5 != 2:
        raise L.LayoutError(f"The overlap must be 5k + 2 latent frames (2, 7, 12, ...: 5, 22, 39 pixel frames) so "
                            f"windows line up with the video VAE's chunks, got {ov}.")
    prompts = [p.strip() for p in req.prompts if p and p.strip()]
    if not prompts:
        raise L.LayoutError("Extending needs a prompt describing what happens next (one per window allowed).")
    if not 0 < req.seconds <= 600:
        raise L.LayoutError(f"Seconds to add must be above 0 and at most 600, got {req.seconds}.")
    window_frames = L.align_num_frames(int(round(min(req.window_seconds, L.MAX_SECONDS) * L.FPS)))  # 15 s: 362
    steps = pipe.canvas.default_steps if req.steps is None else int(req.steps)
    cfg = pipe.dit.config

    clip = prepare_clip(req.source, pipe.canvas.short_edge, pipe.canvas.max_pixels, on_step)
    F_src, height, width = clip.frames.shape[0], clip.height, clip.width
    h, w = height // L.VAE_SPATIAL, width // L.VAE_SPATIAL
    notes = list(clip.notes)
    F0 = F_src - (F_src - 5) % 17 if F_src >= 22 else 0
    if F0 < 22 or L.latent_frames(F0) < ov:
        raise L.LayoutError(f"The source is too short to extend ({F_src} frames); it needs at least "
                            f"{max(22, ov // 5 * 17 + 5)} frames at 24 fps.")
    if F0 != F_src:
        notes.append(f"the source's last {F_src - F0} frames were regenerated so windows line up with the "
                     f"video VAE's 17-frame chunks")
    latents = req.source.video_latents
    if latents is None or tuple(latents.shape[-3:]) != (L.latent_frames(F0), h, w):
        latents = encode_video(pipe, clip.frames[:F0], on_step)
    latents = latents.float().cpu()
    Ta0 = round(F0 * AUDIO_PER_FRAME)
    audio, have = audio_latents(pipe, req.source, Ta0, on_step)
    guide_sound = have > 0  # a silent source gives its first window no sound to continue
    audio = (audio if audio is not None else torch.zeros(2, cfg.audio_in_channels, Ta0)).cpu()

    windows = plan_windows(F0, int(round(req.seconds * L.FPS)), ov, window_frames)
    encoded = [pipe.encode_prompt(prompts[min(k, len(prompts) - 1)]) for k in range(len(windows))]
    media_origin = max(tags.numel() for _, tags in encoded)

    # The result is allocated once: growing it by concatenation would hold two copies at the end.
    total_frames = windows[-1].start + windows[-1].frames
    sr = pipe.audio_vae.sample_rate
    out_frames = torch.empty(total_frames, height, width, 3, dtype=torch.uint8)
    out_frames[:F0] = clip.frames[:F0]
    out_audio = torch.zeros(2, round(total_frames / L.FPS * sr))
    src_wave = None if req.source.audio is None else torch.as_tensor(req.source.audio).float()
    emitted = round(F0 / L.FPS * sr)
    out_audio[:, :emitted] = _source_sound(src_wave, req.source.sample_rate, sr, emitted)
    gen = torch.Generator("cpu").manual_seed(int(req.seed))
    streamed = 0  # frames handed out as final (the source's go with the first window's first decoded chunk)
    for k, window in enumerate(windows):
        text, tags = encoded[k]
        T_w = L.latent_frames(window.frames)
        guide_audio = audio.shape[-1] - window.audio_start if guide_sound else 0
        layout = window_layout(tags, window, ov, guide_audio, h, w, media_origin)
        tail = latents[:, :, -ov:].to(pipe.device)
        guide_noise = pipe.noise(gen, *tail.shape)
        cond_video = L.patchify(L.CONDITION_TIMESTEP * tail + (1 - L.CONDITION_TIMESTEP) * guide_noise)
        cond_audio = L.pack_audio(audio[None, :, :, window.audio_start:].to(pipe.device)) if guide_audio else None
        video = Target(L.patchify(pipe.noise(gen, 1, cfg.in_channels, T_w, h, w)))
        sound = Target(pipe.noise(gen, 1, L.AUDIO_CHANNELS * window.audio_latents, cfg.audio_in_channels))
        name = f"window {k + 1}/{len(windows)}"
        video_rows, audio_rows = pipe.run_denoise(layout, text, video, sound, steps, on_step, (T_w, h, w), name,
                                                  cond_video=cond_video, cond_audio=cond_audio,
                                                  guidance=pipe.guidance)
        window_latents = L.unpatchify(video_rows, T_w, h, w, cfg.patch_size).cpu()
        new_audio = L.unpack_audio(audio_rows)[0][:, :, audio.shape[-1] - window.audio_start:].cpu()
        F_prev, Ta_prev = frames_of(latents.shape[2]), audio.shape[-1]
        # Decoded from the context chunk on, with the regenerated overlap in place of the kept tail: the new frames'
        # own past as the VAE's context
        start, kept = 5 * _context_chunk(F_prev), latents.shape[2] - ov
        decoded = torch.cat([latents[:, :, start:kept], window_latents[:, :, max(0, start - kept):]], dim=2)
        latents = torch.cat([latents, window_latents[:, :, ov:]], dim=2)
        audio = torch.cat([audio, new_audio], dim=2)
        guide_sound = True
        held_chunks = CONTEXT_CHUNKS + 1 if k > 0 else 0  # the decode of the frames the window before held back
        done = Phase(on_step, "decoding", held_chunks + VideoVAE.decode_chunk_count(decoded.shape[2]) + 1,
                     f"{name}: video")
        if held_chunks:
            _decode_held_tail(pipe, latents, F_prev, out_frames, done)
        streamed = _decode_new_frames(pipe, decoded, out_frames, F_prev, streamed, done,
                                      hold=TAIL_FRAMES if k < len(windows) - 1 else 0)
        done.detail = f"{name}: sound"
        sound = _decode_new_sound(pipe, audio, Ta_prev, emitted)[:, : out_audio.shape[1] - emitted]
        done()
        out_audio[:, emitted:emitted + sound.shape[1]] = sound
        emitted += sound.shape[1]

    notes.append(f"{len(windows)} window(s); {(total_frames - F0) / L.FPS:.2f} s added "
                 f"({total_frames} frames, {total_frames / L.FPS:.2f} s in all)")
    return GenerateResult(out_frames, out_audio, sr, L.FPS, latents, audio, notes,
                          {"total_s": time.perf_counter() - t0, "windows": float(len(windows))})


def frames_of(num_latents: int) -> int:
    """Pixel frames of 5k + 2 latent frames (a clip, or an extension's guide)."""
    return (num_latents - 2) // 5 * 17 + 5


def _context_chunk(first_new: int) -> int:
    """The VAE chunk a window's decode starts at: one chunk before its first new frame, for context."""
    return max(0, (first_new - 5) // 17 - CONTEXT_CHUNKS)


def _decode_held_tail(pipe, latents: torch.Tensor, tail_end: int, out: torch.Tensor, done: Phase) -> None:
    """Decode again into `out` the TAIL_FRAMES frames before `tail_end` (17n + 5: the end of the window before,
    held back) from `latents`, which now run a VAE chunk past it, after CONTEXT_CHUNKS chunks of context."""
    n = (tail_end - 5) // 17
    first = max(0, n - CONTEXT_CHUNKS)
    need = 17 * (n - first) + TAIL_FRAMES  # frames from chunk `first` on, up to the end of the tail
    decoded, have = [], 0
    for pixels in pipe.video_vae.decode_chunks(latents[:, :, 5 * first:5 * (n + 1) + 2].to(pipe.device)):
        decoded.append(pixels)
        have += pixels.shape[0]
        done()
        if have >= need:
            break
    out[tail_end - TAIL_FRAMES:tail_end] = torch.cat(decoded)[need - TAIL_FRAMES:need]


def _decode_new_frames(pipe, latents: torch.Tensor, out: torch.Tensor, first_new: int, streamed: int,
                       done: Phase, hold: int = 0) -> int:
    """Decode the frames from `first_new` on into `out` from `latents` that start at the VAE chunk one before it
    (`_context_chunk`), the seam carried into the first SEAM_FRAMES (`carry_seam`). After every chunk `done` hands
    out the frames of `out` final since the first `streamed` (the stream of the result, in order), all but the last
    `hold` of the decode; returns how many are final now."""
    skip, stop = first_new - 17 * _context_chunk(first_new), first_new  # context frames to drop; end of the decode
    end = first_new - skip + frames_of(latents.shape[2])
    seam = None
    for pixels in pipe.video_vae.decode_chunks(latents.to(pipe.device)):
        if seam is None and 0 < skip <= pixels.shape[0]:  # this chunk holds the frame before the first new one
            seam = out[first_new - 1].short() - pixels[skip - 1].short()
        new = pixels[skip:]
        skip = max(0, skip - pixels.shape[0])
        carry_seam(new, seam, stop - first_new)
        out[stop:stop + new.shape[0]] = new
        stop += new.shape[0]
        final = min(stop, end - hold)
        done(frames=DecodedFrames(streamed, out.shape[0], out[streamed:final]) if final > streamed else None)
        streamed = max(streamed, final)
    return streamed


def carry_seam(frames: torch.Tensor, seam: torch.Tensor | None, offset: int) -> None:
    """Add to uint8 frames [n, H, W, 3], the `offset`-th new frames on, the seam [H, W, 3] (int16: the frame before
    them as it stands minus as decoded) at the weights 1 - (i + 1) / (SEAM_FRAMES + 1) of new frame i, in place."""
    if seam is None:
        return
    i = torch.arange(offset, offset + frames.shape[0])
    weight = (1 - (i + 1) / (SEAM_FRAMES + 1)).clamp(min=0)
    if weight.any():
        carried = frames.short() + (weight.view(-1, 1, 1, 1) * seam).round().short()
        frames.copy_(carried.clamp(0, 255))


def _decode_new_sound(pipe, audio: torch.Tensor, first_new: int, emitted: int) -> torch.Tensor:
    """Samples from `emitted` on, decoded from the latents with `AUDIO_CONTEXT` latents of context."""
    start = max(0, first_new - AUDIO_CONTEXT)
    wave = pipe.audio_vae.decode(audio[:, :, start:].to(pipe.device)).float().cpu()
    return wave[:, emitted - start * pipe.audio_vae.hop:]


def _source_sound(wave: torch.Tensor | None, rate: int, target_rate: int, samples: int) -> torch.Tensor:
    """The source's own sound for its kept part (silence where it has none), at the model's rate."""
    out = torch.zeros(2, samples)
    if wave is None:
        return out
    wave = wave[None] if wave.ndim == 1 else wave
    if rate != target_rate:
        from engine.models.h3.vae import resample

        wave = resample(wave, rate, target_rate)
    wave = wave.expand(2, -1) if wave.shape[0] == 1 else wave[:2]
    n = min(samples, wave.shape[1])
    out[:, :n] = wave[:, :n]
    return out
