"""Comfy-Org H3 DiT single files: pruned curve AdaLN, fp8_scaled, int8_convrot (notes/h3_quantized_files.md).

The files are written by the tests in the published schema (tensor names, dtypes, markers; widths scaled down but
ConvRot's 256-wide groups kept), then loaded strictly; each defect gives an error naming the key and the file.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models.h3.checkpoint import CheckpointError, load_dit, save_dit
from engine.models.h3.config import H3Config
from engine.models.h3.dit import build_dit, curve_embedding
from engine.models.h3.prune import curve_samples, prune_adaln
from engine.quant import fp8, int8_convrot
from engine.quant.transform import QuantSpec, quantize_linears
from test_checkpoint import forward as checkpoint_forward

# Every GEMM input width (hidden 256, inner 256, ffn 512) is a multiple of ConvRot's 256; the unpruned AdaLN
# input (time_embed_dim 128) of its 64.
CONFIG = H3Config(num_attention_heads=2, attention_head_dim=128, hidden_size=256, num_layers=2, num_refiner_layers=1,
                  ffn_dim=512, text_dim=64, freq_dim=32, time_embed_hidden_dim=256, time_embed_dim=128,
                  rope_freq_dim=16)
GEMMS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
FP8 = QuantSpec("float8_e4m3fn")
INT8 = QuantSpec("int8_convrot")


def gemm_names(config=CONFIG):
    return [f"blocks.{i}.{g}" for i in range(config.num_layers) for g in GEMMS]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def with_outlier_channels(model, seed=1):
    """Trained weights have a few heavy input channels (why ConvRot exists); random ones do not."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
        for name in gemm_names(model.config):
            w = model.get_submodule(name).weight
            w[:, torch.randperm(w.shape[1], generator=gen)[:8]] *= 6.0
    return model


@pytest.fixture(scope="module")
def full():
    return with_outlier_channels(build_dit(CONFIG, seed=3))


@pytest.fixture(scope="module")
def pruned(full):
    return prune_adaln(full)


def published(model):
    """The released mixed precision: bf16, fp32 islands (the curve projections are stored F16 by save_dit)."""
    return copy.deepcopy(model).set_dtype(torch.bfloat16)


@pytest.fixture(scope="module")
def pruned16(pruned):
    return published(pruned)


@pytest.fixture(scope="module")
def full16(full):
    return published(full)


def forward(model):
    """The tiny DiT's video and audio outputs on test_checkpoint's layout, as one vector."""
    v, a = checkpoint_forward(model)
    return torch.cat([v.flatten(), a.flatten()])


def quantized_file(model, path, spec, markers="tensor", names=None):
    q = quantize_linears(copy.deepcopy(model), dict.fromkeys(names or gemm_names(model.config), spec))
    return save_dit(q, path, markers=markers)


def header(path):
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}, f.metadata()


def rewrite(path, edit, metadata=None):
    tensors = load_file(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    edit(tensors)
    save_file(tensors, path, metadata=metadata if metadata is not None else meta)


# ---------------------------------------------------------------------------------------------- pruned curve AdaLN

def test_pruned_file_schema_and_load(pruned, tmp_path):
    path = save_dit(published(pruned), tmp_path / "h3_pruned_bf16.safetensors")
    keys, _ = header(path)
    assert keys["adaln_t_table"] == ("F32", [1025, 8])
    assert keys["blocks.1.adaln_proj.linear.weight"] == ("F16", [6 * 3 * 256, 8])
    assert keys["final_layer.adaln_proj.linear.bias"] == ("F16", [2 * 256])
    assert keys["blocks.0.mlp.fc1.weight"] == ("BF16", [1024, 256]) and keys["video_patch_proj.bias"][0] == "F32"
    assert not any(k.startswith("time_embedder.") for k in keys)
    loaded = load_dit(path, dtype=torch.bfloat16)
    assert loaded.config.adaln_curve_grid == 1025 and loaded.config.time_embed_dim == 8
    assert not hasattr(loaded, "time_embedder")
    # fp32 islands stay fp32 although the file stores F16
    for name in ("blocks.0.adaln_proj.linear.weight", "final_layer.adaln_proj.linear.bias", "adaln_t_table",
                 "video_patch_proj.weight", "final_layer.audio_out.weight"):
        assert loaded.get_parameter(name).dtype == torch.float32 if "table" not in name else \
            loaded.adaln_t_table.dtype == torch.float32, name
    assert loaded.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    stored = load_file(path)["blocks.0.adaln_proj.linear.weight"]
    assert torch.equal(loaded.blocks[0].adaln_proj.linear.weight, stored.float())


def test_pruned_equals_full_within_rank_truncation(full, pruned):
    samples = curve_samples(full)
    sigma = torch.linalg.svdvals(samples - samples.mean(0))
    truncation = (sigma[8:].norm() / sigma.norm()).item()  # what rank 8 leaves out of the centred curve
    t = torch.tensor([0.0, 0.013, 0.3, 0.5, 0.77, 0.999, 1.0])
    (blocks_f, final_f), (blocks_p, final_p) = (m.modulations(m.time_embedding(t)) for m in (full, pruned))
    for tf, tp in zip([*sum(blocks_f, ()), *final_f], [*sum(blocks_p, ()), *final_p]):
        assert rel(tp, tf) < 10 * truncation + 1e-6
    assert rel(forward(pruned), forward(full)) < 1e-5


def test_pruned_curve_equals_independent_fp32_formula(pruned):
    table = pruned.adaln_t_table.numpy()
    import numpy as np

    t = np.array([0.0, 1e-4, 0.25, 0.5004, 0.75, 0.9999, 1.0, 1.5, -0.2], dtype=np.float32)
    pos = np.clip(t, 0, 1).astype(np.float32) * np.float32(table.shape[0] - 1)
    i0 = np.minimum(np.floor(pos).astype(np.int64), table.shape[0] - 2)
    frac = (pos - i0.astype(np.float32)).astype(np.float32)
    expected = table[i0] + frac[:, None] * (table[i0 + 1] - table[i0])
    temb = pruned.time_embedding(torch.from_numpy(t))
    assert temb.dtype == torch.float32 and torch.equal(temb, torch.from_numpy(expected))
    assert torch.equal(curve_embedding(pruned.adaln_t_table, torch.from_numpy(t)), temb)
    # no SiLU before the projection: the table already holds the post-SiLU curve
    w, b = pruned.blocks[1].adaln_proj.linear.weight, pruned.blocks[1].adaln_proj.linear.bias
    mods = pruned.blocks[1].adaln_proj(temb)
    assert torch.allclose(torch.cat(mods, -1).view(len(t), -1), (temb.double() @ w.double().T + b.double()).float(),
                          rtol=1e-5, atol=1e-6)


def test_adaln_cache_on_the_pruned_path(pruned):
    from engine.cache.adaln import AdaLNCache

    cache = AdaLNCache()
    schedule = cache.schedule(pruned)
    t = torch.tensor([0.4, 0.7])
    first, again = schedule(t), schedule(t)
    assert cache.stats()["hits"] == 1 and first is again
    blocks, final = pruned.modulations(pruned.time_embedding(t))
    assert all(torch.equal(a, b) for x, y in zip(first[0], blocks) for a, b in zip(x, y))


def test_pruned_file_with_time_embedder_is_refused(full, pruned, tmp_path):
    path = save_dit(pruned, tmp_path / "mixed.safetensors")
    extra = {k: v for k, v in full.state_dict().items() if k.startswith("time_embedder.")}
    rewrite(path, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"mixed.safetensors: a pruned \(curve AdaLN\) checkpoint has "
                                              r"'adaln_t_table' and must not also carry 'time_embedder\."):
        load_dit(path)


# ---------------------------------------------------------------------------------------------- quantized layers

def test_regular_hadamard_is_not_sylvester():
    h = int8_convrot.hadamard(256, torch.float64)
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(256, dtype=torch.float64))
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    assert torch.equal(h * 16, torch.kron(torch.kron(h4, h4), torch.kron(h4, h4)))
    s = int8_convrot.hadamard(256, torch.float64, sylvester=True)
    assert not torch.allclose(h, s) and (h @ s).abs().min() > 0.06  # every channel mixed by the wrong matrix


def linear_case(out_features=512, in_features=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.02
    w[:, :4] *= 8
    x = torch.randn(300, in_features, generator=gen).bfloat16()
    return w, x


def test_fp8_linear_matches_dequantized_reference():
    w, x = linear_case()
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ()
    layer = fp8.Fp8Linear(512, 512, bias=False, input_scale=False)
    layer.weight, layer.weight_scale = q, scale
    reference = F.linear(x, fp8.dequantize_weight(q, scale, torch.bfloat16))
    layer.scaled_mm = False
    assert torch.equal(layer(x), reference)  # the fallback is the dequantized bf16 GEMM itself
    layer.scaled_mm = True  # torch._scaled_mm runs on the CPU too: the fp8 x fp8 path's own rounding
    err = rel(layer(x), reference)
    print(f"fp8 _scaled_mm vs dequantized bf16: {err:.4f}; weight rounding vs bf16 weights: "
          f"{rel(reference, F.linear(x, w.bfloat16())):.4f}")
    assert 0 < err < 0.04  # e4m3 keeps 3 mantissa bits: ~2.5 % per activation, averaged over K


def test_int8_convrot_linear_matches_dequantized_reference():
    w, x = linear_case()
    q, scale = int8_convrot.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (512, 1)
    layer = int8_convrot.Int8ConvRotLinear(512, 512, bias=False)
    layer.weight, layer.weight_scale = q, scale
    dequantized = int8_convrot.dequantize_weight(q, scale, 256, torch.float32)
    assert rel(dequantized, w) < 0.01
    reference = F.linear(x, dequantized.bfloat16())
    layer.int_mm = False
    assert torch.equal(layer(x), reference)
    layer.int_mm = True
    err = rel(layer(x), reference)
    print(f"int8 W8A8 vs dequantized bf16: {err:.4f}; weight rounding vs bf16 weights: "
          f"{rel(reference, F.linear(x, w.bfloat16())):.4f}")
    assert 0 < err < 0.015


def test_int8_gemm_is_exact_and_fusion_matches():
    w, x = linear_case(out_features=256)
    xq, xs = int8_convrot.quantize_activation(x, 256)
    q, s = int8_convrot.quantize_weight(w)
    out = int8_convrot.int8_matmul(xq[:5], xs[:5], q, s, torch.float32)  # 5 rows: padded for _int_mm
    exact = (xq[:5].long() @ q.long().T).double() * xs[:5].double() * s.double().T
    assert torch.allclose(out.double(), exact, rtol=1e-6, atol=0)
    layer = int8_convrot.Int8ConvRotLinear(256, 256, bias=False)
    layer.weight, layer.weight_scale = int8_convrot.quantize_weight(torch.randn(256, 256))
    h = torch.randn(40, 512).bfloat16()
    from engine.kernels import fused

    assert torch.equal(layer(h, input_act="swiglu"), layer(fused.swiglu(h)))
    fp8_layer = fp8.Fp8Linear(256, 256, bias=False, input_scale=False)
    fp8_layer.weight, fp8_layer.weight_scale = fp8.quantize_weight(torch.randn(256, 256))
    fp8_layer.scaled_mm = True
    assert torch.equal(fp8_layer(h, input_act="swiglu"), fp8_layer(fused.swiglu(h)))


# ---------------------------------------------------------------------------------------------- quantized files

@pytest.mark.parametrize("markers", ["tensor", "metadata", "both"])
def test_fp8_scaled_file(pruned16, tmp_path, markers):
    path = quantized_file(pruned16, tmp_path / "h3_pruned_fp8_scaled.safetensors", FP8, markers)
    keys, meta = header(path)
    assert keys["blocks.0.mlp.fc1.weight"] == ("F8_E4M3", [1024, 256])
    assert keys["blocks.0.mlp.fc1.weight_scale"] == ("F32", [])
    assert keys["token_refiner.blocks.0.mlp.fc1.weight"][0] == "BF16"
    if markers != "metadata":
        marker = bytes(load_file(path)["blocks.1.attn.qkv_proj.comfy_quant"].tolist())
        assert marker == b'{"format": "float8_e4m3fn"}'
    if markers != "tensor":
        assert json.loads(meta["_quantization_metadata"])["layers"]["blocks.0.mlp.fc2"] == {"format": "float8_e4m3fn"}
    loaded = load_dit(path)
    layer = loaded.blocks[0].mlp.fc1
    assert isinstance(layer, fp8.Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), load_file(path)["blocks.0.mlp.fc1.weight"].view(torch.uint8))


def test_fp8_input_scale_is_optional_and_used(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "fp8.safetensors", QuantSpec("float8_e4m3fn", input_scale=True))
    assert header(path)[0]["blocks.0.attn.out_proj.input_scale"] == ("F32", [])
    loaded = load_dit(path)
    assert loaded.blocks[0].attn.out_proj.input_scale is not None


@pytest.mark.parametrize("variant", ["pruned", "unpruned"])
def test_int8_convrot_file(full16, pruned16, tmp_path, variant):
    model = pruned16 if variant == "pruned" else full16
    names = gemm_names()
    specs = dict.fromkeys(names, INT8)
    if variant == "unpruned":  # the unpruned file quantizes the AdaLN too, at group 64 (128 = 2 x 64 here)
        specs.update({f"blocks.{i}.adaln_proj.linear": QuantSpec("int8_convrot", group=64) for i in range(2)})
    path = save_dit(quantize_linears(copy.deepcopy(model), specs), tmp_path / f"h3_{variant}_int8.safetensors")
    keys, meta = header(path)
    assert meta is None or "_quantization_metadata" not in meta
    assert keys["blocks.0.attn.qkv_proj.weight"] == ("I8", [768, 256])
    assert keys["blocks.0.attn.qkv_proj.weight_scale"] == ("F32", [768, 1])
    marker = bytes(load_file(path)["blocks.0.mlp.fc2.comfy_quant"].tolist())
    assert marker == b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}' and len(marker) == 72
    loaded = load_dit(path)
    assert type(loaded.blocks[0].mlp).__name__ == "QuantSwiGLU"  # SwiGLU formed in fc2's quantizer
    if variant == "unpruned":
        assert loaded.blocks[1].adaln_proj.linear.group == 64
    err = rel(forward(loaded), forward(load_dit(save_dit(model, tmp_path / "bf16.safetensors"))))
    print(f"tiny DiT, int8_convrot ({variant}) vs bf16: {err:.4f}")
    assert err < 0.03


def test_whole_dit_on_fp8_weights_vs_bf16(pruned16, tmp_path):
    bf16 = load_dit(save_dit(pruned16, tmp_path / "bf16.safetensors"))
    loaded = load_dit(quantized_file(pruned16, tmp_path / "fp8.safetensors", FP8))
    dequantized = rel(forward(loaded), forward(bf16))
    for block in loaded.blocks:
        for name in GEMMS:
            block.get_submodule(name).scaled_mm = True
    scaled = rel(forward(loaded), forward(bf16))
    print(f"tiny DiT, fp8_scaled vs bf16: dequantized {dequantized:.4f}, _scaled_mm {scaled:.4f}")
    assert dequantized < 0.04 and scaled < 0.06


# ---------------------------------------------------------------------------------------------- named errors

def test_missing_weight_scale(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", INT8)
    rewrite(path, lambda t: t.pop("blocks.1.mlp.fc1.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing key 'blocks.1.mlp.fc1.weight_scale' \(looked in: "
                                              r"q.safetensors\)"):
        load_dit(path)


def test_wrong_dtype_of_quantized_weight(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", FP8)
    rewrite(path, lambda t: t.update({"blocks.0.attn.out_proj.weight": t["blocks.0.attn.out_proj.weight"].bfloat16()}))
    with pytest.raises(CheckpointError, match=r"wrong dtype for 'blocks.0.attn.out_proj.weight' in q.safetensors: "
                                              r"file has BF16, expected F8_E4M3"):
        load_dit(path)


def test_quantized_weight_without_marker(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", INT8)
    rewrite(path, lambda t: t.pop("blocks.0.mlp.fc2.comfy_quant"))
    with pytest.raises(CheckpointError, match=r"q.safetensors: unexpected key 'blocks.0.mlp.fc2.weight_scale'"):
        load_dit(path)


@pytest.mark.parametrize("spec, shape", [(INT8, [256]), (FP8, [1])])
def test_wrong_scale_shape(pruned16, tmp_path, spec, shape):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", spec)
    key = "blocks.1.attn.out_proj.weight_scale"
    rewrite(path, lambda t: t.update({key: t[key].reshape(shape)}))
    expected = r"\[256, 1\]" if spec is INT8 else r"\[\]"
    with pytest.raises(CheckpointError, match=rf"shape mismatch for '{key}' in q.safetensors: file has "
                                              rf"\[{shape[0]}\], model expects {expected}"):
        load_dit(path)


def test_sylvester_rotated_file_is_refused(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "sylvester.safetensors", INT8)
    sd = {k: v.float() for k, v in pruned16.state_dict().items()}

    def sylvester(t):
        for name in gemm_names():
            t[name + ".weight"], t[name + ".weight_scale"] = int8_convrot.quantize_weight(
                sd[name + ".weight"], sylvester=True)
    rewrite(path, sylvester)
    with pytest.raises(CheckpointError, match=r"sylvester.safetensors: 'blocks.0.attn.qkv_proj.weight' was rotated "
                                              r"with the Sylvester \(Walsh\) Hadamard matrix"):
        load_dit(path)


def test_regular_file_of_random_weights_is_not_mistaken_for_sylvester(tmp_path):
    plain = published(prune_adaln(build_dit(CONFIG, seed=5)))  # no outlier channels: nothing tells the matrices apart
    load_dit(quantized_file(plain, tmp_path / "q.safetensors", INT8))


def test_marker_and_metadata_conflict(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", INT8, markers="both")
    _, meta = header(path)
    layers = json.loads(meta["_quantization_metadata"])
    layers["layers"]["blocks.1.mlp.fc2"]["convrot_groupsize"] = 64
    rewrite(path, lambda t: None, metadata={"_quantization_metadata": json.dumps(layers)})
    with pytest.raises(CheckpointError, match=r"q.safetensors: quantization markers conflict for 'blocks.1.mlp.fc2': "
                                              r"its comfy_quant tensor says .*256.*, __metadata__ "
                                              r"_quantization_metadata says .*64"):
        load_dit(path)


def test_unknown_marker_format(pruned16, tmp_path):
    path = quantized_file(pruned16, tmp_path / "q.safetensors", FP8)
    marker = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    rewrite(path, lambda t: t.update({"blocks.0.mlp.fc1.comfy_quant": marker}))
    with pytest.raises(CheckpointError, match=r"q.safetensors: 'blocks.0.mlp.fc1.comfy_quant': quantization format "
                                              r"'nvfp4' is not supported"):
        load_dit(path)
