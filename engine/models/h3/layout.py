"""Packed-sequence layout for t2va, fl2va and ref2va (specs/h3.md §1.4, §2.2, §2.3, §5.3, §5.5).

Rows are `[text | keyframe condition rows | target audio (channel-major) | target video]`, for ref2va
`[text | reference blocks | target audio | target video]`. Positions are
float64 (t, h, w) rotary coordinates; one rotary time unit is 1/40 s (24 fps x 5/3 = the audio latent rate).
Also the canvas and frame-count rules, with the messages an artist sees when a request breaks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.models.h3.config import AUDIO_TAG, VIDEO_TAG

FPS = 24
FRAME_RESCALE = 5.0 / 3.0
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # pixel frames each latent frame of a 17-frame VAE chunk covers
SPATIAL_SCALE = 32.0
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
CLIP_LENGTH, LATENTS_PER_CHUNK = 17, 5
VAE_SPATIAL = 16
CANVAS_MULTIPLE = 32  # VAE 16 x patch 2
SHORT_EDGE, MAX_PIXELS = 768, 768 * 1344
MIN_ASPECT, MAX_ASPECT = 0.25, 4.0
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
CONDITION_TIMESTEP = 0.999  # visual condition rows: t = max(t_v, 0.999)


class LayoutError(ValueError):
    """A request outside the model's rules; the message is written for an artist."""


def align_num_frames(num_frames: int) -> int:
    """Snap up to the next 17n + 5 frame count the video VAE can encode."""
    if num_frames < 1:
        raise LayoutError(f"The frame count must be positive, got {num_frames}.")
    return num_frames + (LATENTS_PER_CHUNK - num_frames) % CLIP_LENGTH


def latent_frames(num_frames: int) -> int:
    """Latent frames for a 17n + 5 frame count: 5n + 2."""
    if num_frames % CLIP_LENGTH != LATENTS_PER_CHUNK:
        raise LayoutError(f"The frame count must be 17n + 5 (22, 39, ..., 124, ..., 362), got {num_frames}.")
    return (num_frames - LATENTS_PER_CHUNK) // CLIP_LENGTH * LATENTS_PER_CHUNK + 2


def audio_latents(num_frames: int) -> int:
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


def frames_for_seconds(seconds: float, min_seconds: float = MIN_SECONDS,
                       max_seconds: float = MAX_SECONDS) -> tuple[int, str | None]:
    """Frame count for a duration, snapped up to 17n + 5; returns (frames, note about the snap or None)."""
    if not np.isfinite(seconds) or seconds <= 0:
        raise LayoutError(f"Duration must be a positive number of seconds, got {seconds}.")
    if not min_seconds - 1e-9 <= seconds <= max_seconds + 1e-9:
        raise LayoutError(
            f"MiniMax-H3 generates {min_seconds:g} to {max_seconds:g} s per window, got {seconds:g} s "
            f"(use Extend Video for longer clips).")
    # Snapping up may pass max_seconds by < 1/24 s: 15 s is 362 frames (15.083 s), as in the reference runtimes.
    frames = align_num_frames(max(1, int(round(seconds * FPS))))
    note = None
    if abs(frames / FPS - seconds) > 1e-6:
        note = f"{seconds:g} s snapped to {frames} frames ({frames / FPS:.3f} s): the video VAE needs 17n + 5 frames."
    return frames, note


def canvas_for_aspect(aspect_w: float, aspect_h: float, short_edge: int = SHORT_EDGE,
                      max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) for an aspect ratio: short edge, area cap, both sides rounded to multiples of 32."""
    if aspect_w <= 0 or aspect_h <= 0:
        raise LayoutError(f"The aspect ratio must be positive, got {aspect_w}:{aspect_h}.")
    ratio = aspect_w / aspect_h
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise LayoutError(f"MiniMax-H3 supports aspect ratios from 1:4 to 4:1, got {aspect_w:g}:{aspect_h:g}.")
    width, height = (short_edge * ratio, float(short_edge)) if ratio >= 1 else (float(short_edge), short_edge / ratio)
    if width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
        width, height = width * scale, height * scale
    m = CANVAS_MULTIPLE
    return max(m, round(height / m) * m), max(m, round(width / m) * m)


def check_canvas(height: int, width: int, max_pixels: int = MAX_PIXELS) -> tuple[int, int, str | None]:
    """Snap a requested canvas to multiples of 32 (nearest) and check aspect and area; returns (h, w, note)."""
    if height <= 0 or width <= 0:
        raise LayoutError(f"Width and height must be positive, got {width}x{height}.")
    m = CANVAS_MULTIPLE
    h, w = max(m, round(height / m) * m), max(m, round(width / m) * m)
    if not MIN_ASPECT <= w / h <= MAX_ASPECT:
        raise LayoutError(f"MiniMax-H3 supports aspect ratios from 1:4 to 4:1, got {width}x{height}.")
    if h * w > max_pixels * 1.02:
        raise LayoutError(
            f"{width}x{height} is larger than the model's canvas budget of {max_pixels} pixels "
            f"(e.g. 1344x768); generate at that size and upscale with SeedVR2.")
    note = None if (h, w) == (height, width) else f"{width}x{height} snapped to {w}x{h} (multiples of 32)."
    return h, w, note


def spatial_grid(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """One aspect-normalised axis: numpy's endpoint=False linspace, reproduced exactly, x 32."""
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, dim // patch, endpoint=False) * SPATIAL_SCALE
    return torch.from_numpy(grid).to(torch.float64)


def frame_grid(latent_h: int, latent_w: int, patch: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) coordinates of one latent frame's rows [rows, 2] and the width axis."""
    s = np.sqrt(latent_h * latent_w)
    hs, ws = spatial_grid(latent_h, patch[0], s), spatial_grid(latent_w, patch[1], s)
    gh, gw = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([gh.reshape(-1), gw.reshape(-1)], dim=-1), ws


def frame_times(num_latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame: origin + 5/3 * (pixel frame it starts at)."""
    spans = torch.tensor([FRAME_RESCALE * FRAMES_PER_LATENT[i % 5] for i in range(num_latent_frames)],
                         dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans.cumsum(0)])[:num_latent_frames]


def last_keyframe_time(num_latent_frames: int, origin: float) -> float:
    # numpy pairwise summation, as the reference computes this anchor (differs in the last ulp past 16 frames).
    spans = np.ones(num_latent_frames, dtype=np.float64) * FRAME_RESCALE
    for offset in range(5):
        spans[offset::5] *= FRAMES_PER_LATENT[offset]
    return origin + float(spans.sum()) - FRAME_RESCALE


@dataclass
class PackedLayout:
    position_ids: torch.Tensor  # [S, 3] float64
    token_tags: torch.Tensor  # [S] long
    video_indices: torch.Tensor  # condition rows first, then target rows
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int
    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[0]

    @property
    def num_text(self) -> int:
        return self.text_indices.numel()

    def to(self, device) -> "PackedLayout":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return PackedLayout(**moved)


def build_layout(text_tags: torch.Tensor, num_latent_frames: int, latent_height: int, latent_width: int,
                 num_audio_latents: int, patch: tuple[int, int] = (2, 2), keyframes: tuple[str, ...] = (),
                 media_origin: float | None = None, time_shift: float = 0.0, guide_frames: int = 0,
                 guide_audio: int = 0) -> PackedLayout:
    """The t2va / fl2va layout, and the extension layout.

    `keyframes` lists fl2va condition blocks in order, each "first" or "last". For extension windows,
    `guide_frames` latent frames and `guide_audio` audio latents of the previous window's tail are frozen
    condition rows sitting at the times of the target's first frames / latents; all media times move by
    `time_shift` rotary units (s * 40/24 for a window starting at pixel frame s) and start at `media_origin`
    (the longest prompt of all windows, so prompt length never moves the clock; default: this text's length).
    """
    rows_per_frame = (latent_height // patch[0]) * (latent_width // patch[1])
    L = text_tags.shape[0]
    origin = float(L) if media_origin is None else float(media_origin)
    media = origin + time_shift
    n_cond = (len(keyframes) + guide_frames) * rows_per_frame
    n_guide_audio = AUDIO_CHANNELS * guide_audio
    n_audio = n_guide_audio + AUDIO_CHANNELS * num_audio_latents
    n_video = num_latent_frames * rows_per_frame
    cond_start, audio_start = L, L + n_cond
    video_start = audio_start + n_audio
    S = video_start + n_video

    pos = torch.zeros(S, 3, dtype=torch.float64)
    pos[:L, 0] = torch.arange(L, dtype=torch.float64)
    grid, wgrid = frame_grid(latent_height, latent_width, patch)
    for i, anchor in enumerate(keyframes):
        if anchor == "first":
            t = origin
        elif anchor == "last":
            t = last_keyframe_time(num_latent_frames, origin)
        else:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
        rows = slice(cond_start + i * rows_per_frame, cond_start + (i + 1) * rows_per_frame)
        pos[rows, 0] = t
        pos[rows, 1:] = grid
    guide_start = cond_start + len(keyframes) * rows_per_frame
    pos[guide_start:audio_start] = _video_positions(frame_times(guide_frames, media), grid)
    _fill_audio(pos[audio_start:audio_start + n_guide_audio], media, guide_audio, wgrid)
    _fill_audio(pos[audio_start + n_guide_audio:video_start], media, num_audio_latents, wgrid)
    pos[video_start:] = _video_positions(frame_times(num_latent_frames, media), grid)

    video_indices = torch.cat([torch.arange(cond_start, audio_start), torch.arange(video_start, S)])
    audio_indices = torch.arange(audio_start, video_start)
    text_indices = torch.arange(L)
    tags = torch.empty(S, dtype=torch.long)
    tags[text_indices] = text_tags.long()
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(pos, tags, video_indices, audio_indices, text_indices, n_cond, n_guide_audio,
                        num_latent_frames, latent_height, latent_width, num_audio_latents)


@dataclass(frozen=True)
class ReferenceBlock:
    """One reference's rows in a ref2va layout, in packed order."""
    kind: str  # "image" | "video" | "audio"
    latent_frames: int = 0  # image: 1; video: its 5n+2 latent frames; audio: 0
    latent_height: int = 0  # its own latent grid (image and video references have their own resolution)
    latent_width: int = 0
    audio_latents: int = 0  # standalone audio, or a video's own soundtrack: latents per channel (0 = silent video)

    def __post_init__(self):
        if self.kind == "audio":
            if self.audio_latents < 1 or self.latent_frames:
                raise ValueError(f"An audio reference needs audio latents and no video frames, got {self}.")
            return
        if self.kind not in ("image", "video"):
            raise ValueError(f"A reference must be 'image', 'video' or 'audio', got {self.kind!r}.")
        if self.latent_height < 1 or self.latent_width < 1:
            raise ValueError(f"An {self.kind} reference needs a positive latent grid, got {self}.")
        if self.kind == "image" and (self.latent_frames != 1 or self.audio_latents):
            raise ValueError(f"An image reference is one latent frame without audio, got {self}.")
        if self.kind == "video" and (self.latent_frames < 2 or (self.latent_frames - 2) % LATENTS_PER_CHUNK
                                     or self.audio_latents < 0):
            raise ValueError(f"A video reference needs 5n + 2 latent frames (17n + 5 frames), got {self}.")

    def clock_advance(self) -> float:
        if self.kind == "image":
            return 1.0  # one integer rotary slot, not a latent frame's 5/3 units
        if self.kind == "audio":
            return float(self.audio_latents)
        # Python's builtin sum, exactly as diffusers sums this span (sequential up to 3.11, compensated from 3.12):
        # it differs in the last ulp from numpy's pairwise sum (last_keyframe_time) past 16 latent frames.
        span = sum(FRAME_RESCALE * FRAMES_PER_LATENT[i % 5] for i in range(self.latent_frames))
        return max(float(self.audio_latents), span)


def build_ref2va_layout(text_tags: torch.Tensor, blocks: Sequence[ReferenceBlock], num_latent_frames: int,
                        latent_height: int, latent_width: int, num_audio_latents: int,
                        patch: tuple[int, int] = (2, 2)) -> PackedLayout:
    """The ref2va layout: `[text | reference blocks in order | target audio | target video]` (§2.3).

    Each block starts at the shared clock (from L) and advances it. A video's soundtrack rows come right before its
    frames, pinned to the video's own width extremes; a standalone audio is pinned to the target's.
    """
    L = text_tags.shape[0]
    text_pos = torch.zeros(L, 3, dtype=torch.float64)
    text_pos[:, 0] = torch.arange(L, dtype=torch.float64)
    pieces, video, audio = [text_pos], [], []
    cursor, clock = L, float(L)
    target_grid, target_wgrid = frame_grid(latent_height, latent_width, patch)

    def place(audio_latents, frames, grid, wgrid):
        nonlocal cursor
        audio_pos = torch.zeros(AUDIO_CHANNELS * audio_latents, 3, dtype=torch.float64)
        _fill_audio(audio_pos, clock, audio_latents, wgrid)
        video_pos = _video_positions(frame_times(frames, clock), grid)
        for rows, indices in ((audio_pos, audio), (video_pos, video)):
            pieces.append(rows)
            indices.append(torch.arange(cursor, cursor + rows.shape[0]))
            cursor += rows.shape[0]

    for block in blocks:
        if block.kind == "audio":
            place(block.audio_latents, 0, target_grid, target_wgrid)
        else:
            place(block.audio_latents, block.latent_frames, *frame_grid(block.latent_height, block.latent_width, patch))
        clock += block.clock_advance()
    n_cond_video, n_cond_audio = sum(map(len, video)), sum(map(len, audio))
    place(num_audio_latents, num_latent_frames, target_grid, target_wgrid)

    pos = torch.cat(pieces)
    video_indices, audio_indices, text_indices = torch.cat(video), torch.cat(audio), torch.arange(L)
    tags = torch.empty(pos.shape[0], dtype=torch.long)
    tags[text_indices] = text_tags.long()
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(pos, tags, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio,
                        num_latent_frames, latent_height, latent_width, num_audio_latents)


def _video_positions(times: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    pos = torch.empty(times.numel(), grid.shape[0], 3, dtype=torch.float64)
    pos[:, :, 0] = times[:, None]
    pos[:, :, 1:] = grid[None]
    return pos.reshape(-1, 3)


def _fill_audio(pos: torch.Tensor, start: float, num_latents: int, wgrid: torch.Tensor) -> None:
    """Channel-major stereo rows: t = start + j, h = 0, w pinned to the grid's left / right column."""
    pos[:, 0] = (start + torch.arange(num_latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    pos[:num_latents, 2] = float(wgrid[0])
    pos[num_latents:, 2] = float(wgrid[-1])


def row_timesteps(layout: PackedLayout, t_video, t_audio, t_text: float | None = None,
                  t_cond_video: float | None = None,
                  t_cond_audio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row timesteps reduced to (distinct sorted timesteps [M], index of each row [S]).

    `t_video` / `t_audio` are one value for all generated rows or one per generated row (masked edits); text rows
    take `t_text` (default: `t_video`), visual condition rows `max(t_text, 0.999)`, audio references `t_cond_audio`.
    A `t_video` of one row per sample [B, Nv] (training's masked edits, each clip its own mask) gives indices
    [B, S].
    """
    if t_text is None:
        t_text = float(t_video)
    if t_cond_video is None:
        t_cond_video = max(t_text, CONDITION_TIMESTEP)
    t_video = torch.as_tensor(t_video, dtype=torch.float32).cpu()
    t = torch.full((*t_video.shape[:-1], layout.seq_len) if t_video.ndim == 2 else (layout.seq_len,), t_text,
                   dtype=torch.float32)
    nv, na = layout.num_condition_video_rows, layout.num_condition_audio_rows
    t[..., layout.video_indices[:nv].cpu()] = t_cond_video
    t[..., layout.video_indices[nv:].cpu()] = t_video
    t[..., layout.audio_indices[na:].cpu()] = torch.as_tensor(t_audio, dtype=torch.float32).cpu()
    t[..., layout.audio_indices[:na].cpu()] = t_cond_audio
    return torch.unique(t, sorted=True, return_inverse=True)


def patchify(latents: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """[B, C, T, H, W] -> rows [B, T*(H/2)*(W/2), C*pt*ph*pw], frame-major, features (c, pt, ph, pw)."""
    pt, ph, pw = patch
    B, C, T, H, W = latents.shape
    x = latents.reshape(B, C, T // pt, pt, H // ph, ph, W // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(B, -1, C * pt * ph * pw)


def unpatchify(rows: torch.Tensor, T: int, H: int, W: int, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    pt, ph, pw = patch
    B = rows.shape[0]
    C = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(B, T // pt, H // ph, W // pw, C, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(B, C, T, H, W)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, 2, C, Ta] stereo latents -> channel-major rows [B, 2*Ta, C]."""
    B, ch, C, Ta = latents.shape
    return latents.permute(0, 1, 3, 2).reshape(B, ch * Ta, C)


def unpack_audio(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    B, n, C = rows.shape
    return rows.reshape(B, channels, n // channels, C).permute(0, 1, 3, 2)
