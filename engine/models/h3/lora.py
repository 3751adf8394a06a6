"""LoRA files for the H3 DiT (specs/h3.md §7.5): read any published key space, merge into the weights, unmerge.

Accepted key spaces, all normalised onto our module names (= the original checkpoint's):
  bare          blocks.0.attn.qkv_proj.lora_A.weight / .lora_B.weight
  prefixed      diffusion_model.blocks.0... (also model.diffusion_model.)
  musubi/kohya  lora_unet_blocks_0_attn_qkv_proj.lora_down.weight / .lora_up.weight / .alpha
  DiffSynth     blocks.0.attn.qkv_proj.lora_A.default.weight, trained on the raw per-head interleaved QKV
  diffusers     transformer.transformer_blocks.0.attn.to_q.lora_A.weight, ff.net.0.proj = [value; gate], ...
Scale of a module: alpha / rank when an alpha is known (per-module `.alpha`, else a `__metadata__` "alpha" as a
uniform network alpha), else 1.0; times the user's scale.

Pruned (curve AdaLN) models: a full-model AdaLN LoRA (lora_A [r, 2688]) is projected onto the rank-8 curve input,
A' = A·basisᵀ, with B·A·mean landing in the bias, when the model knows its basis (`adaln_basis`, `adaln_mean`;
engine/models/h3/prune.py); the Comfy pruned files carry neither, so there it is refused by name, as is a LoRA
of the time embedder the pruned model does not have. Quantized layers are merged through their float weight and
stored again in their format; unmerging restores the stored bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from engine.models.h3.checkpoint import (
    QKV_PARTS,
    bump_weights_version,
    deinterleave_qkv,
    diffusers_module_to_ours,
    swap_halves,
)

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
_KOHYA_PREFIX = "lora_unet_"
_KEY = re.compile(r"(?P<module>.+)\.(?:(?P<role>lora_A|lora_B|lora_down|lora_up)(?P<default>\.default)?\.weight|alpha)")
_ROLES = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}


class LoraError(ValueError):
    """A LoRA file that does not fit the model; the message names the key and the file."""


class LoraWeight(NamedTuple):
    A: torch.Tensor  # [rank, in_features]
    B: torch.Tensor  # [out_features, rank]
    alpha: float | None  # delta = alpha / rank * B @ A; None means alpha == rank
    bias: torch.Tensor | None = None  # [out_features], scaled like B @ A (a projected AdaLN LoRA's mean term)

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.A.shape[0]


@dataclass
class LoraHandle:
    """What `unmerge_lora` needs: the touched weights as they were before the merge (host copies)."""
    originals: dict[str, torch.Tensor]


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """"file.safetensors:0.8" -> ("file.safetensors", 0.8); without a numeric ":scale" suffix the scale is 1.0."""
    path, sep, tail = spec.rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def _linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Plain and quantized linear layers by name (a quantized one has `dequantized` / `requantize`)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) or hasattr(m, "requantize")}


def _is_adaln(module: str) -> bool:
    return module.endswith("adaln_proj.linear")


def _project_adaln(model: nn.Module, module: str, a: torch.Tensor, b: torch.Tensor, a_key: str, fail):
    """A full-width AdaLN LoRA on a pruned model -> (A·basisᵀ, B·A·mean) in fp32."""
    basis, mean = getattr(model, "adaln_basis", None), getattr(model, "adaln_mean", None)
    if basis is None or mean is None:
        fail(f"'{a_key}' is an AdaLN LoRA of the full model ({a.shape[1]} inputs), but this model is pruned (curve "
             f"AdaLN, {model.config.time_embed_dim} inputs) and its file carries no basis to project it onto; use "
             "a LoRA trained on the pruned model, or the full model")
    if a.shape[1] != basis.shape[1]:
        fail(f"'{a_key}' has {a.shape[1]} inputs; '{module}' takes {basis.shape[1]} (full) or {basis.shape[0]} "
             "(pruned)")
    a = a.float()
    return a @ basis.T.float(), b.float() @ (a @ mean.float())


def _kohya_names(modules) -> dict[str, str | None]:
    """Flattened `a_b_c` -> dotted name; None marks a flattened name two modules share (ambiguous)."""
    flat: dict[str, str | None] = {}
    for name in modules:
        key = name.replace(".", "_")
        flat[key] = None if key in flat else name
    return flat


def load_lora(path: str | Path, model: nn.Module) -> dict[str, LoraWeight]:
    """Read a LoRA file and normalise it onto `model`'s module names: {module: LoraWeight}.

    Every key must be a LoRA tensor of an existing Linear of the model with fitting shapes, else LoraError.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoraError(f"{path.name}: cannot read as safetensors ({e})") from e
    if not tensors:
        raise LoraError(f"{path.name}: contains no tensors")

    def fail(msg: str):
        raise LoraError(f"{path.name}: {msg}")

    network_alpha = None
    if "alpha" in metadata:
        try:
            network_alpha = float(metadata["alpha"])
        except ValueError:
            fail(f"__metadata__ alpha {metadata['alpha']!r} is not a number")

    modules = _linear_modules(model)
    kohya = _kohya_names(modules)
    heads = model.config.num_attention_heads

    # (our module, row relation) -> {"A"/"B"/"alpha": (tensor, file key)}; DiffSynth groups are flagged.
    groups: dict[tuple[str, str | None], dict] = {}
    diffsynth: set[tuple[str, str | None]] = set()
    for raw, tensor in tensors.items():
        key = next((raw[len(p):] for p in _PREFIXES if raw.startswith(p)), raw)
        m = _KEY.fullmatch(key)
        if m is None:
            fail(f"key '{raw}' is not a LoRA tensor (lora_A/lora_B/lora_down/lora_up/alpha)")
        module, relation = m["module"], None
        if module.startswith(_KOHYA_PREFIX):
            module = kohya.get(module[len(_KOHYA_PREFIX):])
        elif module not in modules:
            try:
                module, relation = diffusers_module_to_ours(module)
            except KeyError:
                module = None
        if module not in modules and getattr(model.config, "curve", False) and "time_embedder" in raw:
            fail(f"key '{raw}' adapts the time embedder, which this pruned (curve AdaLN) model does not have")
        if module not in modules:
            fail(f"key '{raw}' does not name a linear module of the H3 DiT")
        group = groups.setdefault((module, relation), {})
        role = _ROLES[m["role"]] if m["role"] else "alpha"
        if role in group:
            fail(f"key '{raw}' repeats '{group[role][1]}'")
        group[role] = (tensor, raw)
        if m["default"]:
            diffsynth.add((module, relation))

    lora: dict[str, LoraWeight] = {}
    qkv: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, str]]] = {}
    for (module, relation), group in groups.items():
        if "A" not in group or "B" not in group:
            fail(f"key '{next(iter(group.values()))[1]}' has no lora_{'B' if 'A' in group else 'A'} partner")
        (a, a_key), (b, b_key) = group["A"], group["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            fail(f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)} are not a LoRA pair [r, in], [out, r]")
        alpha = float(group["alpha"][0]) if "alpha" in group else network_alpha
        linear = modules[module]
        if relation == "swap":
            b = swap_halves(b)
        elif relation is None and module.endswith("attn.qkv_proj") and (module, None) in diffsynth:
            if b.shape[0] % (3 * heads):
                fail(f"'{b_key}' has {b.shape[0]} rows, not a fused QKV of {heads} heads")
            b = deinterleave_qkv(b, heads)
        if relation in QKV_PARTS:
            scale = 1.0 if alpha is None else alpha / a.shape[0]
            if a.shape[1] != linear.in_features or 3 * b.shape[0] != linear.out_features:
                fail(f"'{b_key}' {list(b.shape)} / '{a_key}' {list(a.shape)} do not fit a third of '{module}' "
                     f"{[linear.out_features, linear.in_features]}")
            qkv.setdefault(module, {})[relation] = (a.float(), b.float() * scale, a_key)
            continue
        bias = None
        if model.config.curve and _is_adaln(module) and a.shape[1] != linear.in_features:
            a, bias = _project_adaln(model, module, a, b, a_key, fail)
        if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
            fail(f"'{b_key}' {list(b.shape)} / '{a_key}' {list(a.shape)} do not fit '{module}' "
                 f"{[linear.out_features, linear.in_features]}")
        lora[module] = LoraWeight(a, b, alpha, bias)

    # Separate q/k/v LoRAs onto our fused qkv_proj: A's stacked, B block-diagonal (scales folded in B).
    for module, parts in qkv.items():
        if module in lora:
            fail(f"key '{next(iter(parts.values()))[2]}' targets '{module}', which the file also sets fused")
        third = modules[module].out_features // 3
        a = torch.cat([parts[p][0] for p in QKV_PARTS if p in parts], dim=0)
        b = a.new_zeros(3 * third, a.shape[0])
        col = 0
        for i, p in enumerate(QKV_PARTS):
            if p in parts:
                part_b = parts[p][1]
                b[i * third:(i + 1) * third, col:col + part_b.shape[1]] = part_b
                col += part_b.shape[1]
        lora[module] = LoraWeight(a, b, None)
    return lora


def merge_lora(model: nn.Module, lora: dict[str, LoraWeight], scale: float = 1.0) -> LoraHandle:
    """W += scale * alpha / rank * B @ A for every module (fp32 math, written back in W's dtype; a quantized
    layer is dequantized, patched and quantized again). Unmerge handles in reverse order of merging.
    """
    modules = _linear_modules(model)
    for name, w in lora.items():
        linear = modules.get(name)
        if linear is None or (linear.out_features, linear.in_features) != (w.B.shape[0], w.A.shape[1]):
            raise LoraError(f"LoRA module '{name}' does not fit the model")
    originals = {}
    with torch.no_grad():
        for name, w in lora.items():
            layer = modules[name]
            touched = ["weight"] + (["weight_scale"] if hasattr(layer, "requantize") else []) + \
                (["bias"] if w.bias is not None else [])
            for attr in touched:
                originals[f"{name}.{attr}"] = getattr(layer, attr).detach().to("cpu", copy=True)
            device = layer.weight.device
            delta = w.B.to(device, torch.float32) @ w.A.to(device, torch.float32) * (scale * w.scale)
            if hasattr(layer, "requantize"):
                layer.requantize(layer.dequantized(torch.float32) + delta)
            else:
                layer.weight.copy_(layer.weight.float() + delta)
            if w.bias is not None:
                layer.bias.copy_(layer.bias.float() + w.bias.to(device, torch.float32) * (scale * w.scale))
    bump_weights_version(model)
    return LoraHandle(originals)


def unmerge_lora(model: nn.Module, handle: LoraHandle) -> None:
    """Restore the tensors a merge touched, bit for bit."""
    with torch.no_grad():
        for key, original in handle.originals.items():
            module, attr = key.rsplit(".", 1)
            layer = model.get_submodule(module)
            current = getattr(layer, attr)
            if current.shape == original.shape and current.dtype == original.dtype:
                current.copy_(original)
            else:
                setattr(layer, attr, original.to(current.device))
    bump_weights_version(model)
