"""LoRA files: every published key space, written here from the same low-rank deltas, merges to the same weights."""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from engine.models.h3.config import TEST_CONVERSION
from engine.models.h3.dit import build_dit
from engine.models.h3.lora import LoraError, load_lora, merge_lora, parse_lora_spec, unmerge_lora

CONFIG = TEST_CONVERSION
HEADS = CONFIG.num_attention_heads
RANK, ADALN_RANK, PATCH_RANK = 4, 2, 3  # mixed ranks, as the published files (64 attention/FFN, 16 AdaLN)
BLOCK_MODULES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# Our module -> diffusers module, written out here independently of the code under test.
DIFFUSERS_BLOCK = {"attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
                   "adaln_proj.linear": "adaln_proj.linear"}
DIFFUSERS_TOP = {"final_layer.adaln_proj.linear": "norm_out.linear", "video_patch_proj": "proj_in"}


@pytest.fixture(scope="module")
def model():
    return build_dit(CONFIG, seed=0)


@pytest.fixture(scope="module")
def deltas(model):
    """{module: (A [r, in], B [out, r])}: every LoRA target kind, mixed ranks."""
    names = [f"blocks.{i}.{m}" for i in range(CONFIG.num_layers) for m in BLOCK_MODULES + ("adaln_proj.linear",)]
    names += [f"token_refiner.blocks.{i}.{m}" for i in range(CONFIG.num_refiner_layers) for m in BLOCK_MODULES]
    names += ["final_layer.adaln_proj.linear", "video_patch_proj"]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in names:
        linear = model.get_submodule(name)
        rank = ADALN_RANK if "adaln" in name else PATCH_RANK if "patch" in name else RANK
        out[name] = (torch.randn(rank, linear.in_features, generator=gen) * 0.1,
                     torch.randn(linear.out_features, rank, generator=gen) * 0.1)
    return out


def write_bare(deltas, prefix=""):
    return {f"{prefix}{m}.lora_{ab}.weight": t for m, (a, b) in deltas.items() for ab, t in (("A", a), ("B", b))}


def write_kohya(deltas):
    out = {}
    for m, (a, b) in deltas.items():
        flat = "lora_unet_" + m.replace(".", "_")
        alpha = a.shape[0] / 2  # scale alpha / rank = 0.5, so the stored up-projection is doubled
        out.update({f"{flat}.lora_down.weight": a, f"{flat}.lora_up.weight": b * 2,
                    f"{flat}.alpha": torch.tensor(alpha)})
    return out


def write_network_alpha(deltas, alpha=8.0):
    return {f"{m}.lora_{ab}.weight": t for m, (a, b) in deltas.items()
            for ab, t in (("A", a), ("B", b * a.shape[0] / alpha))}


def write_diffsynth(deltas):
    out = {}
    for m, (a, b) in deltas.items():
        if m.endswith("qkv_proj"):  # DiffSynth trains on the raw checkpoint: rows [h0: q k v, h1: q k v, ...]
            b = b.reshape(3, HEADS, -1, b.shape[1]).transpose(0, 1).reshape(b.shape)
        out.update({f"{m}.lora_A.default.weight": a, f"{m}.lora_B.default.weight": b})
    return out


def write_peft(deltas):
    out = {}
    for m, (a, b) in deltas.items():
        if m in DIFFUSERS_TOP:
            parts = {DIFFUSERS_TOP[m]: b}
        else:
            stack, index, module = re.fullmatch(r"(blocks|token_refiner\.blocks)\.(\d+)\.(.+)", m).groups()
            prefix = f"{'transformer_blocks' if stack == 'blocks' else 'token_refiner.refiner_blocks'}.{index}"
            if module == "attn.qkv_proj":
                parts = {f"{prefix}.attn.to_{p}": part for p, part in zip("qkv", b.chunk(3))}
            elif module == "mlp.fc1":
                gate, value = b.chunk(2)
                parts = {f"{prefix}.ff.net.0.proj": torch.cat([value, gate])}
            else:
                parts = {f"{prefix}.{DIFFUSERS_BLOCK[module]}": b}
        for name, part in parts.items():
            out[f"transformer.{name}.lora_A.weight"] = a
            out[f"transformer.{name}.lora_B.weight"] = part
    return out


FORMATS = {
    "bare": (write_bare, None),
    "diffusion_model": (lambda d: write_bare(d, "diffusion_model."), None),
    "kohya-alpha": (write_kohya, None),
    "metadata-alpha": (write_network_alpha, {"alpha": "8"}),
    "diffsynth": (write_diffsynth, None),
    "peft": (write_peft, None),
}


def save(tmp_path, tensors, metadata=None, name="lora.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, path, metadata=metadata)
    return path


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def expected_weights(before, deltas, scale=1.0):
    out = dict(before)
    for m, (a, b) in deltas.items():
        out[f"{m}.weight"] = before[f"{m}.weight"] + scale * (b @ a)
    return out


def assert_close(actual, expected, tol=1e-6):
    for key in expected:
        assert (actual[key] - expected[key]).abs().max().item() <= tol, key


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_merges_to_the_same_weights(model, deltas, tmp_path, fmt):
    write, metadata = FORMATS[fmt]
    lora = load_lora(save(tmp_path, write(deltas), metadata), model)
    assert set(lora) == set(deltas)
    before = weights(model)
    handle = merge_lora(model, lora)
    try:
        assert_close(model.state_dict(), expected_weights(before, deltas))
    finally:
        unmerge_lora(model, handle)
    assert_close(model.state_dict(), before, tol=0.0)


def test_scale_halves_the_delta(model, deltas, tmp_path):
    lora = load_lora(save(tmp_path, write_bare(deltas)), model)
    before = weights(model)
    handle = merge_lora(model, lora, scale=0.5)
    assert_close(model.state_dict(), expected_weights(before, deltas, scale=0.5))
    unmerge_lora(model, handle)


def test_merge_unmerge_is_exact_in_bf16(deltas, tmp_path):
    model = build_dit(CONFIG, seed=0, dtype=torch.bfloat16)
    lora = load_lora(save(tmp_path, write_kohya(deltas)), model)
    before = weights(model)
    version = getattr(model, "weights_version", 0)
    first = merge_lora(model, lora)
    second = merge_lora(model, lora, scale=-0.3)
    assert model.weights_version == version + 2
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert not torch.equal(model.blocks[0].attn.qkv_proj.weight, before["blocks.0.attn.qkv_proj.weight"])
    unmerge_lora(model, second)
    unmerge_lora(model, first)
    assert model.weights_version == version + 4
    assert_close(model.state_dict(), before, tol=0.0)


def test_separate_qkv_loras_with_different_ranks(model, tmp_path):
    inner, hidden = CONFIG.inner_dim, CONFIG.hidden_size
    gen = torch.Generator().manual_seed(1)
    aq, bq = torch.randn(3, hidden, generator=gen), torch.randn(inner, 3, generator=gen)
    av, bv = torch.randn(5, hidden, generator=gen), torch.randn(inner, 5, generator=gen)
    tensors = {"transformer_blocks.1.attn.to_q.lora_A.weight": aq, "transformer_blocks.1.attn.to_q.lora_B.weight": bq,
               "transformer_blocks.1.attn.to_v.lora_A.weight": av, "transformer_blocks.1.attn.to_v.lora_B.weight": bv}
    lora = load_lora(save(tmp_path, tensors, {"alpha": "2.5"}), model)
    delta = torch.cat([bq @ aq * (2.5 / 3), torch.zeros(inner, hidden), bv @ av * (2.5 / 5)])
    w = lora["blocks.1.attn.qkv_proj"]
    assert torch.allclose(w.scale * (w.B @ w.A), delta, atol=1e-5)


def pair(module, rank=4, fan_in=64, fan_out=64, a="lora_A", b="lora_B"):
    return {f"{module}.{a}.weight": torch.zeros(rank, fan_in), f"{module}.{b}.weight": torch.zeros(fan_out, rank)}


@pytest.mark.parametrize("extra, key, message", [
    ({"blocks.0.attn.qkv_proj.lora_C.weight": torch.zeros(4, 64)}, "blocks.0.attn.qkv_proj.lora_C.weight",
     "is not a LoRA tensor"),
    (pair("blocks.7.attn.out_proj"), "blocks.7.attn.out_proj.lora_A.weight", "does not name a linear module"),
    (pair("blocks.0.norm1"), "blocks.0.norm1.lora_A.weight", "does not name a linear module"),
    (pair("lora_unet_blocks_0_attn_qkv_projection", a="lora_down", b="lora_up"),
     "lora_unet_blocks_0_attn_qkv_projection.lora_down.weight", "does not name a linear module"),
    (pair("transformer.transformer_blocks.0.attn.to_x"), "transformer.transformer_blocks.0.attn.to_x.lora_A.weight",
     "does not name a linear module"),
    (pair("blocks.1.attn.out_proj", fan_in=63), "blocks.1.attn.out_proj.lora_A.weight",
     "do not fit 'blocks.1.attn.out_proj'"),
    (pair("diffusion_model.blocks.0.mlp.fc2"), "diffusion_model.blocks.0.mlp.fc2.lora_A.weight", "repeats"),
    ({**pair("blocks.0.attn.qkv_proj", fan_out=192), **pair("transformer.transformer_blocks.0.attn.to_q")},
     "transformer.transformer_blocks.0.attn.to_q.lora_A.weight", "also sets fused"),
])
def test_bad_key_names_key_and_file(model, deltas, tmp_path, extra, key, message):
    tensors = {**write_bare({"blocks.0.mlp.fc2": deltas["blocks.0.mlp.fc2"]}), **extra}
    path = save(tmp_path, tensors, name="bad_lora.safetensors")
    with pytest.raises(LoraError, match=r"^bad_lora.safetensors: ") as info:
        load_lora(path, model)
    assert message in str(info.value) and f"'{key}'" in str(info.value)


def test_unpaired_tensor(model, deltas, tmp_path):
    path = save(tmp_path, {"blocks.0.mlp.fc2.lora_A.weight": deltas["blocks.0.mlp.fc2"][0]})
    with pytest.raises(LoraError, match=r"lora.safetensors: key 'blocks.0.mlp.fc2.lora_A.weight' has no lora_B"):
        load_lora(path, model)


def test_not_a_safetensors_file(model, tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(LoraError, match="junk.safetensors"):
        load_lora(path, model)


def test_ambiguous_flattened_name(tmp_path):
    model = nn.Module()
    model.config = SimpleNamespace(num_attention_heads=1)
    model.a_b = nn.Linear(2, 2)
    model.a = nn.Module()
    model.a.b = nn.Linear(2, 2)
    path = save(tmp_path, {"lora_unet_a_b.lora_down.weight": torch.zeros(1, 2),
                           "lora_unet_a_b.lora_up.weight": torch.zeros(2, 1)})
    with pytest.raises(LoraError, match="lora_unet_a_b.lora_down.weight"):
        load_lora(path, model)


@pytest.mark.parametrize("spec, expected", [
    ("turbo.safetensors:0.8", ("turbo.safetensors", 0.8)),
    ("turbo.safetensors", ("turbo.safetensors", 1.0)),
    ("loras/a:b.safetensors:-1", ("loras/a:b.safetensors", -1.0)),
    ("C:\\loras\\turbo.safetensors", ("C:\\loras\\turbo.safetensors", 1.0)),
])
def test_parse_lora_spec(spec, expected):
    assert parse_lora_spec(spec) == expected
