"""Online quantization at load (`serve --dit-precision fp8|int8`): the block GEMMs of a bf16 DiT become fp8 or int8
ConvRot layers (int8 also its AdaLN projections), the rest keeps its dtype, the output stays near the float model's, and a real engine started with
the flag says so in /v1/status and runs a job; int8 on a model too narrow for ConvRot is refused by name. The same
for the text encoder's decoder GEMMs (`--text-encoder-precision`), stored quantized and dequantized per layer."""

import asyncio
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from engine.models.h3.config import TINY
from engine.models.h3.dit import build_dit
from engine.models.h3.precision import TEXT_ENCODER_GEMMS, block_gemms, set_precision, set_text_encoder_precision
from engine.quant.fp8 import Fp8Linear
from engine.quant.int8_convrot import Int8ConvRotLinear
from engine_fixture import REPO, free_port, start_engine
from test_comfy_files import CONFIG, forward, rel


@pytest.fixture(scope="module")
def full():
    return build_dit(CONFIG, seed=0)


@pytest.mark.parametrize("precision, layer, tolerance", [("fp8", Fp8Linear, 0.05), ("int8", Int8ConvRotLinear, 0.03)])
def test_block_gemms_are_quantized_and_the_output_stays_close(full, precision, layer, tolerance):
    model = set_precision(copy.deepcopy(full), precision)
    assert all(isinstance(model.get_submodule(n), layer) for n in block_gemms(model))
    # The DiT's fp8 GEMMs promote to fp32 as they accumulate (exact); only the VAE decoder's fp8 tier is fast
    assert not any(getattr(model.get_submodule(n), "fast_accum", False) for n in block_gemms(model))
    adaln = [block.adaln_proj.linear for block in model.blocks]  # int8 takes them (group 64: 128 inputs), fp8 not
    assert all(isinstance(a, Int8ConvRotLinear) and a.group == 64 if precision == "int8" else type(a) is nn.Linear
               for a in adaln)
    assert isinstance(model.time_embedder.proj_in, nn.Linear)  # outside the blocks' GEMMs: as it was
    assert model.time_embedder.proj_in.weight.dtype == torch.float32
    err = rel(forward(model), forward(full))
    print(f"{precision}: relative error of the tiny DiT's output vs float32: {err:.4f}")
    assert 0 < err < tolerance
    assert rel(forward(set_precision(model, precision)), forward(model)) == 0  # quantized layers are left alone


def test_int8_on_a_model_too_narrow_for_convrot_is_refused():
    with pytest.raises(ValueError, match="int8 ConvRot needs layer inputs in multiples of 256; "
                                         "'blocks.0.attn.qkv_proj' takes 48. Use fp8 for this model."):
        set_precision(build_dit(TINY), "int8")


@pytest.mark.parametrize("flag, summary", [
    ("--dit-precision", "H3 tiny (float32; fp8 weights dequantized per layer)"),
    ("--text-encoder-precision", "H3 tiny (float32) · text encoder fp8 weights dequantized per layer"),
    ("--vae-precision", "H3 tiny (float32) · video VAE fp8")])
def test_engine_with_fp8_reports_it_and_runs_a_job(tmp_path, flag, summary):
    with start_engine(tmp_path, flag, "fp8") as engine:
        status = asyncio.run(engine.client().status())
        assert status["models"]["summary"] == summary
        result = asyncio.run(engine.client().run("t2va", {"prompt": "rain", "steps": 2, "width": 64, "height": 64}))
        assert result.frames.shape == (124, 64, 64, 3)


def test_engine_with_dit_precision_int8_on_a_narrow_model_exits_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--preset", "tiny", "--device", "cpu", "--port",
                           str(free_port()), "--token-file", str(tmp_path / "t2"), "--dit-precision", "int8"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "int8 ConvRot needs layer inputs in multiples of 256" in proc.stderr


def test_text_encoder_gemms_are_stored_in_fp8_and_the_prompt_embedding_stays_close():
    from engine.models.h3.pipeline import H3Pipeline

    pipe = H3Pipeline.from_preset("tiny")
    before, _ = pipe.conditioner.encode("a large red ball bounces", [])
    lm = pipe.conditioner.model.model.language_model
    float_bytes = sum(p.numel() * p.element_size() for p in lm.layers.parameters())
    set_text_encoder_precision(pipe.conditioner, "fp8")
    gemms = [layer.get_submodule(g) for layer in lm.layers for g in TEXT_ENCODER_GEMMS]
    assert gemms and all(isinstance(g, Fp8Linear) and not g.scaled_mm for g in gemms)  # dequantized per layer
    quantized_bytes = sum(t.numel() * t.element_size() for t in (*lm.layers.parameters(), *lm.layers.buffers()))
    assert quantized_bytes < 0.5 * float_bytes  # fp32 on the CPU: the GEMM weights at a quarter
    after, _ = pipe.conditioner.encode("a large red ball bounces", [])
    err = ((after - before).norm() / before.norm()).item()
    print(f"fp8 text encoder: relative error of the prompt embedding vs float32: {err:.4f}")
    assert 0 < err < 0.06
    assert pipe.weights_summary() == "H3 tiny (float32) · text encoder fp8 weights dequantized per layer"
    with pytest.raises(ValueError, match="Unknown text encoder precision 'fp4'"):
        set_text_encoder_precision(pipe.conditioner, "fp4")
    narrow = H3Pipeline.from_preset("tiny").conditioner
    with pytest.raises(ValueError, match="int8 ConvRot needs layer inputs in multiples of 256; "
                                         "'model.language_model.layers.0.self_attn.q_proj' takes 32"):
        set_text_encoder_precision(narrow, "int8")
