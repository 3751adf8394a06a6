"""Live previews: a 2x2 sheet of latent frames from the first to the last, each through the video VAE's own linear
latent -> RGB projection (ComfyUI's factors for the released VAE, the fitted pair a toy VAE file carries)."""

import io

import numpy as np
import torch
from PIL import Image

from engine.models.h3 import vae as V
from engine.server.preview import preview_jpeg
from engine.server.scheduler import latent_rgb


def quadrant_means(jpeg: bytes) -> np.ndarray:
    image = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=float)
    h, w = image.shape[0] // 2, image.shape[1] // 2
    return np.array([image[r * h + 4:(r + 1) * h - 4, c * w + 4:(c + 1) * w - 4].mean((0, 1))
                     for r in range(2) for c in range(2)])


def test_preview_is_a_sheet_from_first_to_last_frame_in_the_projected_colours():
    T, h, w = 37, 8, 14
    latents = -torch.ones(1, 24, T, h, w)
    picks = (0, 12, 24, 36)  # where four evenly spread frames fall in 37
    for channel, t in enumerate(picks[:3]):
        latents[0, channel, t] = 1.0  # frame 0 red, 12 green, 24 blue, 36 black
    factors = torch.zeros(24, 3)
    factors[:3] = torch.eye(3)  # rgb = the first three channels
    sheet = quadrant_means(preview_jpeg(latents, (factors, torch.zeros(3))))
    expected = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [0, 0, 0]], dtype=float)
    assert np.abs(sheet - expected).max() < 40, sheet.round()


def test_preview_of_a_single_latent_frame_is_that_frame():
    latents = torch.zeros(1, 24, 1, 4, 6)
    image = Image.open(io.BytesIO(preview_jpeg(latents, (torch.zeros(24, 3), torch.tensor([1.0, -1.0, -1.0])))))
    assert image.size == (512, 341) and np.asarray(image)[..., 0].mean() > 240  # 4h x 4w, long side 512


def test_video_vae_file_carries_its_fitted_projection(tmp_path):
    vae = V.build_tiny_video_vae(0)
    assert torch.equal(vae.latent_rgb[0], torch.tensor(V.VIDEO_LATENT_RGB_FACTORS))  # ComfyUI's, by default
    fitted = (torch.randn(24, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0.1, -0.2, 0.3]))
    vae.latent_rgb = fitted
    path = V.save_video_vae_file(vae, tmp_path / "vae.safetensors")
    loaded = V.load_video_vae_file(path, dict(V.TINY_VIDEO_VAE))
    assert all(torch.equal(a, b) for a, b in zip(loaded.latent_rgb, fitted))

    class Runner:  # the scheduler reads the projection of the loaded pipeline's VAE
        pipeline = type("Pipe", (), {"video_vae": loaded})()

    assert latent_rgb(Runner()) is loaded.latent_rgb
    assert torch.equal(torch.as_tensor(latent_rgb(None)[1]), torch.tensor(V.VIDEO_LATENT_RGB_BIAS))
