"""LoRAs trained on the full H3 DiT onto pruned (curve AdaLN) and quantized models."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from engine.models.h3.checkpoint import load_dit, save_dit
from engine.models.h3.dit import build_dit
from engine.models.h3.lora import LoraError, load_lora, merge_lora, unmerge_lora
from engine.models.h3.prune import prune_adaln
from engine.quant import fp8, int8_convrot
from engine.quant.transform import QuantSpec, quantize_linears
from test_comfy_files import CONFIG, forward, gemm_names, rel

ADALN = "blocks.1.adaln_proj.linear"


@pytest.fixture(scope="module")
def full():
    model = build_dit(CONFIG, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def adaln_lora(model, path, rank=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in (ADALN, "final_layer.adaln_proj.linear", "blocks.0.mlp.fc1"):
        linear = model.get_submodule(name)
        tensors[f"{name}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=gen) * 0.3
        tensors[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=gen) * 0.3
    save_file(tensors, path)
    return path


def test_full_model_adaln_lora_projects_onto_a_pruned_model(full, tmp_path):
    path = adaln_lora(full, tmp_path / "full_lora.safetensors")
    patched_full = copy.deepcopy(full)
    merge_lora(patched_full, load_lora(path, patched_full))
    pruned = prune_adaln(full)
    before = {k: v.clone() for k, v in pruned.state_dict().items()}
    handle = merge_lora(pruned, load_lora(path, pruned))
    # the LoRA on the full model, then pruned, equals the pruned model with the projected LoRA
    t = torch.tensor([0.1, 0.6, 0.95])
    a, b = (m.modulations(m.time_embedding(t)) for m in (patched_full, pruned))
    for x, y in zip([*sum(a[0], ()), *a[1]], [*sum(b[0], ()), *b[1]]):
        assert rel(y, x) < 1e-5
    assert rel(forward(pruned), forward(patched_full)) < 1e-4
    unmerge_lora(pruned, handle)
    assert all(torch.equal(pruned.state_dict()[k], v) for k, v in before.items())


def test_full_model_adaln_lora_on_a_comfy_pruned_file_is_refused(full, tmp_path):
    loaded = load_dit(save_dit(prune_adaln(full), tmp_path / "pruned.safetensors"), dtype=torch.float32)
    path = adaln_lora(full, tmp_path / "full_lora.safetensors")
    with pytest.raises(LoraError, match=rf"full_lora.safetensors: '{ADALN}.lora_A.weight' is an AdaLN LoRA of the "
                                        r"full model \(128 inputs\), but this model is pruned \(curve AdaLN, 8 "
                                        r"inputs\) and its file carries no basis"):
        load_lora(path, loaded)


def test_time_embedder_lora_on_a_pruned_model_is_refused(full, tmp_path):
    pruned = prune_adaln(full)
    path = tmp_path / "te.safetensors"
    save_file({"time_embedder.proj_in.lora_A.weight": torch.zeros(2, CONFIG.freq_dim),
               "time_embedder.proj_in.lora_B.weight": torch.zeros(CONFIG.time_embed_hidden_dim, 2)}, path)
    with pytest.raises(LoraError, match=r"te.safetensors: key 'time_embedder.proj_in.lora_A.weight' adapts the "
                                        r"time embedder, which this pruned \(curve AdaLN\) model does not have"):
        load_lora(path, pruned)


@pytest.mark.parametrize("spec", [QuantSpec("float8_e4m3fn"), QuantSpec("int8_convrot")], ids=["fp8", "int8"])
def test_lora_on_quantized_layers(full, tmp_path, spec):
    path = adaln_lora(full, tmp_path / "lora.safetensors")
    quantized = quantize_linears(copy.deepcopy(full), dict.fromkeys(gemm_names(), spec))
    layer = quantized.blocks[0].mlp.fc1
    stored = (layer.weight.clone(), layer.weight_scale.clone())
    reference = copy.deepcopy(full)
    merge_lora(reference, load_lora(path, reference))
    handle = merge_lora(quantized, load_lora(path, quantized))
    assert layer.weight.dtype == stored[0].dtype  # merged, then stored in its format again
    expected = reference.blocks[0].mlp.fc1.weight
    assert rel(layer.dequantized(), expected) < (0.03 if isinstance(layer, fp8.Fp8Linear) else 0.01)
    unmerge_lora(quantized, handle)
    assert torch.equal(layer.weight.view(torch.uint8), stored[0].view(torch.uint8))
    assert torch.equal(layer.weight_scale, stored[1])
    assert isinstance(layer, (fp8.Fp8Linear, int8_convrot.Int8ConvRotLinear))
