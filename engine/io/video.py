"""MP4 in and out through PyAV: H.264 (libx264, yuv420p, BT.709 tags) + AAC stereo, and the inverse."""

from __future__ import annotations

import io
import os
from fractions import Fraction

import av
import numpy as np
import torch
from av.video.reformatter import ColorRange, Colorspace

FPS = 24
SAMPLE_RATE = 32000
_BT709 = 1  # ITU-T H.273 code for primaries / transfer / matrix


def _frames_numpy(frames) -> np.ndarray:
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    frames = np.ascontiguousarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {frames.shape}")
    if frames.shape[0] == 0:
        raise ValueError("no frames to write")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"H.264 yuv420p needs even sizes, got {frames.shape[2]}x{frames.shape[1]}")
    return frames


def _stereo_numpy(audio) -> np.ndarray:
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().float().numpy()
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim == 1:
        audio = audio[None]
    if audio.ndim != 2 or audio.shape[0] not in (1, 2):
        raise ValueError(f"expected mono or stereo audio [C, S], got shape {audio.shape}")
    if audio.shape[0] == 1:
        audio = np.repeat(audio, 2, axis=0)
    return np.ascontiguousarray(np.clip(audio, -1.0, 1.0))


def write_mp4(target, frames, fps=FPS, audio=None, sample_rate: int = SAMPLE_RATE, *, crf: int = 18,
              preset: str = "medium") -> int:
    """Write uint8 frames [F, H, W, 3] (torch or numpy) and optional float audio [C, S] to an MP4 at `target`
    (a path or a writable, seekable binary file object). Returns the number of bytes written."""
    frames = _frames_numpy(frames)
    audio = None if audio is None else _stereo_numpy(audio)
    rate = Fraction(fps).limit_denominator(1001)
    num_frames, height, width = frames.shape[:3]
    start = None if isinstance(target, (str, os.PathLike)) else target.tell()

    # faststart rewrites the file in a second pass, which FFmpeg can only do on a named file.
    options = {"movflags": "+faststart"} if start is None else {}
    with av.open(target, mode="w", format="mp4", options=options) as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"crf": str(crf), "preset": preset}
        ctx = video.codec_context
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = _BT709
        ctx.color_range = ColorRange.MPEG
        sound = None
        if audio is not None:
            # FFmpeg's default 128 kb/s: its native AAC encoder distorted onsets in tests at 192 kb/s.
            sound = container.add_stream("aac", rate=sample_rate, layout="stereo")

        # Audio is fed per video frame so the muxer gets both streams in time order; audio longer than the
        # video goes out with the last frame.
        total = 0 if audio is None else audio.shape[1]
        bounds = [min(round(i * sample_rate / rate), total) for i in range(num_frames)] + [total]
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frames[i], format="rgb24").reformat(
                format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG,
                dst_color_trc=_BT709, dst_color_primaries=_BT709)
            frame.pts = i
            container.mux(video.encode(frame))
            if sound is not None and bounds[i + 1] > bounds[i]:
                chunk = av.AudioFrame.from_ndarray(audio[:, bounds[i]:bounds[i + 1]], format="fltp", layout="stereo")
                chunk.sample_rate, chunk.pts = sample_rate, bounds[i]
                container.mux(sound.encode(chunk))
        container.mux(video.encode(None))
        if sound is not None:
            container.mux(sound.encode(None))

    if start is None:
        return os.path.getsize(target)
    return target.tell() - start


def encode_mp4_bytes(frames, fps=FPS, audio=None, sample_rate: int = SAMPLE_RATE, **options) -> bytes:
    """`write_mp4` into memory; the MP4 file as bytes (for the wire)."""
    buffer = io.BytesIO()
    write_mp4(buffer, frames, fps, audio, sample_rate, **options)
    return buffer.getvalue()


def read_video(source) -> tuple[np.ndarray, Fraction, np.ndarray | None, int | None]:
    """Decode a video file (path, bytes or binary file object) in one demux pass.

    Returns (uint8 frames [F, H, W, 3], fps, float32 audio [C, S] or None, audio sample rate or None).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    with av.open(source, mode="r") as container:
        video = container.streams.video[0] if container.streams.video else None
        if video is None:
            raise ValueError("no video stream in the file")
        sound = container.streams.audio[0] if container.streams.audio else None
        video.thread_type = "AUTO"
        streams = [video] + ([sound] if sound is not None else [])
        resampler = av.AudioResampler(format="fltp") if sound is not None else None
        frames, chunks, sample_rate = [], [], None
        for packet in container.demux(streams):
            for frame in packet.decode():
                if packet.stream.type == "video":
                    frames.append(frame.to_ndarray(format="rgb24"))
                else:
                    for planar in resampler.resample(frame):
                        sample_rate = planar.sample_rate
                        chunks.append(planar.to_ndarray())
        if resampler is not None:
            chunks.extend(planar.to_ndarray() for planar in resampler.resample(None))
        fps = video.average_rate or video.guessed_rate
        audio = np.concatenate(chunks, axis=1).astype(np.float32, copy=False) if chunks else None
        if audio is not None and sound.duration:
            # AAC pads the last frame to 1024 samples; the stream duration says where the real audio ends.
            audio = audio[:, :round(sound.duration * sound.time_base * sample_rate)]
    if not frames:
        raise ValueError("the video stream holds no frames")
    return np.stack(frames), Fraction(fps), audio, sample_rate if audio is not None else None
