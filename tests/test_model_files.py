"""Model files in a ComfyUI models tree made by the test: what the engine lists (`GET /v1/models`, kinds and
formats from the headers), the combos the nodes offer, and names that leave their folder refused."""

import copy
import json
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from engine.models.h3.checkpoint import save_dit
from engine.models.h3.dit import build_dit
from engine.models.h3.model_files import ModelFileError, describe_file, list_models, resolve
from engine.models.h3.prune import prune_adaln
from engine.models.h3.vae import build_tiny_audio_vae, build_tiny_video_vae
from engine.quant.transform import QuantSpec, quantize_linears
from nodes import model_files
from test_comfy_files import CONFIG, gemm_names
from test_comfy_vae_files import comfy_audio_vae_file, comfy_video_vae_file


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("ComfyUI") / "models"
    for folder in ("diffusion_models", "text_encoders", "vae", "loras"):
        (root / folder).mkdir(parents=True)
    full = build_dit(CONFIG, seed=0).set_dtype(torch.bfloat16)
    pruned = prune_adaln(full)
    save_dit(full, root / "diffusion_models" / "minimax_h3_fl2va_bf16.safetensors")
    for name, spec in (("fp8_scaled", QuantSpec("float8_e4m3fn")), ("int8_convrot", QuantSpec("int8_convrot"))):
        model = quantize_linears(copy.deepcopy(pruned), dict.fromkeys(gemm_names(), spec))
        save_dit(model, root / "diffusion_models" / f"minimax_h3_fl2va_pruned_{name}.safetensors")
    (root / "diffusion_models" / "h3").mkdir()
    save_dit(pruned, root / "diffusion_models" / "h3" / "minimax_h3_fl2va_pruned_bf16.safetensors")
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
               "visual.blocks.0.attn.qkv.weight": torch.zeros(12, 4, dtype=torch.bfloat16)},
              root / "text_encoders" / "qwen3vl_32b_minimax_h3_bf16.safetensors")
    comfy_video_vae_file(build_tiny_video_vae(), root / "vae" / "minimax_h3_video_vae_fp16.safetensors")
    comfy_audio_vae_file(build_tiny_audio_vae(), root / "vae" / "minimax_h3_audio_vae_fp32.safetensors")
    save_file({"blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(2, 256),
               "blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(768, 2)}, root / "loras" / "turbo.safetensors")
    (root / "loras" / "notes.txt").write_text("not a model")
    return root


def test_engine_lists_kinds_and_formats(tree):
    listing = list_models(tree)
    dits = {e["name"]: (e["kind"], e["format"], e["pruned"]) for e in listing["diffusion_models"]}
    assert dits == {"minimax_h3_fl2va_bf16.safetensors": ("dit", "bf16", False),
                    "minimax_h3_fl2va_pruned_fp8_scaled.safetensors": ("dit", "fp8_scaled", True),
                    "minimax_h3_fl2va_pruned_int8_convrot.safetensors": ("dit", "int8_convrot", True),
                    "h3/minimax_h3_fl2va_pruned_bf16.safetensors": ("dit", "bf16", True)}
    vaes = {e["name"]: (e["kind"], e["format"]) for e in listing["vae"]}
    assert vaes == {"minimax_h3_audio_vae_fp32.safetensors": ("audio_vae", "fp32"),
                    "minimax_h3_video_vae_fp16.safetensors": ("video_vae", "fp16")}
    assert [(e["kind"], e["format"]) for e in listing["text_encoders"]] == [("text_encoder", "bf16")]
    assert [e["name"] for e in listing["loras"]] == ["turbo.safetensors"]


def test_engine_resolves_inside_its_folders_only(tree):
    assert resolve(tree, "loras", "turbo.safetensors") == (tree / "loras" / "turbo.safetensors").resolve()
    with pytest.raises(ModelFileError, match="outside the engine's vae folders"):
        resolve(tree, "vae", "../loras/turbo.safetensors")
    with pytest.raises(ModelFileError, match="No loras file 'missing.safetensors'"):
        resolve(tree, "loras", "missing.safetensors")
    with pytest.raises(ModelFileError, match="Unknown model folder 'checkpoints'"):
        resolve(tree, "checkpoints", "x.safetensors")


def test_a_file_that_is_not_safetensors(tree, tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\xff" * 20)
    with pytest.raises(ModelFileError, match="broken.safetensors: is not a safetensors file"):
        describe_file(bad)


def test_node_combos_and_paths(tree, monkeypatch):
    monkeypatch.setenv("H3FORGE_COMFY_MODELS", str(tree))
    assert model_files.choices("diffusion_models") == [
        "h3/minimax_h3_fl2va_pruned_bf16.safetensors", "minimax_h3_fl2va_bf16.safetensors",
        "minimax_h3_fl2va_pruned_fp8_scaled.safetensors", "minimax_h3_fl2va_pruned_int8_convrot.safetensors"]
    assert model_files.choices("loras") == ["turbo.safetensors"]
    assert model_files.full_path("vae", "minimax_h3_video_vae_fp16.safetensors").is_file()
    with pytest.raises(model_files.ModelFileError, match="outside ComfyUI's loras folders"):
        model_files.full_path("loras", "../vae/minimax_h3_video_vae_fp16.safetensors")
    with pytest.raises(model_files.ModelFileError, match="outside ComfyUI's loras folders"):
        model_files.full_path("loras", "/etc/passwd")
    assert model_files.auto_choice("vae", "video_vae") == "minimax_h3_video_vae_fp16.safetensors"
    assert model_files.auto_choice("vae", "audio_vae") == "minimax_h3_audio_vae_fp32.safetensors"
    assert model_files.auto_choice("text_encoders", "text_encoder") == "qwen3vl_32b_minimax_h3_bf16.safetensors"
    with pytest.raises(model_files.ModelFileError, match="No text encoder file in ComfyUI's loras folders"):
        model_files.auto_choice("loras", "text_encoder")


def test_v1_models_on_a_preset_engine(engine):
    request = urllib.request.Request(engine.http_url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 401
    assert model_files.remote_choices(engine.url, engine.token) == {f: [] for f in model_files.FOLDERS}
    request.add_header("Authorization", f"Bearer {engine.token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["root"] is None
