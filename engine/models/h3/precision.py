"""Online quantization of a loaded DiT (`serve --dit-precision fp8|int8`): the four GEMMs of every block (qkv, out,
fc1, fc2), the same layers the Comfy-Org fp8_scaled / int8_convrot files quantize, become fp8 (per-tensor weight
scale, `_scaled_mm` where the GPU has FP8) or int8 ConvRot W8A8. Everything else, the fp32 islands included, keeps
its dtype. Layers a file already stores quantized stay as they are."""

from __future__ import annotations

import torch.nn as nn

from engine.models.h3.checkpoint import bump_weights_version
from engine.models.h3.dit import H3DiT, SwiGLU
from engine.quant import int8_convrot
from engine.quant.transform import QuantSpec, fuse_swiglu, quantize_linears

PRECISIONS = {"bf16": None, "fp8": "float8_e4m3fn", "int8": "int8_convrot"}
BLOCK_GEMMS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def block_gemms(dit: H3DiT) -> list[str]:
    return [f"blocks.{i}.{gemm}" for i in range(len(dit.blocks)) for gemm in BLOCK_GEMMS]


def set_precision(dit: H3DiT, precision: str) -> H3DiT:
    """Quantize the block GEMMs that are still plain nn.Linear; ValueError names what cannot be done."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown DiT precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    fmt = PRECISIONS[precision]
    if fmt is None:
        return dit
    names = [n for n in block_gemms(dit) if isinstance(dit.get_submodule(n), nn.Linear)]
    if fmt == "int8_convrot":
        narrow = [n for n in names if dit.get_submodule(n).in_features % int8_convrot.GROUP]
        if narrow:
            raise ValueError(f"int8 ConvRot needs layer inputs in multiples of {int8_convrot.GROUP}; "
                             f"'{narrow[0]}' takes {dit.get_submodule(narrow[0]).in_features}. Use fp8 for this "
                             f"model.")
    quantize_linears(dit, dict.fromkeys(names, QuantSpec(fmt)))
    fuse_swiglu(dit, SwiGLU)
    bump_weights_version(dit)
    return dit
