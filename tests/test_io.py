"""MP4 writing and reading through PyAV: stream layout, frame count, rate, size, lossy round trip."""

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from engine.io.video import encode_mp4_bytes, read_video, write_mp4

H, W, F, SR = 128, 224, 22, 32000


def moving_gradient(num_frames=F, height=H, width=W):
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = [np.stack([(xx / width * 200 + 4 * i), (yy / height * 200), np.full_like(xx, 40 + 5 * i)], -1)
              for i in range(num_frames)]
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


def tones(num_samples, sample_rate=SR):
    t = np.arange(num_samples, dtype=np.float64) / sample_rate
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def stream_kinds(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        return sorted(s.type for s in container.streams)


def test_round_trip_with_audio(tmp_path):
    frames = moving_gradient()
    samples = round(F / 24 * SR)
    audio = tones(samples)
    path = tmp_path / "clip.mp4"
    size = write_mp4(path, torch.from_numpy(frames), fps=24, audio=torch.from_numpy(audio), sample_rate=SR)
    data = path.read_bytes()
    assert size == len(data) > 0
    assert stream_kinds(data) == ["audio", "video"]

    out, fps, sound, rate = read_video(path)
    assert out.shape == (F, H, W, 3) and out.dtype == np.uint8
    assert fps == Fraction(24) and rate == SR
    assert np.abs(out.astype(np.int16) - frames).mean() < 2.0
    assert sound.dtype == np.float32 and sound.shape[0] == 2
    assert abs(sound.shape[1] - samples) <= 1024  # AAC frames are 1024 samples
    n = min(samples, sound.shape[1]) - 2048
    for ch in range(2):
        assert np.corrcoef(sound[ch, 1024:n], audio[ch, 1024:n])[0, 1] > 0.99


def test_bytes_api_and_mono_audio():
    frames = moving_gradient(5, 64, 96)
    mono = tones(3000)[:1]
    data = encode_mp4_bytes(frames, audio=mono)
    assert stream_kinds(data) == ["audio", "video"]
    out, fps, sound, rate = read_video(data)
    assert out.shape == (5, 64, 96, 3) and fps == 24 and rate == SR
    assert sound.shape[0] == 2 and np.abs(sound[0] - sound[1]).mean() < 1e-3


def test_video_only_and_file_objects():
    frames = moving_gradient(3, 32, 32)
    buffer = io.BytesIO()
    size = write_mp4(buffer, frames)
    assert size == len(buffer.getvalue())
    assert stream_kinds(buffer.getvalue()) == ["video"]
    buffer.seek(0)
    out, fps, sound, rate = read_video(buffer)
    assert out.shape == (3, 32, 32, 3) and fps == 24 and sound is None and rate is None


def test_rejects_odd_sizes_and_bad_dtypes():
    with pytest.raises(ValueError):
        encode_mp4_bytes(np.zeros((2, 33, 32, 3), np.uint8))
    with pytest.raises(ValueError):
        encode_mp4_bytes(np.zeros((2, 32, 32, 3), np.float32))
    with pytest.raises(ValueError):
        encode_mp4_bytes(np.zeros((2, 32, 32, 3), np.uint8), audio=np.zeros((3, 100), np.float32))
