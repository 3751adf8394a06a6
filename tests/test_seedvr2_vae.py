"""SeedVR2 causal VAE: released size, 4n+1 shapes, exact temporal chunking and conv banding, causality, tiling."""

import pytest
import torch

import engine.models.seedvr2.vae as V
from engine.models.seedvr2.config import TINY_VAE, VAE
from engine.models.seedvr2.vae import Causal, CausalConv3d, VideoVAE, build_vae, depth_to_space, tiled


@pytest.fixture(scope="module")
def vae():
    model = build_vae(TINY_VAE, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def video(frames, height=32, width=48, seed=0):
    return torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_released_size():
    with torch.device("meta"):
        model = VideoVAE(VAE)
    sd = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == 250_648_227
    assert sd["encoder.down_blocks.0.downsamplers.0.conv.weight"].shape == (128, 128, 1, 3, 3)
    assert sd["encoder.down_blocks.1.downsamplers.0.conv.weight"].shape == (256, 256, 3, 3, 3)
    assert "encoder.down_blocks.3.downsamplers.0.conv.weight" not in sd
    assert sd["decoder.up_blocks.1.upsamplers.0.upscale_conv.weight"].shape == (4096, 512, 1, 1, 1)
    assert sd["decoder.up_blocks.2.upsamplers.0.upscale_conv.weight"].shape == (1024, 256, 1, 1, 1)
    assert sd["encoder.conv_out.weight"].shape == (32, 512, 3, 3, 3)
    assert sd["decoder.mid_block.attentions.0.to_out.0.weight"].shape == (512, 512)


@torch.no_grad()
def test_shapes_and_exact_chunking(vae):
    x = video(9, 16, 32)
    whole = vae.encoder(x)
    assert whole.shape == (1, 32, 3, 2, 4)
    vae.encode_chunk = 4  # frames 0-4, then 5-8: the causal memory crosses the chunk boundary
    torch.testing.assert_close(vae.encode(x), whole, rtol=1e-5, atol=1e-5)
    z = whole[:, :16]
    full = vae.decoder(z)
    assert full.shape == (1, 3, 9, 16, 32)
    vae.decode_chunk = 1
    torch.testing.assert_close(vae.decode(z), full, rtol=1e-4, atol=1e-5)
    vae.encode_chunk, vae.decode_chunk = 8, 2
    with pytest.raises(ValueError, match="4n\\+1"):
        vae.encode(video(8))


@torch.no_grad()
def test_causal_in_time(vae):
    x = video(13, 16, 16)
    y = x.clone()
    y[:, :, 5:] = -y[:, :, 5:]  # only frames of latent 2 and later change
    a, b = vae.encode(x), vae.encode(y)
    torch.testing.assert_close(a[:, :, :2], b[:, :, :2])
    assert not torch.allclose(a[:, :, 2:], b[:, :, 2:])
    za, zb = a[:, :16].clone(), a[:, :16].clone()
    zb[:, :, 2:] += 1.0
    da, db = vae.decode(za), vae.decode(zb)
    torch.testing.assert_close(da[:, :, :5], db[:, :, :5])  # pixel frames 0-4 come from latents 0-1


@torch.no_grad()
def test_conv_bands_are_exact(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 5, 23, 18, generator=gen)
    for conv in (CausalConv3d(4, 6), CausalConv3d(4, 6, (3, 3, 3), (2, 2, 2), space_pad=(0, 1, 0, 1))):
        ref = conv(x)
        monkeypatch.setattr(V, "CONV_MAX_ELEMENTS", 600)
        torch.testing.assert_close(conv(x), ref, rtol=1e-5, atol=1e-6)
        monkeypatch.setattr(V, "CONV_MAX_ELEMENTS", 1 << 28)
    state, conv = Causal(), CausalConv3d(4, 6)
    chunked = torch.cat([conv(x[:, :, :2], state), conv(x[:, :, 2:], state)], dim=2)
    torch.testing.assert_close(chunked, conv(x))


def test_depth_to_space_channel_order():
    c, rt = 3, 2
    x = torch.arange(4 * rt * c, dtype=torch.float32).view(1, -1, 1, 1, 1).expand(1, -1, 2, 2, 2)
    y = depth_to_space(x.contiguous(), rt)
    assert y.shape == (1, c, 2 * rt, 4, 4)
    for xs in range(2):
        for ys in range(2):
            for z in range(rt):
                for ch in range(c):
                    value = ((xs * 2 + ys) * rt + z) * c + ch
                    assert y[0, ch, 1 * rt + z, 1 * 2 + xs, 0 * 2 + ys] == value


def test_tiles_blend_exactly_for_pointwise_maps():
    x = torch.randn(2, 3, 2, 40, 56)
    seen = []

    def fn(t, index):
        seen.append(index)
        return torch.repeat_interleave(torch.repeat_interleave(t * 2 + 1, 8, dim=-2), 8, dim=-1)

    torch.testing.assert_close(tiled(fn, x, tile=16, overlap=6, scale=8), fn(x, 0))
    assert seen[:-1] == list(range(4 * 5))  # every tile once, numbered (rows 0 10 20 24, columns 0 10 20 30 40)
    torch.testing.assert_close(tiled(lambda t, i: t[..., ::8, ::8], x, tile=24, overlap=8, scale=1 / 8),
                               x[..., ::8, ::8])


@torch.no_grad()
def test_tiled_vae_runs_and_is_exact_when_one_tile_fits(vae):
    x = video(5, 32, 48)
    vae.tile_size, vae.tile_overlap = 48, 16
    torch.testing.assert_close(vae.encode(x, tiling=True), vae.encode(x))
    vae.tile_size = 32
    moments = vae.encode(x, tiling=True)
    assert moments.shape == (1, 32, 2, 4, 6) and torch.isfinite(moments).all()
    assert vae.decode(moments[:, :16], tiling=True).shape == (1, 3, 5, 32, 48)
    vae.tile_size, vae.tile_overlap = 1024, 128
