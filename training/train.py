"""Train the embedded default on the toy world: small video and audio VAEs, then a small H3 DiT on their latents.

    python -m training.train --minutes 8 --seed 0 --out engine/weights/toy     # GPU machine
    python -m training.train --smoke                                            # CPU: a few steps of each stage

Every part is the engine's own class: the diffusers video / audio VAEs at small widths (`TOY_VIDEO_VAE`,
`TOY_AUDIO_VAE`; the real compression and frame rules), our H3 DiT (`TOY`: the tiny preset's architecture, wider
and deeper), and the tiny Qwen3-VL conditioner drawn from seed 0, its text layers trained to make a caption's
attributes readable (training/text_encoder.py) and then frozen (its prompt embeddings computed once per clip). The
DiT learns what every H3 task feeds it: t2va, first / last keyframe rows (fl2va), masked edits (regenerated cells at
their timestep, the rest at the condition level) and extension guide rows.

Weights go out as Comfy-Org single files in the published schemas (DiT comfy layout bf16, text encoder bf16, video
VAE F16 and audio VAE F32 with their latent statistics), so the engine loads them with the strict loaders of real
checkpoints (`H3Pipeline.from_files`); `--resume` starts from them. A JSON-lines log (losses, eval scores) goes
beside them.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from safetensors.torch import save_file

from engine.kernels import attention
from engine.models.h3 import layout as L
from engine.models.h3 import mask as M
from engine.models.h3.checkpoint import save_dit
from engine.models.h3.conditioner import build_tiny_conditioner, text_encoder_file_tensors
from engine.models.h3.config import NUM_MODALITIES, TINY
from engine.models.h3.denoise import Target, guided
from engine.models.h3.dit import build_dit
from engine.models.h3.extend import frames_of
from engine.models.h3.pipeline import KEYFRAME_NOISE_AUG, TOY_FILES, Canvas, GenerateRequest, H3Pipeline
from engine.models.h3.references import AudioReference, ImageReference, normalise_image
from engine.models.h3.request import ExtendRequest
from engine.models.h3.schedule import AUDIO_SHIFT, VIDEO_SHIFT
from engine.models.h3.vae import (IMAGENET_MEAN, IMAGENET_STD, TINY_TILE_OVERLAP, TINY_TILE_SIZE, TOY_AUDIO_VAE,
                                  TOY_VIDEO_VAE, AudioVAE, VideoVAE, build_tiny_audio_vae, build_tiny_video_vae,
                                  save_audio_vae_file, save_video_vae_file)
from training.captions import caption, caption_at, parse_caption
from training.scoring import score_clip
from training.task_checks import box_masks
from training.text_encoder import train_text_encoder
from training.toy_scene import DIRECTIONS, FPS, SAMPLE_RATE, contact_times, sample_scene
from training.toy_world import MAX_FRAMES, background_image, render

# The embedded default's DiT: the tiny preset's architecture (text width 32, partial RoPE) at 256 wide, 6 blocks.
TOY = replace(TINY, num_attention_heads=4, attention_head_dim=64, hidden_size=256, num_layers=6, num_refiner_layers=1,
              ffn_dim=768, time_embed_hidden_dim=256, time_embed_dim=64, rope_freq_dim=8)
FILES = TOY_FILES
EVAL_SEED = 10_000_000  # scenes from here on are never trained on
# Share of DiT steps per layout (normalised by their sum).
TASKS = {"t2va": 0.4, "first": 0.15, "first_last": 0.1, "edit": 0.2, "extend": 0.15, "ref2va": 0.1}
REF_AUDIO_SECONDS = 2.0  # ref2va: the sound reference, the clip's first seconds
EMA = 0.995
LATER_STREAM = 7  # keeps a later window's start draw apart from the scene's own
GUIDE_FRAMES = frames_of(ExtendRequest.overlap_latents)  # the Extend node's default guide: 22 frames
CAPTION_DROP = 0.1  # share of prompts zeroed: the unconditional branch a guided teacher needs
# Guidance distillation teaches the t2va layout alone: keyframe, edit, extension and reference rows are held by their
# conditions, and a student distilled on every layout lost 0.6 dB on keyframes (stop 29); those keep the flow's loss.
DISTILLED_TASKS = ("t2va",)
AUDIO_LR, AUDIO_WARMUP = 3e-4, 100
AUDIO_WAVE_WEIGHT, AUDIO_SPECTRAL_WEIGHT = 100.0, 0.3  # waveform MSE (it teaches the hum's phase) + spectra
CLICK_SECONDS, CLICK_BATCH = 0.4, 32  # `--audio-clicks`: short crops, most of them holding a click
CLICK_CENTRED = 0.75  # share of those crops centred on a click
TOKEN_PX = 32  # a DiT video token's square of pixels: the video VAE's 16x times the 2x2 patch
# A video token's loss weight is 1 + OBJECT_WEIGHT x the share of it the objects cover: the objects are ~3 % of
# the tokens, so an unweighted loss learns the background and leaves them as blobs.
OBJECT_WEIGHT = 8.0
# `--dit-knock-weight W`: an audio row's loss weight is 1 + W within KNOCK_SPAN_S of a contact. A knock lasts ~20 ms,
# 4 of a 5 s clip's 200 audio latents, and the DiTs trained on the plain mean drew none (stops 41-62).
KNOCK_SPAN_S = 0.05
# `--dit-join-weight W`: an extension step's video rows of the JOIN_LATENTS latent frames after its guide (about the
# second an extension's velocity check judges after each join) weigh 1 + W. Stop 67 tried 10-40 against the DiT's
# slowing there (benchmarks/extension_join.py): the first 12 new frames stayed at ~0.5 of the rendered speed.
JOIN_LATENTS = 6
EXTEND_OVERLAPS = (2, 7)  # the guide lengths (latents) an extension step draws: Extend's shortest and default
OBJECT_DILATE = 2  # a VAE's pixel loss is weighted 1 + OBJECT_WEIGHT within this many pixels of an object
FINISH_S = 30  # of --minutes kept for the last evaluation and the files
VAE_FRAMES = 22  # one 17-frame clip and the 5 of the next: every code path of the temporal chunking
# Two decode windows: the first window's 5 frames past its chunk cross-faded into the second's head, the seam every
# extension join and every 17 frames of a longer clip decode through (one window has none).
SEAM_WINDOW_FRAMES = 39
MOTION_STEP = 24  # uint8 levels: a pixel an object enters or leaves inside a latent, not its anti-aliased rim
STAGES = {"video_vae": 0.3, "audio_vae": 0.15, "text_encoder": 0.05, "dit": 0.5}  # share of the time budget
# `--stages video_decoder` alone: the video VAE's decoder trained further on its own budget (the encoder and so the
# DiT's latents unchanged); it runs beside a DiT run on the same GPU (each is launch-bound). `--stages latent_rgb`
# alone refits the previews' latent -> RGB projection of the files in --resume. `--stages header` alone trains
# nothing: the files of --resume written again with the sampling settings given (--sampling-guidance, --video-shift).


def object_cover(masks: np.ndarray) -> np.ndarray:
    """bool [K, F, H, W] object masks -> float16 [T * gh * gw]: the share of each DiT video token (TOKEN_PX square,
    its latent frame's span of frames) that the objects cover, in the DiT's row order."""
    union = masks.any(0)
    num_frames, height, width = union.shape
    spans = np.array_split(np.arange(num_frames), L.latent_frames(num_frames))
    grid = np.stack([union[span].mean(0) for span in spans])
    grid = grid.reshape(len(spans), height // TOKEN_PX, TOKEN_PX, width // TOKEN_PX, TOKEN_PX).mean((2, 4))
    return grid.astype(np.float16).ravel()


def knock_rows(click_frames, num_latents: int, device) -> torch.Tensor:
    """[Ta]: 1 on the audio latents whose middle lies within KNOCK_SPAN_S of a click (frames), else 0."""
    middles = (np.arange(num_latents) + 0.5) / L.AUDIO_LATENTS_PER_SECOND
    clicks = np.asarray(click_frames, np.float64)[:, None] / FPS
    return torch.from_numpy((np.abs(middles - clicks) <= KNOCK_SPAN_S).any(0)).to(device).float()


def object_tracks(masks: np.ndarray) -> np.ndarray:
    """bool [K, F, H, W] object masks -> float16 [K, T * gh * gw]: the DiT rows an edit regenerates when an artist
    boxes each object with Mask Track Box: any token square of its padded box in any frame of the latent frame's
    span (the engine's cell then token mask of a 0/1 mask, in numpy: torch in 16 render workers took 4x longer)."""
    num_frames, height, width = masks.shape[1:]
    tracks = []
    for mask in masks:
        boxes = box_masks(mask).reshape(num_frames, height // TOKEN_PX, TOKEN_PX, width // TOKEN_PX, TOKEN_PX)
        tokens = boxes.max((2, 4))
        tracks.append(np.stack([tokens[a:b].max(0) for a, b in M.latent_frame_spans(num_frames)]).ravel())
    return np.stack(tracks).astype(np.float16)


@dataclass(frozen=True)
class LaterDraw:
    """How `--later-windows` draws a clip's later window: each mover at its own speed factor, log-uniform in
    1/speed_spread..speed_spread, and a `wall_hits` share of the windows started where a mover hits a wall in the
    frames the window generates."""
    speed_spread: float = 1.0
    wall_hits: float = 0.0


def wall_hit_start(scene, width: int, height: int, num_frames: int, draw) -> int | None:
    """A start frame (the window still ending by 15 s) whose window generates one of the scene's wall hits after the
    Extend node's default guide and a second of the path back after it, the hit drawn among those that fit; None
    when none does."""
    last = MAX_FRAMES - num_frames
    spans = []
    for obj in scene.objects:
        if obj.motion in DIRECTIONS:
            for hit in contact_times(obj, MAX_FRAMES / FPS, width, height) * FPS:
                lo, hi = max(0, math.ceil(hit - (num_frames - FPS))), min(last, math.floor(hit - GUIDE_FRAMES))
                if lo <= hi:
                    spans.append((lo, hi))
    if not spans:
        return None
    lo, hi = spans[int(draw.integers(len(spans)))]
    return int(draw.integers(lo, hi + 1))


def later_window(scene, width: int, height: int, num_frames: int, seed: int, how: LaterDraw = LaterDraw()) -> tuple:
    """(frames, audio, object cover, caption, click frames) of `num_frames` of the scene from a start frame drawn
    from `seed` (anywhere the window still ends by 15 s): a clip starts with its objects in their slots, while an
    extension's guide shows them mid-path, near a wall, or past one. The caption says what the window shows from its
    first new frame after the Extend node's default guide (`caption_at`: a mover past an odd number of wall hits goes
    the other way), as an artist prompts each window; the scene's own caption would name the wrong direction there.
    A speed spread S above 1 runs each mover at its own factor, log-uniform in 1/S..S, with the caption unchanged,
    so the guide is the only place the window's speed is: unspread, every mover crosses TRAVEL_SHARE of its range and
    the prompt names its speed within ~12 %, which the DiT then draws after a join instead of the guide's (stop 72).
    A `wall_hits` share of the windows start so a mover turns at a wall in the frames they generate (`wall_hit_start`;
    ~40 % of the windows with a mover do anyway), still prompted with the direction before the hit: the windows after
    a wall hit were the extension joins the DiT failed most (stop 76)."""
    draw = np.random.default_rng((seed, LATER_STREAM))
    start = int(draw.integers(0, MAX_FRAMES - num_frames + 1))
    if how.speed_spread != 1:
        spread = np.log(how.speed_spread)
        factors = np.exp(draw.uniform(-spread, spread, len(scene.objects)))
        scene = replace(scene, objects=tuple(replace(o, speed=o.speed * float(f))
                                             for o, f in zip(scene.objects, factors)))
    if how.wall_hits and draw.random() < how.wall_hits:
        hit_start = wall_hit_start(scene, width, height, num_frames, draw)
        start = start if hit_start is None else hit_start
    clip = render(scene, width, height, num_frames=start + num_frames)
    first = round(start / FPS * SAMPLE_RATE)
    audio = clip.audio[:, first:first + round(num_frames / FPS * SAMPLE_RATE)]
    told = caption_at(scene, (start + GUIDE_FRAMES) / FPS, width, height)
    clicks = tuple(f - start for f in clip.click_frames if f >= start)
    return clip.frames[start:], audio, object_cover(clip.masks[:, start:]), told, clicks


def render_clip(args: tuple[int, int, int, float, LaterDraw | None]) -> tuple:
    """(frames, audio, caption, object cover per DiT token, each object's edit track, a `later_window` drawn as
    `later` says or None, click frames) of one toy scene."""
    seed, width, height, seconds, later = args
    scene = sample_scene(seed, width, height)
    clip = render(scene, width, height, seconds)
    window = later_window(scene, width, height, len(clip.frames), seed, later) if later is not None else None
    return (clip.frames, clip.audio, clip.caption, object_cover(clip.masks), object_tracks(clip.masks), window,
            clip.click_frames)


def rendered(work, jobs: list[tuple], workers: int) -> list:
    """`work` over the jobs, in `workers` processes when more than one."""
    if workers <= 1:
        return [work(j) for j in jobs]
    with Pool(workers) as pool:
        return pool.map(work, jobs, chunksize=4)


def toy_clips(seeds, width: int, height: int, seconds: float, workers: int,
              later: LaterDraw | None = None) -> list[tuple]:
    return rendered(render_clip, [(s, width, height, seconds, later) for s in seeds], workers)


class Log:
    def __init__(self, path: Path | None):
        self.path, self.t0, self.last = path, time.monotonic(), {}

    def __call__(self, stage: str, step: int, total: int | None = None, **values) -> None:
        self.last[stage] = values
        row = {"stage": stage, "step": step, "s": round(time.monotonic() - self.t0, 1), **values}
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        done = f"{step}/{total}" if total else str(step)
        shown = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        print(f"[{row['s']:7.1f} s] {stage:9s} {done:>11s} {shown}", flush=True)


def load_compiled(path: Path | None) -> None:
    """Seed torch.compile's caches from a file an earlier run wrote: its kernels then load instead of compiling
    (compilation took 100-250 s of a DiT run's 7-8 minute budget on the H200)."""
    if path is not None and path.is_file():
        torch.compiler.load_cache_artifacts(path.read_bytes())


def save_compiled(path: Path | None) -> None:
    """Write what torch.compile built in this process (kernels, graphs) for `load_compiled`."""
    artifacts = torch.compiler.save_cache_artifacts() if path is not None else None
    if artifacts:
        path.write_bytes(artifacts[0])


def clip_odds(prompt: str, bounce_boost: float = 1.0, two_object_boost: float = 1.0) -> float:
    """How often a clip is drawn relative to a lone object that does not bounce."""
    boosts = (bounce_boost, "bounces" in prompt), (two_object_boost, len(parse_caption(prompt).objects) == 2)
    return float(np.prod([boost for boost, applies in boosts if applies]))


def timed_steps(budget_s: float, max_steps: int | None):
    """Step numbers until the budget (or the step cap) runs out."""
    end, step = time.monotonic() + budget_s, 0
    while time.monotonic() < end and (max_steps is None or step < max_steps):
        yield step
        step += 1


def object_pixels(frames: np.ndarray, text: str) -> np.ndarray:
    """bool [F, H, W]: where a toy clip's objects are drawn (its pixels that differ from the caption's background)."""
    _, height, width, _ = frames.shape
    background = np.round(background_image(parse_caption(text).background, width, height)).astype(np.uint8)
    return (frames != background).any(-1)


def object_weight(masks: np.ndarray, device, weight: float = OBJECT_WEIGHT) -> torch.Tensor:
    """bool [B, F, H, W] object masks -> loss weights [B, 1, F, H, W]: 1 + `weight` near an object."""
    m = torch.from_numpy(masks).to(device).float().flatten(0, 1)[:, None]
    m = F.max_pool2d(m, 2 * OBJECT_DILATE + 1, stride=1, padding=OBJECT_DILATE)
    return (1 + weight * m).view(masks.shape[0], masks.shape[1], 1, *masks.shape[2:]).transpose(1, 2)


def motion_pixels(frames: np.ndarray) -> np.ndarray:
    """bool [B, F, H, W]: where a frame differs from the mean of its latent's frames (by more than MOTION_STEP in
    some channel): what a decoder must draw changing inside one latent, e.g. a bouncer turning at the floor."""
    out = np.zeros(frames.shape[:-1], bool)
    for a, b in M.latent_frame_spans(frames.shape[1]):
        span = frames[:, a:b].astype(np.float32)
        out[:, a:b] = (np.abs(span - span.mean(1, keepdims=True)) > MOTION_STEP).any(-1)
    return out


def pixels(frames: np.ndarray, device) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] -> ImageNet-normalised [B, 3, F, H, W], the video VAE's input space."""
    x = torch.from_numpy(frames).to(device).permute(0, 4, 1, 2, 3).float() / 255
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1, 1)
    return (x - mean) / std


def train_video_vae(vae: VideoVAE, clips, budget_s: float, batch: int, log: Log, rng, max_steps=None,
                    decoder_only: bool = False, near_object_weight: float = OBJECT_WEIGHT,
                    temporal_weight: float = 0.0, bounce_boost: float = 1.0, motion_weight: float = 0.0,
                    seam_weight: float = 0.0) -> None:
    """Reconstruction weighted near the objects (+ a faint KL); `decoder_only` keeps the encoder, so the latents a
    DiT learned stay valid. Unweighted, the ~3 % of pixels that hold objects hardly count: small and fast objects
    came back too faint to find by colour in a quarter of the held-out round trips. `near_object_weight` is the
    weight added near them. `temporal_weight` adds the error of each frame-to-frame change: a latent's frames come
    from one token, so their errors move together and jump where the next latent's start (every decoded clip
    stepped ~2x its median frame difference at each latent boundary, an extension's joins included).
    `bounce_boost` draws clips with a bouncing object that many times as often: at a floor contact an object moves
    fastest and turns within one latent's 4 frames, where the round trip lost it (it faded or froze).
    `motion_weight` is added where a frame differs from its latent's mean frame (`motion_pixels`): the decoders
    trained without it drew each latent's 4 frames nearly alike (a bouncer at 98 px through a contact rendered
    104 -> 108 -> 100 -> 93), though the same decoder fitted to that one clip draws it within 50 steps.
    `seam_weight` adds the error of the frame-to-frame change across every latent boundary alone, on
    SEAM_WINDOW_FRAMES windows where the clips are that long: the decoder steps there 2.1-2.4x the clip's median
    frame difference and 2.8x at a chunk seam, where every extension joins (the render: 1x), so a join fails
    no-jump in the VAE's own round trip. The log's `seam_ratio` is the decoded change across the boundaries over the
    change inside latents."""
    model, device = vae.model.train(), vae.device
    model.disable_tiling()
    params = list((model.decoder if decoder_only else model).parameters())
    if decoder_only:
        params += list(model.post_quant_conv.parameters())
        model.encoder.requires_grad_(False)
        model.quant_conv.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=device.type == "cuda")
    num_frames = clips[0][0].shape[0]
    window = SEAM_WINDOW_FRAMES if seam_weight and num_frames >= SEAM_WINDOW_FRAMES else VAE_FRAMES
    seams = torch.tensor([a - 1 for a, _ in M.latent_frame_spans(window)[1:]], device=device)
    inside = torch.ones(window - 1, dtype=torch.bool, device=device).index_fill_(0, seams, False)
    odds = np.array([clip_odds(clip[2], bounce_boost) for clip in clips])
    for step in timed_steps(budget_s, max_steps):
        # A smoke run (max_steps) fits one batch, so its loss must fall; a real run draws clips and windows.
        picks = range(batch) if max_steps else rng.choice(len(clips), size=batch, p=odds / odds.sum())
        start = 0 if max_steps else int(rng.integers(0, num_frames - window + 1))
        frames = np.stack([clips[i][0][start:start + window] for i in picks])
        x = pixels(frames, device)
        masks = np.stack([object_pixels(f, clips[i][2]) for f, i in zip(frames, picks)])
        weight = object_weight(masks, device, near_object_weight)
        if motion_weight:
            moving = torch.from_numpy(motion_pixels(frames)).to(device)
            weight = weight + motion_weight * moving[:, None].float()
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            with torch.set_grad_enabled(not decoder_only):
                posterior = model.encode(x).latent_dist
            y = model.decode(posterior.sample()).sample
        error = (y.float() - x).pow(2)
        change = y.float().diff(dim=2)
        step_error = (change - x.diff(dim=2)).pow(2)
        weighted_steps = step_error * weight[:, :, 1:]
        recon = error.mean()
        loss = (error * weight).mean() + temporal_weight * weighted_steps.mean()
        loss = (loss + seam_weight * weighted_steps[:, :, seams].mean()) / weight.mean()
        loss = loss + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or max_steps:
            drawn = change.detach().abs().mean((0, 1, 3, 4))
            log("video_vae", step, max_steps, recon=recon.item(), step_error=step_error.mean().item(),
                seam_ratio=(drawn[seams].mean() / drawn[inside].mean()).item())
    model.eval()
    model.enable_tiling(TINY_TILE_SIZE, TINY_TILE_SIZE, TINY_TILE_OVERLAP, TINY_TILE_OVERLAP)


def fresh_video_decoder(vae: VideoVAE, seed: int) -> VideoVAE:
    """The VAE's encoder (so its latents, and the DiT that learned them, stay valid) with a TOY_VIDEO_VAE decoder drawn
    from `seed`."""
    model = build_tiny_video_vae(seed, TOY_VIDEO_VAE).model.to(vae.device)
    kept = {k: v for k, v in vae.model.state_dict().items() if not k.startswith("decoder.")}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    assert not unexpected and all(k.startswith("decoder.") for k in missing), (missing, unexpected)
    fresh = video_vae(model, list(vae.latents_mean_values), list(vae.latents_std_values))
    fresh.latent_rgb = vae.latent_rgb
    return fresh


def fresh_audio_vae(seed: int) -> AudioVAE:
    """TOY_AUDIO_VAE drawn from `seed` with signal-preserving upsamplers. At PyTorch's default init each transposed
    conv scales the signal by sqrt(2 / (3 rate)) (x0.29 at rate 8), so what reaches the waveform hardly depends on
    the latent (std 0.005 of an output of 0.018 at init) and training settles on one near-silent output for every
    input; rescaled, the latent's share stays O(1) through the stack and the output starts at the clips' level."""
    vae = build_tiny_audio_vae(seed, TOY_AUDIO_VAE)
    decoder = vae.model.decoder
    with torch.no_grad():
        for (up,), rate in zip(decoder.ups, vae.model.config.decoder_rates):
            up.weight_g.mul_((1.5 * rate) ** 0.5)
        decoder.conv_post.weight_g.mul_(0.2)
    return vae


def spectral_convergence(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Multi-resolution ||S_y - S_x|| / ||S_x|| of the STFT magnitudes: hums, clicks and rain by their spectra. No
    log magnitudes: their mean over a hum's many near-silent bins pulls the decoder to silence (a pure-tone overfit
    decodes to RMS 1e-4 after 300 steps with them, even at a tenth of the weight; to the tone in 150 without)."""
    loss = 0.0
    for n_fft in (256, 1024, 2048):
        if x.shape[-1] < n_fft:
            continue
        window = torch.hann_window(n_fft, device=x.device)
        sy, sx = (torch.stft(a.reshape(-1, a.shape[-1]), n_fft, n_fft // 4, window=window, return_complex=True).abs()
                  for a in (y, x))
        loss = loss + torch.linalg.norm(sy - sx) / torch.linalg.norm(sx).clamp(min=1e-3)
    return loss


def high_band_envelope(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """L1 of the log power envelopes (1 ms windows) of the second differences: rain is noise whose waveform no
    decoder can predict, but its envelope it can (waveform MSE alone teaches silence there; spectral convergence
    alone a constant hiss on every clip)."""
    def envelope(a):
        d = a[..., 2:] - 2 * a[..., 1:-1] + a[..., :-2]
        return torch.log(F.avg_pool1d(d * d, 32, 32) + 1e-6)
    return (envelope(y) - envelope(x)).abs().mean()


def click_envelope(y: torch.Tensor, x: torch.Tensor, hop: int) -> torch.Tensor:
    """L2 of the RMS envelopes (one latent hop) of the second differences: a knock by its level where it is, the
    measure the click stage trains on. Its L1 of log powers (`high_band_envelope`) pulls to silence where a knock's
    timing is uncertain; on the rainy sound it teaches hiss everywhere."""
    def envelope(a):
        d = a[..., 2:] - 2 * a[..., 1:-1] + a[..., :-2]
        return torch.sqrt(F.avg_pool1d(d * d, hop, hop) + 1e-10)
    return (envelope(y) - envelope(x)).pow(2).mean()


def dry_sound(args: tuple[int, int, int, int]) -> tuple[np.ndarray, list[int]]:
    """(the scene's sound rendered without rain, its clicks' start samples) of `num_frames` of one toy scene."""
    seed, width, height, num_frames = args
    clip = render(replace(sample_scene(seed, width, height), rain=False), width, height, num_frames=num_frames)
    return clip.audio, [round(f / FPS * SAMPLE_RATE) for f in clip.click_frames]


def dry_sounds(seeds, width: int, height: int, num_frames: int, workers: int) -> list[tuple]:
    return rendered(dry_sound, [(s, width, height, num_frames) for s in seeds], workers)


def click_segment(clips, dry, clicked: list[int], length: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(rainy input, rain-free target) mono segments of `length` samples: CLICK_CENTRED of the time around a click
    (anywhere in the segment's middle three quarters) of a clip that has one, else anywhere in any clip."""
    if clicked and rng.random() < CLICK_CENTRED:
        i = clicked[int(rng.integers(len(clicked)))]
        starts = dry[i][1]
        start = starts[int(rng.integers(len(starts)))] - int(rng.integers(length // 8, length - length // 8))
    else:
        i = int(rng.integers(len(clips)))
        start = int(rng.integers(0, clips[i][1].shape[1] - length + 1))
    audio, target = clips[i][1], dry[i][0]
    start, channel = int(np.clip(start, 0, audio.shape[1] - length)), int(rng.integers(2))
    return audio[channel, start:start + length], target[channel, start:start + length]


def train_audio_vae(vae: AudioVAE, clips, budget_s: float, batch: int, seconds: float, log: Log, rng,
                    max_steps=None, decoder_only: bool = False, envelope_weight: float = 0.0, dry=None,
                    click_weight: float = 0.0) -> None:
    """`decoder_only` keeps the encoder (and so the latents a DiT learned). With `dry` (each clip's `dry_sound`)
    the click recipe: `click_segment`s, the waveform judged against the rain-free sound and the knocks by
    `click_envelope` at `click_weight` (rain is not kept: the latents never carried it)."""
    model, device = vae.model.train(), vae.device
    params = list(model.parameters())
    if decoder_only:
        for part in (model.encoder, model.pre_block, model.mean_proj, model.logs_proj):
            part.requires_grad_(False)
        params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=AUDIO_LR, fused=device.type == "cuda")
    length = int(seconds * vae.sample_rate) // vae.hop * vae.hop
    clicked = [i for i, (_, starts) in enumerate(dry or ()) if starts]
    for step in timed_steps(budget_s, max_steps):
        # Warm-up: Adam's first full-size steps shift every layer's output together (the encoder's common part
        # grows x4 in one step at 5e-4), and the decoder then learns one output for every input.
        opt.param_groups[0]["lr"] = AUDIO_LR * (1 if max_steps else min(1.0, (step + 1) / AUDIO_WARMUP))
        if dry is not None:
            draw = np.random.default_rng(0) if max_steps else rng  # a smoke run: one batch, the loss must fall
            pairs = [click_segment(clips, dry, clicked, length, draw) for _ in range(batch)]
            x, target = (torch.from_numpy(np.stack(a)).to(device)[:, None] for a in zip(*pairs))
        else:
            segments = []
            for i in (range(batch) if max_steps else rng.integers(len(clips), size=batch)):
                audio = clips[i][1]
                start = 0 if max_steps else int(rng.integers(0, audio.shape[1] - length + 1))
                segments.append(audio[0 if max_steps else int(rng.integers(2)), start:start + length])
            x = target = torch.from_numpy(np.stack(segments)).to(device)[:, None]
        y = model(x, sample_posterior=False).sample[..., :length]  # the engine decodes posterior means
        wave = F.mse_loss(y, target)
        loss = AUDIO_WAVE_WEIGHT * wave + AUDIO_SPECTRAL_WEIGHT * spectral_convergence(y, target)
        if envelope_weight:
            loss = loss + envelope_weight * high_band_envelope(y, target)
        if click_weight:
            loss = loss + click_weight * click_envelope(y, target, vae.hop)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or max_steps:
            log("audio_vae", step, max_steps, mse=wave.item(), loss=loss.item())
    model.eval()


@torch.no_grad()
def latent_stats(vae, clips, encode, channel_dim: int, samples: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the raw latents over some clips (the VAE files carry them)."""
    z = torch.cat([encode(vae, clip).float().movedim(channel_dim, 0).flatten(1) for clip in clips[:samples]], dim=1)
    return z.mean(dim=1).tolist(), z.std(dim=1).clamp(min=1e-3).tolist()


def video_vae(model, mean=None, std=None) -> VideoVAE:
    channels = model.config.latent_channels
    return VideoVAE(model, mean or [0.0] * channels, std or [1.0] * channels, TINY_TILE_SIZE, TINY_TILE_OVERLAP)


def audio_vae(model, mean=None, std=None) -> AudioVAE:
    channels = model.config.latent_channels
    return AudioVAE(model, mean or [0.0] * channels, std or [1.0] * channels)


def encode_video(vae: VideoVAE, clip) -> torch.Tensor:
    return vae.encode_frames(torch.from_numpy(clip[0]))[0]  # [24, T, h, w]


def encode_audio(vae: AudioVAE, clip) -> torch.Tensor:
    return vae.encode(torch.from_numpy(clip[1]), vae.sample_rate)  # [2, 32, Ta]


@torch.no_grad()
def fit_latent_rgb(vae: VideoVAE, clips, samples: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The live previews' latent -> RGB projection, least squares: every latent cell against the mean colour (in
    [-1, 1]) of its 16x16 pixels at the latent's nearest pixel frame."""
    latents, colours = [], []
    for clip in clips[:samples]:
        z = encode_video(vae, clip).float().cpu()  # [24, T, h, w]
        frames = clip[0][np.round(np.linspace(0, clip[0].shape[0] - 1, z.shape[1])).astype(int)]
        rgb = F.avg_pool2d(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1, vae.spatial_compression)
        latents.append(z.permute(1, 2, 3, 0).reshape(-1, z.shape[0]))
        colours.append(rgb.permute(0, 2, 3, 1).reshape(-1, 3))
    x = torch.cat(latents)
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1)], 1), torch.cat(colours)).solution
    return solution[:-1].contiguous(), solution[-1].contiguous()


def sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


def box_rows(T: int, h: int, w: int, patch, rng) -> torch.Tensor:
    """A random box of latent cells over all frames, as a 0/1 mask per video row."""
    ph, pw = patch
    gh, gw = h // ph, w // pw
    bh, bw = int(rng.integers(1, gh + 1)), int(rng.integers(1, gw + 1))
    y0, x0 = int(rng.integers(0, gh - bh + 1)), int(rng.integers(0, gw - bw + 1))
    cells = torch.zeros(gh, gw)
    cells[y0:y0 + bh, x0:x0 + bw] = 1
    return cells.flatten().repeat(T)


def edit_rows(batch: list[dict], T: int, h: int, w: int, patch, rng, tracks: float) -> torch.Tensor:
    """The rows an edit step regenerates: a `tracks` share of the time each clip's track of one of its objects
    ([B, rows]: row timesteps per sample), else one random box for the batch ([rows]; with `tracks` 0 the draws and
    layouts of the DiT's runs before stop 45)."""
    if tracks and rng.random() < tracks:
        return torch.stack([b["tracks"][int(rng.integers(len(b["tracks"])))] for b in batch])
    return box_rows(T, h, w, patch, rng).to(batch[0]["tracks"].device)


def extension_rows(T: int, rng, overlaps: tuple[int, ...] = EXTEND_OVERLAPS) -> tuple[int, int, float]:
    """An extension window's guide: (overlap latents 5k + 2, one of `overlaps`, its audio latents, the window's
    start frame)."""
    overlap = int(rng.choice(overlaps))
    audio = round(frames_of(overlap) * L.AUDIO_LATENTS_PER_SECOND / L.FPS)
    return overlap, audio, float(rng.integers(0, 15 * L.FPS))


def dit_loss(dit, batch: list[dict], task: str, rng, gen: torch.Generator, caption_drop: float = 0.0,
             teacher=None, guidance: float = 1.0, video_shift: float = VIDEO_SHIFT,
             noise_gen: torch.Generator | None = None, edit_tracks: float = 0.0,
             edit_kept_sound: float = 0.0, keep: tuple[str, ...] = (), knock_weight: float = 0.0,
             join_weight: float = 0.0, temporal_weight: float = 0.0,
             overlaps: tuple[int, ...] = EXTEND_OVERLAPS, later: bool = False) -> torch.Tensor:
    """The flow-matching loss of a batch of clips (one caption length) under one task's layout, one sigma for all: x_t =
    (1 - s) x0 + s e, the DiT predicts x0 - e (the engine's data-ward velocity) at timestep 1 - s. The condition rows
    are what the engine feeds at inference: keyframe latents noised to KEYFRAME_NOISE_AUG (fl2va), the source outside a
    box (an `edit_tracks` share of the time, each clip's track of one object) at the condition level and, an
    `edit_kept_sound` share of the time, the batch's next clip's sound clean at timestep 1 and not scored (what a Masked
    Edit that keeps the source's sound feeds) (edit), the window's first latents noised to the condition level with its
    clean audio, on a shifted clock (extension: one of `overlaps` latents long; the window is the clip's later one when
    it has one, with its own prompt), an image reference (the clip's middle frame at the reference size) noised likewise
    and a clean sound reference (its first seconds), the prompt presenting both (ref2va). With a `teacher` and a
    `guidance` other than 1, a DISTILLED_TASKS layout's target is its velocity guided by `guidance`
    (engine/models/h3/denoise.py), else the flow's, with a `caption_drop` share of the prompts zeroed; `keep` ("video",
    "audio"): those rows' target is the `teacher`'s own velocity on the same rows. The audio rows near a contact weigh 1
    + `knock_weight`, an extension's video rows of the JOIN_LATENTS after its guide 1 + `join_weight`; `temporal_weight`
    adds the video error's change between latent frames (`temporal_error`). The noise comes from `noise_gen` (a
    generator on the device: drawn on the host, a batch's noise costs more than its step) or else `gen`. `later`: a
    t2va step on the clips' later windows (each with its own prompt), as the extension steps always are."""
    device = batch[0]["video"].device
    clips = [b.get("later", b) for b in batch] if task == "extend" or later else batch
    x0v = L.patchify(torch.stack([b["video"] for b in clips]))
    x0a = L.pack_audio(torch.stack([b["audio"] for b in clips]))
    keyframes = {"first": ("first",), "first_last": ("first", "last")}.get(task, ())
    presentation = "ref2va" if task == "ref2va" else keyframes  # what the prompt carries
    text, tags = torch.stack([c["text"][presentation] for c in clips]), clips[0]["tags"][presentation]
    _, _, T, h, w = batch[0]["video"][None].shape
    Ta = batch[0]["audio"].shape[-1]
    patch = dit.config.patch_size[1:]

    def noise(like):
        source = noise_gen or gen
        return torch.randn(like.shape, generator=source, device=source.device).to(device)

    u = torch.rand((), generator=gen)
    s_v, s_a = float(sigma(u, video_shift)), float(sigma(u, AUDIO_SHIFT))
    ev, ea = noise(x0v), noise(x0a)
    xv, xa = (1 - s_v) * x0v + s_v * ev, (1 - s_a) * x0a + s_a * ea
    t_video, weight = 1 - s_v, torch.stack([b["weight"] for b in clips])
    cond_v, cond_a = xv[:, :0], xa[:, :0]
    sound_given = False
    if keyframes:
        layout = L.build_layout(tags, T, h, w, Ta, patch, keyframes)
        cond_v = torch.cat([L.patchify(torch.stack([b[k] for b in batch])) for k in keyframes], dim=1)
        cond_v = KEYFRAME_NOISE_AUG * cond_v + (1 - KEYFRAME_NOISE_AUG) * noise(cond_v)
    elif task == "ref2va":
        picture = torch.stack([b["reference"] for b in batch])  # [B, 24, 1, rh, rw]
        sound = min(Ta, round(REF_AUDIO_SECONDS * L.AUDIO_LATENTS_PER_SECOND))
        blocks = (L.ReferenceBlock("image", 1, *picture.shape[-2:]), L.ReferenceBlock("audio", audio_latents=sound))
        layout = L.build_ref2va_layout(tags, blocks, T, h, w, Ta, patch)
        cond_v = L.patchify(picture)
        cond_v = KEYFRAME_NOISE_AUG * cond_v + (1 - KEYFRAME_NOISE_AUG) * noise(cond_v)
        cond_a = L.pack_audio(torch.stack([b["audio"][..., :sound] for b in batch]))
    elif task == "extend":
        overlap, guide_audio, start = extension_rows(T, rng, overlaps)
        layout = L.build_layout(tags, T, h, w, Ta, patch, media_origin=float(tags.numel() + rng.integers(0, 8)),
                                time_shift=start * L.AUDIO_LATENTS_PER_SECOND / L.FPS, guide_frames=overlap,
                                guide_audio=guide_audio)
        tail = x0v[:, :overlap * (h // patch[0]) * (w // patch[1])]
        cond_v = L.CONDITION_TIMESTEP * tail + (1 - L.CONDITION_TIMESTEP) * noise(tail)
        cond_a = L.pack_audio(torch.stack([b["audio"][..., :guide_audio] for b in clips]))
        rows_per_frame = tail.shape[1] // overlap
        weight[:, tail.shape[1]:(overlap + JOIN_LATENTS) * rows_per_frame] *= 1 + join_weight
    else:
        layout = L.build_layout(tags, T, h, w, Ta, patch)
        if task == "edit":  # regenerated cells at 1 - s, the rest of the source at the condition level
            q = edit_rows(batch, T, h, w, patch, rng, edit_tracks)
            sound_given = bool(edit_kept_sound) and rng.random() < edit_kept_sound
            if sound_given:  # another clip's: the clip's own hums what the hole held, and the DiT copies it back
                xa, s_a = x0a.roll(1, 0), 0.0
            anchor = L.CONDITION_TIMESTEP * x0v + (1 - L.CONDITION_TIMESTEP) * noise(x0v)
            xv = torch.lerp(anchor, xv, q[..., None])
            t_video = Target(xv, cap=L.CONDITION_TIMESTEP, model_mask=q.cpu()).timesteps(s_v)
            weight = weight * q
    layout = layout.to(device)
    timestep, idx = L.row_timesteps(layout, t_video, 1 - s_a, t_text=1 - s_v)
    rows = (timestep.to(device), idx.to(device), layout.token_tags, layout.position_ids, layout.video_indices,
            layout.audio_indices, layout.text_indices)
    video, audio = torch.cat([cond_v, xv], dim=1), torch.cat([cond_a, xa], dim=1)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    # flow matching; the dropped captions teach the unconditional branch
    if teacher is None or guidance == 1 or task not in DISTILLED_TASKS or keep:
        kept = (torch.rand(len(batch), generator=gen) >= caption_drop).to(device, text.dtype)
        text = text * kept[:, None, None]
        target_v, target_a = x0v - ev, x0a - ea
        if keep:
            with torch.no_grad(), autocast:
                own_v, own_a = teacher(video, audio, text, *rows)
            if "video" in keep:
                target_v = own_v[:, cond_v.shape[1]:].float()
            if "audio" in keep:
                target_a = own_a[:, cond_a.shape[1]:].float()
    else:  # guidance distillation: the teacher's guided velocity in one forward
        with torch.no_grad(), autocast:
            target_v, target_a = guided(teacher, guidance, video, audio, text, *rows)
        target_v, target_a = target_v[:, cond_v.shape[1]:], target_a[:, cond_a.shape[1]:]
    with autocast:
        v_out, a_out = dit(video, audio, text, *rows)
    v_diff = v_out[:, cond_v.shape[1]:].float() - target_v
    video_loss = (v_diff.pow(2).mean(-1) * weight).sum() / weight.sum().clamp(min=1)
    if temporal_weight:
        video_loss = video_loss + temporal_weight * temporal_error(v_diff, weight, T)
    if sound_given:
        return video_loss
    a_err = (a_out[:, cond_a.shape[1]:].float() - target_a).pow(2).mean(-1)
    a_weight = 1 + knock_weight * torch.stack([b["knocks"] for b in clips]).repeat(1, x0a.shape[1] // Ta)
    return video_loss + (a_err * a_weight).sum() / a_weight.sum()


def temporal_error(diff: torch.Tensor, weight: torch.Tensor, frames: int) -> torch.Tensor:
    """diff [B, N, C] of video rows (frame-major, `frames` latent frames), weight [B, N] -> the weighted mean square
    of the diff's change from each latent frame to the next, a pair of rows weighing as the lighter of the two (an
    edit's kept cells weigh 0). An error the frames share (an object drawn a pixel off throughout) adds nothing, one
    that changes between frames (a mover whose speed wavers) its squares twice over: the best prediction is the same,
    a small DiT only spends its errors elsewhere."""
    step = diff.unflatten(1, (frames, -1)).diff(dim=1).pow(2).mean(-1)
    pair = weight.unflatten(1, (frames, -1))
    pair = torch.minimum(pair[:, 1:], pair[:, :-1])
    return (step * pair).sum() / pair.sum().clamp(min=1)


@torch.no_grad()
def encode_clips(vae: VideoVAE, frames: np.ndarray) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] -> normalised latents [B, 24, T, h, w]: `VideoVAE.encode_frames` for a batch."""
    x = pixels(frames, vae.device)
    z = DiagonalGaussianDistribution(vae._encoded_clips(x, lambda: None)).sample().half().float()
    return (z - vae.latents_mean) / vae.latents_std


def token_weight(cover: np.ndarray, device) -> torch.Tensor:
    return 1 + OBJECT_WEIGHT * torch.from_numpy(cover).to(device).float()


def encode_sounds(vae: AudioVAE, sounds: np.ndarray) -> torch.Tensor:
    """float32 [B, 2, S] -> normalised latents [B, 2, C, Ta], each channel encoded alone (as the engine does)."""
    audio = vae.model.encode(torch.from_numpy(sounds).to(vae.device).flatten(0, 1)[:, None],
                             return_dict=False)[0].mode()
    return ((audio - vae.latents_mean) / vae.latents_std).unflatten(0, (-1, 2))


def prepare(pipe: H3Pipeline, clips, batch: int = 64) -> list[dict]:
    """Each clip's latents, keyframe latents, image reference latents and prompt embeddings (plain, with the first
    keyframe's picture block, with both, with the references: what each task's prompt carries, as in the engine),
    and its later window's latents when it has one, on the device. Every part but the DiT is frozen, so all of it
    runs once, batched."""
    out = []
    canvas = pipe.canvas
    with torch.no_grad():
        for i in range(0, len(clips), batch):
            group = clips[i:i + batch]
            frames = np.stack([c[0] for c in group])
            video = encode_clips(pipe.video_vae, frames)
            first, last = encode_clips(pipe.video_vae, frames[:, :1]), encode_clips(pipe.video_vae, frames[:, -1:])
            pictures = np.stack([reference_picture(c, canvas) for c in group])
            reference = encode_clips(pipe.video_vae, pictures[:, None])
            audio = encode_sounds(pipe.audio_vae, np.stack([c[1] for c in group]))
            for j, clip in enumerate(group):
                out.append({"video": video[j], "audio": audio[j], "first": first[j], "last": last[j],
                            "reference": reference[j], "picture": pictures[j], "sound": clip[1],
                            "prompt": clip[2], "text": {}, "tags": {}, "weight": token_weight(clip[3], pipe.device),
                            "tracks": torch.from_numpy(clip[4]).to(pipe.device).float(),
                            "knocks": knock_rows(clip[6], audio.shape[-1], pipe.device)})
            if group[0][5] is not None:
                video = encode_clips(pipe.video_vae, np.stack([c[5][0] for c in group]))
                audio = encode_sounds(pipe.audio_vae, np.stack([c[5][1] for c in group]))
                for j, clip in enumerate(group):
                    out[i + j]["later"] = {"video": video[j], "audio": audio[j], "prompt": clip[5][3],
                                           "text": {}, "tags": {}, "weight": token_weight(clip[5][2], pipe.device),
                                           "knocks": knock_rows(clip[5][4], audio.shape[-1], pipe.device)}
        for indices in by_caption_length(pipe, out):
            for start in range(0, len(indices), 64):
                part = indices[start:start + 64]
                for keyframes, picked in (((), ()), (("first",), (0,)), (("first", "last"), (0, -1))):
                    text, tags = pipe.conditioner.encode_batch([out[k]["prompt"] for k in part],
                                                               [[clips[k][0][f] for f in picked] for k in part])
                    for k, hidden in zip(part, text):
                        out[k]["text"][keyframes], out[k]["tags"][keyframes] = hidden.float(), tags
                if "later" in out[part[0]]:
                    windows = [out[k]["later"] for k in part]
                    text, tags = pipe.conditioner.encode_batch([w["prompt"] for w in windows], [[] for _ in part])
                    for window, hidden in zip(windows, text):
                        window["text"][()], window["tags"][()] = hidden.float(), tags
        for sample in out:  # one prompt at a time: the presentation of its references
            text, tags = pipe.conditioner.encode_references(
                sample["prompt"], [ImageReference(sample.pop("picture")), AudioReference(sample.pop("sound"))])
            sample["text"]["ref2va"], sample["tags"]["ref2va"] = text[0].float(), tags
    return out


def training_canvas(width: int, height: int) -> Canvas:
    """The canvas rules of the clips trained on: at 224x128 the engine's embedded canvas (TINY_CANVAS), image
    references included (their "2048" short edge is twice the canvas's; the release's 2048 made every clip's
    reference a 3584x2048 picture and the encoding of 1536 clips take over 5 minutes)."""
    return Canvas(short_edge=height, max_pixels=height * width, default_steps=8, reference_short_edge=2 * height)


def reference_picture(clip, canvas: Canvas) -> np.ndarray:
    """A clip's middle frame as the engine sizes an image reference ("diffusers" mode)."""
    frame = clip[0][len(clip[0]) // 2]
    return normalise_image(frame, 1, "diffusers", frame.shape[0] * frame.shape[1], canvas.reference_short_edge)


def text_at_unit_scale(conditioner) -> None:
    """Rescale the text encoder's token embeddings to unit RMS. The tiny Qwen3-VL is drawn at init range 0.02, so
    its hidden states are ~0.03 per channel, and a fresh DiT's refiner drowns them in its own O(1) sublayer outputs:
    it never learns to read the prompt (measured on two clips told apart by one word: 100 steps give the same loss
    with the right and the swapped captions, 1.818 vs 1.819; at unit scale 1.50 vs 5.19). The released Qwen3-VL's
    hidden states are O(1) and larger."""
    with torch.no_grad():
        table = conditioner.model.get_input_embeddings().weight
        table.mul_(1 / table.float().pow(2).mean().sqrt())


def encoded(pipe: H3Pipeline, clips, cache: Path | None, later: LaterDraw | None = None) -> list[dict]:
    """`prepare`d clips, through a cache file when given (a second run on a warm machine skips the encoding). The
    later windows carry how they were drawn (`LaterDraw`): a cache drawn otherwise is refused."""
    if cache is not None and cache.is_file():
        data = torch.load(cache, map_location=pipe.device)
        for sample in data:  # the layouts' tags stay on the host, as `prepare` made them
            for part in (sample, sample.get("later", {})):
                if "tags" in part:
                    part["tags"] = {k: v.cpu() for k, v in part["tags"].items()}
        window = data[0].get("later", {})
        if "knocks" not in data[0] or (later is not None and not {"prompt", "knocks"} <= window.keys()):
            raise SystemExit(f"{cache} lacks what this run trains on (the knocks' audio rows of stop 64's toy "
                             "world, or the later windows --later-windows asks for, with their prompts); delete it "
                             "and run again to re-encode.")
        drawn = LaterDraw(**{k: window[k] for k in ("speed_spread", "wall_hits") if k in window})  # older: defaults
        if later is not None and drawn != later:
            raise SystemExit(f"{cache} holds later windows drawn at {draw_options(drawn)}; this run asks for "
                             f"{draw_options(later)}. Give another --cache, or delete it to re-encode.")
        if clips is None or len(data) == len(clips):
            return data
    data = prepare(pipe, clips)
    for sample in data:
        if "later" in sample:
            sample["later"].update(speed_spread=later.speed_spread, wall_hits=later.wall_hits)
    if cache is not None:
        torch.save(data, cache)
    return data


def draw_options(later: LaterDraw) -> str:
    return f"--later-speed-spread {later.speed_spread:g} --later-wall-hits {later.wall_hits:g}"


def by_caption_length(pipe: H3Pipeline, data: list[dict]) -> list[list[int]]:
    """Clip indices grouped by their prompt's token count, and their later window's (one layout per group)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, sample in enumerate(data):
        prompts = [sample["prompt"]] + ([sample["later"]["prompt"]] if "later" in sample else [])
        groups.setdefault(tuple(len(pipe.conditioner._text(p)) for p in prompts), []).append(i)
    return list(groups.values())


def evaluate(pipe: H3Pipeline, scenes, steps: int, guidance: float) -> dict:
    """t2va on held-out captions, scored from the decoded frames and sound alone: the share of clips passing
    each check, and all of them; sampled at `guidance` (two DiT forwards a step unless 1)."""
    dit, sampled_at = pipe.dit.eval(), pipe.guidance
    pipe.guidance = guidance
    width, height = pipe.canvas.max_pixels // pipe.canvas.short_edge, pipe.canvas.short_edge
    passed, checks = 0, {}
    try:
        for scene in scenes:
            result = pipe.generate(GenerateRequest(prompt=caption(scene), seed=scene.seed, steps=steps, width=width,
                                                   height=height))
            verdict = score_clip(result.frames.numpy(), np.asarray(result.audio), scene)["checks"]
            passed += all(verdict.values())
            for name, ok in verdict.items():
                checks[name] = checks.get(name, 0) + bool(ok)
    finally:
        pipe.dit, pipe.guidance = dit.train(), sampled_at
    return {"guidance": guidance, "t2va_pass": passed / len(scenes),
            **{f"{k}_rate": v / len(scenes) for k, v in checks.items()}}


def task_shares(overrides: list[str]) -> dict[str, float]:
    """TASKS with `--task-share TASK=SHARE` overrides."""
    shares = dict(TASKS)
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in TASKS or not value:
            raise SystemExit(f"--task-share takes TASK=SHARE with TASK one of {', '.join(TASKS)}; got {item!r}.")
        shares[name] = float(value)
    return shares


def pick_batch(groups: list[list[int]], odds: list[list[float]], batch: int, rng) -> list[int]:
    """`batch` clip indices of one group (one caption length), each clip drawn with its odds, a group with their
    sum."""
    sums = np.array([sum(o) for o in odds])
    g = int(rng.choice(len(groups), p=sums / sums.sum()))
    return [groups[g][int(i)] for i in rng.choice(len(groups[g]), size=batch, p=np.array(odds[g]) / sums[g])]


def train_dit(pipe: H3Pipeline, data: list[dict], budget_s: float, batch: int, log: Log, rng, gen, eval_scenes,
              eval_every: int, lr: float, max_steps=None, caption_drop: float = CAPTION_DROP, guidance: float = 1.0,
              eval_guidance=(), compile: bool = False, bounce_boost: float = 1.0,
              edit_tracks: float = 0.0, two_object_boost: float = 1.0, edit_kept_sound: float = 0.0,
              tasks: dict[str, float] = TASKS, extend_caption_drop: float | None = None,
              keep_video: bool = False, data_tasks: tuple[str, ...] | None = None, knock_weight: float = 0.0,
              join_weight: float = 0.0, temporal_weight: float = 0.0,
              extend_overlaps: tuple[int, ...] = EXTEND_OVERLAPS, later_t2va: float = 0.0) -> None:
    """DiT steps over batches of one caption length, the task drawn per step; the weights kept (and saved) are an
    exponential moving average. `guidance` != 1 distills: the DiT as it starts, frozen, is the guided teacher.
    `compile` runs the blocks of the training steps through torch.compile, one block at a time (dynamic shapes; the
    blocks share their code, so one graph serves all of them; the whole DiT compiled spent 100-250 s of each run
    on a graph per layout): the eager step is bound by the unfused fp32 norm / modulation / residual passes over
    the rows. `bounce_boost` and `two_object_boost` draw clips with a bouncing object, or with two objects, that
    many times as often as the others; `edit_tracks` is the share of edit steps on object tracks and
    `edit_kept_sound` the share given a kept sound. `tasks`: each layout's share of the steps;
    `extend_caption_drop` (default `caption_drop`) the share of the extension steps' prompts zeroed, which leaves
    the guide rows the only source of the motion to continue. `keep_video`: the video rows learn the DiT as it
    starts (frozen) instead of the data, so the pictures and the edits stay while the sound is relearned, its timing
    through the attention the audio rows share with the video's (stop 56: the audio rows' own weights alone, with
    that attention frozen, drew no knock in 778 steps and still lost a removal). `data_tasks`: only these layouts
    learn from the data, every other one the DiT as it starts (both rows), so what those do stays while these are
    taught. `knock_weight`: the audio rows near a contact weigh that much more (KNOCK_SPAN_S); `join_weight`: an
    extension's video rows just after its guide (JOIN_LATENTS); `temporal_weight`: the video error's change between
    latent frames (`temporal_error`); `extend_overlaps`: the guide lengths (latents) the extension steps draw from;
    `later_t2va`: the share of the t2va steps drawn on the later windows."""
    log("encoded", len(data))
    dit = pipe.dit.float().train().requires_grad_(True)
    kept_by_teacher = keep_video or data_tasks is not None
    if kept_by_teacher and guidance != 1:
        raise SystemExit("--dit-keep-video and --dit-data-tasks learn from the starting DiT unguided; they do not go "
                         "with --guidance.")
    if keep_video and data_tasks is not None:
        raise SystemExit("--dit-keep-video and --dit-data-tasks keep different rows; choose one.")
    teacher = copy.deepcopy(dit).eval().requires_grad_(False) if guidance != 1 or kept_by_teacher else None
    params = list(dit.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=pipe.device.type == "cuda")
    blocks = dit.blocks
    if compile:
        dit.blocks = nn.ModuleList(torch.compile(block, dynamic=True) for block in blocks)
        if teacher is not None:
            teacher.blocks = nn.ModuleList(torch.compile(block, dynamic=True) for block in teacher.blocks)
    names, shares = list(tasks), np.array(list(tasks.values()))
    groups = by_caption_length(pipe, data)
    odds = [[clip_odds(data[i]["prompt"], bounce_boost, two_object_boost) for i in g] for g in groups]
    # Noise drawn on the device; the loss summed there, read once per log line (no host sync per step).
    noise_gen = torch.Generator(pipe.device).manual_seed(int(torch.randint(1 << 62, (), generator=gen)))
    total, every = 0.0, 1 if max_steps else 100
    t0 = t_every = time.monotonic()
    for step in timed_steps(budget_s, max_steps):
        done = min(1.0, (time.monotonic() - t0) / budget_s)  # cosine over the time budget, down to a tenth
        opt.param_groups[0]["lr"] = lr * (0.55 + 0.45 * np.cos(np.pi * done))
        if max_steps:  # one batch, one layout (one that learns the data), one noise draw: the loss must fall
            task, picks, gen = (data_tasks or ("t2va",))[0], groups[0][:batch], torch.Generator().manual_seed(0)
            step_rng = np.random.default_rng(0)
        else:
            task = names[int(rng.choice(len(names), p=shares / shares.sum()))]
            picks, step_rng = pick_batch(groups, odds, batch, rng), rng
        later = later_t2va > 0 and task == "t2va" and step_rng.random() < later_t2va
        dropped = extend_caption_drop if task == "extend" and extend_caption_drop is not None else caption_drop
        keep = ("video",) if keep_video else ("video", "audio") if data_tasks and task not in data_tasks else ()
        loss = dit_loss(dit, [data[i] for i in picks], task, step_rng, gen, dropped, teacher, guidance,
                        pipe.video_shift, None if max_steps else noise_gen, edit_tracks, edit_kept_sound, keep,
                        knock_weight, join_weight, temporal_weight, extend_overlaps, later)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - (0 if max_steps else EMA))
        total += loss.detach()
        if (step + 1) % every == 0:
            mean = float(total) / every
            ms = (time.monotonic() - t_every) * 1000 / every
            log("dit", step + 1, max_steps, loss=mean, lr=opt.param_groups[0]["lr"], ms_per_step=ms)
            total, t_every = 0.0, time.monotonic()
        if not max_steps and step and step % eval_every == 0:
            log("eval", step, None, **evaluate(pipe, eval_scenes, 9, pipe.guidance))
            t_every = time.monotonic()
    dit.blocks = blocks  # evaluated and saved eager
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    for scale in eval_guidance or (pipe.guidance,):
        log("eval", step + 1, None, **evaluate(pipe, eval_scenes[:1] if max_steps else eval_scenes,
                                               3 if max_steps else 9, scale))
    dit.eval().requires_grad_(False)


def deepen(dit, layers: int):
    """`dit` grown to `layers` blocks, computing exactly what it did: each added block a copy of the one before it
    with its two gates' rows of the AdaLN projection zeroed (its residual branches add nothing until training opens
    them), the copies spread evenly between the old blocks."""
    old = len(dit.blocks)
    if layers < old:
        raise ValueError(f"--dit-layers {layers}: the resumed DiT has {old} blocks; it can only grow")
    added = layers - old
    copies_after = Counter(max(0, round((j + 1) * old / (added + 1)) - 1) for j in range(added))
    blocks = []
    for i, block in enumerate(dit.blocks):
        blocks.append(block)
        for _ in range(copies_after[i]):
            blocks.append(copy.deepcopy(block))
            linear, width = blocks[-1].adaln_proj.linear, dit.config.hidden_size
            with torch.no_grad():  # tables per modality: shift, scale, gate (attention), then the MLP's
                linear.weight.view(NUM_MODALITIES, 6, width, -1)[:, [2, 5]] = 0
                linear.bias.view(NUM_MODALITIES, 6, width)[:, [2, 5]] = 0
    dit.blocks = nn.ModuleList(blocks)
    dit.config = replace(dit.config, num_layers=layers)
    return dit


def save(pipe: H3Pipeline, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_dit(copy.deepcopy(pipe.dit).set_dtype(torch.bfloat16).cpu(), out / FILES["dit"],
             video_shift=pipe.video_shift, guidance=pipe.guidance)
    save_file(text_encoder_file_tensors(pipe.conditioner.model), str(out / FILES["text_encoder"]))
    save_video_vae_file(pipe.video_vae, out / FILES["video_vae"])
    save_audio_vae_file(pipe.audio_vae, out / FILES["audio_vae"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Train the embedded default (toy world) and write its weight files.")
    p.add_argument("--minutes", type=float, default=8.0,
                   help="wall-clock budget of the whole run, data included: the stages share it and the last one "
                        "ends in time to evaluate and save")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=768, help="toy clips rendered for training")
    p.add_argument("--out", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resume", nargs="?", type=Path, const=True, default=None, metavar="DIR",
                   help="start from the weight files in DIR (default: --out)")
    p.add_argument("--fresh-dit", action="store_true",
                   help="with --resume: a DiT drawn from --seed instead of the file's (the other parts resumed; "
                        "the text encoder's embeddings rescaled to unit RMS, see text_at_unit_scale)")
    p.add_argument("--dit-layers", type=int, default=None, metavar="N",
                   help="the resumed DiT grown to N blocks, each added one a copy of its neighbour with closed gates "
                        "(it starts computing what the resumed DiT does)")
    p.add_argument("--fresh-audio-vae", action="store_true",
                   help="with --resume: an audio VAE drawn from --seed (TOY_AUDIO_VAE) instead of the file's; a DiT "
                        "resumed on it relearns the sound")
    p.add_argument("--fresh-video-decoder", action="store_true",
                   help="with --resume: the video VAE's decoder drawn from --seed at TOY_VIDEO_VAE's width (the "
                        "encoder, its latents and so the DiT kept); train it with --stages video_decoder")
    p.add_argument("--cache", type=Path, default=None,
                   help="the DiT stage's encoded clips: read from this file when it holds --clips of them, "
                        "else written (not used when the text encoder trains in the same run)")
    p.add_argument("--stages", nargs="+", default=list(STAGES),
                   choices=[*STAGES, "video_decoder", "audio_decoder", "latent_rgb", "header"])
    p.add_argument("--audio-envelope", type=float, default=0.0,
                   help="weight of the audio VAE's high-band envelope loss (high_band_envelope)")
    p.add_argument("--audio-clicks", type=float, default=0.0, metavar="WEIGHT",
                   help="the audio VAE stages on the click recipe (train_audio_vae): short crops around clicks, "
                        "rain-free targets, the bursts' envelope at this weight")
    p.add_argument("--eval-every", type=int, default=2000, help="DiT steps between held-out evaluations")
    p.add_argument("--batch", type=int, default=32, help="DiT clips per step (of one caption length)")
    p.add_argument("--lr", type=float, default=3e-4, help="DiT learning rate (cosine to a tenth over the budget)")
    p.add_argument("--caption-drop", type=float, default=CAPTION_DROP,
                   help="share of the DiT's prompts zeroed (teaches the unconditional branch guidance needs)")
    p.add_argument("--guidance", type=float, default=1.0,
                   help="distill: on the t2va layout the DiT learns, in one forward, its starting self guided by "
                        "this scale (denoise.guided; the starting DiT must have trained with --caption-drop)")
    p.add_argument("--sampling-guidance", type=float, default=None,
                   help="the guidance scale the engine samples text-to-video and masked edits with, recorded in the "
                        "DiT file (default: the resumed file's, else 1: one forward a step)")
    p.add_argument("--eval-guidance", type=float, nargs="+", default=[],
                   help="the final held-out evaluation at each of these guidance scales (1: the plain DiT; "
                        "default: the one the engine samples with)")
    p.add_argument("--eval-scenes", type=int, default=4, help="held-out captions of the DiT's evaluations")
    p.add_argument("--video-shift", type=float, default=None,
                   help="the video schedule's shift, trained and recorded in the DiT file (default: the resumed "
                        "file's, else the release's 12)")
    p.add_argument("--compile", action="store_true", help="the DiT's training steps through torch.compile")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="FILE",
                   help="with --compile: torch.compile's kernels read from FILE if it exists, written to it after")
    p.add_argument("--bounce-boost", type=float, default=1.0,
                   help="the DiT (and the video decoder) draw clips with a bouncing object this many times as "
                        "often as the others")
    p.add_argument("--two-object-boost", type=float, default=1.0,
                   help="the DiT draws clips with two objects this many times as often as those with one")
    p.add_argument("--edit-tracks", type=float, default=0.0,
                   help="share of the DiT's edit steps whose mask is each clip's track of one object as Mask Track "
                        "Box boxes it, the rest a random box (a replacement's mask; 0: boxes only, as the DiT was "
                        "trained until stop 45)")
    p.add_argument("--edit-kept-sound", type=float, default=0.0,
                   help="share of the DiT's edit steps given another clip's sound, clean (Masked Edit's keep_audio, "
                        "its default) instead of generating it")
    p.add_argument("--task-share", nargs="+", default=[], metavar="TASK=SHARE",
                   help=f"a layout's share of the DiT steps instead of its default (TASKS: {TASKS}; the shares are "
                        "normalised by their sum)")
    p.add_argument("--extend-caption-drop", type=float, default=None,
                   help="share of the extension steps' prompts zeroed (default --caption-drop): the DiT then "
                        "continues the guide's motion from the guide alone")
    p.add_argument("--extend-overlaps", type=int, nargs="+", choices=(2, 7, 12), default=list(EXTEND_OVERLAPS),
                   metavar="N", help="the guide lengths (5k + 2 latents; Extend's overlap_latents) the extension "
                   "steps draw from: a longer guide shows more of a mover's path to read its speed from (a later "
                   "window keeps the prompt of what it shows after the default 7)")
    p.add_argument("--dit-keep-video", action="store_true",
                   help="the DiT stage trains every weight, the video rows on the starting DiT's own prediction: the "
                        "sound relearned, the pictures and edits kept")
    p.add_argument("--dit-data-tasks", nargs="+", choices=list(TASKS), default=None, metavar="TASK",
                   help="only these layouts learn from the data, the others the starting DiT's own prediction (both "
                        "rows): e.g. extend taught while every other task stays as it was")
    p.add_argument("--dit-knock-weight", type=float, default=0.0, metavar="W",
                   help="the DiT's audio rows within KNOCK_SPAN_S of a contact weigh 1 + W in its loss")
    p.add_argument("--dit-join-weight", type=float, default=0.0, metavar="W",
                   help="an extension step's video rows of the JOIN_LATENTS latent frames after its guide weigh 1 + W "
                        "in the DiT's loss")
    p.add_argument("--dit-temporal-weight", type=float, default=0.0, metavar="W",
                   help="the change of the DiT's video error from one latent frame to the next weighs W in its loss "
                        "(a mover's wavering speed costs more than a steady offset)")
    p.add_argument("--later-windows", action="store_true",
                   help="every clip also gets a window of its scene from a random later start (up to 15 s), and "
                        "the extension steps train on those: guides with objects mid-path or past a wall hit, each "
                        "window prompted with what it shows after its guide (training.captions.caption_at)")
    p.add_argument("--later-speed-spread", type=float, default=1.0, metavar="S",
                   help="with --later-windows: each mover of a later window at its own speed factor, log-uniform in "
                        "1/S..S, the prompt unchanged, so the extension steps must take the speed from the guide")
    p.add_argument("--later-wall-hits", type=float, default=0.0, metavar="P",
                   help="with --later-windows: a share P of the later windows start where a mover hits a wall in "
                        "the frames they generate (prompted with its direction before the hit): the extension steps "
                        "see more turns at a wall after the guide (~40 %% of the windows with a mover hold one); "
                        "measured at P = 1 (stop 78) it loses extension joins after a wall hit, 4 -> 3 of 9")
    p.add_argument("--later-t2va", type=float, default=0.0, metavar="P",
                   help="with --later-windows: a share P of the text-to-video steps train on the later windows too "
                        "(each with its own prompt): a mover mid-path or turning at a wall inside the clip, which "
                        "the first windows never show (their movers keep clear of the walls for 6 s)")
    p.add_argument("--vae-temporal-weight", type=float, default=0.0,
                   help="video decoder: weight of the frame-to-frame change's error beside the frames' own")
    p.add_argument("--vae-seam-weight", type=float, default=0.0,
                   help="the video decoder stage's weight on the frame-to-frame change's error across latent "
                        "boundaries, on two decode windows (39 frames): against the step at every latent and chunk "
                        "seam")
    p.add_argument("--vae-motion-weight", type=float, default=0.0,
                   help="video decoder: loss weight added where a frame differs from its latent's mean frame")
    p.add_argument("--vae-object-weight", type=float, default=OBJECT_WEIGHT,
                   help="the video VAE stages' loss weight added within OBJECT_DILATE pixels of an object")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny canvas, a few steps of each stage")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.minutes * 60 - FINISH_S
    torch.manual_seed(args.seed)
    rng, gen = np.random.default_rng(args.seed), torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    width, height = (96, 64) if args.smoke else (224, 128)
    steps_cap = 6 if args.smoke else None
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / ("smoke_log.jsonl" if args.smoke else "train_log.jsonl"))
    attention.set_backend("sdpa")  # differentiable everywhere; FA3 here has no backward

    # A smoke run's clips are one VAE window long (22 frames): every stage runs, in seconds on a CPU. A DiT run
    # with its cache needs none.
    cache = None if "text_encoder" in args.stages else args.cache  # it holds the old encoder's prompt states
    clip_stages = set(args.stages) - {"text_encoder", "header"}
    clips = None
    if args.later_t2va and not args.later_windows:
        raise SystemExit("--later-t2va trains on the later windows; add --later-windows.")
    later = LaterDraw(args.later_speed_spread, args.later_wall_hits) if args.later_windows else None
    if clip_stages and (clip_stages != {"dit"} or cache is None or not cache.is_file()):
        clips = toy_clips(range(args.seed * 1_000_000, args.seed * 1_000_000 + (2 if args.smoke else args.clips)),
                          width, height, 0.9 if args.smoke else 5.0, 1 if args.smoke else 16, later)
        log("data", len(clips), frames=int(clips[0][0].shape[0]), canvas=f"{width}x{height}")
    if args.resume:
        start = args.out if args.resume is True else args.resume
        pipe = H3Pipeline.from_files(*(start / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                     device=device, dtype=torch.float32)
    else:
        conditioner = build_tiny_conditioner(0, TOY.text_dim).to(device)  # frozen
        pipe = H3Pipeline(build_dit(TOY, seed=args.seed, device=device),
                          build_tiny_video_vae(args.seed, TOY_VIDEO_VAE).to(device),
                          fresh_audio_vae(args.seed).to(device), conditioner,
                          training_canvas(width, height), device, "toy")
    if args.fresh_dit:
        pipe.dit = build_dit(TOY, seed=args.seed, device=device)
    if args.dit_layers:
        pipe.dit = deepen(pipe.dit, args.dit_layers)
    if args.fresh_audio_vae:
        pipe.audio_vae = fresh_audio_vae(args.seed).to(device)
    if args.fresh_video_decoder:
        pipe.video_vae = fresh_video_decoder(pipe.video_vae, args.seed).to(device)
    if args.fresh_dit or not args.resume:
        text_at_unit_scale(pipe.conditioner)
    pipe.canvas = training_canvas(width, height)
    if args.video_shift is not None:
        pipe.video_shift = args.video_shift
    if args.sampling_guidance is not None:
        pipe.guidance = args.sampling_guidance
    pipe.encode_mp4, pipe.adaln_cache = False, None
    shares = {**STAGES, "video_decoder": 1.0, "audio_decoder": 1.0, "latent_rgb": 0.0, "header": 0.0}
    stage_share = {k: v / max(1e-9, sum(shares[s] for s in args.stages)) for k, v in shares.items()}
    budget = args.minutes * 60

    def stage_budget(stage: str) -> float:
        return max(1.0, min(budget * stage_share[stage], deadline - time.monotonic()))

    if "video_vae" in args.stages:
        train_video_vae(pipe.video_vae, clips, stage_budget("video_vae"), 1 if args.smoke else 8, log, rng,
                        steps_cap, near_object_weight=args.vae_object_weight)
        raw = video_vae(pipe.video_vae.model).to(device)
        pipe.video_vae = video_vae(pipe.video_vae.model, *latent_stats(raw, clips, encode_video, 0, 32)).to(device)
    if "video_decoder" in args.stages:
        train_video_vae(pipe.video_vae, clips, stage_budget("video_decoder"), 1 if args.smoke else 8, log, rng,
                        steps_cap, decoder_only=True, near_object_weight=args.vae_object_weight,
                        temporal_weight=args.vae_temporal_weight, bounce_boost=args.bounce_boost,
                        motion_weight=args.vae_motion_weight, seam_weight=args.vae_seam_weight)
    audio_recipe = dict(batch=1 if args.smoke else 16, seconds=0.1 if args.smoke else 1.0,
                        envelope_weight=args.audio_envelope)
    if args.audio_clicks and {"audio_vae", "audio_decoder"} & set(args.stages):
        dry = dry_sounds(range(args.seed * 1_000_000, args.seed * 1_000_000 + len(clips)), width, height,
                         len(clips[0][0]), 1 if args.smoke else 16)
        audio_recipe.update(batch=1 if args.smoke else CLICK_BATCH, seconds=CLICK_SECONDS, dry=dry,
                            click_weight=args.audio_clicks)
    if "audio_vae" in args.stages:
        train_audio_vae(pipe.audio_vae, clips, stage_budget("audio_vae"), log=log, rng=rng, max_steps=steps_cap,
                        **audio_recipe)
        raw = audio_vae(pipe.audio_vae.model).to(device)
        pipe.audio_vae = audio_vae(pipe.audio_vae.model, *latent_stats(raw, clips, encode_audio, 1, 32)).to(device)
    if "audio_decoder" in args.stages:
        train_audio_vae(pipe.audio_vae, clips, stage_budget("audio_decoder"), log=log, rng=rng, max_steps=steps_cap,
                        decoder_only=True, **audio_recipe)
    if "text_encoder" in args.stages:
        train_text_encoder(pipe.conditioner, stage_budget("text_encoder"), 8 if args.smoke else 128, log, rng,
                           EVAL_SEED, width, height, steps_cap)
    if "dit" in args.stages:
        eval_scenes = [sample_scene(EVAL_SEED + i, width, height) for i in range(args.eval_scenes)]
        load_compiled(args.compile_cache if args.compile else None)
        data = encoded(pipe, clips, cache, later)
        train_dit(pipe, data, stage_budget("dit"), 2 if args.smoke else args.batch, log, rng, gen, eval_scenes,
                  args.eval_every, args.lr, steps_cap, args.caption_drop, args.guidance, args.eval_guidance,
                  args.compile, args.bounce_boost, args.edit_tracks, args.two_object_boost, args.edit_kept_sound,
                  task_shares(args.task_share), args.extend_caption_drop, args.dit_keep_video, args.dit_data_tasks,
                  args.dit_knock_weight, args.dit_join_weight, args.dit_temporal_weight,
                  tuple(args.extend_overlaps), args.later_t2va)
        save_compiled(args.compile_cache if args.compile else None)
    if clips is not None and ({"video_vae", "video_decoder", "latent_rgb"} & set(args.stages)):
        pipe.video_vae.latent_rgb = fit_latent_rgb(pipe.video_vae, clips)
        log("latent_rgb", 0, bias=str([round(v, 3) for v in pipe.video_vae.latent_rgb[1].tolist()]))
    save(pipe, args.out)
    log("saved", 0, out=str(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
