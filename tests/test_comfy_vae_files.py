"""Comfy-Org VAE single files (F16 video VAE with latent statistics, F32 audio VAE with weight norm folded), tiny
versions written by the tests in that schema, load into the diffusers classes strictly."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.h3.vae import (TINY_AUDIO_VAE, TINY_VIDEO_VAE, TOY_AUDIO_VAE, TOY_VIDEO_VAE, VideoVAE,
                                  audio_vae_file_config, build_tiny_audio_vae, build_tiny_video_vae,
                                  load_audio_vae_file, load_video_vae_file, save_audio_vae_file, save_video_vae_file,
                                  video_vae_file_config)


def comfy_video_vae_file(vae, path, prefix=""):
    """The file with doubled latent stds: loading it proves the file's statistics are used."""
    doubled = VideoVAE(vae.model, vae.latents_mean_values, [2 * s for s in vae.latents_std_values])
    return save_video_vae_file(doubled, path, prefix)


def comfy_audio_vae_file(vae, path):
    return save_audio_vae_file(vae, path)


@pytest.mark.parametrize("prefix", ["", "first_stage_model."])
def test_video_vae_fp16_file(tmp_path, prefix):
    vae = build_tiny_video_vae(seed=2)
    path = comfy_video_vae_file(vae, tmp_path / "minimax_h3_video_vae_fp16.safetensors", prefix)
    loaded = load_video_vae_file(path, dict(TINY_VIDEO_VAE))
    for key, value in vae.model.state_dict().items():
        assert loaded.model.state_dict()[key].dtype == torch.float32
        assert torch.equal(loaded.model.state_dict()[key], value.half().float()), key
    assert loaded.latents_mean_values == vae.latents_mean_values
    assert loaded.latents_std_values == tuple((torch.tensor(vae.latents_std_values) * 2).tolist())
    z = torch.randn(1, 24, 7, 2, 2)
    reference = build_tiny_video_vae(seed=2)
    reference.model.load_state_dict({k: v.half().float() for k, v in reference.model.state_dict().items()})
    assert torch.allclose(loaded.model.decode(z).sample, reference.model.decode(z).sample, atol=1e-5)


def test_video_vae_file_missing_key(tmp_path):
    path = comfy_video_vae_file(build_tiny_video_vae(), tmp_path / "v.safetensors")
    tensors = load_file(path)
    tensors.pop("decoder.transformer_blocks.1.attn.to_out.bias")
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing key 'decoder.transformer_blocks.1.attn.to_out.bias' in "
                                         r"v.safetensors"):
        load_video_vae_file(path, dict(TINY_VIDEO_VAE))


def test_video_vae_file_without_statistics(tmp_path):
    path = comfy_video_vae_file(build_tiny_video_vae(), tmp_path / "v.safetensors")
    tensors = load_file(path)
    tensors.pop("latents_std")
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing key 'latents_std' in v.safetensors"):
        load_video_vae_file(path, dict(TINY_VIDEO_VAE))


def test_audio_vae_fp32_file_weight_norm_folded(tmp_path):
    vae = build_tiny_audio_vae(seed=4)
    path = comfy_audio_vae_file(vae, tmp_path / "minimax_h3_audio_vae_fp32.safetensors")
    assert not any(k.endswith("weight_g") for k in load_file(path))
    loaded = load_audio_vae_file(path, dict(TINY_AUDIO_VAE))
    z = torch.randn(1, 32, 1)
    assert torch.allclose(loaded.decode(z), vae.decode(z), atol=1e-5)
    wave = torch.randn(1, 2400) * 0.1
    assert torch.allclose(loaded.encode(wave, 32000), vae.encode(wave, 32000), atol=1e-4)


def test_audio_vae_file_unexpected_key(tmp_path):
    path = comfy_audio_vae_file(build_tiny_audio_vae(), tmp_path / "a.safetensors")
    tensors = load_file(path)
    tensors["decoder.conv_post.weight_g"] = torch.ones(1, 1, 1)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"unexpected key 'decoder.conv_post.weight_g' in a.safetensors"):
        load_audio_vae_file(path, dict(TINY_AUDIO_VAE))


def test_audio_vae_file_header_names_its_architecture(tmp_path):
    """The embedded default's audio VAE (four upsamplers, not the release's seven) loads from its file alone: the
    header records the architecture, and a file without one still takes the given or the released config."""
    vae = build_tiny_audio_vae(seed=5, config=TOY_AUDIO_VAE)
    path = comfy_audio_vae_file(vae, tmp_path / "minimax_h3_toy_audio_vae_fp32.safetensors")
    assert audio_vae_file_config(path)["decoder_rates"] == [8, 5, 5, 4]
    loaded = load_audio_vae_file(path)
    assert loaded.model.config.decoder_dim == TOY_AUDIO_VAE["decoder_dim"]
    z = torch.randn(2, 32, 3)
    assert torch.allclose(loaded.decode(z), vae.decode(z), atol=1e-5)

    tensors = load_file(path)
    bare = tmp_path / "bare.safetensors"
    save_file(tensors, bare)
    assert audio_vae_file_config(bare) is None
    with pytest.raises(ValueError, match=r"bare.safetensors"):  # read as the release: every shape disagrees
        load_audio_vae_file(bare)
    save_file(tensors, bare, metadata={"config": '{"decoder_dim": 256, "upsample_rates": [8, 5, 5, 4]}'})
    with pytest.raises(ValueError, match=r"unknown audio VAE setting\(s\) \['upsample_rates'\].*allowed: encoder_dim"):
        load_audio_vae_file(bare)


def test_video_vae_file_header_names_its_architecture(tmp_path):
    """The embedded default's video VAE (the tiny encoder, a wider decoder) loads from its file alone, as the audio
    VAE does; a file without a header is read as the release."""
    vae = build_tiny_video_vae(seed=6, config=TOY_VIDEO_VAE)
    path = comfy_video_vae_file(vae, tmp_path / "minimax_h3_toy_video_vae_fp16.safetensors")
    assert video_vae_file_config(path)["decoder_attention_head_dim"] == TOY_VIDEO_VAE["decoder_attention_head_dim"]
    loaded = load_video_vae_file(path)
    assert loaded.model.decoder.proj_in.out_features == 6 * 32
    z = torch.randn(1, 24, 7, 2, 3)
    reference = build_tiny_video_vae(seed=6, config=TOY_VIDEO_VAE)
    reference.model.load_state_dict({k: v.half().float() for k, v in reference.model.state_dict().items()})
    assert torch.allclose(loaded.model.decode(z).sample, reference.model.decode(z).sample, atol=1e-5)

    tensors = load_file(path)
    bare = tmp_path / "bare.safetensors"
    save_file(tensors, bare)
    assert video_vae_file_config(bare) is None
    with pytest.raises(ValueError, match=r"bare.safetensors"):
        load_video_vae_file(bare)
    save_file(tensors, bare, metadata={"config": '{"decoder_width": 128}'})
    with pytest.raises(ValueError, match=r"unknown video VAE setting\(s\) \['decoder_width'\].*allowed: latent_channels"):
        load_video_vae_file(bare)
