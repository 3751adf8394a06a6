"""Video and audio VAE wrappers on the tiny presets: shapes, normalisation, recipes against diffusers, loading."""

import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
from safetensors.torch import save_file

from engine.io.convert import to_uint8_frames
from engine.models.h3 import vae as V
from engine.models.h3.checkpoint import interleave_qkv, swap_halves
from engine.models.h3.layout import LayoutError, audio_latents, latent_frames


@pytest.fixture(scope="module")
def video_vae():
    return V.build_tiny_video_vae(seed=0)


@pytest.fixture(scope="module")
def audio_vae():
    return V.build_tiny_audio_vae(seed=0)


def smooth_frames(num_frames, height, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(num_frames, 3, height // 8, width // 8, generator=g)
    up = torch.nn.functional.interpolate(base, size=(height, width), mode="bilinear", align_corners=False)
    return (up * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


# --- video ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_frames", [5, 22, 39])
def test_video_frame_rule_round_trip(video_vae, num_frames):
    frames = smooth_frames(num_frames, 64, 96)
    z = video_vae.encode_frames(frames)
    assert z.shape == (1, 24, latent_frames(num_frames), 4, 6) and z.dtype == torch.float32
    out = video_vae.decode(z)
    assert out.shape == (num_frames, 64, 96, 3) and out.dtype == torch.uint8 and out.is_contiguous()


def test_single_image_is_one_latent_frame(video_vae):
    z = video_vae.encode_image(smooth_frames(1, 64, 96)[0])
    assert z.shape == (1, 24, 1, 4, 6)


def test_encode_rejects_bad_frame_counts(video_vae):
    with pytest.raises(LayoutError):
        video_vae.encode_frames(smooth_frames(6, 32, 32))
    with pytest.raises(ValueError):
        video_vae.decode(torch.zeros(1, 24, 3, 2, 2))


def test_encode_recipe_matches_diffusers(video_vae):
    frames = smooth_frames(22, 64, 96, seed=3)
    ours = video_vae.encode_frames(frames)
    pixels = frames.permute(3, 0, 1, 2)[None]
    reference = encode_vae_condition(video_vae.model, pixels, V.IMAGENET_MEAN, V.IMAGENET_STD, encode_seed=42)
    assert torch.equal(ours, reference)
    assert not torch.equal(video_vae.encode_frames(frames, generator_seed=7), ours)


@torch.no_grad()
def test_decode_matches_diffusers_recipe(video_vae):
    z = torch.randn(1, 24, 7, 4, 6, generator=torch.Generator().manual_seed(5))
    ours = video_vae.decode(z)
    mean = torch.tensor(video_vae.model.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(video_vae.model.config.latents_std).view(1, -1, 1, 1, 1)
    video = video_vae.model.decode(z * std + mean, return_dict=False)[0]
    pm, ps = torch.tensor(V.IMAGENET_MEAN).view(1, 3, 1, 1, 1), torch.tensor(V.IMAGENET_STD).view(1, 3, 1, 1, 1)
    video = (video.float() * ps + pm).clamp(0, 1)[0].permute(1, 2, 3, 0).numpy()
    assert np.array_equal(ours.numpy(), np.round(video * np.float32(255)).astype(np.uint8))


@torch.no_grad()
@pytest.mark.parametrize("num_latents, h, w", [(2, 4, 6), (7, 4, 6), (12, 4, 6), (17, 8, 14)])  # 8x14: tiled
def test_decode_chunks_join_to_diffusers_decode(video_vae, num_latents, h, w):
    z = torch.randn(1, 24, num_latents, h, w, generator=torch.Generator().manual_seed(num_latents))
    chunks = list(video_vae.decode_chunks(z))
    n = (num_latents - 2) // 5
    assert [c.shape[0] for c in chunks] == [17] * n + [5]
    x = z * video_vae.latents_std + video_vae.latents_mean
    if num_latents == 2:  # diffusers needs a whole window: the wrapper decodes one and keeps its first 5 frames
        x = torch.cat([x, x[:, :, -1:].expand(-1, -1, 5, -1, -1)], dim=2)
    video = video_vae.model.decode(x, return_dict=False)[0]
    frames = to_uint8_frames(video.float() * video_vae.pixel_std + video_vae.pixel_mean)
    assert torch.equal(torch.cat(chunks), frames[:17 * n + 5])
    assert torch.equal(video_vae.decode(z), frames[:17 * n + 5])


@torch.no_grad()
def test_decoder_weights_cast_once_decode_as_autocast_casts_them():
    """On CUDA the decoder runs under fp16 autocast with its weights cast once beforehand; the CPU analogue (bf16
    autocast) shows that this is exactly what autocast's per-call casts compute, and that the encoder stays fp32."""
    vae = V.build_tiny_video_vae(seed=0)
    z = torch.randn(1, 24, 7, 8, 14, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = vae.model._decode_clip(z)
        vae.cast_decoder_weights(torch.bfloat16)
        cast_once = vae.model._decode_clip(z)
    assert torch.equal(cast_once, reference)
    assert vae.model.post_quant_conv.weight.dtype == torch.bfloat16
    assert {p.dtype for p in vae.model.encoder.parameters()} == {torch.float32}
    assert any(p.dtype == torch.float32 for p in vae.model.decoder.parameters())  # the norms


def test_tiny_decode_at_default_canvas_is_tiled(video_vae):
    model = video_vae.model
    assert model.use_tiling and model.tile_sample_min_width == V.TINY_TILE_SIZE < 224
    z = torch.randn(1, 24, latent_frames(124), 8, 14, generator=torch.Generator().manual_seed(0))
    out = video_vae.decode(z)
    assert out.shape == (124, 128, 224, 3)
    assert out.float().std() > 1.0


def test_latent_constants_match_spec(video_vae, audio_vae):
    assert len(V.VIDEO_LATENTS_MEAN) == len(V.VIDEO_LATENTS_STD) == 24
    assert len(V.AUDIO_LATENTS_MEAN) == len(V.AUDIO_LATENTS_STD) == 32
    assert V.VIDEO_LATENTS_MEAN[0] == 0.858090341091156
    assert V.VIDEO_LATENTS_MEAN[5] == -1.3675414323806763
    assert V.VIDEO_LATENTS_MEAN[23] == 0.7056031823158264
    assert V.VIDEO_LATENTS_STD[2] == 1.68317747116088865
    assert V.VIDEO_LATENTS_STD[13] == 0.44988900423049925
    assert V.VIDEO_LATENTS_STD[22] == 2.28168129920959475
    assert V.AUDIO_LATENTS_MEAN[0] == -0.020211687488382354
    assert V.AUDIO_LATENTS_MEAN[15] == 0.5905951377425391
    assert V.AUDIO_LATENTS_MEAN[31] == 0.3979258376211797
    assert V.AUDIO_LATENTS_STD[1] == 2.76263727217653
    assert V.AUDIO_LATENTS_STD[15] == 3.298670198067373
    assert V.AUDIO_LATENTS_STD[31] == 1.5613768203168363
    assert video_vae.latents_mean_values == V.VIDEO_LATENTS_MEAN
    assert audio_vae.latents_std_values == V.AUDIO_LATENTS_STD
    assert torch.equal(video_vae.latents_std.flatten(), torch.tensor(V.VIDEO_LATENTS_STD))
    assert torch.equal(audio_vae.latents_mean.flatten(), torch.tensor(V.AUDIO_LATENTS_MEAN))


def test_tiny_presets_keep_the_real_compression(video_vae, audio_vae):
    assert video_vae.model.spatial_compression_ratio == 16 and video_vae.model.temporal_compression_ratio == 4
    assert video_vae.model.config.latent_channels == 24
    assert (video_vae.model.config.clip_length, video_vae.model.config.token_drop) == (17, 3)
    assert audio_vae.hop == 800 and audio_vae.sample_rate == 32000 and audio_vae.model.config.latent_channels == 32
    a, b = V.build_tiny_video_vae(seed=0), V.build_tiny_video_vae(seed=1)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], v) for k, v in video_vae.state_dict().items())
    assert not torch.equal(sa["model.decoder.proj_in.weight"], sb["model.decoder.proj_in.weight"])


# --- uint8 conversion ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_to_uint8_frames_matches_numpy(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 3, 5, 6, 10, generator=g) * 1.4 - 0.2
    x.view(-1)[:256] = (torch.arange(256) + 0.5) / 255  # round-half cases
    x = x.to(dtype)
    ref = np.clip(x.float().numpy(), 0, 1) * np.float32(255)
    ref = np.round(ref).astype(np.uint8)[0].transpose(1, 2, 3, 0)
    out = to_uint8_frames(x)
    assert out.dtype == torch.uint8 and out.is_contiguous() and out.shape == (5, 6, 10, 3)
    assert np.array_equal(out.numpy(), ref)
    assert np.array_equal(to_uint8_frames(x[0]).numpy(), ref)


# --- audio ---------------------------------------------------------------------------------------------------

def test_audio_decode_shape_and_stereo(audio_vae):
    ta = audio_latents(124)
    z = torch.randn(2, 32, ta, generator=torch.Generator().manual_seed(0))
    wave = audio_vae.decode(z)
    assert ta == 207 and wave.shape == (2, ta * 800) and wave.dtype == torch.float32
    assert torch.isfinite(wave).all() and wave.abs().max() <= 1.0 and wave.std() > 0
    assert not torch.equal(wave[0], wave[1])
    same = audio_vae.decode(z[:1, :, :20].expand(2, -1, -1))
    assert torch.equal(same[0], same[1])


@torch.no_grad()
def test_audio_encode(audio_vae):
    g = torch.Generator().manual_seed(1)
    stereo = torch.rand(2, 800 * 10 + 5, generator=g) - 0.5
    z = audio_vae.encode(stereo, 32000)
    assert z.shape == (2, 32, 11)
    padded = torch.nn.functional.pad(stereo, (0, 795))[:, None]
    mean = audio_vae.model.encode(padded).latent_dist.mode()
    assert torch.allclose(z, (mean - audio_vae.latents_mean) / audio_vae.latents_std, atol=1e-6)
    mono = audio_vae.encode(torch.rand(1, 48000, generator=g) - 0.5, 48000)  # 1 s at 48 kHz -> 40 latents
    assert mono.shape == (2, 32, 40) and torch.equal(mono[0], mono[1])


# --- loading -------------------------------------------------------------------------------------------------

def test_diffusers_layout_round_trip(tmp_path, video_vae, audio_vae):
    video_vae.model.save_pretrained(tmp_path / "vae")
    audio_vae.model.save_pretrained(tmp_path / "audio_vae")
    v = V.VideoVAE.from_pretrained(tmp_path)
    a = V.AudioVAE.from_pretrained(tmp_path)
    for loaded, ref in ((v, video_vae), (a, audio_vae)):
        ref_sd = ref.model.state_dict()
        assert all(torch.equal(t, ref_sd[k]) for k, t in loaded.model.state_dict().items())
        assert loaded.latents_mean_values == ref.latents_mean_values
    assert v.model.tile_sample_min_height == V.TILE_SIZE


def write_original_video_vae(root, vae):
    """The tiny VAE written in the original MiniMax layout (inverse of the loader's conversion)."""
    model, cfg = vae.model, vae.model.config
    state = model.state_dict()
    original = {"decoder.mask_token": torch.zeros(1, 1, cfg.latent_channels)}
    for key, targets in V.original_video_vae_plan(model).items():
        if ".attn.to_qkv." in key:
            original[key] = interleave_qkv(torch.cat([state[t] for t in targets]), cfg.decoder_num_attention_heads)
        elif ".ff.w1." in key:
            original[key] = swap_halves(state[targets[0]])
        else:
            original[key] = state[targets[0]]
    folder = root / "video_vae"
    (folder / "source").mkdir(parents=True)
    ch = cfg.block_out_channels[0]
    source = {
        "in_channels": 3, "out_ch": 3, "z_channels": 24, "embed_dim": 24, "ch": ch,
        "ch_mult": [c // ch for c in cfg.block_out_channels], "num_res_blocks": cfg.layers_per_block,
        "space_down": list(cfg.spatial_downsample_factors), "time_down": list(cfg.temporal_downsample_factors),
        "norm_num_groups": cfg.norm_num_groups, "padding_mode": "reflect",
        "vit_decoder_kwargs": {"num_layers": cfg.decoder_num_layers, "heads": cfg.decoder_num_attention_heads,
                               "dim_head": cfg.decoder_attention_head_dim, "rope_theta": 100.0,
                               "rope_dim_ratio": 0.75, "num_register_tokens": cfg.decoder_num_register_tokens},
    }
    wrapper = {"source_path": "source", "source_safetensors_path": "model.safetensors", "vae_clip_length": 17,
               "vae_token_drop": 3, "vae_tile_size": V.TINY_TILE_SIZE, "vae_tile_overlap_min": V.TINY_TILE_OVERLAP,
               "latents_mean": list(V.VIDEO_LATENTS_MEAN), "latents_std": list(V.VIDEO_LATENTS_STD)}
    (folder / "source" / "config.json").write_text(json.dumps(source))
    (folder / "config.json").write_text(json.dumps(wrapper))
    weights = folder / "source" / "model.safetensors"
    save_file({k: v.contiguous() for k, v in original.items()}, weights)
    return original, weights


def test_original_layout_video_vae_loads(tmp_path, video_vae):
    write_original_video_vae(tmp_path, video_vae)
    loaded = V.VideoVAE.from_pretrained(tmp_path)
    ref_sd = video_vae.model.state_dict()
    assert all(torch.equal(t, ref_sd[k]) for k, t in loaded.model.state_dict().items())
    assert loaded.model.tile_sample_min_width == V.TINY_TILE_SIZE
    z = torch.randn(1, 24, 2, 4, 6, generator=torch.Generator().manual_seed(2))
    assert torch.equal(loaded.decode(z), video_vae.decode(z))


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_original_layout_names_bad_keys(tmp_path, video_vae, change):
    original, weights = write_original_video_vae(tmp_path, video_vae)
    key = "decoder.transformer_blocks.1.attn.to_qkv.bias"
    if change == "missing":
        del original[key]
    else:
        original[key.replace("to_qkv", "to_qkv_extra")] = original[key].clone()
    save_file({k: v.contiguous() for k, v in original.items()}, weights)
    with pytest.raises(ValueError) as err:
        V.VideoVAE.from_pretrained(tmp_path / "video_vae")
    assert change in str(err.value) and str(weights) in str(err.value)
    assert (key if change == "missing" else "to_qkv_extra") in str(err.value)


def test_original_layout_audio_vae_loads(tmp_path, audio_vae):
    folder = tmp_path / "audio_vae"
    folder.mkdir()
    cfg = audio_vae.model.config
    kwargs = {"encoder_dim": cfg.encoder_dim, "encoder_rates": list(cfg.encoder_rates), "latent_dim": cfg.latent_dim,
              "vae_latent_channels": 32, "decoder_dim": cfg.decoder_dim, "decoder_rates": list(cfg.decoder_rates),
              "decoder_type": "bigvgan", "attn_proj": True, "sample_rate": 32000,
              "num_attention_heads": cfg.num_attention_heads, "resblock_kernel_sizes": cfg.resblock_kernel_sizes,
              "resblock_dilation_sizes": cfg.resblock_dilation_sizes}
    (folder / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": kwargs}}))
    (folder / "config.json").write_text(json.dumps({"latent_channels": 32, "sample_rate": 32000,
                                                    "latents_mean": list(V.AUDIO_LATENTS_MEAN),
                                                    "latents_std": list(V.AUDIO_LATENTS_STD)}))
    state = {k: v.contiguous() for k, v in audio_vae.model.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    loaded = V.AudioVAE.from_pretrained(tmp_path)
    assert all(torch.equal(t, state[k]) for k, t in loaded.model.state_dict().items())
    del state["mean_proj.bias"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match="missing key 'mean_proj.bias'"):
        V.AudioVAE.from_pretrained(folder)


def test_original_conversion_matches_diffusers_classes(video_vae):
    # The plan must cover exactly the model's tensors, with the module names diffusers really uses.
    plan = V.original_video_vae_plan(video_vae.model)
    assert "encoder.down.0.block.0.conv1.weight" in plan
    assert "encoder.down.0.downsample.conv.weight" in plan and "encoder.down.4.downsample.conv.weight" not in plan
    assert "encoder.down.1.block.0.nin_shortcut.weight" in plan
    assert plan["decoder.x_embedder.weight"] == ["decoder.proj_in.weight"]
    assert plan["decoder.transformer_blocks.0.attn.to_qkv.weight"] == [
        f"decoder.transformer_blocks.0.attn.to_{n}.weight" for n in "qkv"]
    assert plan["decoder.transformer_blocks.0.ff.w1.weight"] == ["decoder.transformer_blocks.0.ff.net.0.proj.weight"]
    assert plan["decoder.transformer_blocks.0.attn.to_out.bias"] == ["decoder.transformer_blocks.0.attn.to_out.0.bias"]
    assert sum(len(t) for t in plan.values()) == len(video_vae.model.state_dict())
    assert isinstance(video_vae.model, AutoencoderKLMiniMaxH3)
