"""SeedVR2 temporal batches joined in latent space: the latents two batches share are crossfaded and every other
latent is the batch's own, bit for bit; the clip is decoded in one causal pass, so the frames before the first
overlap are the first batch decoded alone, bit for bit; a seam (batches whose outputs differ by a constant offset)
is spread into steps no larger than the content's own, where a hard cut (the control) leaves it."""

import pytest
import torch
import torch.nn.functional as F

from engine.models.seedvr2.config import LATENT_SCALE
from engine.models.seedvr2.pipeline import SeedVR2Pipeline, crossfade, plan_batches


pytestmark = pytest.mark.usefixtures("one_thread")


def steps(latents: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between consecutive latent frames [T, h, w, c] -> [T - 1]."""
    return (latents[1:] - latents[:-1]).abs().mean((1, 2, 3))


def vae_scale(x0: torch.Tensor) -> torch.Tensor:
    return (x0 / LATENT_SCALE).permute(3, 0, 1, 2)[None]


def test_crossfade_blends_the_shared_latents_and_keeps_the_rest():
    batches = plan_batches(14, 6, 2)
    assert batches == [(0, 6), (4, 10), (8, 14)]
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(6, 2, 3, 4, generator=gen) for _ in batches]
    x0 = torch.empty(14, 2, 3, 4)
    for i, ((start, _), out) in enumerate(zip(batches, outs)):
        crossfade(x0, out, start, batches[i - 1][1] if i else start)
    for t, (batch, offset) in {0: (0, 0), 3: (0, 3), 6: (1, 2), 7: (1, 3), 10: (2, 2), 13: (2, 5)}.items():
        assert torch.equal(x0[t], outs[batch][offset])  # one batch's latent: untouched
    for first in (4, 8):  # two shared latents: the earlier batch weighs 2/3, then 1/3
        i = first // 4 - 1
        torch.testing.assert_close(x0[first], outs[i][4] * 2 / 3 + outs[i + 1][0] / 3)
        torch.testing.assert_close(x0[first + 1], outs[i][5] / 3 + outs[i + 1][1] * 2 / 3)


def drifting_clip(frames: int = 45) -> torch.Tensor:
    """A smooth texture moving one pixel a frame: uint8 [frames, 16, 16, 3]."""
    texture = F.avg_pool2d(torch.rand(1, 3, 16, 80, generator=torch.Generator().manual_seed(0)), 3, 1, 1)[0]
    clip = torch.stack([torch.roll(texture, t, dims=-1)[:, :, :16] for t in range(frames)])
    return (clip.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)


def offset_batches(pipe: SeedVR2Pipeline, overlap_frames: int):
    """Upscales the drifting clip (45 frames: 12 latents) in batches of 21 frames (6 latents) whose DiT outputs are
    the LQ latents plus i * c for batch i (c: twice the first batch's largest frame step). -> (the joined x0, each
    batch's own output, the largest frame step inside any batch)."""
    own, joined = [], []

    def predict(cond):
        noise, lq = cond[..., :16], cond[..., 16:32]
        if not own:
            predict.c = 2 * steps(lq).max()
        v = noise - lq - predict.c * len(own)
        own.append(noise - v)  # what `denoise` makes of it
        return v

    decode = pipe.decode
    pipe.predict = predict
    pipe.decode = lambda x0, *args: joined.append(x0.clone()) or decode(x0, *args)
    try:
        pipe.upscale(drifting_clip(), scale=2, color_fix="none", batch_frames=21, overlap_frames=overlap_frames)
    finally:
        del pipe.predict, pipe.decode
    return joined[0], own, max(steps(out).max() for out in own)


@pytest.fixture(scope="module")
def toy():
    return SeedVR2Pipeline.from_preset("toy")  # trained weights: its VAE reconstructs, so steps mean motion


def test_a_constant_offset_seam_is_spread_to_the_in_batch_level(toy):
    x0, own, level = offset_batches(toy, 12)  # latents 0-5, 3-8, 6-11: 3 shared between neighbours
    assert len(own) == 3 and torch.equal(x0[:3], own[0][:3]) and torch.equal(x0[9:], own[2][3:])
    assert steps(x0).max() <= 1.2 * level

    cut, own, level = offset_batches(toy, 0)  # the control: latents 0-5, then 6-11, nothing shared
    assert len(own) == 2 and torch.equal(cut[:6], own[0]) and torch.equal(cut[6:], own[1])
    assert steps(cut)[5] >= 1.5 * level  # the seam


def test_frames_before_the_first_overlap_are_the_first_batch_decoded_alone(toy):
    x0, own, _ = offset_batches(toy, 12)
    with torch.no_grad():
        joined, alone = toy.vae.decode(vae_scale(x0)), toy.vae.decode(vae_scale(own[0]))
    assert torch.equal(joined[:, :, :9], alone[:, :, :9])  # pixel frames 0-8 come from latents 0-2 alone
    assert not torch.equal(joined[:, :, 9:21], alone[:, :, 9:21])
