"""MP4 in and out through PyAV: H.264 (libx264 or NVENC, yuv420p, BT.709 tags) + AAC stereo, and the inverse."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import queue
import threading
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable

import av
import numpy as np
import torch
from av.codec.codec import UnknownCodecError
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

FPS = 24
SAMPLE_RATE = 32000
# One core's libx264 time for a 1344x768 frame (measured on a CPU build host): "veryfast" 19-22 ms for film-like
# content (25 kB a frame at CRF 18), 94-102 ms for noise (430 kB: what random weights decode to); "ultrafast" 10-14
# and 19-22 ms for 5x and 1.2x the bytes. A GPU decodes ~40 such frames a second (an H200 with the fast VAE), which
# veryfast keeps up with while each encoder thread has at most this many pixels of a frame (1344x768 from 7 threads
# on, 70 frames/s of noise); past it, ultrafast.
VERYFAST_PIXELS_PER_THREAD = 160_000
_BT709 = 1  # ITU-T H.273 code for primaries / transfer / matrix


@dataclass(frozen=True)
class H264Options:
    codec: str  # "h264_nvenc" | "libx264"
    preset: str  # libx264's (NVENC runs its own default)
    threads: int  # libx264's frame threads and the RGB -> YUV conversion's

    def describe(self) -> str:
        """e.g. "libx264 (veryfast, 15 threads)"."""
        if self.codec != "libx264":
            return self.codec
        return f"{self.codec} ({self.preset}, {self.threads} thread{'s' * (self.threads > 1)})"


def h264_options(width: int, height: int, cores: int, nvenc: bool) -> H264Options:
    """How a `width` x `height` clip is encoded on a machine of `cores` cores: NVENC where it may open (`nvenc`: a
    GPU and an FFmpeg that has h264_nvenc; these libx264 settings stay the fallback), else libx264 on every core but
    the producer's (the VAE decode's Python thread), at "veryfast" while each thread has at most
    VERYFAST_PIXELS_PER_THREAD pixels of a frame, else at "ultrafast"."""
    threads = max(1, cores - 1)
    preset = "veryfast" if width * height <= VERYFAST_PIXELS_PER_THREAD * threads else "ultrafast"
    return H264Options("h264_nvenc" if nvenc else "libx264", preset, threads)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's cpuset, taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


class Mp4Encoder:
    """`write_mp4` fed in chunks: frames are converted, encoded and muxed on a background thread (PyAV releases
    the GIL there) while the caller makes the next ones, e.g. the video VAE decoding its next chunk.

    `target` is a path or a writable, seekable binary file object; the audio (float [C, S]) comes up front. `codec`:
    "libx264"; "h264_nvenc", which falls back to libx264 when FFmpeg lacks it or it does not open (no NVENC on the
    GPU, no GPU); "auto", NVENC first when CUDA is available. Threads and preset come from `h264_options` for the
    first chunk's size (`preset` overrides). `options` then says what runs, once the first chunk is in. `close()`
    finishes the file and returns its size in bytes; `add` and `close` raise what failed on the encoder thread. As a
    context manager it closes on exit, dropping queued frames if the block raised.
    """

    def __init__(self, target, fps=FPS, audio=None, sample_rate: int = SAMPLE_RATE, *, crf: int = 18,
                 preset: str | None = None, codec: str = "libx264"):
        if codec not in ("auto", "libx264", "h264_nvenc"):
            raise ValueError(f"codec must be auto, libx264 or h264_nvenc, got {codec!r}")
        if codec == "auto":
            codec = "h264_nvenc" if torch.cuda.is_available() else "libx264"
        self.target, self.sample_rate, self.crf, self.preset = target, sample_rate, crf, preset
        self.audio = None if audio is None else _stereo_numpy(audio)
        self.rate = Fraction(fps).limit_denominator(1001)
        self.options: H264Options | None = None
        self._preferred = codec
        self._start = None if isinstance(target, (str, os.PathLike)) else target.tell()
        self._queue: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._cancelled = False
        self._error: BaseException | None = None
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="mp4-encoder", daemon=True)
        self._thread.start()

    def add(self, frames) -> None:
        """Queue uint8 frames [n, H, W, 3] (torch or numpy; every chunk the same size)."""
        self._raise_error()
        self._queue.put(_frames_numpy(frames))

    def close(self) -> int:
        """Wait for the queued frames, flush the encoders and finish the file; the bytes written."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_error()
        return self._size

    def __enter__(self) -> "Mp4Encoder":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
            return
        self._cancelled = True  # the producer failed: the file is not wanted, the error that matters is its own
        with contextlib.suppress(Exception):
            self.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        # Below the producer's priority (x264's worker threads inherit it): on the GPU host, x264 on every core
        # slowed the VAE decode it overlaps, which waits on this process's Python thread to launch its kernels.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            self._size = self._encode()
        except BaseException as error:  # for the producer: `add` and `close` raise it
            self._error = error

    def _encode(self) -> int:
        frames = self._queue.get()
        if frames is None:
            raise ValueError("no frames to write")
        height, width = frames.shape[1:3]
        total = 0 if self.audio is None else self.audio.shape[1]
        # faststart rewrites the file in a second pass, which FFmpeg can only do on a named file.
        options = {"movflags": "+faststart"} if self._start is None else {}
        with av.open(self.target, mode="w", format="mp4", options=options) as container:
            video = self._add_video(container, width, height)
            sound = None
            if self.audio is not None:
                # FFmpeg's default 128 kb/s: its native AAC encoder distorted onsets in tests at 192 kb/s.
                sound = container.add_stream("aac", rate=self.sample_rate, layout="stereo")

            # One converter for the stream: a frame's own `reformat` makes a scaler (and its threads) per frame, which
            # cost 10 ms a 1344x768 frame with 16 threads against 4 ms reused.
            to_yuv = VideoReformatter()
            # Audio is fed per video frame so the muxer gets both streams in time order; audio longer than the
            # video goes out after the last frame.
            count = 0
            while frames is not None and not self._cancelled:
                if frames.shape[1:3] != (height, width):
                    raise ValueError(f"frame size changed from {width}x{height} to {frames.shape[2]}x"
                                     f"{frames.shape[1]} after {count} frames; an MP4 keeps one size")
                for image in frames:
                    frame = to_yuv.reformat(
                        av.VideoFrame.from_ndarray(image, format="rgb24"), format="yuv420p",
                        dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG, dst_color_trc=_BT709,
                        dst_color_primaries=_BT709, threads=self.options.threads)
                    frame.pts = count
                    container.mux(video.encode(frame))
                    self._mux_sound(container, sound, self._sample_at(count, total), self._sample_at(count + 1, total))
                    count += 1
                frames = self._queue.get()
            container.mux(video.encode(None))
            if sound is not None:
                self._mux_sound(container, sound, self._sample_at(count, total), total)
                container.mux(sound.encode(None))

        if self._start is None:
            return os.path.getsize(self.target)
        return self.target.tell() - self._start

    def _add_video(self, container, width: int, height: int):
        nvenc = self._preferred == "h264_nvenc" and "h264_nvenc" in av.codecs_available
        options = h264_options(width, height, usable_cores(), nvenc)
        options = replace(options, preset=self.preset or options.preset)
        if nvenc and not _opens("h264_nvenc", width, height, self.rate, tuple(self._settings(options).items())):
            options = replace(options, codec="libx264")
        self.options = options
        video = container.add_stream(options.codec, rate=self.rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = self._settings(options)
        ctx = video.codec_context
        if options.codec == "libx264":
            # PyAV opens every codec for slice threads, which makes x264 run sliced threads (lower throughput, its
            # lookahead on the calling thread); frame threads keep every core busy.
            ctx.thread_type, ctx.thread_count = "FRAME", options.threads
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = _BT709
        ctx.color_range = ColorRange.MPEG
        return video

    def _settings(self, options: H264Options) -> dict[str, str]:
        if options.codec == "h264_nvenc":  # constant quality on libx264's CRF scale; NVENC has its own presets
            return {"rc": "vbr", "cq": str(self.crf)}
        return {"crf": str(self.crf), "preset": options.preset}

    def _sample_at(self, frame: int, total: int) -> int:
        return min(round(frame * self.sample_rate / self.rate), total)

    def _mux_sound(self, container, sound, start: int, stop: int) -> None:
        if sound is None or stop <= start:
            return
        chunk = av.AudioFrame.from_ndarray(self.audio[:, start:stop], format="fltp", layout="stereo")
        chunk.sample_rate, chunk.pts = self.sample_rate, start
        container.mux(sound.encode(chunk))


@functools.cache  # once per process and stream shape: a failed NVENC probe costs ~0.5 s (no NVENC on the H200)
def _opens(codec: str, width: int, height: int, rate: Fraction, options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this FFmpeg has `codec` and it opens here for the stream (NVENC needs the hardware and driver)."""
    try:
        ctx = av.CodecContext.create(codec, "w")
        ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = width, height, "yuv420p", 1 / rate
        ctx.options = dict(options)
        ctx.open()
    except (av.FFmpegError, UnknownCodecError):
        return False
    return True


def write_mp4(target, frames, fps=FPS, audio=None, sample_rate: int = SAMPLE_RATE, *, crf: int = 18,
              preset: str | None = None) -> int:
    """Write uint8 frames [F, H, W, 3] (torch or numpy) and optional float audio [C, S] to an MP4 at `target`
    (a path or a writable, seekable binary file object) with libx264 (preset per canvas unless given). Returns the
    number of bytes written."""
    with Mp4Encoder(target, fps, audio, sample_rate, crf=crf, preset=preset) as encoder:
        encoder.add(frames)
        return encoder.close()


def encode_mp4_bytes(frames, fps=FPS, audio=None, sample_rate: int = SAMPLE_RATE, **options) -> bytes:
    """`write_mp4` into memory; the MP4 file as bytes (for the wire)."""
    buffer = io.BytesIO()
    write_mp4(buffer, frames, fps, audio, sample_rate, **options)
    return buffer.getvalue()


@dataclass(frozen=True)
class VideoInfo:
    frames: int  # 0 when the container says neither a frame count nor a duration
    fps: float
    height: int
    width: int


def probe_video(source) -> VideoInfo:
    """A video file's frame count, rate and size from its container header, without decoding a frame."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    try:
        with av.open(source, mode="r") as container:
            if not container.streams.video:
                raise ValueError("no video stream in the file")
            video = container.streams.video[0]
            rate = float(video.average_rate or video.guessed_rate or 0)
            frames = video.frames
            if not frames and rate:
                if video.duration and video.time_base:
                    frames = round(float(video.duration * video.time_base) * rate)
                elif container.duration:
                    frames = round(container.duration / av.time_base * rate)
            return VideoInfo(int(frames), rate, int(video.codec_context.height), int(video.codec_context.width))
    except (OSError, av.FFmpegError) as exc:
        raise ValueError(str(exc)) from None


def read_video(source, on_frames: Callable[[int, int], None] | None = None, every: int = 16,
               max_bytes: int | None = None) -> tuple[np.ndarray, Fraction, np.ndarray | None, int | None]:
    """Decode a video file (path, bytes or binary file object) in one demux pass; past `max_bytes` of decoded
    frames it stops with a ValueError (a header may understate what the stream holds).

    Returns (uint8 frames [F, H, W, 3], fps, float32 audio [C, S] or None, audio sample rate or None).
    `on_frames(decoded, expected)` is called after every `every` video frames (`expected` from the stream's
    header, at least `decoded`); raise from it to stop.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    decoded = 0
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
                    decoded += frame.width * frame.height * 3
                    if max_bytes is not None and decoded > max_bytes:
                        raise ValueError(f"its frames decode to more than {max_bytes / 2**30:.2f} GB, the most this "
                                         f"engine decodes; send a shorter or smaller video")
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if on_frames is not None and len(frames) % every == 0:
                        on_frames(len(frames), max(video.frames, len(frames)))
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


def read_audio(source) -> tuple[np.ndarray, int]:
    """The first sound stream of a media file (WAV, FLAC, MP3, AAC, or a video's soundtrack): float32 [C, S] at
    its own sample rate."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    with av.open(source, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no sound stream in the file")
        resampler = av.AudioResampler(format="fltp")
        chunks, sample_rate = [], None
        for frame in container.decode(container.streams.audio[0]):
            for planar in resampler.resample(frame):
                sample_rate = planar.sample_rate
                chunks.append(planar.to_ndarray())
        chunks.extend(planar.to_ndarray() for planar in resampler.resample(None))
    if not chunks:
        raise ValueError("the sound stream holds no samples")
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), int(sample_rate)
