"""MP4 writing and reading through PyAV: stream layout, frame count, rate, size, lossy round trip, streaming, the
encoder settings per canvas."""

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from engine.io.video import H264Options, Mp4Encoder, encode_mp4_bytes, h264_options, read_video, write_mp4

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


def test_streamed_chunks_decode_like_write_mp4(tmp_path):
    frames, audio = moving_gradient(), tones(round(F / 24 * SR))
    whole = tmp_path / "whole.mp4"
    write_mp4(whole, frames, audio=audio)
    streamed = tmp_path / "streamed.mp4"
    with Mp4Encoder(streamed, 24, torch.from_numpy(audio), SR) as encoder:
        for chunk in (frames[:5], torch.from_numpy(frames[5:14]), frames[14:]):  # uneven, torch or numpy
            encoder.add(chunk)
        size = encoder.close()
    assert encoder.options.codec == "libx264" and size == streamed.stat().st_size
    out, fps, sound, rate = read_video(streamed)
    ref, ref_fps, ref_sound, ref_rate = read_video(whole)
    assert out.shape == ref.shape == (F, H, W, 3) and fps == ref_fps == 24 and rate == ref_rate == SR
    assert sound.shape == ref_sound.shape
    assert np.abs(out.astype(np.int16) - frames).mean() < 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="NVENC may open where there is a GPU")
@pytest.mark.parametrize("codec", ["h264_nvenc", "auto"])
def test_nvenc_falls_back_to_libx264_where_it_does_not_open(codec):
    buffer = io.BytesIO()
    with Mp4Encoder(buffer, codec=codec) as encoder:
        encoder.add(moving_gradient(3, 32, 32))
    assert encoder.options.codec == "libx264" and encoder.options.preset == "veryfast"
    assert read_video(buffer.getvalue())[0].shape == (3, 32, 32, 3)


def test_encoder_settings_per_canvas_and_machine():
    # libx264 on every core but the producer's; veryfast while a thread has at most 160 000 pixels of a frame
    assert h264_options(1344, 768, 16, nvenc=False) == H264Options("libx264", "veryfast", 15)
    assert h264_options(1344, 768, 8, nvenc=False) == H264Options("libx264", "veryfast", 7)
    assert h264_options(1344, 768, 4, nvenc=False) == H264Options("libx264", "ultrafast", 3)
    assert h264_options(1920, 1080, 16, nvenc=False).preset == "veryfast"
    assert h264_options(3840, 2160, 16, nvenc=False).preset == "ultrafast"
    assert h264_options(224, 128, 1, nvenc=False) == H264Options("libx264", "veryfast", 1)
    assert h264_options(1344, 768, 16, nvenc=True) == H264Options("h264_nvenc", "veryfast", 15)  # the fallback's
    assert H264Options("libx264", "ultrafast", 1).describe() == "libx264 (ultrafast, 1 thread)"
    assert H264Options("h264_nvenc", "veryfast", 15).describe() == "h264_nvenc"


def test_a_given_preset_overrides_the_canvas_choice():
    with Mp4Encoder(io.BytesIO(), preset="ultrafast") as encoder:
        encoder.add(moving_gradient(3, 32, 32))
    assert encoder.options.preset == "ultrafast"


def test_encoder_thread_errors_surface_from_close():
    encoder = Mp4Encoder(io.BytesIO())
    encoder.add(moving_gradient(3, 32, 32))
    encoder.add(moving_gradient(2, 64, 32))  # queued fine; the encoder thread finds the size change
    with pytest.raises(ValueError, match="frame size changed from 32x32 to 32x64"):
        encoder.close()
    with pytest.raises(ValueError, match="frame size changed"):
        encoder.add(moving_gradient(1, 32, 32))
    with pytest.raises(ValueError, match="no frames"):
        Mp4Encoder(io.BytesIO()).close()
