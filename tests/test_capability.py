"""The kernel each path runs, pinned per device capability (engine/kernels/capability.py): no FA3 or TMA kernel
before SM 9.0 (FA3 on Hopper only), no fp8 GEMM before 8.9, no int8 GEMM before 7.5, no fused Triton kernel before
8.0; the portable path everywhere else. The CPU engine reports its own choice in /v1/status."""

import pytest
import torch

from engine.kernels import capability

PORTABLE = {"attention": "cudnn", "vsa": "dense", "fp8": "dequantized", "int8": "int_mm", "fused": "triton"}

TABLE = [  # device, capability, what each path runs
    ("cpu", None, {"attention": "sdpa", "vsa": "torch", "fp8": "dequantized", "int8": "int_mm", "fused": "torch"}),
    ("cuda", (7, 0), {**PORTABLE, "int8": "dequantized", "fused": "torch"}),  # V100
    ("cuda", (7, 5), {**PORTABLE, "fused": "torch"}),  # T4
    ("cuda", (8, 0), PORTABLE),  # A100
    ("cuda", (8, 6), PORTABLE),  # RTX 3090, A6000
    ("cuda", (8, 9), {**PORTABLE, "fp8": "scaled_mm"}),  # RTX 4090, L40S, RTX 6000 Ada
    ("cuda", (9, 0), {"attention": "fa3", "vsa": "triton", "fp8": "scaled_mm", "int8": "triton",
                      "fused": "triton"}),  # H100, H200
    ("cuda", (10, 0), {"attention": "cudnn", "vsa": "triton", "fp8": "scaled_mm", "int8": "triton",
                       "fused": "triton"}),  # B200: TMA, but no FA3 build
    ("cuda", (12, 0), {"attention": "cudnn", "vsa": "triton", "fp8": "scaled_mm", "int8": "triton",
                       "fused": "triton"}),  # RTX 5090
]


@pytest.mark.parametrize("device, cap, expected", TABLE, ids=[f"{d}-{c}" for d, c, _ in TABLE])
def test_kernel_choice_per_capability(device, cap, expected):
    assert capability.kernel_choices(device, cap) == expected


def test_missing_packages_fall_back():
    hopper = capability.kernel_choices("cuda", (9, 0), fa3_installed=False, triton_installed=False)
    assert hopper == {"attention": "cudnn", "vsa": "dense", "fp8": "scaled_mm", "int8": "int_mm", "fused": "torch"}


def test_predicates_at_their_edges():
    assert not capability.fp8_gemm("cpu", None) and not capability.fp8_gemm("cuda", (8, 6))
    assert capability.fp8_gemm("cuda", (8, 9)) and capability.fp8_gemm("cuda", (12, 0))
    assert capability.int8_gemm("cpu", None) and not capability.int8_gemm("cuda", (7, 0))
    assert capability.int8_gemm("cuda", (7, 5)) and not capability.int8_gemm("mps", None)
    assert not capability.tma((8, 9)) and capability.tma((9, 0))
    assert capability.fa3((9, 0)) and not capability.fa3((10, 0)) and not capability.fa3(None)
    assert capability.capability("cpu") is None and capability.capability(torch.device("cpu")) is None


def test_the_engine_reports_its_kernels():
    from engine.models.h3.pipeline import H3Pipeline

    assert H3Pipeline.from_preset("tiny").describe()["kernels"] == TABLE[0][2]
