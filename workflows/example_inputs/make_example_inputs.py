"""Writes the example inputs the shipped workflows load (run from the repository root, with the engine extra):

    python workflows/example_inputs/make_example_inputs.py

One toy-world scene (training/toy_world.py, the world the embedded default was trained on) at MiniMax-H3's real
canvas, 1344x768 at 24 fps: "a large red ball moves right and a large yellow box stays still on green grass under
a blue sky, humming" (the hum panned with the ball).
- h3_scene.mp4: 124 frames (5.2 s) with its sound; the edit workflows' source. The removal workflow's Mask Track
  Box follows the ball (BALL_TRACK), the replacement workflow's h3_box_mask.png covers the box, the repaint
  workflow's sky_mask.png (drawn at half size) covers the sky.
- h3_first_frame.png / h3_last_frame.png: its first and last frames (first/last-frame workflow).
- h3_small_clip.mp4: the same scene, 2 s at 112x64, half the embedded canvas (the SeedVR2 upscale workflow's input).
- ref_ball.png / ref_box.png / ref_hum.wav: the reference-to-video workflow's two "characters" (the red ball and a
  blue box, each alone on white at 768x768) and a sound reference (the red ball's hum, 3 s, 32 kHz stereo WAV).
Everything is drawn from numbers here, so the files are the same on every run. The scene's files were renamed
(h3_source.mp4 -> h3_scene.mp4, ...) when its objects moved to where the toy world puts them: the pack never
overwrites a file of the same name in ComfyUI's input folder, so an older copy there is simply no longer used.
"""

from __future__ import annotations

import sys
import wave
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from engine.io.video import encode_mp4_bytes  # noqa: E402
from training.toy_scene import HORIZON, PITCHES_HZ, SAMPLE_RATE, Scene, ToyObject  # noqa: E402
from training.toy_sound import hum  # noqa: E402
from training.toy_world import render  # noqa: E402

WIDTH, HEIGHT, FPS, FRAMES = 1344, 768, 24, 124
# Where the toy world puts two objects (mid-height, in their slots; training/toy_scene.py), so the embedded default
# knows the scene: stood on the grass, a still box is a place it was never trained on and a replacement draws none.
SCENE = Scene((ToyObject("ball", "red", "large", "moves right", x=0.25, y=0.5, speed=0.06),
               ToyObject("box", "yellow", "large", "stays still", x=0.75, y=0.5)),
              "green grass under a blue sky", humming=True, rain=False, seed=1)


def track_box(clip, frame: int, margin: int = 16) -> tuple[int, int, int, int]:
    """The ball's bounding box (x, y, width, height) at `frame`, from the renderer's mask, with a margin."""
    ys, xs = np.nonzero(clip.masks[0, frame])
    x0, y0 = int(xs.min()) - margin, int(ys.min()) - margin
    return x0, y0, int(xs.max()) + margin - x0, int(ys.max()) + margin - y0


SOURCE = render(SCENE, WIDTH, HEIGHT, num_frames=FRAMES)
# The ball's box at the first and the last frame, for Mask Track Box.
BALL_TRACK = {0: track_box(SOURCE, 0), FRAMES - 1: track_box(SOURCE, FRAMES - 1)}
_ys, _xs = np.nonzero(SOURCE.masks[1, 0])
BOX = (int(_xs.min()), int(_ys.min()), int(_xs.max() - _xs.min() + 1), int(_ys.max() - _ys.min() + 1))


def mask_png(box: tuple[int, int, int, int], scale: float = 1.0) -> Image.Image:
    """White inside `box` (1344x768 coordinates) on black, drawn at `scale` times the canvas."""
    x, y, w, h = (round(v * scale) for v in box)
    mask = np.zeros((round(HEIGHT * scale), round(WIDTH * scale)), np.uint8)
    mask[y:y + h, x:x + w] = 255
    return Image.fromarray(mask).convert("RGB")


def main(out: Path = HERE) -> None:
    frames = SOURCE.frames
    (out / "h3_scene.mp4").write_bytes(encode_mp4_bytes(frames, FPS, SOURCE.audio, SAMPLE_RATE, crf=20))
    Image.fromarray(frames[0]).save(out / "h3_first_frame.png", optimize=True)
    Image.fromarray(frames[-1]).save(out / "h3_last_frame.png", optimize=True)
    bx, by, bw, bh = BOX
    mask_png((bx - 10, by - 10, bw + 20, bh + 20)).save(out / "h3_box_mask.png", optimize=True)
    # Drawn at half size, as masks painted on a preview often are: the engine resizes a mask to its video.
    mask_png((0, 0, WIDTH, round(HORIZON * HEIGHT)), scale=0.5).save(out / "sky_mask.png", optimize=True)
    clip = render(SCENE, 112, 64, num_frames=2 * FPS)
    (out / "h3_small_clip.mp4").write_bytes(encode_mp4_bytes(clip.frames, FPS, clip.audio, SAMPLE_RATE, crf=18))
    for name, thing in (("ref_ball.png", ToyObject("ball", "red", "large", "stays still", x=0.5, y=0.5)),
                        ("ref_box.png", ToyObject("box", "blue", "large", "stays still", x=0.5, y=0.5))):
        still = render(Scene((thing,), "white", humming=False, rain=False, seed=2), 768, 768, num_frames=1)
        Image.fromarray(still.frames[0]).save(out / name, optimize=True)
    sound = np.round(hum(PITCHES_HZ["red"], 3 * SAMPLE_RATE, SAMPLE_RATE) * 32767).astype("<i2")
    with wave.open(str(out / "ref_hum.wav"), "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(np.repeat(sound[:, None], 2, axis=1).tobytes())


if __name__ == "__main__":
    main()
