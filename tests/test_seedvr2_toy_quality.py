"""The trained toy SeedVR2 (engine/weights/toy/seedvr2) on held-out degraded toy clips (issue 18: beat bicubic by
>= 2 dB PSNR against the ground truth; the colour fix keeps the mean colour within ΔE 3), and the two things that
bound it: the VAE's reconstruction of the ground truth (a ceiling for whatever the DiT restores) and the DiT's
restoration in latent space, which must not carry the noise it is given at t = 1000.

The committed pair (stop 35: the VAE trained on an H200, the DiT on it there and then on the CPU; README)
reconstructs toy_eval's 4 upscale clips at 35.8 dB and upscales them at 33.5 dB against bicubic's 29.3 (+4.1 dB).
Its DiT adds 0.3 dB in pixels over passing the LQ latent through, but in latent space its x0 is still a little
further from the ground truth's latent than the LQ latent on the first test clip: that check stays a strict xfail
until a longer DiT run clears it.
"""

import numpy as np
import pytest
import torch

from engine.models.seedvr2.config import LATENT_SCALE
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.models.seedvr2.vae import posterior_sample
from training.quality import delta_e76, mean_colour_lab, psnr
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train_seedvr2 import UPSCALE_SEED, degrade, to_model

WIDTH, HEIGHT, FRAMES = 224, 128, 17
dit_short_of_target = pytest.mark.xfail(strict=True, reason="the committed toy DiT's x0 is further from the ground "
                                                             "truth's latent than the LQ latent on clip 0 (MSE 0.0228 "
                                                             "vs 0.0220; clip 1: 0.0195 vs 0.0374)")


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return SeedVR2Pipeline.from_preset("toy")


@pytest.fixture(scope="module")
def clips():
    """(ground truth, degraded copy) of two of toy_eval's held-out upscale clips (17 frames)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(2):
        hr = render(sample_scene(UPSCALE_SEED + i, WIDTH, HEIGHT), WIDTH, HEIGHT, 1.0).frames[:FRAMES]
        out.append((hr, degrade(hr, rng)))
    return out


def bicubic(lq: np.ndarray) -> np.ndarray:
    return ((to_model(lq, (HEIGHT, WIDTH), "cpu").permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy()


@torch.no_grad()
def latent(pipe, frames: np.ndarray, generator=None) -> torch.Tensor:
    return posterior_sample(pipe.vae.encode(to_model(frames, (HEIGHT, WIDTH), "cpu")[None]),
                            generator)[0].permute(1, 2, 3, 0) * LATENT_SCALE


@torch.no_grad()
def test_the_vae_reconstructs_the_ground_truth_above_bicubic(toy, clips):
    """Encode -> decode of the ground truth (no DiT, no colour fix) must clear bicubic from the degraded copy by a
    margin, else no DiT can beat bicubic by 2 dB."""
    for hr, lq in clips:
        recon = toy.vae.decode((latent(toy, hr) / LATENT_SCALE).permute(3, 0, 1, 2)[None])[0].clamp(-1, 1)
        recon = ((recon.permute(1, 2, 3, 0) + 1) * 127.5).round().byte().numpy()
        assert psnr(recon, hr) >= psnr(bicubic(lq), hr) + 3.0, (psnr(recon, hr), psnr(bicubic(lq), hr))


@dit_short_of_target
@torch.no_grad()
def test_the_dit_restores_towards_the_ground_truth_whatever_the_noise(toy, clips):
    """x0 = noise - v at t = 1000 is nearer the ground truth's latent than the LQ latent it starts from, and two
    noise draws give (nearly) the same x0."""
    for hr, lq in clips:
        gt, cond = latent(toy, hr), latent(toy, lq, torch.Generator().manual_seed(0))
        x0 = []
        for seed in (1, 2):
            noise = torch.randn(cond.shape, generator=torch.Generator().manual_seed(seed))
            x0.append(noise - toy.dit(torch.cat([noise, cond, torch.ones_like(cond[..., :1])], -1), toy.text))
        lq_error = (cond - gt).square().mean()
        assert (x0[0] - gt).square().mean() < lq_error, ((x0[0] - gt).square().mean(), lq_error)
        assert (x0[0] - x0[1]).square().mean() < 0.25 * lq_error, ((x0[0] - x0[1]).square().mean(), lq_error)


def test_upscaling_a_degraded_clip_beats_bicubic_by_2_db_and_keeps_its_colour(toy, clips):
    for hr, lq in clips:
        out = toy.upscale(lq, target_height=HEIGHT, target_width=WIDTH).numpy()
        assert psnr(out, hr) >= psnr(bicubic(lq), hr) + 2.0, (psnr(out, hr), psnr(bicubic(lq), hr))
        assert delta_e76(mean_colour_lab(out), mean_colour_lab(hr)) <= 3.0

