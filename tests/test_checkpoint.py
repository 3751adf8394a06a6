"""Strict DiT checkpoint loading: every layout round-trips exactly; every defect gives an error naming key and file."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models.h3.checkpoint import (
    CheckpointError,
    infer_config,
    load_dit,
    save_dit,
    to_diffusers,
)
from engine.models.h3.config import TEST_CONVERSION, TEST_DIFFUSERS, TEXT_TAG, TINY
from engine.models.h3.dit import FP32_MODULES, build_dit
from engine.models.h3.layout import build_layout, row_timesteps

CONFIG = TEST_CONVERSION
QKV = "blocks.1.attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def source():
    model = build_dit(CONFIG, seed=3)
    with torch.no_grad():  # default init leaves norms at one and some biases tiny: perturb every tensor
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def forward(model):
    gen = torch.Generator().manual_seed(0)
    c = model.config
    layout = build_layout(torch.full((5,), TEXT_TAG), num_latent_frames=2, latent_height=4, latent_width=6,
                          num_audio_latents=3, keyframes=("first",))
    timestep, idx = row_timesteps(layout, 0.4, 0.7)
    video = torch.randn(1, layout.video_indices.numel(), c.video_patch_dim, generator=gen)
    audio = torch.randn(1, layout.audio_indices.numel(), c.audio_in_channels, generator=gen)
    text = torch.randn(1, layout.num_text, c.text_dim, generator=gen)
    with torch.no_grad():
        return model(video, audio, text, timestep, idx, layout.token_tags, layout.position_ids.float(),
                     layout.video_indices, layout.audio_indices, layout.text_indices)


def assert_same_weights(actual, expected):
    actual, expected = actual.state_dict(), expected.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def prefixed_comfy(model, path, prefix):
    save_dit(model, path, layout="comfy")
    save_file({prefix + k: v for k, v in load_file(path).items()}, path)
    return path


def rewrite(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_original_layout_stores_interleaved_qkv(source, tmp_path):
    save_dit(source, tmp_path / "orig", layout="original", shards=3)
    index = json.loads((tmp_path / "orig" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "orig" / index["weight_map"][QKV]
    with safe_open(shard, "pt") as f:
        stored = f.get_tensor(QKV)
    ours = source.state_dict()[QKV]
    assert not torch.equal(stored, ours)
    heads, head_dim = CONFIG.num_attention_heads, CONFIG.attention_head_dim
    assert torch.equal(stored.reshape(heads, 3, head_dim, -1).transpose(0, 1).reshape(ours.shape), ours)  # §7.2
    config = json.loads((tmp_path / "orig" / "config.json").read_text())
    assert config["_class_name"] == "MiniMaxH3DiTModel" and config["latents_dim"] == CONFIG.in_channels


@pytest.mark.parametrize("layout", ["original", "comfy", "comfy-prefixed", "diffusers"])
def test_every_layout_loads_to_the_same_model(source, tmp_path, layout):
    if layout == "original":
        path = save_dit(source, tmp_path / "orig", layout="original", shards=3)
    elif layout == "comfy":
        path = save_dit(source, tmp_path / "h3.safetensors", layout="comfy")
    elif layout == "comfy-prefixed":
        path = prefixed_comfy(source, tmp_path / "h3.safetensors", "model.diffusion_model.")
    else:
        path = save_dit(source, tmp_path / "diff", layout="diffusers", shards=4)
        weight_map = json.loads((path / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
        qkv_shards = {weight_map[f"transformer_blocks.1.attn.to_{p}.weight"] for p in "qkv"}
        assert len(qkv_shards) == 2  # one fused QKV is assembled across two shards
    loaded = load_dit(path, dtype=torch.float32)
    assert loaded.config == CONFIG  # from config.json, or inferred for the comfy files
    assert_same_weights(loaded, source)
    v0, a0 = forward(source)
    v1, a1 = forward(loaded)
    assert torch.equal(v0, v1) and torch.equal(a0, a1)


def test_diffusers_file_names_match_diffusers(source, tmp_path):
    path = save_dit(source, tmp_path / "diff", layout="diffusers")
    assert set(load_file(path / "diffusion_pytorch_model.safetensors")) == set(to_diffusers(source.state_dict()))


def test_bf16_load_keeps_fp32_modules(source, tmp_path):
    loaded = load_dit(save_dit(source, tmp_path / "orig", layout="original", shards=2), dtype=torch.bfloat16)
    for name, p in loaded.named_parameters():
        fp32 = any(name.startswith(m + ".") for m in FP32_MODULES)
        assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name
        assert not p.requires_grad and p.device.type == "cpu"
    assert loaded.rope_inv_freq.device.type == "cpu"
    assert torch.equal(loaded.blocks[0].attn.qkv_proj.weight, source.blocks[0].attn.qkv_proj.weight.bfloat16())
    assert loaded.weights_version >= 1


def test_explicit_layout_override(source, tmp_path):
    path = save_dit(source, tmp_path / "orig", layout="original")  # one file + config.json: detected as original
    stored = load_file(path / "model.safetensors")[QKV]
    assert torch.equal(load_dit(path, dtype=torch.float32).state_dict()[QKV], source.state_dict()[QKV])
    assert torch.equal(load_dit(path, dtype=torch.float32, layout="comfy").state_dict()[QKV], stored)


def test_missing_key(source, tmp_path):
    path = save_dit(source, tmp_path / "h3.safetensors")
    rewrite(path, lambda t: t.pop("final_layer.video_out.bias"))
    with pytest.raises(CheckpointError, match=r"missing key 'final_layer.video_out.bias' \(looked in: h3.safetensors"):
        load_dit(path, config=CONFIG)


def test_missing_key_in_shard_names_the_shard(source, tmp_path):
    path = save_dit(source, tmp_path / "orig", layout="original", shards=3)
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][QKV]
    rewrite(path / shard, lambda t: t.pop(QKV))
    with pytest.raises(CheckpointError, match=rf"missing key '{QKV}' \(looked in: {shard}\)"):
        load_dit(path)


def test_missing_key_with_prefix_is_named_in_file_key_space(source, tmp_path):
    path = prefixed_comfy(source, tmp_path / "h3.safetensors", "diffusion_model.")
    rewrite(path, lambda t: t.pop("diffusion_model.blocks.0.norm2.weight"))
    with pytest.raises(CheckpointError, match=r"missing key 'diffusion_model.blocks.0.norm2.weight'.*h3.safetensors"):
        load_dit(path, config=CONFIG)


def test_unexpected_key(source, tmp_path):
    path = save_dit(source, tmp_path / "orig", layout="original", shards=3)
    shard = "model-00002-of-00003.safetensors"
    rewrite(path / shard, lambda t: t.update({"blocks.9.foo.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=rf"{shard}: unexpected key 'blocks.9.foo.weight'"):
        load_dit(path)


def test_unexpected_key_in_diffusers_layout(source, tmp_path):
    path = save_dit(source, tmp_path / "diff", layout="diffusers")
    file = path / "diffusion_pytorch_model.safetensors"
    rewrite(file, lambda t: t.update({"rope.inv_freq": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.safetensors: unexpected key 'rope.inv_freq'"):
        load_dit(path)


def test_wrong_shape(source, tmp_path):
    path = save_dit(source, tmp_path / "x.safetensors")
    key = "blocks.0.mlp.fc2.weight"
    rewrite(path, lambda t: t.update({key: torch.zeros(32, 128)}))
    with pytest.raises(CheckpointError, match=rf"shape mismatch for '{key}' in x.safetensors: file has \[32, 128\], "
                                              r"model expects \[64, 128\]"):
        load_dit(path)


def test_config_json_disagreeing_with_shapes(source, tmp_path):
    path = save_dit(source, tmp_path / "diff", layout="diffusers", shards=2)
    config = json.loads((path / "config.json").read_text())
    config["ffn_dim"] = 96
    (path / "config.json").write_text(json.dumps(config))
    key = "token_refiner.refiner_blocks.0.ff.net.0.proj.weight"  # the first fc1 in model order
    with pytest.raises(CheckpointError, match=rf"shape mismatch for '{key}' in "
                                              r"diffusion_pytorch_model-00001-of-00002.safetensors"):
        load_dit(path)


def test_rope_inv_freq_is_checked(source, tmp_path):
    path = save_dit(source, tmp_path / "orig", layout="original")
    file = path / "model.safetensors"
    rewrite(file, lambda t: t.update({"rope.inv_freq": t["rope.inv_freq"] * 1.01}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: 'rope.inv_freq' does not match"):
        load_dit(path)


@pytest.mark.parametrize("cut", [40, 4])
def test_truncated_file(source, tmp_path, cut):
    path = save_dit(source, tmp_path / "orig", layout="original", shards=3)
    shard = path / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:cut] if cut < 10 else data[:-cut])
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003.safetensors: is truncated or not a safetensors"):
        load_dit(path)


def test_missing_shard(source, tmp_path):
    path = save_dit(source, tmp_path / "orig", layout="original", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json lists shard "
                                              r"'model-00002-of-00003.safetensors', which is missing"):
        load_dit(path)


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_dit(tmp_path)


@pytest.mark.parametrize("config", [TEST_CONVERSION, TEST_DIFFUSERS, TINY], ids=["conversion", "diffusers", "tiny"])
def test_infer_config_from_shapes(config):
    model = build_dit(config, seed=0)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert infer_config(shapes, rope_freq_dim=config.rope_freq_dim) == config
    assert infer_config({**shapes, "rope.inv_freq": (config.rope_freq_dim,)}) == config


def test_diffusers_directory_without_config_json(tmp_path):
    model = build_dit(TEST_DIFFUSERS, seed=0)
    path = save_dit(model, tmp_path / "diff", layout="diffusers")
    (path / "config.json").unlink()
    loaded = load_dit(path, dtype=torch.float32)
    # The diffusers layout has no rope.inv_freq: rope_freq_dim falls back to the default.
    assert loaded.config == replace(TEST_DIFFUSERS, rope_freq_dim=16)
    assert_same_weights(loaded, model)
