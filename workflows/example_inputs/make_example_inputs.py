"""Writes the example inputs the shipped workflows load (run from the repository root, with the engine extra):

    python workflows/example_inputs/make_example_inputs.py

One drawn scene at MiniMax-H3's real canvas, 1344x768 at 24 fps: a blue sky over green grass, a red ball rolling
right across the grass (humming, panned with it) and a yellow box standing still on the right.
- h3_source.mp4: 124 frames (5.2 s) with its sound; the edit workflows' source. The removal workflow's Mask Track
  Box follows the ball (BALL_TRACK), the replacement workflow's object_mask.png covers the box, the repaint
  workflow's sky_mask.png (drawn at half size) covers the sky.
- first_frame.png / last_frame.png: the scene with the ball at the left / at the right (first/last-frame workflow).
- clip.mp4: the same scene, 2 s at 128x72 (the SeedVR2 upscale workflow's input: on the embedded default, 1080p
  means a 144-px short edge, twice this).
Everything is drawn from numbers here, so the files are the same on every run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from engine.io.video import encode_mp4_bytes  # noqa: E402

WIDTH, HEIGHT, FPS, FRAMES = 1344, 768, 24, 124
SAMPLE_RATE = 32000
HORIZON = 400  # sky above, grass below
BALL_RADIUS = 90
BALL_Y = 560
BALL_X = (420, 860)  # centre at the first and the last frame
BOX = (1000, 520, 180, 140)  # x, y, width, height
HUM_HZ = 220.0
# The ball's box (x, y, width, height) at the first and the last frame, for Mask Track Box.
BALL_TRACK = {0: (BALL_X[0] - 100, BALL_Y - 100, 200, 200), FRAMES - 1: (BALL_X[1] - 100, BALL_Y - 100, 200, 200)}


def ball_x(frame: int, frames: int = FRAMES) -> float:
    return BALL_X[0] + (BALL_X[1] - BALL_X[0]) * frame / (frames - 1)


def scene(cx: float, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """uint8 [height, width, 3] of the scene with the ball centred at x = cx (in 1344x768 coordinates)."""
    sy, sx = height / HEIGHT, width / WIDTH
    y = (np.arange(height)[:, None] + 0.5) / sy
    x = (np.arange(width)[None, :] + 0.5) / sx
    sky = np.stack([90 + 60 * y / HORIZON, 150 + 50 * y / HORIZON, np.full_like(y, 235)], -1)
    grass = np.stack([np.full_like(y, 60), 150 - 40 * (y - HORIZON) / (HEIGHT - HORIZON), np.full_like(y, 50)], -1)
    image = np.where((y < HORIZON)[..., None], sky, grass) * np.ones((1, width, 1))
    bx, by, bw, bh = BOX
    image[(x >= bx) & (x < bx + bw) & (y >= by) & (y < by + bh)] = (235, 200, 40)
    image[(x - cx) ** 2 + (y - BALL_Y) ** 2 < BALL_RADIUS ** 2] = (210, 40, 40)
    return image.round().clip(0, 255).astype(np.uint8)


def soundtrack(frames: int) -> np.ndarray:
    """float32 [2, S]: the ball's hum, panned with its x position."""
    t = np.arange(round(frames / FPS * SAMPLE_RATE)) / SAMPLE_RATE
    hum = 0.3 * np.sin(2 * np.pi * HUM_HZ * t)
    pan = (ball_x(0, frames) + (BALL_X[1] - BALL_X[0]) * t * FPS / (frames - 1)) / WIDTH
    return np.stack([hum * (1 - pan), hum * pan]).astype(np.float32)


def mask_png(box: tuple[int, int, int, int], scale: float = 1.0) -> Image.Image:
    """White inside `box` (1344x768 coordinates) on black, drawn at `scale` times the canvas."""
    x, y, w, h = (round(v * scale) for v in box)
    mask = np.zeros((round(HEIGHT * scale), round(WIDTH * scale)), np.uint8)
    mask[y:y + h, x:x + w] = 255
    return Image.fromarray(mask).convert("RGB")


def main(out: Path = HERE) -> None:
    frames = np.stack([scene(ball_x(i)) for i in range(FRAMES)])
    (out / "h3_source.mp4").write_bytes(encode_mp4_bytes(frames, FPS, soundtrack(FRAMES), SAMPLE_RATE, crf=20))
    Image.fromarray(frames[0]).save(out / "first_frame.png", optimize=True)
    Image.fromarray(frames[-1]).save(out / "last_frame.png", optimize=True)
    bx, by, bw, bh = BOX
    mask_png((bx - 10, by - 10, bw + 20, bh + 20)).save(out / "object_mask.png", optimize=True)
    # Drawn at half size, as masks painted on a preview often are: the engine resizes a mask to its video.
    mask_png((0, 0, WIDTH, HORIZON), scale=0.5).save(out / "sky_mask.png", optimize=True)
    clip_frames = 2 * FPS
    clip = np.stack([scene(ball_x(i, clip_frames), 128, 72) for i in range(clip_frames)])
    (out / "clip.mp4").write_bytes(encode_mp4_bytes(clip, FPS, soundtrack(clip_frames), SAMPLE_RATE, crf=18))


if __name__ == "__main__":
    main()
