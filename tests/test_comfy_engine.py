"""Comfy-Org single files chosen the ComfyUI way and run by a real engine: a ComfyUI models tree made by the test
(the embedded default's architecture in the published schemas: pruned fp8_scaled DiT, bf16 text encoder, fp16 video
VAE, fp32 audio VAE) plus a second LoRA folder as extra_model_paths.yaml adds one. The Engine node offers the files,
`auto` picks the text encoder and VAEs by their headers, the bundled engine starts on them, a LoRA from the chain
applies, and names outside the model folders are refused (by the node, the engine's CLI and a job)."""

import asyncio
import copy
import importlib
import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from engine.models.h3.checkpoint import save_dit
from engine.models.h3.conditioner import build_tiny_conditioner
from engine.models.h3.config import TINY
from engine.models.h3.dit import build_dit
from engine.models.h3.prune import prune_adaln
from engine.models.h3.vae import build_tiny_audio_vae, build_tiny_video_vae
from engine.quant.transform import QuantSpec, quantize_linears
from engine_fixture import REPO, free_port
from test_comfy_files import gemm_names, published
from test_comfy_text_encoder import bf16_tensors
from test_comfy_vae_files import comfy_audio_vae_file, comfy_video_vae_file
from test_pack_import import load_pack

load_pack()
launcher = importlib.import_module("h3forge_pack.nodes.launcher")
from h3forge_pack.nodes.engine_node import H3ForgeEngine, client_for  # noqa: E402
from h3forge_pack.nodes.lora import H3ForgeLora  # noqa: E402
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo  # noqa: E402

DIT = "minimax_h3_fl2va_pruned_fp8_scaled.safetensors"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_bf16.safetensors"
VIDEO_VAE, AUDIO_VAE = "minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors"


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(ComfyUI models folder, an extra models folder holding only loras/)."""
    base = tmp_path_factory.mktemp("ComfyUI")
    root, extra = base / "models", base / "shared_models"
    for folder in ("diffusion_models", "text_encoders", "vae", "loras"):
        (root / folder).mkdir(parents=True)
    (extra / "loras").mkdir(parents=True)
    dit = prune_adaln(build_dit(TINY, seed=0))
    dit = quantize_linears(copy.deepcopy(published(dit)), dict.fromkeys(gemm_names(TINY), QuantSpec("float8_e4m3fn")))
    save_dit(dit, root / "diffusion_models" / DIT)
    save_file(bf16_tensors(build_tiny_conditioner(0, TINY.text_dim).model), root / "text_encoders" / TEXT_ENCODER)
    comfy_video_vae_file(build_tiny_video_vae(0), root / "vae" / VIDEO_VAE)
    comfy_audio_vae_file(build_tiny_audio_vae(0), root / "vae" / AUDIO_VAE)
    torch.manual_seed(0)
    save_file({"blocks.0.attn.out_proj.lora_A.weight": torch.randn(2, TINY.inner_dim),
               "blocks.0.attn.out_proj.lora_B.weight": torch.randn(TINY.hidden_size, 2)},
              extra / "loras" / "style.safetensors")
    (base / "secret.safetensors").write_bytes(b"not for jobs")
    return root, extra


@pytest.fixture
def comfy_models(trees, monkeypatch):
    monkeypatch.setenv("H3FORGE_COMFY_MODELS", os.pathsep.join(str(t) for t in trees))
    return trees


def engine_node(url, **files):
    return H3ForgeEngine().configure(url, "", True, "tiny", "", "cpu", 1, "auto", "engine default", **files)[0]


def test_engine_node_offers_the_files_and_auto_picks_by_header(comfy_models):
    root, extra = comfy_models
    optional = H3ForgeEngine.INPUT_TYPES()["optional"]
    assert optional["diffusion_model"][0] == ["none", DIT]
    assert optional["text_encoder"][0] == ["auto", TEXT_ENCODER]
    assert optional["video_vae"][0] == ["auto", AUDIO_VAE, VIDEO_VAE]
    assert H3ForgeLora.INPUT_TYPES()["required"]["lora_name"][0] == ["style.safetensors"]

    settings = engine_node("ws://127.0.0.1:1", diffusion_model=DIT)
    assert settings["files"] == {"dit": str(root / "diffusion_models" / DIT),
                                 "text_encoder": str(root / "text_encoders" / TEXT_ENCODER),
                                 "video_vae": str(root / "vae" / VIDEO_VAE), "audio_vae": str(root / "vae" / AUDIO_VAE)}
    command = launcher.serve_command(settings, 1, root / "token")
    assert "--preset" not in command and command[command.index("--dit") + 1] == settings["files"]["dit"]
    assert f"loras={extra / 'loras'}" in command and f"vae={root / 'vae'}" in command
    # Without a DiT the node keeps the old way (preset or models_dir); old workflows have no file inputs at all.
    assert "files" not in engine_node("ws://127.0.0.1:1")
    with pytest.raises(ValueError, match="outside ComfyUI's diffusion_models folders"):
        engine_node("ws://127.0.0.1:1", diffusion_model="../../secret.safetensors")
    with pytest.raises(ValueError, match="No diffusion_models file 'gone.safetensors'"):
        engine_node("ws://127.0.0.1:1", diffusion_model="gone.safetensors")


def test_chosen_files_run_a_job_with_a_chained_lora(comfy_models, tmp_path, monkeypatch):
    monkeypatch.setenv("H3FORGE_TOKEN_FILE", str(tmp_path / "token"))
    url = f"ws://127.0.0.1:{free_port()}"
    settings = engine_node(url, diffusion_model=DIT)
    (chain,) = H3ForgeLora().chain("style.safetensors", 0.8)
    node = H3ForgeTextToVideo()
    try:
        _, frames, _, job = asyncio.run(node.generate("a red ball bounces", 5.0, "16:9", 0, 0, 3, 1, engine=settings,
                                                      loras=chain, unique_id="1"))
        assert frames.shape == (124, 128, 224, 3)  # the embedded architecture's canvas, read from the files
        engine = launcher.launched(url)
        assert engine is not None and "--dit" in engine.command

        status = asyncio.run(client_for(settings).status())
        summary = status["models"]["summary"]
        assert summary == (f"DiT {DIT} (fp8_scaled, pruned; fp8 weights dequantized per layer) · text encoder "
                           "bf16 · VAEs fp16/fp32"), summary
        http = url.replace("ws://", "http://")
        request = urllib.request.Request(http + "/v1/models", headers={"Authorization": f"Bearer {engine_token()}"})
        listing = json.loads(urllib.request.urlopen(request, timeout=5).read())["folders"]
        assert [e["name"] for e in listing["loras"]] == ["style.safetensors"]
        assert {e["name"]: e["format"] for e in listing["diffusion_models"]} == {DIT: "fp8_scaled"}

        with pytest.raises(ValueError, match="outside the models directory and the LoRA folders"):
            asyncio.run(node.generate("x", 5.0, "16:9", 0, 0, 3, 1, engine=settings,
                                      lora_list="../../secret.safetensors:1", unique_id="1"))
        assert launcher.launched(url).pid == engine.pid  # the same choice reuses the engine
        # Other models restart the engine this ComfyUI started (here: back to the preset, no files).
        preset = engine_node(url)
        asyncio.run(launcher.ensure_engine(preset))
        restarted = launcher.launched(url)
        assert restarted.pid != engine.pid and not engine.alive() and "--dit" not in restarted.command
        assert asyncio.run(client_for(preset).status())["engine"]["source"] == "preset tiny"
    finally:
        engine = launcher.launched(url)
        if engine is not None:
            engine.stop()


def engine_token() -> str:
    return open(os.environ["H3FORGE_TOKEN_FILE"]).read().strip()


@pytest.mark.parametrize("args, message", [
    (["--dit", "../../secret.safetensors", "--text-encoder", TEXT_ENCODER, "--video-vae", VIDEO_VAE,
      "--audio-vae", AUDIO_VAE], "is outside the engine's diffusion_models folders"),
    (["--dit", DIT, "--text-encoder", TEXT_ENCODER], "missing --video-vae, --audio-vae"),
    (["--dit", DIT, "--text-encoder", TEXT_ENCODER, "--video-vae", VIDEO_VAE, "--audio-vae", AUDIO_VAE,
      "--model-path", "checkpoints=/tmp"], "Unknown model folder 'checkpoints'"),
    (["--dit", DIT, "--text-encoder", TEXT_ENCODER, "--video-vae", VIDEO_VAE, "--audio-vae", AUDIO_VAE,
      "--ref-dit", "../../ref.safetensors"], "is outside the engine's diffusion_models folders"),
    (["--ref-dit", DIT], "--ref-dit goes with the single files"),
])
def test_serve_refuses_what_cannot_work(trees, tmp_path, args, message):
    root, _ = trees
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--device", "cpu", "--port", str(free_port()),
                           "--token-file", str(tmp_path / "token"), "--models", str(root), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
