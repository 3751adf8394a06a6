"""Video masks for H3Forge Masked Edit: shape a mask over a frame range, grow or shrink it, feather it, track a box
across frames, and preview the exact latent-cell mask the engine will use.

The helpers are pure torch (imported when a node runs; the pack itself loads without torch). Mask Preview reduces
the mask with the engine's own code (engine.models.h3.mask.cell_mask, after engine.models.h3.source.prepare_clip),
so the red cells it draws are the cells the edit regenerates. The nodes are coroutines that do their tensor work on
a worker thread: ComfyUI runs every node on one event loop, whose other nodes' network timers must keep running.
"""

from __future__ import annotations

import asyncio
import re

from .client import EngineError, protocol
from .engine_node import ENGINE_TYPE, connect, readable_error
from .video_io import engine_module, frame_chunks, images_to_uint8, mask_batch, mask_to_uint8, video_media

MAX_SIDE = 8192
MAX_FRAMES = 100000
MAX_PIXELS_GROWN = 512

# ---- shapes ---------------------------------------------------------------------------------------------------

_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX = re.compile(rf"^{_NUMBER},{_NUMBER},{_NUMBER},{_NUMBER}$")
_KEYFRAME = re.compile(r"^\s*(\d+)\s*:(.*)$")


def parse_box(text: str, where: str = "box") -> tuple[float, float, float, float]:
    """"x, y, w, h" in pixels (top-left corner, width, height)."""
    m = _BOX.match(text)
    if m is None:
        raise ValueError(f"H3Forge: {where} ({text.strip()!r}) must be x, y, width, height in pixels, "
                         f"e.g. 120, 80, 200, 160")
    x, y, w, h = (float(v) for v in m.groups())
    if w <= 0 or h <= 0:
        raise ValueError(f"H3Forge: {where} ({text.strip()!r}) needs a positive width and height")
    return x, y, w, h


def parse_keyframes(text: str) -> list[tuple[int, tuple[float, float, float, float]]]:
    """Lines "frame: x, y, w, h" (blank lines and # comments skipped) -> keyframes sorted by frame."""
    keys = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _KEYFRAME.match(line)
        if m is None:
            raise ValueError(f"H3Forge: keyframe line {number} ({line!r}) must look like frame: x, y, width, height "
                             f"(e.g. 0: 120, 80, 200, 160)")
        frame = int(m.group(1))
        if frame in keys:
            raise ValueError(f"H3Forge: frame {frame} has two keyframes (line {number})")
        keys[frame] = parse_box(m.group(2), f"keyframe line {number}")
    if not keys:
        raise ValueError("H3Forge: give at least one keyframe line, frame: x, y, width, height")
    return sorted(keys.items())


def interpolate_boxes(keys, frames: int):
    """Box per frame [frames, 4]: linear between keyframes, held before the first and after the last."""
    import torch

    at = torch.tensor([float(frame) for frame, _ in keys], dtype=torch.float64)
    boxes = torch.tensor([box for _, box in keys], dtype=torch.float64)
    if len(keys) == 1:
        return boxes.expand(frames, 4)
    t = torch.arange(frames, dtype=torch.float64)
    upper = torch.searchsorted(at, t, right=True).clamp(1, len(keys) - 1)
    w = ((t - at[upper - 1]) / (at[upper] - at[upper - 1])).clamp(0, 1)[:, None]
    return boxes[upper - 1] * (1 - w) + boxes[upper] * w


def box_masks(boxes, height: int, width: int):
    """Boxes [F, 4] (x, y, w, h in pixels) -> masks [F, height, width], 1 inside; edges rounded to whole pixels."""
    import torch

    boxes = torch.as_tensor(boxes, dtype=torch.float64)
    x0, y0 = boxes[:, 0].round(), boxes[:, 1].round()
    x1, y1 = (boxes[:, 0] + boxes[:, 2]).round(), (boxes[:, 1] + boxes[:, 3]).round()
    cols, rows = torch.arange(width, dtype=torch.float64), torch.arange(height, dtype=torch.float64)
    inside_x = (cols[None] >= x0[:, None]) & (cols[None] < x1[:, None])
    inside_y = (rows[None] >= y0[:, None]) & (rows[None] < y1[:, None])
    return (inside_y[:, :, None] & inside_x[:, None, :]).float()


# ---- morphology -------------------------------------------------------------------------------------------------


def window_max(x, radius: int, dim: int):
    """Max over [i - radius, i + radius] along `dim` (zero beyond the edges), in O(log radius) passes."""
    import torch
    import torch.nn.functional as F

    x = x.movedim(dim, -1)
    n, length = x.shape[-1], 2 * radius + 1
    y = F.pad(x, (radius, radius))
    span = 1
    while span * 2 <= length:  # y[i] = max over [i, i + 2 * span)
        y = torch.maximum(y[..., :-span], y[..., span:])
        span *= 2
    out = torch.maximum(y[..., :n], y[..., length - span:length - span + n])
    return out.movedim(-1, dim)


def grow_mask(mask, pixels: int):
    """Grow (pixels > 0) or shrink (< 0) every frame of a [B, H, W] mask by `pixels` in each direction (square
    corners). Shrinking keeps the image border: the area outside the frame counts as masked."""
    import torch

    r = abs(int(pixels))
    if r == 0:
        return mask.clone()
    inverse = pixels < 0
    out = torch.empty_like(mask)
    for chunk in frame_chunks(mask):
        x = 1 - mask[chunk] if inverse else mask[chunk]
        x = window_max(window_max(x, r, -1), r, -2)
        out[chunk] = 1 - x if inverse else x
    return out


def box_blur(x, radius: int, dim: int):
    """Mean over [i - radius, i + radius] along `dim`, edges repeated (cumulative sums: any radius, one pass)."""
    import torch.nn.functional as F

    x = x.movedim(dim, -1)
    shape, n = x.shape, x.shape[-1]
    padded = F.pad(x.reshape(-1, 1, n).double(), (radius + 1, radius), mode="replicate")
    total = padded.cumsum(-1)
    out = (total[..., 2 * radius + 1:] - total[..., :n]) / (2 * radius + 1)
    return out.reshape(shape).to(x.dtype).movedim(-1, dim)


def feather_mask(mask, pixels: int):
    """Soften the edges of a [B, H, W] mask so they fade over about `pixels` on each side (two box blurs)."""
    if pixels <= 0:
        return mask.clone()
    import torch

    radius = max(1, round(int(pixels) / 2))
    out = torch.empty_like(mask)
    for chunk in frame_chunks(mask):
        x = mask[chunk]
        for _ in range(2):
            x = box_blur(box_blur(x, radius, -1), radius, -2)
        out[chunk] = x.clamp(0, 1)
    return out


# ---- geometry shared by the shape nodes ---------------------------------------------------------------------------

GEOMETRY_INPUTS = {
    "width": ("INT", {"default": 1344, "min": 16, "max": MAX_SIDE, "tooltip":
              "Mask width in pixels: the video's width. Ignored when a video is connected."}),
    "height": ("INT", {"default": 768, "min": 16, "max": MAX_SIDE, "tooltip":
               "Mask height in pixels: the video's height. Ignored when a video is connected."}),
    "frames": ("INT", {"default": 124, "min": 1, "max": MAX_FRAMES, "tooltip":
               "Number of mask frames: the video's frame count. Ignored when a video is connected."}),
}
VIDEO_GEOMETRY = ("VIDEO", {"tooltip": "Take width, height and frame count from this video (the one to edit)."})


def geometry(width: int, height: int, frames: int, video) -> tuple[int, int, int]:
    """(frames, height, width) of the mask to make."""
    if video is not None:
        width, height = video.get_dimensions()
        frames = video.get_frame_count()
    return int(frames), int(height), int(width)


class H3ForgeMaskFrameRange:
    DESCRIPTION = ("A video mask that is active only on frames start to end: a mask (one for all frames, or one "
                   "per frame) or a box, and nothing on the other frames. For objects that enter or leave.")
    CATEGORY = "H3Forge"
    FUNCTION = "frame_range"
    RETURN_TYPES = ("MASK",)
    RETURN_NAMES = ("mask",)
    OUTPUT_TOOLTIPS = ("One mask per frame [frames, height, width].",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "start": ("INT", {"default": 0, "min": 0, "max": MAX_FRAMES, "tooltip":
                          "First frame where the mask is active (0 = the first frame)."}),
                "end": ("INT", {"default": 0, "min": 0, "max": MAX_FRAMES, "tooltip":
                        "The mask stops before this frame. 0 = it stays active to the last frame."}),
                **GEOMETRY_INPUTS,
            },
            "optional": {
                "mask": ("MASK", {"tooltip":
                         "The shape inside the range: one mask for all frames or one per frame; sets the size."}),
                "box": ("STRING", {"default": "", "tooltip":
                        "Without a mask: a box x, y, width, height in pixels, e.g. 120, 80, 200, 160."}),
                "video": VIDEO_GEOMETRY,
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, start=None, end=None, box=""):
        if start is not None and end is not None and end and end <= start:
            return f"end ({end}) must be after start ({start}), or 0 for the last frame"
        try:
            if box and box.strip():
                parse_box(box)
        except ValueError as error:
            return str(error).removeprefix("H3Forge: ")
        return True

    async def frame_range(self, start, end, width, height, frames, mask=None, box="", video=None):
        return (await asyncio.to_thread(frame_range_mask, start, end, width, height, frames, mask, box, video),)


def frame_range_mask(start: int, end: int, width: int, height: int, frames: int, mask=None, box: str = "",
                     video=None):
    """[frames, H, W]: the mask (or the box) on frames start..end (0 = the last), zero elsewhere."""
    import torch

    count, height, width = geometry(width, height, frames, video)
    if mask is not None:
        shape = mask_batch(mask)
        if shape.shape[0] not in (1, count):
            raise ValueError(f"H3Forge: the mask has {shape.shape[0]} frames but the video has {count}")
    elif box and box.strip():
        shape = box_masks(torch.tensor([parse_box(box)]), height, width)
    else:
        raise ValueError("H3Forge: connect a mask or write a box (x, y, width, height) for the frame range")
    stop = end or count
    if not 0 <= start < stop <= count:
        raise ValueError(f"H3Forge: frames {start} to {stop} do not fit a video of {count} frames")
    out = torch.zeros(count, *shape.shape[1:])
    out[start:stop] = shape.expand(count, -1, -1)[start:stop]
    return out


class H3ForgeMaskTrackBox:
    DESCRIPTION = ("A box that follows an object: give its position at two or more keyframes and it moves in "
                   "straight lines between them (held before the first and after the last). Makes one mask per "
                   "frame for H3Forge Masked Edit.")
    CATEGORY = "H3Forge"
    FUNCTION = "track"
    RETURN_TYPES = ("MASK",)
    RETURN_NAMES = ("mask",)
    OUTPUT_TOOLTIPS = ("One mask per frame [frames, height, width], 1 inside the box.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "keyframes": ("STRING", {"multiline": True, "default": "0: 560, 280, 240, 240\n123: 760, 300, 240, 240",
                              "tooltip": "One line per keyframe: frame: x, y, width, height (pixels, top-left "
                              "corner). Frames count from 0 in the source video."}),
                **GEOMETRY_INPUTS,
            },
            "optional": {"video": VIDEO_GEOMETRY},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, keyframes=None):
        try:
            if keyframes is not None:
                parse_keyframes(keyframes)
        except ValueError as error:
            return str(error).removeprefix("H3Forge: ")
        return True

    async def track(self, keyframes, width, height, frames, video=None):
        keys = parse_keyframes(keyframes)

        def masks():
            count, h, w = geometry(width, height, frames, video)  # may read the video file's header
            return box_masks(interpolate_boxes(keys, count), h, w)

        return (await asyncio.to_thread(masks),)


class H3ForgeMaskGrow:
    DESCRIPTION = ("Grows (or with a negative value shrinks) a mask by a number of pixels on every frame, e.g. to "
                   "cover an object's shadow and motion blur before removing it.")
    CATEGORY = "H3Forge"
    FUNCTION = "grow"
    RETURN_TYPES = ("MASK",)
    RETURN_NAMES = ("mask",)
    OUTPUT_TOOLTIPS = ("The grown mask, same frames and size.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "mask": ("MASK", {"tooltip": "The mask to grow: one or many frames."}),
            "pixels": ("INT", {"default": 16, "min": -MAX_PIXELS_GROWN, "max": MAX_PIXELS_GROWN, "tooltip":
                       "Pixels to add around the mask in every direction; negative values shrink it."}),
        }}

    async def grow(self, mask, pixels):
        return (await asyncio.to_thread(lambda: grow_mask(mask_batch(mask), pixels)),)


class H3ForgeMaskFeather:
    DESCRIPTION = ("Softens a mask's edges so the edit blends into the kept video: values fade from 1 to 0 over "
                   "about the given number of pixels on each side of the edge, on every frame.")
    CATEGORY = "H3Forge"
    FUNCTION = "feather"
    RETURN_TYPES = ("MASK",)
    RETURN_NAMES = ("mask",)
    OUTPUT_TOOLTIPS = ("The feathered mask, same frames and size, values from 0 to 1.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "mask": ("MASK", {"tooltip": "The mask to soften: one or many frames."}),
            "pixels": ("INT", {"default": 16, "min": 0, "max": MAX_PIXELS_GROWN, "tooltip":
                       "Width of the fade on each side of the edge. Grow the mask first to keep the object "
                       "itself fully regenerated."}),
        }}

    async def feather(self, mask, pixels):
        return (await asyncio.to_thread(lambda: feather_mask(mask_batch(mask), pixels)),)


# ---- preview ------------------------------------------------------------------------------------------------------

CANVASES = {  # short edge and pixel cap of the engine's canvas; "ask the engine" reads them from /v1/status
    "ask the engine": None,
    "768p (MiniMax-H3)": (768, 768 * 1344),
    "128p (tiny preset)": (128, 128 * 224),  # engine.models.h3.pipeline.TINY_CANVAS
}
OVERLAY_RED = (1.0, 0.0, 0.0)
OVERLAY_OPACITY = 0.5
GRID_SHADE = 0.6
ENGINE_LOADING_WAIT_S = 300.0


async def canvas_rules(choice: str, engine) -> tuple[int, int]:
    """(short edge, max pixels) of the canvas the engine puts a source on."""
    if CANVASES[choice] is not None:
        return CANVASES[choice]
    client = await connect(engine)
    deadline = asyncio.get_running_loop().time() + ENGINE_LOADING_WAIT_S
    while True:
        try:
            status = await client.status()
        except EngineError as error:
            raise await readable_error(error, client.url) from None
        canvas = (status.get("models") or {}).get("canvas")
        if canvas:
            return int(canvas["short_edge"]), int(canvas["max_pixels"])
        if status["engine"]["state"] != "loading" or asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"H3Forge: the engine at {client.url} reports no MiniMax-H3 canvas (state "
                               f"{status['engine']['state']}); pick the canvas in Mask Preview instead.")
        await asyncio.sleep(0.5)


def latent_overlay(frames, fps: float, mask, strength: float, short_edge: int, max_pixels: int, grid: bool):
    """The video (uint8 frames) as the engine sees it (24 fps, on the canvas) with every regenerated latent cell
    tinted red, as strongly as it is regenerated. Same steps as the engine's edit: uint8 mask, prepare_clip,
    edit_cells."""
    import torch

    layout = engine_module("engine.models.h3.layout")
    cells_of = engine_module("engine.models.h3.mask")
    source = engine_module("engine.models.h3.source")
    request = engine_module("engine.models.h3.request")

    wire_mask = mask_to_uint8(mask)  # what Masked Edit sends
    problem = protocol.mask_mismatch(wire_mask.shape, frames.shape)
    if problem:
        raise ValueError(f"H3Forge: {problem}")
    try:  # the engine's own rules, with the messages it would send
        clip = source.prepare_clip(request.Source(frames, float(fps)), short_edge, max_pixels)
        count = clip.frames.shape[0]
        padded, _ = layout.frames_for_seconds(count / layout.FPS)
        pixel_mask = torch.from_numpy(wire_mask)
        if pixel_mask.ndim == 3 and pixel_mask.shape[0] != count:
            pixel_mask = pixel_mask[clip.frame_index]  # a per-frame mask follows the 24 fps resampling
        _, cells = cells_of.edit_cells(pixel_mask, float(strength), padded, clip.height, clip.width)
    except ValueError as error:
        raise ValueError(f"H3Forge: {error}") from None

    sizes = torch.tensor([b - a for a, b in cells_of.latent_frame_spans(padded)])
    latent = torch.repeat_interleave(torch.arange(len(sizes)), sizes)[:count]
    s = layout.VAE_SPATIAL
    alpha = cells[latent].repeat_interleave(s, 1).repeat_interleave(s, 2)[..., None] * OVERLAY_OPACITY
    out = clip.frames.float() / 255 * (1 - alpha) + torch.tensor(OVERLAY_RED) * alpha
    if grid:
        out[:, ::s] *= GRID_SHADE
        out[:, :, ::s] *= GRID_SHADE
    return out


class H3ForgeMaskPreview:
    DESCRIPTION = ("Shows exactly which latent cells H3Forge Masked Edit will regenerate: the video as the engine "
                   "sees it (24 fps, on the model's canvas) with those 16x16-pixel cells tinted red, computed by "
                   "the engine's own mask code. No generation: run it to check a mask before editing.")
    CATEGORY = "H3Forge"
    FUNCTION = "preview"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("overlay",)
    OUTPUT_TOOLTIPS = ("The frames at 24 fps on the canvas, regenerated cells in red (stronger = more "
                       "regenerated). Play them with Create Video (24 fps).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mask": ("MASK", {"tooltip": "The mask you give H3Forge Masked Edit."}),
                "canvas": (list(CANVASES), {"default": "ask the engine", "tooltip":
                           "The canvas the engine resizes the video to: ask the engine (it must be running or "
                           "startable), or the full MiniMax-H3 768p canvas, or the tiny preset's 128p one."}),
                "strength": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip":
                             "The Masked Edit's strength (1.0 for remove and replace, 0.75 for repaint when it "
                             "is left at 0): the mask is scaled by it, so the tint shows the exact amount."}),
                "grid": ("BOOLEAN", {"default": False, "tooltip": "Draw the 16x16-pixel latent cell borders."}),
            },
            "optional": {
                "video": ("VIDEO", {"tooltip": "The video you edit (or connect its frames instead)."}),
                "frames": ("IMAGE", {"tooltip": "The frames of the video you edit, taken as 24 fps (when no "
                           "video is connected)."}),
                "engine": (ENGINE_TYPE, {"tooltip": "The engine to ask for its canvas (canvas: ask the engine). "
                           "Without it: the default engine settings."}),
            },
        }

    async def preview(self, mask, canvas, strength, grid, video=None, frames=None, engine=None):
        if video is None and frames is None:
            raise ValueError("H3Forge: connect the video the mask belongs to (or its frames) to Mask Preview")
        short_edge, max_pixels = await canvas_rules(canvas, engine)

        def overlay():
            pixels, fps = video_media(video)[:2] if video is not None else (images_to_uint8(frames), 24.0)
            return latent_overlay(pixels, float(fps), mask, strength, short_edge, max_pixels, grid)

        return (await asyncio.to_thread(overlay),)
