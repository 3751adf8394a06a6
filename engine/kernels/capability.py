"""Which kernel each path may run on a device, from its compute capability. Hopper-only kernels never run before
SM 9.0: FA3 (Hopper itself only), the VSA fine kernel (its blocks arrive by TMA) and the int8 GEMM tiled for
Hopper's shared memory; FP8 GEMMs need SM 8.9, int8 GEMMs SM 7.5, the fused Triton kernels bf16 (SM 8.0).
Elsewhere the portable path runs: cuDNN / SDPA attention, dense attention for VSA requests, cuBLAS `_int_mm`, fp8
weights dequantized per layer, the PyTorch reference of the fused ops.
"""

from __future__ import annotations

import functools

import torch

Capability = tuple[int, int] | None  # None: not a CUDA device


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device | str) -> Capability:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def at_least(cap: Capability, version: tuple[int, int]) -> bool:
    return cap is not None and tuple(cap) >= version


def fa3(cap: Capability) -> bool:
    return cap is not None and cap[0] == 9


def tma(cap: Capability) -> bool:
    """TMA-fed Triton kernels (the VSA fine kernel, the int8 GEMM's Hopper tiles)."""
    return at_least(cap, (9, 0))


def fp8_gemm(device_type: str, cap: Capability) -> bool:
    """Native fp8 GEMMs (`torch._scaled_mm`): CUDA at SM 8.9 (Ada) or newer."""
    return device_type == "cuda" and at_least(cap, (8, 9))


def int8_gemm(device_type: str, cap: Capability) -> bool:
    """The exact int8 GEMM (`torch._int_mm`): on the CPU, and on CUDA from SM 7.5 (Turing)."""
    return device_type == "cpu" or (device_type == "cuda" and at_least(cap, (7, 5)))


def fused_triton(cap: Capability) -> bool:
    return at_least(cap, (8, 0))


def kernel_choices(device_type: str, cap: Capability, fa3_installed: bool = True,
                   triton_installed: bool = True) -> dict:
    """What each path runs (for /v1/status and the tests that pin the choice per capability)."""
    cuda = device_type == "cuda"
    triton = cuda and triton_installed
    return {"attention": "fa3" if cuda and fa3_installed and fa3(cap) else "cudnn" if cuda else "sdpa",
            "vsa": "triton" if triton and tma(cap) else "dense" if cuda else "torch",
            "fp8": "scaled_mm" if fp8_gemm(device_type, cap) else "dequantized",
            "int8": ("dequantized" if not int8_gemm(device_type, cap) else "triton" if triton and tma(cap)
                     else "int_mm"),
            "fused": "triton" if triton and fused_triton(cap) else "torch"}
