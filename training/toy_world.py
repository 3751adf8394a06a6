"""The toy world generator: `render(scene)` -> a `ToyClip` of frames, stereo audio, caption and ground truth.

Renders any canvas (default the embedded 224x128) and length (default 5 s, 17n + 5 frames at 24 fps, stereo
32 kHz). Objects are drawn anti-aliased: each pixel's coverage is a one-pixel ramp across the shape's signed
distance, so edges blend two flat colours and a 2x render is the same picture at double resolution.
Deterministic: the same scene gives the same clip, and a longer render starts with a shorter one's frames.
Numpy only (no torch, no engine); a 5 s 224x128 clip takes well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.captions import caption
from training.toy_scene import (
    BACKGROUNDS, BOUNDING_RADIUS, BOX_HALF_SIDE, COLOURS, DEFAULT_HEIGHT, DEFAULT_SECONDS, DEFAULT_WIDTH, FPS, HORIZON, SAMPLE_RATE,
    TRIANGLE_HEIGHT, Scene, centroid_px, contact_times, size_px)
from training.toy_sound import mix

CLIP_LENGTH, CLIP_OFFSET = 17, 5  # the video VAE's frame rule: 17n + 5
MAX_FRAMES = 362  # 15 s snapped up to 17n + 5, the longest window
FRAMES_PER_CHUNK = 32  # frames drawn at once: bounds memory at large canvases


@dataclass(frozen=True, eq=False)
class ToyClip:
    scene: Scene
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray  # float32 [2, S] at SAMPLE_RATE, S = round(F / FPS * SAMPLE_RATE)
    caption: str
    masks: np.ndarray  # bool [K, F, H, W]: each object's visible pixels (coverage >= 1/2, after occlusion)
    centroids: np.ndarray  # float32 [K, F, 2]: each object's (x, y) centroid in pixels (whole shape)
    contact_frames: tuple[tuple[int, ...], ...]  # per object: frames of its floor bounces and wall hits

    @property
    def click_frames(self) -> tuple[int, ...]:
        """Every frame with a click in the audio: one per contact."""
        return tuple(sorted(f for frames in self.contact_frames for f in frames))

    @property
    def background(self) -> str:
        return self.scene.background

    @property
    def pitches_hz(self) -> tuple[float, ...]:
        return tuple(o.pitch_hz for o in self.scene.objects)


def frames_for_seconds(seconds: float) -> int:
    """The 17n + 5 frame count that covers `seconds` at 24 fps (5 s -> 124, 15 s -> 362)."""
    frames = max(1, int(round(seconds * FPS)))
    return frames + (CLIP_OFFSET - frames) % CLIP_LENGTH


def background_image(name: str, width: int, height: int) -> np.ndarray:
    """float32 [H, W, 3]; the horizon row blends by how much of it the ground covers."""
    above, below = (np.asarray(c, np.float32) for c in BACKGROUNDS[name])
    ground = np.clip(np.arange(height, dtype=np.float32) + 1 - HORIZON * height, 0, 1)[:, None, None]
    return np.broadcast_to(above + ground * (below - above), (height, width, 3)).astype(np.float32)


def _coverage(shape: str, dx: np.ndarray, dy: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Share of each pixel the shape covers, from its signed distance (pixels, negative inside)."""
    if shape == "ball":
        distance = np.hypot(dx, dy) - s
    elif shape == "box":
        distance = np.maximum(np.abs(dx), np.abs(dy)) - BOX_HALF_SIDE * s
    else:  # an upright triangle around its centroid: base and both slanted edges at the inradius
        slanted = np.sqrt(3) / 2 * np.abs(dx) - dy / 2
        distance = np.maximum(slanted, dy) - TRIANGLE_HEIGHT / 3 * s
    return np.clip(0.5 - distance, 0.0, 1.0)


def _box(centre: np.ndarray, reach: np.ndarray, limit: int) -> slice:
    """Pixel rows or columns that a shape can touch during a chunk of frames."""
    lo = int(np.clip(np.floor((centre - reach).min()) - 1, 0, limit))
    return slice(lo, int(np.clip(np.ceil((centre + reach).max()) + 1, lo, limit)))


def _draw(scene: Scene, centroids: np.ndarray, sizes: np.ndarray, width: int, height: int):
    """Frames uint8 [F, H, W, 3] and visible masks bool [K, F, H, W]; shapes are drawn only inside their boxes."""
    num_frames = centroids.shape[1]
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    frames[:] = np.round(background_image(scene.background, width, height))
    masks = np.zeros((len(scene.objects), num_frames, height, width), bool)
    for start in range(0, num_frames, FRAMES_PER_CHUNK):
        chunk = slice(start, min(start + FRAMES_PER_CHUNK, num_frames))
        drawn = []
        for k, obj in enumerate(scene.objects):
            cx, cy, s = centroids[k, chunk, 0], centroids[k, chunk, 1], sizes[k, chunk]
            reach = BOUNDING_RADIUS[obj.shape] * s
            rows, cols = _box(cy, reach, height), _box(cx, reach, width)
            dx = np.arange(cols.start, cols.stop, dtype=np.float32)[None, None, :] + 0.5 - cx[:, None, None]
            dy = np.arange(rows.start, rows.stop, dtype=np.float32)[None, :, None] + 0.5 - cy[:, None, None]
            cover = _coverage(obj.shape, dx, dy, s[:, None, None])
            region = frames[chunk, rows, cols].astype(np.float32)
            region += cover[..., None] * (np.asarray(COLOURS[obj.colour], np.float32) - region)
            frames[chunk, rows, cols] = np.round(region)
            drawn.append((rows, cols, cover))
        uncovered = np.ones((chunk.stop - chunk.start, height, width), np.float32)
        for k in reversed(range(len(drawn))):  # later objects are drawn on top
            rows, cols, cover = drawn[k]
            masks[k, chunk, rows, cols] = cover * uncovered[:, rows, cols] >= 0.5
            uncovered[:, rows, cols] *= 1 - cover
    return frames, masks


def _sound(scene: Scene, width: int, height: int, num_samples: int) -> np.ndarray:
    t = np.arange(num_samples) / SAMPLE_RATE
    hums = [(o.pitch_hz, centroid_px(o, t, width, height)[0] / width) for o in scene.objects] if scene.humming else []
    clicks = sorted((int(round(tc * SAMPLE_RATE)), float(centroid_px(o, tc, width, height)[0]) / width)
                    for o in scene.objects for tc in contact_times(o, num_samples / SAMPLE_RATE, width, height))
    return mix(hums, clicks, scene.rain, scene.seed, num_samples, SAMPLE_RATE)


def render(scene: Scene, width: int = DEFAULT_WIDTH, height: int = DEFAULT_HEIGHT, seconds: float = DEFAULT_SECONDS,
           num_frames: int | None = None) -> ToyClip:
    """Draw and voice a scene. `num_frames` (any count from 1, e.g. 1 for a keyframe) overrides `seconds`
    (snapped up to 17n + 5)."""
    if not (isinstance(width, (int, np.integer)) and isinstance(height, (int, np.integer)) and min(width, height) >= 16):
        raise ValueError(f"The canvas must be whole pixels, at least 16x16; got {width}x{height}.")
    width, height = int(width), int(height)
    if num_frames is None:
        if not 0 < seconds <= MAX_FRAMES / FPS:
            raise ValueError(f"A toy clip lasts more than 0 and at most 15 s, got {seconds} s.")
        num_frames = frames_for_seconds(seconds)
    if not (isinstance(num_frames, (int, np.integer)) and 1 <= num_frames <= MAX_FRAMES):
        raise ValueError(f"A toy clip has 1 to {MAX_FRAMES} frames (15 s), got {num_frames}.")
    num_frames = int(num_frames)
    t = np.arange(num_frames) / FPS
    centroids = np.stack([np.stack(centroid_px(o, t, width, height), -1) for o in scene.objects]).astype(np.float32)
    sizes = np.stack([size_px(o, t, height) for o in scene.objects]).astype(np.float32)
    frames, masks = _draw(scene, centroids, sizes, width, height)
    num_samples = int(round(num_frames / FPS * SAMPLE_RATE))
    contacts = tuple(
        tuple(min(int(round(tc * FPS)), num_frames - 1) for tc in contact_times(o, num_samples / SAMPLE_RATE,
                                                                                  width, height))
        for o in scene.objects)
    return ToyClip(scene, frames, _sound(scene, width, height, num_samples), caption(scene), masks, centroids,
                   contacts)
