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


@pytest.mark.parametrize("m, n", [(37, 320), (300, 700)])  # edge tiles in both dimensions
def test_int8_linear_is_the_exact_gemm_with_its_epilogue(kernels, m, n):
    torch.manual_seed(0)
    k = 256
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    wq = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    sx, sw, bias = torch.rand(m, 1), torch.rand(n, 1), torch.randn(n)
    exact = (xq.long() @ wq.long().T).double()  # int64: no rounding anywhere
    want = (exact * sx.double() * sw.double().T + bias.double()).float()
    got = kernels.int8_linear(*(t.to(DEVICE) for t in (xq, sx, wq, sw, bias)), torch.float32).cpu()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-3)
    assert kernels.int8_linear(*(t.to(DEVICE) for t in (xq, sx, wq, sw)), None, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K divisible by 128"):
        kernels.int8_linear(xq[:, :100].to(DEVICE), sx.to(DEVICE), wq[:, :100].to(DEVICE), sw.to(DEVICE), None,
                            torch.float32)
