"""fp8_scaled linear layers (notes/h3_quantized_files.md §1): F8_E4M3 weights with one fp32 scale per tensor.

W = q * weight_scale. With FP8 hardware the activation is quantized too, per tensor by the file's static
`input_scale` when it has one, else per row (amax / 448 of each row, one Triton pass that can also compute the
SwiGLU of fc1's output on the way; or already, by the norm before it: `fused.Fp8Rows`), and `torch._scaled_mm`
multiplies the fp8 operands; without FP8 hardware the weight is dequantized to the activation dtype on the fly, layer
by layer (nothing cached).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import capability, fused
from engine.kernels.fused import FP8, FP8_MAX, Fp8Rows


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (F8_E4M3 [N, K], fp32 scalar scale = amax / 448), the exporter's recipe."""
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quantize_rows(x: torch.Tensor, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (or the [M, 2K] [gate; value] rows of fc1 with `swiglu`) -> (F8_E4M3 [M, K], fp32 [M, 1] amax / 448)."""
    if x.is_cuda and fused._have_triton():
        from engine.quant import quant_triton

        return quant_triton.rowwise_quantize(x, FP8, swiglu)
    return fused.quantize_fp8_rows(fused.swiglu(x) if swiglu else x)


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, input_scale: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale", torch.empty((), dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32) if input_scale else None)
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.scaled_mm: bool | None = None  # None: decided from the device on the first call
        # Hopper's fp8 tensor cores accumulate in ~22 bits unless the GEMM promotes to fp32 every few k-blocks
        # (exact, slower): fast accumulation is for callers that accept the error (the VAE decoder's fp8 tier).
        self.fast_accum = False

    def forward(self, x: torch.Tensor | Fp8Rows, input_act: str | None = None) -> torch.Tensor:
        """`input_act="swiglu"`: x holds fc1's [gate; value] output and fc2 computes on its SwiGLU. x may come
        quantized already (`Fp8Rows`, from a fused norm)."""
        rows_given = isinstance(x, Fp8Rows)
        if self.scaled_mm is None:
            d = (x.q if rows_given else x).device
            self.scaled_mm = capability.fp8_gemm(d.type, capability.capability(d))
        swiglu = input_act == "swiglu"
        if not self.scaled_mm:
            x = x.dequantized() if rows_given else x
            x = fused.swiglu(x) if swiglu else x
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, dequantize_weight(self.weight, self.weight_scale, x.dtype), bias)
        if rows_given:
            lead, out_dtype = x.q.shape[:-1], x.dtype
            xq, x_scale = x.q.reshape(-1, x.q.shape[-1]), x.scale.reshape(-1, 1)
        else:
            lead, out_dtype = x.shape[:-1], x.dtype
            xq, x_scale = self._quantized_input(x.reshape(-1, x.shape[-1]), swiglu)
        # Row scales pair with the weight's scale as a row of columns; a file's static input scale with the scalar.
        w_scale = (self.weight_scale if x_scale.dim() == 0
                   else self.weight_scale.reshape(1, 1).expand(1, self.out_features).contiguous())
        bias = None if self.bias is None else self.bias.to(out_dtype)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype,
                               use_fast_accum=self.fast_accum)
        return out.reshape(*lead, self.out_features)

    def _quantized_input(self, rows: torch.Tensor, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is None:
            return quantize_rows(rows, swiglu)
        rows = fused.swiglu(rows) if swiglu else rows
        # Divide in the activation dtype (no fp32 copy of x) by a scale that dtype holds exactly, so the scale
        # _scaled_mm multiplies back is the one divided by.
        scale = self.input_scale.to(rows.dtype)
        return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def requantize(self, w: torch.Tensor) -> None:
        """Store a changed float weight (a LoRA merge) in this layer's format, with a fresh scale."""
        self.weight, self.weight_scale = quantize_weight(w)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 per-tensor"
