"""H3 DiT checkpoints: strict loading, saving, and the key-space conversions between layouts.

Layouts (specs/h3.md §7.2):
  ours      blocks.i.attn.qkv_proj = [q_all; k_all; v_all], mlp.fc1 = [gate; value]
  original  raw MiniMax shards: qkv_proj per-head interleaved [h0: q k v, h1: q k v, ...], plus rope.inv_freq
  comfy     ComfyUI single-file repack: our names, QKV already contiguous (rope.inv_freq optional)
  diffusers MiniMaxH3Transformer3DModel names, q/k/v split, ff.net.0.proj = [value; gate]
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.models.h3.config import H3Config
from engine.models.h3.dit import FP32_MODULES, H3DiT, rope_inv_freq

LAYOUTS = ("original", "comfy", "diffusers")
ROPE_KEY = "rope.inv_freq"
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
FILE_STEMS = {"original": "model", "diffusers": "diffusion_pytorch_model"}
CLASS_NAMES = {"original": "MiniMaxH3DiTModel", "diffusers": "MiniMaxH3Transformer3DModel"}
# Our (= diffusers) config field names -> the sglang-native names of an original `transformer/config.json`.
ORIGINAL_CONFIG_NAMES = {
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the key and the file."""


# ---------------------------------------------------------------------------------------------- conversions

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
_TOP_FROM_DIFFUSERS = {v: k for k, v in _TOP_TO_DIFFUSERS.items()}
_BLOCK_FROM_DIFFUSERS = {v: (k, None) for k, v in _BLOCK_TO_DIFFUSERS.items()} | {
    "attn.to_q": ("attn.qkv_proj", "q"),
    "attn.to_k": ("attn.qkv_proj", "k"),
    "attn.to_v": ("attn.qkv_proj", "v"),
    "ff.net.0.proj": ("mlp.fc1", "swap"),
}
QKV_PARTS = ("q", "k", "v")


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


def diffusers_module_to_ours(name: str) -> tuple[str, str | None]:
    """A diffusers module name -> (our module name, row relation).

    The relation is None (same rows), "q"/"k"/"v" (that third of our fused qkv_proj) or "swap" (our fc1 with its
    halves swapped). Raises KeyError for a name the diffusers model does not have.
    """
    m = re.fullmatch(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)", name)
    if m is None:
        return _TOP_FROM_DIFFUSERS[name], None
    stack, index, module = m.groups()
    ours, relation = _BLOCK_FROM_DIFFUSERS[module]
    prefix = "blocks" if stack == "transformer_blocks" else "token_refiner.blocks"
    return f"{prefix}.{index}.{ours}", relation


def from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMaxH3Transformer3DModel state dict -> ours (inverse of `to_diffusers`)."""
    out, qkv = {}, {}
    for key, value in sd.items():
        module, suffix = key.rsplit(".", 1)
        ours, relation = diffusers_module_to_ours(module)
        name = f"{ours}.{suffix}"
        if relation in QKV_PARTS:
            qkv.setdefault(name, {})[relation] = value
        else:
            out[name] = swap_halves(value) if relation == "swap" else value
    for name, parts in qkv.items():
        out[name] = torch.cat([parts[p] for p in QKV_PARTS], dim=0)
    return out


def _map_qkv(sd: dict[str, torch.Tensor], fn, heads: int) -> dict[str, torch.Tensor]:
    return {k: fn(v, heads) if k.endswith("attn.qkv_proj.weight") else v for k, v in sd.items()}


def to_original(sd: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """Our state dict -> raw MiniMax key space (per-head interleaved QKV); `rope.inv_freq` is not added."""
    return _map_qkv(sd, interleave_qkv, heads)


def from_original(sd: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    return _map_qkv(sd, deinterleave_qkv, heads)


def _to_layout(sd: dict[str, torch.Tensor], layout: str, heads: int) -> dict[str, torch.Tensor]:
    if layout == "diffusers":
        return to_diffusers(sd)
    return to_original(sd, heads) if layout == "original" else dict(sd)


def _from_layout(sd: dict[str, torch.Tensor], layout: str, heads: int) -> dict[str, torch.Tensor]:
    if layout == "diffusers":
        return from_diffusers(sd)
    return from_original(sd, heads) if layout == "original" else dict(sd)


# ---------------------------------------------------------------------------------------------- config

def infer_config(shapes: Mapping[str, Sequence[int]], rope_freq_dim: int = 16) -> H3Config:
    """Config from tensor shapes in our (original/comfy) key space.

    Patch size (1, 2, 2) and the default eps/theta are assumed; rope_freq_dim is read from `rope.inv_freq` when
    present, else taken from the argument.
    """
    def dim(key: str, axis: int) -> int:
        if key not in shapes:
            raise CheckpointError(f"cannot infer the config: missing key '{key}'")
        return int(shapes[key][axis])

    def count(prefix: str) -> int:
        ids = [int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))]
        return max(ids) + 1 if ids else 0

    layers, refiners = count("blocks."), count("token_refiner.blocks.")
    probe = "blocks.0" if layers else "token_refiner.blocks.0"
    head_dim = dim(f"{probe}.attn.q_norm.weight", 0)
    return H3Config(
        num_attention_heads=dim(f"{probe}.attn.qkv_proj.weight", 0) // (3 * head_dim),
        attention_head_dim=head_dim,
        hidden_size=dim("condition_proj.weight", 0),
        num_layers=layers,
        num_refiner_layers=refiners,
        ffn_dim=dim(f"{probe}.mlp.fc2.weight", 1),
        in_channels=dim("video_patch_proj.weight", 1) // 4,
        audio_in_channels=dim("audio_patch_proj.weight", 1),
        text_dim=dim("condition_proj.weight", 1),
        freq_dim=dim("time_embedder.proj_in.weight", 1),
        time_embed_hidden_dim=dim("time_embedder.proj_in.weight", 0),
        time_embed_dim=dim("time_embedder.proj_out.weight", 0),
        rope_freq_dim=dim(ROPE_KEY, 0) if ROPE_KEY in shapes else rope_freq_dim,
    )


def _native_shapes(shapes: dict[str, tuple], layout: str) -> dict[str, tuple]:
    """File shapes renamed to our key space (enough for `infer_config`); unknown keys are left to the strict check."""
    if layout != "diffusers":
        return shapes
    out = {}
    for key, shape in shapes.items():
        module, suffix = key.rsplit(".", 1)
        try:
            ours, relation = diffusers_module_to_ours(module)
        except KeyError:
            continue
        out[f"{ours}.{suffix}"] = (3 * shape[0], *shape[1:]) if relation in QKV_PARTS else shape
    return out


def _config_json(config: H3Config, layout: str) -> dict:
    fields = config.to_dict()
    if layout == "original":
        fields = {ORIGINAL_CONFIG_NAMES.get(k, k): v for k, v in fields.items()}
    return {"_class_name": CLASS_NAMES[layout], **fields}


# ---------------------------------------------------------------------------------------------- files

@contextmanager
def _open(path: Path):
    try:
        f = safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path.name}: is truncated or not a safetensors file ({e})") from e
    with f:
        yield f


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: cannot read JSON ({e})") from e


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str], dict | None]:
    """(files to read, the index's weight_map or {}, config.json or None) for a file or a directory."""
    if path.is_file():
        return [path], {}, None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    config_json = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    for stem in FILE_STEMS.values():
        index = path / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index.name}: has no weight_map")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (path / shard).is_file():
                    raise CheckpointError(f"{index.name} lists shard '{shard}', which is missing from {path}")
            return [path / s for s in shards], weight_map, config_json
        single = path / f"{stem}.safetensors"
        if single.is_file():
            return [single], {}, config_json
    raise CheckpointError(f"{path}: holds neither model.safetensors[.index.json] "
                          "nor diffusion_pytorch_model.safetensors[.index.json]")


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every key of every file -> (file, shape), without reading tensor data."""
    found = {}
    for path in files:
        with _open(path) as f:
            for key in f.keys():
                if key in found:
                    raise CheckpointError(f"{path.name}: key '{key}' is also in {found[key][0].name}")
                found[key] = (path, tuple(f.get_slice(key).get_shape()))
    return found


def detect_layout(keys, config_json: dict | None, sharded: bool) -> str:
    if any(k.startswith(("transformer_blocks.", "proj_in.")) for k in keys):
        return "diffusers"
    if sharded or (config_json or {}).get("_class_name") == CLASS_NAMES["original"]:
        return "original"
    return "comfy"


def _target_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if any(key.startswith(p + ".") for p in FP32_MODULES) else dtype


def bump_weights_version(model: torch.nn.Module) -> None:
    """Weights changed (load, LoRA merge/unmerge): caches keyed on `model.weights_version` must miss."""
    model.weights_version = getattr(model, "weights_version", 0) + 1


def load_dit(path: str | Path, config: H3Config | None = None, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu", layout: str | None = None) -> H3DiT:
    """Load an H3 DiT from any layout, strictly: every tensor exactly once, no extra key, every shape checked.

    `path` is a .safetensors file or a directory with an index + shards or a single model file, and optionally
    config.json (else the config is inferred from the shapes). Shards are read one at a time into a model built on
    the meta device, so host memory holds at most one shard beyond the model itself.
    """
    path = Path(path)
    files, weight_map, config_json = _checkpoint_files(path)
    found = _read_headers(files)
    prefix = next((p for p in KEY_PREFIXES if all(k.startswith(p) for k in found)), "")
    shapes = {k[len(prefix):]: shape for k, (_, shape) in found.items()}
    layout = layout or detect_layout(shapes, config_json, bool(weight_map))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    looked_in = ", ".join(p.name for p in files)

    if config is None and config_json is not None:
        config = H3Config.from_dict(config_json)
    elif config is None:
        try:
            config = infer_config(_native_shapes(shapes, layout))
        except CheckpointError as e:
            raise CheckpointError(f"{e} (looked in: {looked_in})") from None
    heads = config.num_attention_heads

    with torch.device("meta"):
        model = H3DiT(config)
    # Our key -> {file key: meta tensor of the expected shape}; q/k/v of diffusers are three file keys.
    plan = {k: _to_layout({k: t}, layout, heads) for k, t in model.state_dict().items()}
    owner = {fk: k for k, group in plan.items() for fk in group}
    expected = {fk: tuple(t.shape) for group in plan.values() for fk, t in group.items()}
    rope = rope_inv_freq(config)
    if layout == "original" or (layout == "comfy" and ROPE_KEY in shapes):
        expected[ROPE_KEY] = tuple(rope.shape)

    for key, (file, _) in found.items():
        if key[len(prefix):] not in expected:
            raise CheckpointError(f"{file.name}: unexpected key '{key}'")
    for key, shape in expected.items():
        raw = prefix + key
        if key not in shapes:
            where = weight_map.get(raw) or looked_in
            raise CheckpointError(f"missing key '{raw}' (looked in: {where})")
        if shapes[key] != shape:
            raise CheckpointError(f"shape mismatch for '{raw}' in {found[raw][0].name}: file has "
                                  f"{list(shapes[key])}, model expects {list(shape)}")

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        part = {}
        with _open(file) as f:
            for raw in f.keys():
                key = raw[len(prefix):]
                if key == ROPE_KEY:
                    if not torch.allclose(f.get_tensor(raw).float(), rope, rtol=1e-5, atol=0.0):
                        raise CheckpointError(f"{file.name}: '{raw}' does not match rope_freq_dim="
                                              f"{config.rope_freq_dim}, rope_theta={config.rope_theta}")
                    continue
                ours = owner[key]
                group = pending.setdefault(ours, {})
                group[key] = f.get_tensor(raw)
                if len(group) == len(plan[ours]):
                    tensor = _from_layout(pending.pop(ours), layout, heads)[ours]
                    part[ours] = tensor.to(device=device, dtype=_target_dtype(ours, dtype))
        model.load_state_dict(part, strict=False, assign=True)

    model.rope_inv_freq = rope.to(device)
    model.set_dtype(dtype).eval().requires_grad_(False)
    bump_weights_version(model)
    return model


def save_dit(model: H3DiT, path: str | Path, layout: str = "comfy", shards: int = 1) -> Path:
    """Write `model` in a layout: comfy = one file at `path`; original/diffusers = a directory with config.json,
    and with `shards` > 1 an index plus `{model|diffusion_pytorch_model}-0000i-of-0000N.safetensors`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config, path = model.config, Path(path)
    sd = _to_layout({k: v.detach().cpu() for k, v in model.state_dict().items()}, layout,
                    config.num_attention_heads)
    if layout != "diffusers":
        sd[ROPE_KEY] = rope_inv_freq(config)
    if layout == "comfy":
        if shards != 1:
            raise ValueError("a comfy checkpoint is a single file")
        _write(sd, path)
        return path

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config_json(config, layout), indent=2))
    stem = FILE_STEMS[layout]
    if shards == 1:
        _write(sd, path / f"{stem}.safetensors")
        return path
    keys = list(sd)
    weight_map = {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = keys[i * len(keys) // shards:(i + 1) * len(keys) // shards]
        _write({k: sd[k] for k in chunk}, path / name)
        weight_map.update(dict.fromkeys(chunk, name))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def _write(sd: dict[str, torch.Tensor], path: Path) -> None:
    # Clones: q/k/v thirds and state-dict views share storage, which safetensors refuses.
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(path))
