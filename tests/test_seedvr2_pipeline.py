"""SeedVR2 pipeline on the tiny preset: output sizes, 4n+1 batches of latents with overlap, frame count kept; colour
fix."""

import pytest
import torch

from engine.models.seedvr2.colorfix import color_fix, lab_fix, wavelet_decomposition, wavelet_fix
from engine.models.seedvr2.pipeline import (SeedVR2Pipeline, UpscaleError, batch_latents, output_size, plan_batches,
                                            snap_frames)


@pytest.fixture(scope="module")
def pipe():
    return SeedVR2Pipeline.from_preset("tiny")


def clip(frames=9, height=64, width=96, seed=0):
    return torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_output_sizes():
    assert output_size(768, 1344, resolution="1080p") == (1080, 1890)
    assert output_size(720, 1280, resolution="4K") == (2160, 3840)
    assert output_size(720, 1280, resolution="2k") == (1440, 2560)
    assert output_size(1344, 768, resolution=1080) == (1890, 1080)  # short edge, portrait
    assert output_size(64, 96, scale=1.5) == (96, 144)
    assert output_size(64, 96, target_height=100, target_width=151) == (100, 152)  # even sides for H.264
    assert output_size(64, 96, target_width=200) == (134, 200)
    for kwargs in ({}, {"scale": 2, "resolution": "1080p"}, {"resolution": "8k"}, {"scale": -1}):
        with pytest.raises(UpscaleError):
            output_size(64, 96, **kwargs)


def test_batches_of_latents_overlap():
    assert [snap_frames(n) for n in (1, 4, 5, 8, 9, 20, 21)] == [1, 1, 5, 5, 9, 17, 21]
    assert plan_batches(3, None, 1) == [(0, 3)] and plan_batches(3, 6, 1) == [(0, 3)]
    for latents, size, overlap in ((30, 8, 2), (31, 9, 1), (17, 5, 0), (10, 9, 8)):
        batches = plan_batches(latents, size, overlap)
        assert batches[0][0] == 0 and batches[-1][1] == latents
        for (s0, e0), (s1, e1) in zip(batches, batches[1:]):
            assert s0 < s1 and e0 - s1 >= min(overlap, size - 1)
        assert all(e - s == size for s, e in batches)
    # The user's options: 121 frames = 31 latents; 33-frame batches = 9 latents; 4 frames shared = 1 latent, 5 = 2.
    assert batch_latents(121, 33, 4) == [(0, 9), (8, 17), (16, 25), (22, 31)]
    assert batch_latents(121, 33, 5)[:2] == [(0, 9), (7, 16)]
    assert batch_latents(7, 6, 3) == [(0, 2), (1, 3)]  # 7 frames run as 9 (3 latents), batches of 5 frames
    assert batch_latents(121, None, 4) == [(0, 31)] and batch_latents(121, 33, 0)[1] == (9, 18)


def test_upscale_tiny_clip_keeps_frames_and_streams_them(pipe):
    frames = clip()
    steps = []
    pipe.vae.decode_chunk = 1  # 3 latents decode as 2 chunks: frames 0-4, then 5-8
    try:
        out = pipe.upscale(frames, target_height=72, target_width=104, seed=3, on_step=steps.append)
    finally:
        pipe.vae.decode_chunk = 2
    assert out.shape == (9, 72, 104, 3) and out.dtype == torch.uint8 and out.device.type == "cpu"
    assert [e.done for e in steps] == list(range(steps[-1].total + 1))
    assert [e.detail for e in steps[1:]] == ["VAE encode", "batch 1/1: DiT", "VAE decode", "VAE decode"]
    decoded = [e.frames for e in steps if e.frames is not None]  # each decode chunk's final frames, in order
    assert [(d.start, len(d.pixels), d.total) for d in decoded] == [(0, 5, 9), (5, 4, 9)]
    assert all(d.pixels.data_ptr() == out[d.start].data_ptr() for d in decoded)  # views of the result
    assert [e.preview.data_ptr() for e in steps if e.preview is not None] == [out[4].data_ptr(), out[8].data_ptr()]


def test_upscale_in_overlapping_batches(pipe):
    frames = clip(7, 32, 48)  # 7 frames: not 4n+1; batches of 5 overlapping by 3
    steps = []
    out = pipe.upscale(frames, scale=1.5, batch_frames=6, overlap_frames=3, color_fix="lab", on_step=steps.append)
    assert out.shape == (7, 48, 72, 3)
    assert [e.detail for e in steps if "DiT" in (e.detail or "") and e.done] == ["batch 1/2: DiT", "batch 2/2: DiT"]


def test_area_resize_is_the_official_crop(pipe):
    out = pipe.upscale(clip(1, 40, 60), resolution=56, resize="area", color_fix="none", seed=5)
    assert out.shape == (1, 48, 80, 3)  # 56x84 area at the input aspect, centre-cropped to multiples of 16
    assert torch.equal(out, pipe.upscale(clip(1, 40, 60), resolution=56, resize="area", color_fix="none", seed=5))
    with pytest.raises(UpscaleError, match="uint8"):
        pipe.upscale(clip().float(), scale=2)
    with pytest.raises(UpscaleError, match="Colour fix"):
        pipe.upscale(clip(), scale=2, color_fix="adain")


def test_wavelet_fix_takes_the_reference_low_frequencies():
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(2, 3, 64, 64, generator=gen) * 0.5 - 0.25
    detail = torch.randn(2, 3, 64, 64, generator=gen) * 0.05
    restored = base + detail + torch.tensor([0.3, -0.2, 0.1]).view(1, 3, 1, 1)  # a colour cast
    fixed = wavelet_fix(restored, base)
    high, low = wavelet_decomposition(restored)
    torch.testing.assert_close(high + low, restored)
    assert (fixed.mean((2, 3)) - base.mean((2, 3))).abs().max() < 0.01  # the cast is gone
    assert (restored.mean((2, 3)) - base.mean((2, 3))).abs().max() > 0.19
    corr = torch.corrcoef(torch.stack([(fixed - base).flatten(), detail.flatten()]))[0, 1]
    assert corr > 0.9  # the fine detail stays
    torch.testing.assert_close(color_fix(restored, base, "none"), restored)


def test_lab_fix():
    gen = torch.Generator().manual_seed(1)
    ref = torch.rand(2, 3, 32, 32, generator=gen) * 1.6 - 0.8
    torch.testing.assert_close(lab_fix(ref, ref), ref, rtol=0, atol=1e-3)
    warm = (ref + torch.tensor([0.3, 0.0, -0.3]).view(1, 3, 1, 1)).clamp(-1, 1)
    fixed = lab_fix(warm, ref)
    assert (fixed.mean((2, 3)) - ref.mean((2, 3))).abs().max() < 0.03
