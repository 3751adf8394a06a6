"""One attention entry point for every model; backends are picked per device and can be overridden.

Tensors are `[batch, seq, heads, head_dim]` (the layout FlashAttention uses); full, non-causal, unmasked attention.
Backends register themselves here so the models never hard-code a kernel.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_BACKENDS: dict[str, AttentionFn] = {}
_AVAILABLE: dict[str, Callable[[torch.device], bool]] = {}
_override: str | None = None


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


def backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends usable on `device`, fastest first."""
    device = torch.device(device)
    preference = ["fa3", "cudnn", "flex", "sdpa"]
    names = [n for n in preference if n in _BACKENDS] + [n for n in _BACKENDS if n not in preference]
    return [n for n in names if _AVAILABLE[n](device)]


def choose(device: torch.device | str) -> str:
    if _override is not None:
        return _override
    return backends(device)[0]


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _BACKENDS[choose(q.device)](q, k, v)
