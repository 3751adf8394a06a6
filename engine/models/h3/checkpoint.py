"""Key-space conversions between our DiT (original/sglang names, contiguous QKV) and other layouts.

Layouts (specs/h3.md §7.2):
  ours      blocks.i.attn.qkv_proj = [q_all; k_all; v_all], mlp.fc1 = [gate; value]
  original  raw MiniMax shards: qkv_proj per-head interleaved [h0: q k v, h1: q k v, ...], plus rope.inv_freq
  comfy     ComfyUI single-file repack: our names, QKV already contiguous
  diffusers MiniMaxH3Transformer3DModel names, q/k/v split, ff.net.0.proj = [value; gate]
"""

from __future__ import annotations

import re

import torch

_TOP_TO_DIFFUSERS = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.norm": "norm_out.norm",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
    "token_refiner.final_norm": "token_refiner.final_norm",
}
_BLOCK_TO_DIFFUSERS = {
    "norm1": "norm1",
    "norm2": "norm2",
    "attn.q_norm": "attn.norm_q",
    "attn.k_norm": "attn.norm_k",
    "attn.out_proj": "attn.to_out.0",
    "mlp.fc2": "ff.net.2",
    "adaln_proj.linear": "adaln_proj.linear",
}


def swap_halves(w: torch.Tensor) -> torch.Tensor:
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def deinterleave_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[h0: q k v, h1: q k v, ...] rows -> [q_all; k_all; v_all]."""
    rows, *rest = w.shape
    head_dim = rows // (3 * heads)
    return w.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(rows, *rest)


def interleave_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, *rest = w.shape
    head_dim = rows // (3 * heads)
    return w.reshape(3, heads, head_dim, *rest).transpose(0, 1).reshape(rows, *rest)


def _split_block_key(key: str):
    m = re.match(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.+)\.(weight|bias)$", key)
    return m.groups() if m else None


def to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> MiniMaxH3Transformer3DModel state dict."""
    out = {}
    for key, value in sd.items():
        parts = _split_block_key(key)
        if parts is None:
            module, suffix = key.rsplit(".", 1)
            out[f"{_TOP_TO_DIFFUSERS[module]}.{suffix}"] = value
            continue
        stack, index, module, suffix = parts
        prefix = f"transformer_blocks.{index}" if stack == "blocks" else f"token_refiner.refiner_blocks.{index}"
        if module == "attn.qkv_proj":
            for name, part in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                out[f"{prefix}.attn.{name}.{suffix}"] = part
        elif module == "mlp.fc1":
            out[f"{prefix}.ff.net.0.proj.{suffix}"] = swap_halves(value)
        else:
            out[f"{prefix}.{_BLOCK_TO_DIFFUSERS[module]}.{suffix}"] = value
    return out
