"""Swap a plain model's nn.Linear modules for quantized ones (on the meta device before loading, or on real
weights to quantize them in place)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from engine.quant import fp8, int8_convrot

FORMATS = ("float8_e4m3fn", "int8_convrot")


@dataclass(frozen=True)
class QuantSpec:
    format: str  # one of FORMATS
    group: int = int8_convrot.GROUP  # int8_convrot only
    input_scale: bool = False  # float8_e4m3fn only: the file carries a static activation scale
    full_precision: bool = False  # the marker's full_precision_matrix_mult: always dequantize, never a low-bit GEMM


def quantized_linear(linear: nn.Linear, spec: QuantSpec) -> nn.Module:
    """An empty quantized layer of `linear`'s shape, on `linear`'s device (meta stays meta)."""
    bias = linear.bias is not None
    with torch.device(linear.weight.device):
        if spec.format == "float8_e4m3fn":
            layer = fp8.Fp8Linear(linear.in_features, linear.out_features, bias, spec.input_scale)
            layer.scaled_mm = False if spec.full_precision else None
        elif spec.format == "int8_convrot":
            layer = int8_convrot.Int8ConvRotLinear(linear.in_features, linear.out_features, bias, spec.group)
            layer.int_mm = False if spec.full_precision else None
        else:
            raise ValueError(f"unknown quantization format {spec.format!r}; known: {FORMATS}")
    return layer


def replace_linears(model: nn.Module, specs: dict[str, QuantSpec]) -> nn.Module:
    """Replace each named nn.Linear by its empty quantized layer (weights come from a later load)."""
    for name, spec in specs.items():
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"'{name}' is a {type(linear).__name__}, not an nn.Linear")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized_linear(linear, spec))
    return model


def quantize_linears(model: nn.Module, specs: dict[str, QuantSpec]) -> nn.Module:
    """Quantize the named nn.Linear modules of a model with real weights (what a file of that format would hold); each
    quantized layer keeps the forward hooks of the one it replaces (tensor parallelism's collectives)."""
    for name, spec in specs.items():
        linear = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        layer = quantized_linear(linear, spec)
        if spec.format == "float8_e4m3fn":
            layer.weight, layer.weight_scale = fp8.quantize_weight(linear.weight.detach())
            if spec.input_scale:
                layer.input_scale = torch.ones((), device=linear.weight.device)
        else:
            layer.weight, layer.weight_scale = int8_convrot.quantize_weight(linear.weight.detach(), spec.group)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        layer._forward_hooks.update(linear._forward_hooks)
        setattr(model.get_submodule(parent), child, layer)
    return model


class QuantSwiGLU(nn.Module):
    """fc2(swiglu(fc1(x))) with the SwiGLU formed inside fc2's activation quantizer; the MLP's fc1/fc2 names."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x), input_act="swiglu")


def fuse_swiglu(model: nn.Module, mlp_type: type) -> nn.Module:
    """Every `mlp_type` module (fc2(swiglu(fc1(x)))) whose fc2 is quantized becomes a QuantSwiGLU."""
    for name, module in list(model.named_modules()):
        if type(module) is mlp_type and isinstance(module.fc2, (fp8.Fp8Linear, int8_convrot.Int8ConvRotLinear)):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantSwiGLU(module.fc1, module.fc2))
    return model
