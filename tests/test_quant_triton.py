"""The quantized layers' Triton kernels (compiled on a GPU, triton's interpreter on the CPU) against the torch
reference path: the row-wise activation quantizer (fp8 / int8, with SwiGLU formed inside) and the int8 epilogue."""

import pytest
import torch

from engine.kernels import fused
from engine.quant import fp8, int8_convrot
from triton_interpreter import load_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, else interpreted


@pytest.fixture(scope="module")
def kernels():
    return load_kernels("engine.quant.quant_triton")


def test_int8_rowwise_quantize(kernels):
    torch.manual_seed(0)
    x = (torch.randn(37, 320) * torch.linspace(0.1, 5, 37)[:, None]).to(DEVICE)
    q, s = kernels.rowwise_quantize(x, torch.int8)
    q_ref, s_ref = int8_convrot.quantize_rows(x)
    assert torch.equal(s, s_ref) and q.dtype == torch.int8
    assert (q.int() - q_ref.int()).abs().max() <= 1 and (q != q_ref).float().mean() < 0.01  # ties round apart


def test_fp8_rowwise_quantize_with_swiglu(kernels):
    torch.manual_seed(0)
    h = torch.randn(21, 2 * 192).to(DEVICE)
    q, s = kernels.rowwise_quantize(h, torch.float8_e4m3fn, swiglu=True)
    q_ref, s_ref = fp8.quantize_rows(h, swiglu=True)
    assert torch.allclose(s, s_ref, rtol=1e-6)
    assert q.dtype == torch.float8_e4m3fn
    # the kernel forms the SwiGLU in fp32, the reference rounds it to x's dtype first: a code may step once
    assert (q.float() != q_ref.float()).float().mean() < 0.05
    act = fused.swiglu(h)
    assert ((q.float() * s - act).norm() / act.norm()) < 0.07  # e4m3 rounding of a heavy-tailed row


def test_int8_rescale(kernels):
    torch.manual_seed(0)
    acc = torch.randint(-2**20, 2**20, (19, 1500), dtype=torch.int32).to(DEVICE)
    sx, sw, bias = (t.to(DEVICE) for t in (torch.rand(19, 1), torch.rand(1500, 1), torch.randn(1500)))
    out = kernels.int8_rescale(acc, sx, sw, bias, torch.float32)
    assert torch.allclose(out, acc.float() * sx * sw.T + bias, rtol=1e-6)
    assert kernels.int8_rescale(acc, sx, sw, None, torch.bfloat16).dtype == torch.bfloat16
