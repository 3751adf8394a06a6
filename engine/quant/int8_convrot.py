"""int8_convrot linear layers (notes/h3_quantized_files.md §2.2-2.3): ConvRot-rotated I8 weights, one fp32 scale
per output row, run as W8A8.

ConvRot rotates the input dimension group by group with the *regular* Hadamard matrix H (Kronecker powers of
H4 = J - 2·antidiag, divided by sqrt(n); symmetric and orthogonal, so H·H = I), not the Sylvester one. The file
holds q = round(W_g·H / s_w) with s_w[n] = max|row n| / 127. Forward: rotate the activation by the same H,
quantize it per row (s_x = max|row| / 127), multiply int8 by int8 into exact int32 (`torch._int_mm`), rescale by
s_x·s_wᵀ: x·H·(W·H)ᵀ = x·Wᵀ. Without an int8 GEMM the weight is dequantized instead: W = (q·s_w)_g·H.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import capability, fused

GROUP = 256
ROWS_PER_CHUNK = 16384  # bounds the fp32 temporaries of the activation quantizer and the rescale
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


@functools.cache
def _regular_hadamard(n: int) -> torch.Tensor:
    k = round(math.log(n, 4))
    if 4 ** k != n:
        raise ValueError(f"a ConvRot group must be a power of 4 (16, 64, 256, ...), got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(k):
        h = torch.kron(h, torch.tensor(_H4, dtype=torch.float64))
    return h / math.sqrt(n)


@functools.cache
def _sylvester_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@functools.cache
def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             sylvester: bool = False) -> torch.Tensor:
    """The n x n rotation (regular by default; the Sylvester one only to recognise files made with it); cached per
    device so a forward does not copy it there again."""
    return (_sylvester_hadamard(n) if sylvester else _regular_hadamard(n)).to(device, dtype)


def rotate(x: torch.Tensor, group: int, sylvester: bool = False) -> torch.Tensor:
    """Right-multiply every `group`-wide slice of the last dimension by H (H is its own inverse)."""
    h = hadamard(group, x.dtype, x.device, sylvester)
    return (x.unflatten(-1, (-1, group)) @ h).flatten(-2)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 [M, K], fp32 [M, 1]) with s = max|row| / 127, round half to even."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    return (x.float() / scale).round().clamp(-128, 127).to(torch.int8), scale


def quantize_weight(w: torch.Tensor, group: int = GROUP, sylvester: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (I8 [N, K], F32 [N, 1]): the file's recipe (rotate in fp32, then per-row absmax)."""
    return quantize_rows(rotate(w.float(), group, sylvester))


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype,
                      sylvester: bool = False) -> torch.Tensor:
    return rotate(q.float() * scale.float(), group, sylvester).to(dtype)


def _quantize_rows_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda and fused._have_triton():
        from engine.quant import quant_triton

        return quant_triton.rowwise_quantize(x, torch.int8)
    return quantize_rows(x)


def quantize_activation(x: torch.Tensor, group: int, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (with `swiglu`: the SwiGLU of fc1's [gate; value] rows) rotated and quantized, chunk by chunk, so
    the float intermediates exist for one chunk of rows at a time: SwiGLU, rotation (one bf16 GEMM) and the
    abs-max + quantize pass (one Triton kernel on CUDA)."""
    rows = x.shape[0]
    width = x.shape[1] // 2 if swiglu else x.shape[1]
    q = torch.empty(rows, width, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    for start in range(0, rows, ROWS_PER_CHUNK):
        part = x[start:start + ROWS_PER_CHUNK]
        q[start:start + part.shape[0]], scale[start:start + part.shape[0]] = _quantize_rows_fast(
            rotate(fused.swiglu(part) if swiglu else part, group))
    return q, scale


def int8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(xq · wqᵀ exact in int32) · x_scale · w_scaleᵀ (+ bias): one Triton kernel on Hopper, else `torch._int_mm`
    (which wants more than 16 rows: M is padded to >= 32) and a rescale, chunk by chunk."""
    if xq.is_cuda and fused._have_triton() and capability.tma(capability.capability(xq.device)):
        from engine.quant import quant_triton

        return quant_triton.int8_linear(xq, x_scale, wq, w_scale, bias, out_dtype)
    m = xq.shape[0]
    if m < 32:
        xq = F.pad(xq, (0, 0, 0, 32 - m))
    out = torch.empty(m, wq.shape[0], dtype=out_dtype, device=xq.device)
    wt = wq.t()  # a column-major view: a contiguous copy of the transpose costs more than the GEMM (DS-DOC)
    for start in range(0, m, ROWS_PER_CHUNK):
        acc = torch._int_mm(xq[start:start + ROWS_PER_CHUNK], wt)[:min(ROWS_PER_CHUNK, m - start)]
        part = acc.float() * x_scale[start:start + acc.shape[0]] * w_scale.t()
        out[start:start + acc.shape[0]] = (part if bias is None else part + bias.float()).to(out_dtype)
    return out


class Int8ConvRotLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, group: int = GROUP):
        super().__init__()
        if in_features % group:
            raise ValueError(f"in_features {in_features} is not a multiple of the ConvRot group {group}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.int_mm: bool | None = None  # None: decided from the device on the first call

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        """`input_act="swiglu"`: x holds fc1's [gate; value] output and fc2 computes on its SwiGLU, which is formed
        inside the activation quantizer chunk by chunk."""
        if self.int_mm is None:
            d = x.device
            self.int_mm = capability.int8_gemm(d.type, capability.capability(d))
        lead = x.shape[:-1]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        swiglu = input_act == "swiglu"
        if not self.int_mm:
            x = fused.swiglu(x) if swiglu else x
            w = dequantize_weight(self.weight, self.weight_scale, self.group, x.dtype)
            return F.linear(x, w, bias)
        xq, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]), self.group, swiglu)
        out = int8_matmul(xq, x_scale, self.weight, self.weight_scale, x.dtype, bias)
        return out.reshape(*lead, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, self.group, dtype)

    def requantize(self, w: torch.Tensor) -> None:
        """Store a changed float weight (a LoRA merge) in this layer's format, with fresh row scales."""
        self.weight, self.weight_scale = quantize_weight(w, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row, "
                f"ConvRot group {self.group}")


def channel_flatness(q: torch.Tensor, scale: torch.Tensor, group: int, sylvester: bool = False,
                     rows: int = 1024) -> float:
    """Cosine between the per-input-channel energy of the weight un-rotated with one matrix and a flat profile.

    Trained weights have outlier input channels (why ConvRot rotates at all): un-rotated with the matrix the file
    was made with they show them (cosine clearly below 1); with the other matrix the channels stay mixed (near 1).
    """
    w = dequantize_weight(q[:rows], scale[:rows], group, torch.float32, sylvester)
    energy = w.square().sum(dim=0)
    return float(energy.mean() / energy.square().mean().sqrt())
