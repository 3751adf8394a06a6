"""VIDEO, MASK and results between ComfyUI and the engine: a VIDEO as the source of an engine task (the file it was
loaded from, as it is; else its frames and sound, raw or as an MP4), a MASK as uint8, a job result as VIDEO / IMAGE /
AUDIO outputs. Whole clips are converted a few frames at a time.

Torch and the engine's media code are imported when a node runs (torch is always there inside ComfyUI), never
when the pack loads.
"""

from __future__ import annotations

import importlib
import sys
from fractions import Fraction
from pathlib import Path

from . import comfy_compat as comfy

PACK_ROOT = Path(__file__).resolve().parent.parent
# Decoded clips above this travel as a near-lossless MP4: sending one WebSocket frame holds the event loop for about
# 5 ms per MB (aiohttp masks and copies it there), and the engine takes tensors up to 256 MiB.
RAW_FRAMES_LIMIT = 32 * 2**20
MP4_CRF = 12  # near-lossless H.264 for those
SOURCE_FILE_LIMIT = 256 * 2**20  # the largest tensor an engine takes by default (--max-tensor-mb)
# Whole-clip conversions go a few frames at a time: one pass over a 768p clip of 124 frames as float32 makes
# 1.5 GB temporaries per operation and runs 4-10x slower than chunks that stay in the CPU's cache.
CHUNK_ELEMENTS = 1 << 22


def engine_module(name: str):
    """An engine module (e.g. engine.models.h3.mask), imported on first use. The pack's folder holds the `engine`
    package, whose modules import each other by absolute name, so the folder must be importable."""
    if str(PACK_ROOT) not in sys.path:
        sys.path.append(str(PACK_ROOT))
    return importlib.import_module(name)


def frame_chunks(frames) -> list[slice]:
    """Slices of a [F, ...] tensor's frames, each about CHUNK_ELEMENTS elements (at least one frame)."""
    per = max(1, CHUNK_ELEMENTS // max(1, frames[0].numel()))
    return [slice(i, i + per) for i in range(0, frames.shape[0], per)]


def images_to_uint8(images):
    """A ComfyUI IMAGE batch [F, H, W, C] float 0..1 -> uint8 [F, H, W, 3] numpy."""
    import torch

    if images.ndim != 4 or images.shape[-1] not in (3, 4) or images.shape[0] == 0:
        raise ValueError(f"H3Forge: expected video frames [frames, height, width, 3], got {tuple(images.shape)}")
    out = torch.empty((*images.shape[:3], 3), dtype=torch.uint8)
    for chunk in frame_chunks(images):
        rgb = images[chunk, ..., :3].detach().to("cpu", torch.float32, copy=True)
        out[chunk] = rgb.clamp_(0, 1).mul_(255).round_()
    return out.numpy()


def audio_samples(audio) -> tuple:
    """A ComfyUI AUDIO dict -> (float32 [C, S] numpy with at most 2 channels, sample rate), or (None, None)."""
    if audio is None:
        return None, None
    import torch

    waveform = audio["waveform"]
    waveform = waveform[0] if waveform.ndim == 3 else waveform
    return waveform[:2].detach().to("cpu", torch.float32).contiguous().numpy(), int(audio["sample_rate"])


def loaded_file(video) -> bytes | None:
    """The bytes of the file a VIDEO was loaded from, when the engine can take them as they are: ComfyUI's Load
    Video gives a VideoFromFile holding nothing but its file, whose header says its frame count and rate. None for
    any other VIDEO (frames made in the graph; a file a later ComfyUI trims or crops on load), or a file above
    SOURCE_FILE_LIMIT. Decoding it here would take ComfyUI's single-threaded float decode (6.5 s for the shipped
    1344x768 source of 124 frames against 1.2 s in the engine) and an MP4 re-encode."""
    if type(video) is not comfy.VideoFromFile or set(vars(video)) != {"_VideoFromFile__file"}:
        return None
    source = video.get_stream_source()
    if isinstance(source, (str, Path)):
        if Path(source).stat().st_size > SOURCE_FILE_LIMIT:
            return None
        data = Path(source).read_bytes()
    else:
        data = source.read()
    try:
        info = engine_module("engine.io.video").probe_video(data)
    except ValueError:
        return None
    return data if len(data) <= SOURCE_FILE_LIMIT and info.frames > 0 and info.fps > 0 else None


def video_media(video) -> tuple:
    """(uint8 frames [F, H, W, 3] numpy, frame rate as a Fraction, float32 sound [C <= 2, S] numpy or None, its
    sample rate or None) of a VIDEO: a loaded file decoded as the engine decodes it (the same frames as ComfyUI's
    decode, in uint8 at once), else its components converted."""
    data = loaded_file(video)
    if data is not None:
        frames, rate, sound, sample_rate = engine_module("engine.io.video").read_video(data)
        return frames, Fraction(rate), None if sound is None else sound[:2], sample_rate
    parts = video.get_components()
    return images_to_uint8(parts.images), Fraction(parts.frame_rate), *audio_samples(parts.audio)


def source_of(video) -> tuple[dict, dict]:
    """(params, tensors) that send a VIDEO as an engine task's source, as ComfyUI decodes it (with any trim, crop
    or rotation applied, so masks drawn on it line up): a loaded file as it is (`loaded_file`), else its frames and
    sound, raw when they are small, as a near-lossless MP4 the engine decodes when they are not."""
    import numpy as np

    data = loaded_file(video)
    if data is not None:
        return {}, {"source_mp4": np.frombuffer(data, dtype=np.uint8)}
    parts = video.get_components()
    frames = images_to_uint8(parts.images)
    audio, rate = audio_samples(parts.audio)
    if frames.nbytes > RAW_FRAMES_LIMIT:
        data = engine_module("engine.io.video").encode_mp4_bytes(frames, parts.frame_rate, audio,
                                                                 rate or 32000, crf=MP4_CRF)
        return {}, {"source_mp4": np.frombuffer(data, dtype=np.uint8)}
    params, tensors = {"source_fps": float(parts.frame_rate)}, {"source_frames": frames}
    if audio is not None:
        params["source_sample_rate"], tensors["source_audio"] = rate, audio
    return params, tensors


def mask_batch(mask):
    """A ComfyUI MASK ([H, W] or [B, H, W]) as float32 [B, H, W] on the CPU, checked to hold 0..1."""
    import torch

    mask = mask.detach().to("cpu", torch.float32)
    mask = mask[None] if mask.ndim == 2 else mask
    if mask.ndim != 3 or mask.shape[0] == 0:
        raise ValueError(f"H3Forge: a mask must be [height, width] or [frames, height, width], got "
                         f"{tuple(mask.shape)}")
    low, high = torch.aminmax(mask)  # both NaN where the mask holds one: the test below fails
    if not (low >= 0 and high <= 1):
        raise ValueError("H3Forge: the mask must hold values from 0 (keep) to 1 (regenerate)")
    return mask


def mask_to_uint8(mask):
    """A ComfyUI MASK -> uint8 0..255 numpy: [H, W] when one mask covers every frame, else [F, H, W]."""
    import torch

    batch = mask_batch(mask)
    one_for_all = all(bool((batch[chunk] == batch[:1]).all()) for chunk in frame_chunks(batch))
    if one_for_all:
        batch = batch[:1]
    out = torch.empty(batch.shape, dtype=torch.uint8)
    for chunk in frame_chunks(batch):
        out[chunk] = batch[chunk].mul(255).round_()
    return out[0].numpy() if one_for_all else out.numpy()


class ResultImages:
    """A job's result frames as a ComfyUI IMAGE (float32 [F, H, W, 3] in 0..1), converted chunk by chunk as the
    engine streams them (the client's `on_frames`, on a worker thread), so the result leaves only the frames it
    carries to convert."""

    def __init__(self):
        self.images = None  # allocated at the first chunk
        self.converted = 0  # frames [0, converted) are in `images`

    def convert(self, start: int, total: int, frames) -> None:
        """Frames [start, start + n) of `total` (uint8 [n, H, W, 3] numpy, read-only), in order."""
        import numpy as np
        import torch

        if self.images is None:
            self.images = torch.empty((total, *frames.shape[1:]), dtype=torch.float32)
        target = self.images[start:start + len(frames)]
        np.copyto(target.numpy(), frames)  # uint8 -> float32 is exact
        target.div_(255.0)
        self.converted = start + len(frames)

    def finish(self, frames):
        """The IMAGE of all the result's `frames` (uint8 [F, H, W, 3]): those not streamed are converted now."""
        if self.converted < len(frames):
            self.convert(self.converted, len(frames), frames[self.converted:])
        return self.images


def result_outputs(result, images: ResultImages) -> tuple:
    """(VIDEO, IMAGE, AUDIO) of an engine JobResult whose streamed frames `images` converted. A silent result gets a
    silent AUDIO track of its length."""
    import numpy as np
    import torch

    frames = images.finish(result.frames)
    frame_rate = Fraction(result.fps).limit_denominator(1001)
    if result.audio is not None:
        # The client's audio is a read-only view of the received buffer; astype makes a new array.
        audio = {"waveform": torch.from_numpy(result.audio.astype(np.float32)).unsqueeze(0),
                 "sample_rate": int(result.sample_rate)}
        sound = audio
    else:
        samples = round(frames.shape[0] / frame_rate * result.sample_rate)
        audio, sound = {"waveform": torch.zeros(1, 2, samples), "sample_rate": int(result.sample_rate)}, None
    video = comfy.VideoFromComponents(comfy.VideoComponents(images=frames, audio=sound, frame_rate=frame_rate))
    return video, frames, audio

