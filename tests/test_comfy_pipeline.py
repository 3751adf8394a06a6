"""A chosen set of Comfy-Org single files (pruned int8_convrot DiT, text encoder, both VAEs, a LoRA), picked from
a ComfyUI models tree made by the test, runs a t2va job end to end."""

import copy

import torch
from safetensors.torch import save_file

from engine.models.h3.checkpoint import save_dit
from engine.models.h3.conditioner import build_tiny_image_processor, build_tiny_tokenizer
from engine.models.h3.pipeline import TINY_CANVAS, H3Pipeline
from engine.models.h3.prune import prune_adaln
from engine.models.h3.request import GenerateRequest
from engine.models.h3.vae import TINY_AUDIO_VAE, TINY_VIDEO_VAE, build_tiny_audio_vae, build_tiny_video_vae
from engine.quant.int8_convrot import Int8ConvRotLinear
from engine.quant.transform import QuantSpec, quantize_linears
from nodes import model_files
from test_comfy_files import CONFIG, full, gemm_names, published  # noqa: F401  (module fixture)
from test_comfy_text_encoder import bf16_tensors, tiny_config
from test_comfy_vae_files import comfy_audio_vae_file, comfy_video_vae_file
from transformers import Qwen3VLForConditionalGeneration


def test_comfy_files_run_a_job(full, tmp_path, monkeypatch):  # noqa: F811
    root = tmp_path / "models"
    for folder in model_files.FOLDERS:
        (root / folder).mkdir(parents=True)
    dit = quantize_linears(copy.deepcopy(published(prune_adaln(full))), dict.fromkeys(gemm_names(), QuantSpec("int8_convrot")))
    save_dit(dit, root / "diffusion_models" / "minimax_h3_fl2va_pruned_int8_convrot.safetensors")
    te_config = tiny_config()
    te_config.text_config.hidden_size = CONFIG.text_dim
    te_config.vision_config.out_hidden_size = CONFIG.text_dim
    torch.manual_seed(0)
    save_file(bf16_tensors(Qwen3VLForConditionalGeneration(te_config)),
              root / "text_encoders" / "qwen3vl_32b_minimax_h3_bf16.safetensors")
    comfy_video_vae_file(build_tiny_video_vae(1), root / "vae" / "minimax_h3_video_vae_fp16.safetensors")
    comfy_audio_vae_file(build_tiny_audio_vae(1), root / "vae" / "minimax_h3_audio_vae_fp32.safetensors")
    save_file({"blocks.0.attn.out_proj.lora_A.weight": torch.randn(2, 256) * 0.1,
               "blocks.0.attn.out_proj.lora_B.weight": torch.randn(256, 2) * 0.1},
              root / "loras" / "style.safetensors")
    tokenizer = tmp_path / "tokenizer_folder"
    build_tiny_tokenizer().save_pretrained(tokenizer / "tokenizer")
    build_tiny_image_processor().save_pretrained(tokenizer / "processor")

    monkeypatch.setenv("H3FORGE_COMFY_MODELS", str(root))
    chosen = {folder: model_files.choices(folder) for folder in model_files.FOLDERS}
    video_vae, audio_vae = (model_files.full_path("vae", n) for n in sorted(chosen["vae"], reverse=True))
    pipe = H3Pipeline.from_files(
        model_files.full_path("diffusion_models", chosen["diffusion_models"][0]),
        model_files.full_path("text_encoders", chosen["text_encoders"][0]), video_vae, audio_vae, tokenizer,
        device="cpu", dtype=torch.float32, lora_roots=[root / "loras"],
        configs={"text_encoder": te_config, "layer": 2, "video_vae": dict(TINY_VIDEO_VAE),
                 "audio_vae": dict(TINY_AUDIO_VAE), "canvas": TINY_CANVAS})
    assert isinstance(pipe.dit.blocks[0].attn.qkv_proj, Int8ConvRotLinear)
    status = pipe.describe()
    assert status["files"]["dit"]["format"] == "int8_convrot" and status["files"]["dit"]["pruned"]
    assert status["files"]["video_vae"]["format"] == "fp16"
    assert status["dit"]["adaln"] == "curve (pruned, rank 8)"
    assert status["dit"]["quantized_layers"] == ["Int8ConvRotLinear"]

    pipe.encode_mp4 = False
    result = pipe.generate(GenerateRequest(prompt="a bell rings", seconds=5, width=224, height=128, steps=2,
                                           loras=[("style.safetensors", 0.5)]))
    assert tuple(result.frames.shape[1:]) == (128, 224, 3) and result.frames.dtype == torch.uint8
    assert result.audio.shape[0] == 2 and torch.isfinite(torch.as_tensor(result.audio)).all()
