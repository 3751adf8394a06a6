"""Tensor parallelism for the H3 DiT (Megatron-style, as sglang shards it; notes/h3_quantized_files.md §7.1-7.2).

`shard(dit, group)` cuts a loaded DiT, in place, down to this rank's part for the T ranks of `group`, the way
gpt-fast transforms a plain model: no flag reaches the model file.

* Attention (blocks and token refiner): rank r keeps heads [r·H/T, (r+1)·H/T) of each of q, k and v, so qkv_proj's
  rows are cut in its three parts separately, and the matching input columns of out_proj, whose partial sums one
  all-reduce over the group adds up. q_norm / k_norm act per head and stay whole.
* SwiGLU: fc1's gate and value rows cut separately (the local SwiGLU pairs the right halves), fc2's input columns to
  match, then one all-reduce.
* The blocks' AdaLN projections: a contiguous 1/T of the output features each, then one all-gather along the features
  gives every rank the whole table, in the original order (the hidden size is not sharded, every row needs all of
  it), so the AdaLN cache stores what it always stored.

Everything else (patch projections, time embedder, condition_proj, the final layer, norms) stays whole on every rank.
Quantized layers (fp8, int8 ConvRot) are cut the same way, their row scales with their rows. The collectives are
forward hooks on the cut layers (inference only); quantizing a layer afterwards keeps them (engine/quant/transform.py).
The heads left on a rank are what Ulysses splits further (engine/parallel/mesh.py).

    shard(dit, group)
    video, audio = dit(...)  # every rank of the group: the whole model's output

LoRA files are read against the full shapes (`full_width`) and cut like the layers they adapt (`shard_lora`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.models.h3.config import H3Config
from engine.models.h3.dit import Attention, H3DiT
from engine.parallel.collectives import all_gather


@dataclass(frozen=True)
class Cut:
    """How one kind of layer is cut: its output rows (dim 0), in `parts` stacked parts each split on its own, or its
    input columns (dim 1); then `collective` on its output."""

    pattern: re.Pattern
    dim: int
    parts: int = 1
    collective: str | None = None  # "all_reduce" | "all_gather"


CUTS = (
    Cut(re.compile(r"(token_refiner\.)?blocks\.\d+\.attn\.qkv_proj"), 0, parts=3),  # [q; k; v]
    Cut(re.compile(r"(token_refiner\.)?blocks\.\d+\.attn\.out_proj"), 1, collective="all_reduce"),
    Cut(re.compile(r"(token_refiner\.)?blocks\.\d+\.mlp\.fc1"), 0, parts=2),  # [gate; value]
    Cut(re.compile(r"(token_refiner\.)?blocks\.\d+\.mlp\.fc2"), 1, collective="all_reduce"),
    Cut(re.compile(r"blocks\.\d+\.adaln_proj\.linear"), 0, collective="all_gather"),
)


@dataclass(frozen=True)
class TensorParallel:
    """What `shard` left on the DiT (`dit.tensor_parallel`)."""

    group: dist.ProcessGroup
    rank: int
    degree: int


def cut_of(name: str) -> Cut | None:
    return next((cut for cut in CUTS if cut.pattern.fullmatch(name)), None)


def tp_degrees(config: H3Config) -> list[int]:
    """The tensor-parallel degrees of this DiT: those that split its heads, FFN and hidden widths evenly and, as in
    sglang, the output heads' widths too (video patch and audio channels; they stay whole here), so both engines run
    the same degrees: 1, 2, 4 and 8 for MiniMax-H3 (7 splits the 56 heads but not the 96 video channels)."""
    widths = (config.num_attention_heads, config.ffn_dim, config.hidden_size, config.video_patch_dim,
              config.audio_in_channels)
    return [t for t in range(1, config.num_attention_heads + 1) if all(w % t == 0 for w in widths)]


def ranges(size: int, parts: int, rank: int, degree: int) -> list[tuple[int, int]]:
    """(start, length) of what `rank` keeps of `size` features stacked in `parts` equal parts, each split `degree`
    ways."""
    part = size // parts
    share = part // degree
    return [(p * part + rank * share, share) for p in range(parts)]


def take(t: torch.Tensor, dim: int, kept: list[tuple[int, int]]) -> torch.Tensor:
    """A new tensor of the `kept` ranges of t along `dim` (the whole t can be freed)."""
    return torch.cat([t.narrow(dim, start, length) for start, length in kept], dim)


def _replace(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(tensor, old.requires_grad) if isinstance(old, nn.Parameter) else tensor)


def _cut_layer(layer: nn.Module, cut: Cut, rank: int, degree: int) -> None:
    """Cut a plain or quantized linear (weight [out, in]; a bias and row scales [out, ...] follow the rows)."""
    size = layer.weight.shape[cut.dim]
    kept = ranges(size, cut.parts, rank, degree)
    names = ["weight"]
    if cut.dim == 0:
        names += [n for n in ("weight_scale", "bias")
                  if (t := getattr(layer, n, None)) is not None and t.ndim and t.shape[0] == size]
    for name in names:
        _replace(layer, name, take(getattr(layer, name), cut.dim, kept))
    if cut.dim == 0:
        layer.out_features = size // degree
    else:
        layer.in_features = size // degree


def _all_reduce(group, module, args, output):
    dist.all_reduce(output, group=group)
    return output


def _all_gather(group, module, args, output):
    return all_gather(output, group, dim=-1)


COLLECTIVES = {"all_reduce": _all_reduce, "all_gather": _all_gather}


def shard(dit: H3DiT, group: dist.ProcessGroup) -> H3DiT:
    """Cut `dit` in place to this rank's part for tensor parallelism over `group`; ValueError when the group's size
    is not one of `tp_degrees` or an int8 ConvRot layer's input columns would not split into whole rotation groups."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    config = dit.config
    if getattr(dit, "tensor_parallel", None) is not None:
        raise ValueError("This DiT is already sharded for tensor parallelism.")
    legal = tp_degrees(config)
    if degree not in legal:
        raise ValueError(f"Tensor parallelism over {degree} ranks does not fit this DiT ({config.num_attention_heads} "
                         f"attention heads, FFN width {config.ffn_dim}): the degree must be one of "
                         f"{', '.join(map(str, legal))}.")
    layers = [(name, module, cut) for name, module in dit.named_modules() if (cut := cut_of(name)) is not None]
    for name, layer, cut in layers:
        rotation = getattr(layer, "group", None)  # int8 ConvRot rotates its input columns in groups
        if cut.dim == 1 and rotation and (layer.in_features // degree) % rotation:
            raise ValueError(f"'{name}' is stored int8 ConvRot, rotated in groups of {rotation} input columns; "
                             f"split {degree} ways its {layer.in_features} columns are {layer.in_features // degree} "
                             f"per rank, not whole groups. Use a smaller --tp, or a bf16 or fp8 DiT.")
    for name, layer, cut in layers:
        _cut_layer(layer, cut, rank, degree)
        if cut.collective:
            layer.register_forward_hook(functools.partial(COLLECTIVES[cut.collective], group))
    for module in dit.modules():
        if isinstance(module, Attention):
            module.heads //= degree
    dit.tensor_parallel = TensorParallel(group, rank, degree)
    return dit


def full_width(dit: H3DiT) -> H3DiT:
    """What LoRA files are checked against: `dit`, or for a sharded one a weightless (meta) DiT of its full shapes."""
    if getattr(dit, "tensor_parallel", None) is None:
        return dit
    with torch.device("meta"):
        whole = H3DiT(dit.config)
    for attr in ("adaln_basis", "adaln_mean"):  # a pruned model's AdaLN basis (engine/models/h3/prune.py)
        if hasattr(dit, attr):
            setattr(whole, attr, getattr(dit, attr))
    return whole


def shard_lora(dit: H3DiT, lora: dict) -> dict:
    """A full-width LoRA ({module: LoraWeight}, engine/models/h3/lora.py) cut like `dit`'s layers: B's rows (and a
    bias) where the layer's rows are cut, A's columns where its input columns are, so B·A is exactly the local part
    of the full delta."""
    tp = getattr(dit, "tensor_parallel", None)
    if tp is None:
        return lora
    out = {}
    for name, w in lora.items():
        cut = cut_of(name)
        if cut is None:
            out[name] = w
        elif cut.dim == 0:
            kept = ranges(w.B.shape[0], cut.parts, tp.rank, tp.degree)
            out[name] = w._replace(B=take(w.B, 0, kept), bias=None if w.bias is None else take(w.bias, 0, kept))
        else:
            out[name] = w._replace(A=take(w.A, 1, ranges(w.A.shape[1], 1, tp.rank, tp.degree)))
    return out
