"""One attention entry point for every model; backends are picked per device and can be overridden.

Tensors are `[batch, seq, heads, head_dim]` (the layout FlashAttention uses); full, non-causal, unmasked attention.
Backends register themselves here so the models never hard-code a kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels import capability

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_BACKENDS: dict[str, AttentionFn] = {}
_AVAILABLE: dict[str, Callable[[torch.device], bool]] = {}
_override: str | None = None
_sparse: Callable[..., torch.Tensor | None] | None = None  # set by engine.kernels.vsa.active(); None declines


def register(name: str, available: Callable[[torch.device], bool] = lambda device: True):
    def wrap(fn: AttentionFn) -> AttentionFn:
        _BACKENDS[name] = fn
        _AVAILABLE[name] = available
        return fn

    return wrap


@register("sdpa")
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


@register("cudnn", available=_cuda)
def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # SDPA's default pick on Hopper is the FA2-based flash kernel (~355 TFLOP/s); cuDNN reaches ~620.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Flash takes the shapes cuDNN rejects; fp32 (the tiny preset on a GPU) has only the efficient and math kernels.
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]):
        return sdpa(q, k, v)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@register("flex")
def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Uncompiled, flex materialises the whole score matrix (S = 109 126 would need 298 GiB); compiled it is a fused
    # Triton kernel. The CPU keeps the eager path (no C++ compile for the small CPU shapes). Contiguous inputs: on
    # q/k/v sliced from one [S, 3, 56, 128] buffer at S = 109 126 (2.35e9 elements, past 32-bit offsets) the compiled
    # kernel hits an illegal memory access on the H200; separate contiguous tensors of that size run.
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _fa3_available(device: torch.device) -> bool:
    if not capability.fa3(capability.capability(device)):
        return False
    try:
        import fa3_fwd_interface  # noqa: F401  (the `fa3-fwd` wheel: FlashAttention-3 forward, Hopper only)
    except ImportError:
        return False
    return True


@register("fa3", available=_fa3_available)
def fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from fa3_fwd_interface import flash_attn_func

    if q.dtype != torch.bfloat16:
        return cudnn(q, k, v)  # the wheel is built for bf16 (and fp8) only
    return flash_attn_func(q, k, v)


def backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends usable on `device`, fastest first."""
    device = torch.device(device)
    preference = ["fa3", "cudnn", "flex", "sdpa"] if device.type == "cuda" else ["sdpa", "flex"]
    names = [n for n in preference if n in _BACKENDS] + [n for n in _BACKENDS if n not in preference]
    return [n for n in names if _AVAILABLE[n](device)]


_auto: dict[torch.device, str] = {}


def choose(device: torch.device | str) -> str:
    if _override is not None:
        return _override
    device = torch.device(device)
    if device not in _auto:
        _auto[device] = backends(device)[0]
    return _auto[device]


def set_backend(name: str | None) -> None:
    """Force one backend for this process (the engine's --attention flag); None: choose per device."""
    global _override
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    _override = name


@contextlib.contextmanager
def use_backend(name: str | None):
    """Force one backend inside the block (`None` keeps the automatic choice)."""
    global _override
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    previous, _override = _override, name
    try:
        yield
    finally:
        _override = previous


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _BACKENDS[choose(q.device)](q, k, v)


def sparse_active() -> bool:
    """Whether VSA (engine.kernels.vsa.active) may take attention calls now."""
    return _sparse is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if _sparse is not None and (out := _sparse(q, k, v)) is not None:
        return out
    return dense(q, k, v)
