"""SeedVR2 checkpoints in the official key layout: strict loading of .safetensors and .pth (fp32 / fp16 / bf16 /
fp8), named errors, the broken fp8 7B file refused, weights-only text embeddings, and a models folder end to end."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.seedvr2.checkpoint import (
    CheckpointError,
    find_models,
    infer_dit_config,
    load_nadit,
    load_text_embedding,
    load_vae,
    recorded_config,
    save_checkpoint,
)
from engine.models.seedvr2.config import TINY_3B, TINY_7B, TINY_VAE, NaDiTConfig, VAEConfig
from engine.models.seedvr2.nadit import build_nadit
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.models.seedvr2.vae import build_vae


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def dits():
    return {"3b": perturbed(build_nadit(TINY_3B, seed=4)), "7b": perturbed(build_nadit(TINY_7B, seed=5))}


def inputs(config):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 16, 33, generator=gen), torch.randn(4, config.text_dim, generator=gen)


@pytest.mark.parametrize("size", ["3b", "7b"])
@pytest.mark.parametrize("suffix, dtype", [(".safetensors", None), (".pth", None), (".safetensors", torch.float16),
                                           (".pth", torch.bfloat16)])
def test_official_layout_loads_strictly_and_runs(dits, tmp_path, size, suffix, dtype):
    model = dits[size]
    path = save_checkpoint(model, tmp_path / f"seedvr2_ema_{size}{suffix}", dtype=dtype)
    config = infer_dit_config({k: tuple(v.shape) for k, v in model.state_dict().items()})
    assert dataclasses.replace(config, window_area=model.config.window_area) == model.config
    loaded = load_nadit(path, model.config, dtype=torch.float32)
    vid, txt = inputs(model.config)
    tol = 0 if dtype is None else 3e-2
    torch.testing.assert_close(loaded(vid, txt), model(vid, txt), rtol=tol, atol=tol)
    assert loaded.blocks[0].ada.get("vid").attn_scale.dtype == torch.float32


def _edit(path, fn):
    sd = load_file(str(path))
    fn(sd)
    save_file(sd, str(path))


def test_named_errors(dits, tmp_path):
    model = dits["3b"]
    path = save_checkpoint(model, tmp_path / "dit.safetensors")
    _edit(path, lambda sd: sd.pop("blocks.1.attn.norm_k.txt.weight"))
    with pytest.raises(CheckpointError, match=r"dit\.safetensors: missing key 'blocks\.1\.attn\.norm_k\.txt\.weight'"):
        load_nadit(path, model.config)
    path = save_checkpoint(model, tmp_path / "dit.safetensors")
    _edit(path, lambda sd: sd.update({"blocks.2.mlp.all.proj_in.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"'blocks\.2\.mlp\.all\.proj_in\.weight' in dit\.safetensors: file "
                                              r"has \[3, 3\], model expects \[176, 64\]"):
        load_nadit(path, model.config)
    path = save_checkpoint(model, tmp_path / "dit.safetensors")
    _edit(path, lambda sd: sd.update({"blocks.0.extra": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"dit\.safetensors: unexpected key 'blocks\.0\.extra'"):
        load_nadit(path, model.config)
    path = save_checkpoint(model, tmp_path / "dit.safetensors")
    _edit(path, lambda sd: sd.update({"blocks.0.attn.rope.rope.freqs": torch.ones(5)}))
    with pytest.raises(CheckpointError, match="rope.freqs' does not match"):
        load_nadit(path, model.config)
    with pytest.raises(CheckpointError, match="no such file"):
        load_nadit(tmp_path / "missing.safetensors", model.config)


def test_broken_fp8_7b_is_refused(dits, tmp_path):
    with pytest.raises(CheckpointError, match="plain fp8 SeedVR2 7B file is known to be broken"):
        load_nadit(tmp_path / "seedvr2_ema_7b_fp8_e4m3fn.safetensors")
    (tmp_path / "seedvr2_ema_7b_fp8_e4m3fn.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="mixed_block35_fp16"):
        find_models(tmp_path, "7b")

    model = dits["7b"]
    last = f"blocks.{model.config.num_layers - 1}."
    sd = {k: v.to(torch.float8_e4m3fn) if k.startswith("blocks.") and not k.startswith(last) else v
          for k, v in model.state_dict().items()}
    mixed = tmp_path / "seedvr2_ema_7b_fp8_e4m3fn_mixed_block35_fp16.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(mixed))
    loaded = load_nadit(mixed, model.config, dtype=torch.float32)  # fp8 weights upcast; rope freqs recomputed
    assert torch.isfinite(loaded(*inputs(model.config))).all()
    all_fp8 = tmp_path / "renamed_7b.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn).contiguous() if k.startswith(last) else v.contiguous()
               for k, v in sd.items()}, str(all_fp8))
    with pytest.raises(CheckpointError, match="last block of this 7B checkpoint is stored in fp8"):
        load_nadit(all_fp8, model.config)


def test_vae_loads_strictly_with_legacy_attention_names(tmp_path):
    vae = perturbed(build_vae(TINY_VAE, seed=1))
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    legacy = {k.replace("attentions.0.to_q", "attentions.0.query").replace("attentions.0.to_out.0",
                                                                           "attentions.0.proj_attn"): v
              for k, v in sd.items()}
    torch.save(legacy, tmp_path / "ema_vae.pth")
    loaded = load_vae(tmp_path / "ema_vae.pth", TINY_VAE, dtype=torch.float32)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, sd[key]), key
    sd.pop("decoder.conv_out.bias")
    save_file(sd, str(tmp_path / "ema_vae_fp16.safetensors"))
    with pytest.raises(CheckpointError, match=r"ema_vae_fp16\.safetensors: missing key 'decoder\.conv_out\.bias'"):
        load_vae(tmp_path / "ema_vae_fp16.safetensors", TINY_VAE)


class Payload:
    pass


def test_weights_only_text_embedding(tmp_path):
    emb = torch.randn(58, 16).bfloat16()
    torch.save(emb, tmp_path / "pos_emb.pt")
    assert torch.equal(load_text_embedding(tmp_path / "pos_emb.pt", 16), emb)
    with pytest.raises(CheckpointError, match=r"expected a float tensor \[L, 5120\], got torch.bfloat16 \[58, 16\]"):
        load_text_embedding(tmp_path / "pos_emb.pt")
    torch.save({"emb": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refused"):
        load_text_embedding(tmp_path / "evil.pt", 16)
    torch.save({"w": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refused"):
        load_nadit(tmp_path / "evil.pth", TINY_3B)


def test_models_folder_end_to_end(dits, tmp_path):
    folder = tmp_path / "seedvr2"
    folder.mkdir()
    save_checkpoint(dits["3b"], folder / "seedvr2_ema_3b_fp16.safetensors", dtype=torch.float16)
    save_checkpoint(build_vae(TINY_VAE, seed=2), folder / "ema_vae_fp16.safetensors", dtype=torch.float16)
    torch.save(torch.randn(6, TINY_3B.text_dim).bfloat16(), folder / "pos_emb.pt")
    with pytest.raises(CheckpointError, match="no SeedVR2 7B DiT"):
        find_models(tmp_path, "7b")
    pipe = SeedVR2Pipeline.from_models(tmp_path, "3b", device="cpu", dtype=torch.float32, dit_config=TINY_3B,
                                       vae_config=TINY_VAE)
    out = pipe.upscale(torch.randint(0, 256, (5, 32, 48, 3), dtype=torch.uint8), scale=1.5)
    assert out.shape == (5, 48, 72, 3) and out.dtype == torch.uint8


def test_toy_files_record_their_architecture(dits, tmp_path):
    """The embedded default's files carry their architecture in the safetensors header (the toy DiT is wider than
    TINY_3B: at 64 its residual stream cannot hold the 64 noise numbers a token besides the restored latent); the
    toy preset builds what the header says, and files without one (official, tiny) stay as they were."""
    wide = dataclasses.replace(TINY_3B, dim=96, heads=3, mlp_dim=256)
    vae_config = VAEConfig(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_groups=4)
    dit, vae = perturbed(build_nadit(wide, seed=3)), perturbed(build_vae(vae_config, seed=3))
    save_checkpoint(dit, tmp_path / "seedvr2_ema_3b_fp16.safetensors", torch.float16, config=wide)
    save_checkpoint(vae, tmp_path / "ema_vae_fp16.safetensors", torch.float16, config=vae_config)
    torch.save(torch.randn(7, wide.text_dim), tmp_path / "pos_emb.pt")
    assert recorded_config(tmp_path / "seedvr2_ema_3b_fp16.safetensors", NaDiTConfig) == wide
    assert recorded_config(tmp_path / "ema_vae_fp16.safetensors", VAEConfig) == vae_config
    pipe = SeedVR2Pipeline.from_preset("toy", root=tmp_path)
    assert pipe.dit.config == wide and pipe.vae.config == vae_config
    for key, value in pipe.dit.state_dict().items():
        if not key.endswith("rope.freqs"):
            assert torch.equal(value, dit.state_dict()[key].half().float()), key
    out = pipe.upscale(torch.randint(0, 256, (5, 16, 24, 3), dtype=torch.uint8), scale=2)
    assert out.shape == (5, 32, 48, 3)

    save_checkpoint(dits["3b"], tmp_path / "seedvr2_ema_3b_fp16.safetensors", torch.float16)  # no header
    save_checkpoint(build_vae(TINY_VAE, seed=2), tmp_path / "ema_vae_fp16.safetensors", torch.float16)
    assert recorded_config(tmp_path / "ema_vae_fp16.safetensors", VAEConfig) is None
    pipe = SeedVR2Pipeline.from_preset("toy", root=tmp_path)
    assert pipe.dit.config == TINY_3B and pipe.vae.config == TINY_VAE
