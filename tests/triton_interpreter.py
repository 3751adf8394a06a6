"""Triton kernel modules for tests: compiled on a GPU, run by triton's interpreter on the CPU (conftest.py sets
TRITON_INTERPRET there); tests skip where triton is not installed."""

import importlib

import pytest
import torch


def _interpreter_index_fix():
    """triton 3.6's interpreter turns a scalar into an index with int() on a 1-element array, which numpy >= 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"); index through .item() instead."""
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "item_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch.item_index = True
    interpreter._patch_lang_tensor = patch


def load_kernels(module: str):
    """`module`, e.g. "engine.kernels.fused_triton"."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        _interpreter_index_fix()
    return importlib.import_module(module)
