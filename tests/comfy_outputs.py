"""What a shipped workflow's outputs should be, read from the workflow itself, and the checks of an MP4 against it.

`expectation(prompt, node_id, ...)` follows the link into a Preview node back to the node that made its video and
says what that video must be (frame count from the seconds widgets and the 17n + 5 grid at 24 fps, size rules,
sound). `caption_problems(...)` scores a text-to-video clip of the embedded default against its prompt.
`edit_regions(...)` rebuilds the mask an edit workflow regenerates from its mask nodes (Mask Track Box
keyframes, mask PNGs, grow / feather / frame range), and `edit_change(...)` measures how much an edit changed the
source inside that mask and how much it kept outside.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from engine.io.video import read_audio
from training.captions import parse_caption
from training.scoring import NAMED_CHECKS, colour_labels, score_clip
from training.toy_scene import COLOURS

FPS = 24
ANALYSIS_WIDTH = 336  # edit checks decode frames at most this wide (a 1344x768 source -> 336x192)
# Pixels of the edited clip around the mask's edge that count as neither inside nor outside: the engine regenerates
# whole 16-px latent cells, and the video VAE spreads a little across cell borders.
INSIDE_MARGIN_PX = 4
OUTSIDE_MARGIN_PX = 24
# Frames around a frame-range mask's first and last frame left out of the comparison (4 frames per latent).
EDGE_MARGIN_FRAMES = 8


@dataclass
class Clip:
    frames: int
    fps: float
    width: int
    height: int
    audio_s: float  # 0 without an audio stream
    pixels: np.ndarray | None = None  # uint8 [F, h, w, 3] at most ANALYSIS_WIDTH wide, when decoded for analysis


def read_mp4(data: bytes, analysis: bool = False) -> Clip:
    with av.open(io.BytesIO(data)) as container:
        video = container.streams.video[0]
        audio_s = 0.0
        if container.streams.audio:
            sound = container.streams.audio[0]
            audio_s = float(sound.duration * sound.time_base) if sound.duration else container.duration / 1e6
        width, height, fps = video.codec_context.width, video.codec_context.height, float(video.average_rate)
        small_w = min(width, ANALYSIS_WIDTH)
        small_h = round(height * small_w / width)
        frames, pixels = 0, []
        for frame in container.decode(video=0):
            frames += 1
            if analysis:
                pixels.append(frame.reformat(small_w, small_h, format="rgb24").to_ndarray())
    return Clip(frames, fps, width, height, audio_s, np.stack(pixels) if analysis else None)


def prompt_of_plain_t2va(prompt: dict, link) -> str | None:
    """The prompt of the text-to-video node the link comes from when nothing but text conditions it (no keyframes,
    no references): a clip the toy world's scoring can judge against its caption."""
    _, node = source_node(prompt, link)
    if node["class_type"] != "H3ForgeTextToVideo":
        return None
    if any(k in node["inputs"] for k in ("first_frame", "last_frame", "references")):
        return None
    return node["inputs"]["prompt"]


def caption_problems(clip: Clip, mp4: bytes, caption: str) -> tuple[list[str], dict[str, bool]]:
    """A clip of the embedded default (decoded for analysis) scored against its caption from its frames and sound
    (training/scoring.py): its NAMED_CHECKS must pass; all checks are returned as well."""
    sound, rate = read_audio(mp4)
    checks = {k: bool(v) for k, v in score_clip(clip.pixels, sound, caption, sample_rate=rate)["checks"].items()}
    missed = [k for k in NAMED_CHECKS if not checks.get(k, True)]
    return ([f"does not show its prompt {caption!r}: {', '.join(missed)} check(s) failed"] if missed else []), checks


def grid_frames(seconds: float) -> int:
    """Frames of a clip of `seconds`, snapped up to the 17n + 5 grid at 24 fps (5 s -> 124, 15 s -> 362)."""
    return math.ceil((seconds * FPS - 5) / 17) * 17 + 5


@dataclass
class Expect:
    what: str
    frames: tuple[int, int]  # inclusive range
    fps: float
    audio: bool
    size: tuple[int, int] | None = None  # exact (width, height)
    aspect: float | None = None  # width / height, within 5 %
    short_side: int | None = None
    min_short_side: int | None = None
    multiple_of: int = 1

    def problems(self, clip: Clip) -> list[str]:
        out = []
        lo, hi = self.frames
        if not lo <= clip.frames <= hi:
            out.append(f"{clip.frames} frames, expected {lo if lo == hi else f'{lo}..{hi}'}")
        if abs(clip.fps - self.fps) > 0.01:
            out.append(f"{clip.fps:g} fps, expected {self.fps:g}")
        if self.audio and clip.audio_s < 0.5 * clip.frames / max(clip.fps, 1):
            out.append(f"no sound (audio stream of {clip.audio_s:.2f} s)")
        if not self.audio and clip.audio_s:
            out.append(f"an audio track of {clip.audio_s:.2f} s where none was expected")
        if self.size and (clip.width, clip.height) != self.size:
            out.append(f"{clip.width}x{clip.height}, expected {self.size[0]}x{self.size[1]}")
        if self.aspect and abs(clip.width / clip.height / self.aspect - 1) > 0.05:
            out.append(f"{clip.width}x{clip.height} is not {self.aspect:.3f}:1")
        if self.short_side and min(clip.width, clip.height) != self.short_side:
            out.append(f"{clip.width}x{clip.height}: short side is not {self.short_side}")
        if self.min_short_side and min(clip.width, clip.height) < self.min_short_side:
            out.append(f"{clip.width}x{clip.height}: short side below {self.min_short_side}")
        if clip.width % self.multiple_of or clip.height % self.multiple_of:
            out.append(f"{clip.width}x{clip.height} is not a multiple of {self.multiple_of}")
        return [f"{self.what}: {p}" for p in out]


ASPECTS = {"16:9": 16 / 9, "9:16": 9 / 16, "1:1": 1.0, "4:3": 4 / 3, "3:4": 3 / 4, "21:9": 21 / 9}
RESOLUTIONS = {"1080p": 1080, "2K": 1440, "4K": 2160}


def source_node(prompt: dict, link) -> tuple[str, dict]:
    return link[0], prompt[link[0]]


def expectation(prompt: dict, link, source_clips: dict[str, Clip], real_weights: bool = True) -> Expect:
    """What the VIDEO coming out of `link` ([node id, slot]) must be. `source_clips`: the input videos by file name
    (for LoadVideo, and for the nodes that keep their source's length, rate or sound)."""
    made_by, node = source_node(prompt, link)
    kind, inputs = node["class_type"], node["inputs"]
    what = f"{kind} (node {made_by})"
    if kind == "LoadVideo":
        clip = source_clips[inputs["file"]]
        return Expect(what, (clip.frames, clip.frames), clip.fps, clip.audio_s > 0, size=(clip.width, clip.height),
                      aspect=clip.width / clip.height)
    if kind == "H3ForgeTextToVideo":
        frames = grid_frames(inputs["seconds"])
        aspect = ASPECTS.get(inputs["aspect"])
        if aspect is None:  # auto: the first frame's proportions (the example keyframes are 1344x768), else 16:9
            aspect = 1344 / 768 if "first_frame" in inputs else 16 / 9
        return Expect(what, (frames, frames), FPS, True, aspect=aspect, multiple_of=32)
    if kind == "H3ForgeExtendVideo":
        before = expectation(prompt, inputs["source"], source_clips, real_weights)
        add = round(inputs["seconds"] * FPS)  # the last window ends on the 17n + 5 grid: up to 16 frames more
        return Expect(what, (before.frames[0] + add, before.frames[1] + add + 16), FPS, True, aspect=before.aspect,
                      multiple_of=32)
    if kind == "H3ForgeMaskedEdit":
        before = expectation(prompt, inputs["source"], source_clips, real_weights)
        return Expect(what, before.frames, FPS, True, aspect=before.aspect, multiple_of=32)
    if kind == "H3ForgeUpscale":
        before = expectation(prompt, inputs["source"], source_clips, real_weights)
        # The embedded default maps the named resolutions to its small canvas (1080p: a 144-px short edge), so there
        # only "larger than the source" is checked.
        short = RESOLUTIONS.get(inputs["resolution"]) if real_weights else None
        larger = None if real_weights or before.size is None else min(before.size) + 1
        return Expect(what, before.frames, before.fps, before.audio, aspect=before.aspect, short_side=short,
                      min_short_side=larger, multiple_of=2)
    if kind == "CreateVideo":
        frames = image_frames(prompt, inputs["images"], source_clips, real_weights)
        return Expect(what, frames, float(inputs["fps"]), "audio" in inputs)
    raise AssertionError(f"no expectation for a video from {kind}: add one to tests/comfy_outputs.py")


def image_frames(prompt: dict, link, source_clips: dict[str, Clip], real_weights: bool) -> tuple[int, int]:
    """Frame count of an IMAGE batch: a Mask Preview overlay has its video's frames."""
    _, node = source_node(prompt, link)
    if node["class_type"] == "H3ForgeMaskPreview" and "video" in node["inputs"]:
        return expectation(prompt, node["inputs"]["video"], source_clips, real_weights).frames
    raise AssertionError(f"no frame count for images from {node['class_type']}: add it to tests/comfy_outputs.py")


# ---- edit regions ---------------------------------------------------------------------------------------------

_KEYFRAME = re.compile(r"^\s*(\d+)\s*:\s*([-\d.]+)\s*,\s*([-\d.]+)\s*,\s*([-\d.]+)\s*,\s*([-\d.]+)\s*$")


def track_boxes(text: str, frames: int) -> np.ndarray:
    """[frames, 4] boxes from Mask Track Box keyframe lines, linear between keyframes, held outside them."""
    keys = sorted((int(m.group(1)), [float(v) for v in m.groups()[1:]])
                  for m in map(_KEYFRAME.match, text.splitlines()) if m)
    at = np.array([k for k, _ in keys], float)
    boxes = np.array([b for _, b in keys], float)
    return np.stack([np.interp(np.arange(frames), at, boxes[:, i]) for i in range(4)], 1)


def load_mask_png(path: Path, channel: str, width: int, height: int) -> np.ndarray:
    image = Image.open(path)
    band = image.convert("RGBA").getchannel({"red": "R", "green": "G", "blue": "B", "alpha": "A"}[channel])
    return np.asarray(band.resize((width, height), Image.NEAREST)) > 127


def edit_regions(prompt: dict, edit_id: str, input_dir: Path, frames: int, width: int, height: int):
    """(mask [F, H, W] bool at the source's size, spread_px): the shape the edit's mask chain starts from and how
    far grow/feather nodes push its edge out."""
    spread, link = 0, prompt[edit_id]["inputs"]["mask"]
    frame_range = None
    while True:
        _, node = source_node(prompt, link)
        kind, inputs = node["class_type"], node["inputs"]
        if kind in ("H3ForgeMaskGrow", "H3ForgeMaskFeather"):
            spread += max(int(inputs["pixels"]), 0)
            link = inputs["mask"]
        elif kind == "H3ForgeMaskFrameRange":
            frame_range = (int(inputs["start"]), int(inputs["end"]) or frames)
            link = inputs["mask"]
        elif kind == "H3ForgeMaskTrackBox":
            sx, sy = width / inputs["width"], height / inputs["height"]
            boxes = track_boxes(inputs["keyframes"], frames) * np.array([sx, sy, sx, sy])
            cols, rows = np.arange(width), np.arange(height)
            x0, y0 = boxes[:, 0].round(), boxes[:, 1].round()
            x1, y1 = (boxes[:, 0] + boxes[:, 2]).round(), (boxes[:, 1] + boxes[:, 3]).round()
            inside_x = (cols[None] >= x0[:, None]) & (cols[None] < x1[:, None])
            inside_y = (rows[None] >= y0[:, None]) & (rows[None] < y1[:, None])
            mask = inside_y[:, :, None] & inside_x[:, None, :]
            break
        elif kind == "LoadImageMask":
            shape = load_mask_png(input_dir / inputs["image"], inputs["channel"], width, height)
            mask = np.broadcast_to(shape, (frames, height, width)).copy()
            break
        else:
            raise AssertionError(f"edit mask from {kind}: add it to tests/comfy_outputs.edit_regions")
    if frame_range is not None:
        start, stop = frame_range
        mask[:start] = False
        mask[stop:] = False
    return mask, spread, frame_range


def _dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    if radius <= 0:
        return mask
    return F.max_pool2d(mask.float()[:, None], 2 * radius + 1, stride=1, padding=radius)[:, 0] > 0


def _at_output_size(source: np.ndarray, output: np.ndarray, mask: np.ndarray):
    """Source and output frames (float [F, 3, h, w]) and the mask (bool [F, h, w]) at the output's size, over the
    frames both have."""
    count = min(len(source), len(output))
    h, w = output.shape[1:3]
    src = torch.from_numpy(np.ascontiguousarray(source[:count])).permute(0, 3, 1, 2).float()
    if src.shape[-2:] != (h, w):
        src = F.interpolate(src, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    out = torch.from_numpy(np.ascontiguousarray(output[:count])).permute(0, 3, 1, 2).float()
    m = F.interpolate(torch.from_numpy(mask[:count]).float()[:, None], size=(h, w), mode="nearest")[:, 0] > 0
    return src, out, m


def replacement_fill(source: np.ndarray, output: np.ndarray, mask: np.ndarray, caption: str) -> tuple[str, float]:
    """Issue 18's replacement check on a workflow's output: the colour the prompt names that the source does not
    show (the new object's), and the share of the former object's pixels (the source's object colours inside the
    mask) that the output shows in it."""
    src, out, m = _at_output_size(source, output, mask)
    before = colour_labels(src.round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy())
    after = colour_labels(out.byte().permute(0, 2, 3, 1).numpy())
    former = m.numpy() & (before >= 0) & (before < len(COLOURS))
    names, seen = list(COLOURS), np.bincount(before[before >= 0].ravel(), minlength=len(COLOURS))
    shown = {name for name, count in zip(names, seen) if count >= 0.01 * former.sum()}  # not a stray edge pixel
    (colour,) = [o.colour for o in parse_caption(caption).objects if o.colour not in shown]
    return colour, float((after[former] == names.index(colour)).mean())


def edit_change(source: np.ndarray, output: np.ndarray, output_width: int, mask: np.ndarray, spread_px: int,
                frame_range: tuple[int, int] | None) -> dict:
    """Mean absolute difference (0..255) between source and output frames inside the mask (shrunk by the edge
    margin) and outside it (the mask grown by its spread and the margin; every frame outside a frame range).
    Frames are compared at the output's analysis size; `mask` is at the source's full size and `spread_px` in
    source pixels."""
    src, out, m = _at_output_size(source, output, mask)
    count, w = len(m), m.shape[2]
    diff = (src - out).abs().mean(1)  # [F, h, w]
    scale = w / output_width  # analysis pixels per output pixel
    spread = round(spread_px * w / mask.shape[2])
    inside = ~_dilate(~m, round(INSIDE_MARGIN_PX * scale))
    outside = ~_dilate(m, spread + round(OUTSIDE_MARGIN_PX * scale))
    if frame_range is not None:  # frames next to where the range starts or stops are neither
        start, stop = frame_range
        for edge in (start, stop):
            if 0 < edge < count:
                lo, hi = max(edge - EDGE_MARGIN_FRAMES, 0), min(edge + EDGE_MARGIN_FRAMES, count)
                inside[lo:hi] = False
                outside[lo:hi] = False
    assert inside.any() and outside.any(), "the mask leaves no inside or no outside to compare"
    return {"inside": float(diff[inside].mean()), "outside": float(diff[outside].mean()),
            "inside_px": int(inside.sum()), "outside_px": int(outside.sum()), "frames": count}
