"""Online quantization at load. The DiT (`serve --dit-precision fp8|int8`): the four GEMMs of every block (qkv, out,
fc1, fc2), the same layers the Comfy-Org fp8_scaled / int8_convrot files quantize, become fp8 (per-tensor weight
scale, `_scaled_mm` where the GPU has FP8) or int8 ConvRot W8A8; int8 also takes the blocks' full-width AdaLN
projections (26 GB of the release's 61.5) with ConvRot group 64, as Comfy-Org's unpruned int8 file stores them (a
pruned model's curve projections, 8 inputs and fp32, stay). Everything else, the fp32 islands included, keeps
its dtype. Layers a file already stores quantized stay as they are. The text encoder (`--text-encoder-precision`):
the seven GEMMs of every decoder layer are stored in fp8 or int8 ConvRot and dequantized per layer as they run, the
way the int8_convrot text-encoder file runs (ComfyUI runs text encoders at full precision): half its memory, the
vision tower and the embeddings as they are."""

from __future__ import annotations

import torch.nn as nn

from engine.models.h3.checkpoint import bump_weights_version
from engine.models.h3.dit import H3DiT, SwiGLU
from engine.quant import int8_convrot
from engine.quant.transform import QuantSpec, fuse_swiglu, quantize_linears

PRECISIONS = {"bf16": None, "fp8": "float8_e4m3fn", "int8": "int8_convrot"}
ADALN_GROUPS = (256, 64, 16)  # ConvRot groups an AdaLN projection may take, widest first
BLOCK_GEMMS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
TEXT_ENCODER_GEMMS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                      "mlp.up_proj", "mlp.down_proj")


def stored_as(layer: nn.Module) -> str | None:
    """fp8 / int8 for a linear stored quantized, else None."""
    from engine.quant.fp8 import Fp8Linear

    return {Fp8Linear: "fp8", int8_convrot.Int8ConvRotLinear: "int8"}.get(type(layer))


def block_gemms(dit: H3DiT) -> list[str]:
    return [f"blocks.{i}.{gemm}" for i in range(len(dit.blocks)) for gemm in BLOCK_GEMMS]


def adaln_group(in_features: int) -> int | None:
    """The widest ConvRot group that divides an AdaLN projection's inputs (the release's 2688 = 42 x 64 takes 64),
    or None: too narrow for int8."""
    return next((g for g in ADALN_GROUPS if in_features % g == 0), None)


def int8_adaln(dit: H3DiT) -> dict[str, QuantSpec]:
    """The blocks' AdaLN projections online int8 quantizes (still plain nn.Linear and wide enough), with their group."""
    layers = {f"blocks.{i}.adaln_proj.linear": block.adaln_proj.linear for i, block in enumerate(dit.blocks)}
    return {name: QuantSpec("int8_convrot", group=adaln_group(layer.in_features)) for name, layer in layers.items()
            if type(layer) is nn.Linear and adaln_group(layer.in_features)}


def set_precision(dit: H3DiT, precision: str) -> H3DiT:
    """Quantize the block GEMMs (and for int8 the AdaLN projections) that are still plain nn.Linear; ValueError
    names what cannot be done."""
    fmt = _format(precision, "DiT")
    if fmt is None:
        return dit
    specs = dict.fromkeys(_plain_linears(dit, block_gemms(dit), fmt), QuantSpec(fmt))
    if precision == "int8":
        specs.update(int8_adaln(dit))
    quantize_linears(dit, specs)
    fuse_swiglu(dit, SwiGLU)
    bump_weights_version(dit)
    return dit


def set_text_encoder_precision(conditioner, precision: str) -> None:
    """Store the decoder layers' GEMMs of the conditioner's Qwen3-VL quantized, dequantized per layer as they run;
    the layers a file already stores quantized stay as they are."""
    fmt = _format(precision, "text encoder")
    if fmt is None:
        return
    model = conditioner.model
    layers = len(model.model.language_model.layers)
    names = [f"model.language_model.layers.{i}.{gemm}" for i in range(layers) for gemm in TEXT_ENCODER_GEMMS]
    names = _plain_linears(model, names, fmt)
    quantize_linears(model, dict.fromkeys(names, QuantSpec(fmt, full_precision=True)))


def _format(precision: str, what: str) -> str | None:
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown {what} precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]


def _plain_linears(model: nn.Module, names: list[str], fmt: str) -> list[str]:
    """The named layers still plain nn.Linear; ValueError when int8 ConvRot cannot take one."""
    names = [n for n in names if isinstance(model.get_submodule(n), nn.Linear)]
    if fmt == "int8_convrot":
        narrow = [n for n in names if model.get_submodule(n).in_features % int8_convrot.GROUP]
        if narrow:
            raise ValueError(f"int8 ConvRot needs layer inputs in multiples of {int8_convrot.GROUP}; "
                             f"'{narrow[0]}' takes {model.get_submodule(narrow[0]).in_features}. Use fp8 for this "
                             f"model.")
    return names
