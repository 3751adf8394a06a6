"""H3 DiT checkpoints: strict loading, saving, and the key-space conversions between layouts.

Layouts (specs/h3.md §7.2):
  ours      blocks.i.attn.qkv_proj = [q_all; k_all; v_all], mlp.fc1 = [gate; value]
  original  raw MiniMax shards: qkv_proj per-head interleaved [h0: q k v, h1: q k v, ...], plus rope.inv_freq
  comfy     ComfyUI single-file repack: our names, QKV already contiguous (rope.inv_freq optional)
  diffusers MiniMaxH3Transformer3DModel names, q/k/v split, ff.net.0.proj = [value; gate]

Comfy single files may also be pruned (`adaln_t_table`, rank-r AdaLN projections, no time embedder) and quantized
(notes/h3_quantized_files.md): per-layer `<layer>.comfy_quant` U8 JSON markers or a file-level
`__metadata__["_quantization_metadata"]` name the fp8_scaled (F8_E4M3 + scalar `weight_scale`, optional
`input_scale`) and int8_convrot (I8 + `weight_scale [N, 1]`, regular-Hadamard ConvRot) layers, which load into the
quantized layers of engine/quant and run as stored.
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
from engine.models.h3.dit import H3DiT, SwiGLU, keeps_fp32, rope_inv_freq
from engine.quant import int8_convrot
from engine.quant.fp8 import Fp8Linear
from engine.quant.transform import QuantSpec, fuse_swiglu, replace_linears

LAYOUTS = ("original", "comfy", "diffusers")
ROPE_KEY = "rope.inv_freq"
CURVE_TABLE = "adaln_t_table"
MARKER = "comfy_quant"
QUANT_METADATA = "_quantization_metadata"
VIDEO_SHIFT_METADATA = "video_shift"
GUIDANCE_METADATA = "guidance"  # a DiT trained with caption dropout; the released ones are guidance-distilled
FLOAT_DTYPES = ("F32", "BF16", "F16")
STORED_DTYPES = {"float8_e4m3fn": "F8_E4M3", "int8_convrot": "I8"}
MARKER_FIELDS = {"format", "convrot", "convrot_groupsize", "full_precision_matrix_mult"}
# Un-rotating a ConvRot file with the wrong matrix leaves its channels mixed: refuse when the Sylvester matrix
# reveals clearly more channel structure than the regular one (a margin far above random weights' 2e-4 spread).
SYLVESTER_MARGIN = 0.02
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
    if CURVE_TABLE in shapes:  # pruned: the table replaces the time embedder (whose widths keep their defaults)
        time = dict(adaln_curve_grid=dim(CURVE_TABLE, 0), time_embed_dim=dim(CURVE_TABLE, 1))
    else:
        time = dict(freq_dim=dim("time_embedder.proj_in.weight", 1),
                    time_embed_hidden_dim=dim("time_embedder.proj_in.weight", 0),
                    time_embed_dim=dim("time_embedder.proj_out.weight", 0))
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
        rope_freq_dim=dim(ROPE_KEY, 0) if ROPE_KEY in shapes else rope_freq_dim,
        **time,
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


def _read_headers(files: list[Path]) -> tuple[dict[str, tuple[Path, tuple[int, ...], str]], dict[str, str]]:
    """(every key of every file -> (file, shape, safetensors dtype), the files' __metadata__), without tensor data."""
    found, metadata = {}, {}
    for path in files:
        with _open(path) as f:
            metadata.update(f.metadata() or {})
            for key in f.keys():
                if key in found:
                    raise CheckpointError(f"{path.name}: key '{key}' is also in {found[key][0].name}")
                part = f.get_slice(key)
                found[key] = (path, tuple(part.get_shape()), part.get_dtype())
    return found, metadata


def detect_layout(keys, config_json: dict | None, sharded: bool) -> str:
    if any(k.startswith(("transformer_blocks.", "proj_in.")) for k in keys):
        return "diffusers"
    if sharded or (config_json or {}).get("_class_name") == CLASS_NAMES["original"]:
        return "original"
    return "comfy"


def spec_from_marker(marker: dict, where: str) -> QuantSpec:
    """A comfy_quant marker (or a `_quantization_metadata` layer entry) -> QuantSpec; `where` names it in errors."""
    if not isinstance(marker, dict) or set(marker) - MARKER_FIELDS:
        extra = sorted(set(marker) - MARKER_FIELDS) if isinstance(marker, dict) else marker
        raise CheckpointError(f"{where}: unknown quantization fields {extra} (known: {sorted(MARKER_FIELDS)})")
    fmt, full = marker.get("format"), bool(marker.get("full_precision_matrix_mult", False))
    if fmt == "float8_e4m3fn":
        if "convrot" in marker or "convrot_groupsize" in marker:
            raise CheckpointError(f"{where}: a float8_e4m3fn layer cannot be ConvRot-rotated ({marker})")
        return QuantSpec("float8_e4m3fn", full_precision=full)
    if fmt == "int8_tensorwise":
        if marker.get("convrot") is not True:
            raise CheckpointError(f"{where}: int8_tensorwise without ConvRot is not an H3 DiT format; the Comfy-Org "
                                  "int8 files are int8_convrot (\"convrot\": true)")
        group = marker.get("convrot_groupsize", int8_convrot.GROUP)
        if group not in (16, 64, 256, 1024):
            raise CheckpointError(f"{where}: convrot_groupsize {group!r} is not a power of 4 (64 or 256 expected)")
        return QuantSpec("int8_convrot", group=group, full_precision=full)
    raise CheckpointError(f"{where}: quantization format {fmt!r} is not supported; the H3 DiT loads "
                          "float8_e4m3fn (fp8_scaled) and int8_tensorwise + convrot (int8_convrot)")


def comfy_quant_marker(spec: QuantSpec) -> dict:
    """The marker JSON Comfy writes for a layer of this spec (json.dumps default separators in the file)."""
    if spec.format == "float8_e4m3fn":
        return {"format": "float8_e4m3fn"}
    return {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": spec.group}


def _quant_specs(files: list[Path], found: dict, prefix: str, metadata: dict[str, str]) -> tuple[dict, bool]:
    """({our layer name: QuantSpec}, whether the file has per-layer marker tensors) from the markers and/or the
    file-level metadata, which must agree layer by layer when both are present."""
    markers = {}
    for key, (file, _, dtype) in found.items():
        if not key.endswith("." + MARKER):
            continue
        if dtype != "U8":
            raise CheckpointError(f"wrong dtype for '{key}' in {file.name}: file has {dtype}, expected U8 (JSON bytes)")
        with _open(file) as f:
            raw = bytes(f.get_tensor(key).tolist())
        try:
            markers[key[len(prefix):-len(MARKER) - 1]] = (json.loads(raw.decode()), f"{file.name}: '{key}'")
        except (UnicodeDecodeError, ValueError):
            raise CheckpointError(f"{file.name}: '{key}' is not UTF-8 JSON ({raw[:40]!r})") from None

    layers = {}
    if QUANT_METADATA in metadata:
        where = f"{files[0].name}: __metadata__ {QUANT_METADATA}"
        try:
            entries = json.loads(metadata[QUANT_METADATA])["layers"]
        except (ValueError, TypeError, KeyError):
            raise CheckpointError(f"{where} is not JSON with a 'layers' map") from None
        for name, entry in entries.items():
            layers[next((name[len(p):] for p in KEY_PREFIXES if name.startswith(p)), name)] = (
                entry, f"{where} layer '{name}'")
    if markers and layers:
        for name in sorted(markers.keys() | layers.keys()):
            a, b = markers.get(name, (None,))[0], layers.get(name, (None,))[0]
            if a != b:
                raise CheckpointError(f"{files[0].name}: quantization markers conflict for '{name}': its "
                                      f"{MARKER} tensor says {a}, __metadata__ {QUANT_METADATA} says {b}")
    specs = {name: spec_from_marker(entry, where) for name, (entry, where) in (layers | markers).items()}
    keys = {k[len(prefix):] for k in found}
    for name, spec in list(specs.items()):
        if spec.format == "float8_e4m3fn" and name + ".input_scale" in keys:
            specs[name] = QuantSpec(spec.format, input_scale=True, full_precision=spec.full_precision)
    return specs, bool(markers)


def _allowed_dtypes(key: str, quant: dict[str, QuantSpec]) -> tuple[str, ...]:
    module, _, suffix = key.rpartition(".")
    spec = quant.get(module)
    if suffix == MARKER:
        return ("U8",)
    if spec is not None and suffix == "weight":
        return (STORED_DTYPES[spec.format],)
    if spec is not None and suffix in ("weight_scale", "input_scale"):
        return ("F32",)
    return FLOAT_DTYPES


def _check_rotation(model: H3DiT, file: Path) -> None:
    """A ConvRot file made with the Sylvester Hadamard matrix un-rotates to noise: recognise it on one layer."""
    probe = next(((n, m) for n, m in model.named_modules()
                  if isinstance(m, int8_convrot.Int8ConvRotLinear) and m.group == int8_convrot.GROUP), None)
    if probe is None:
        return
    name, layer = probe
    regular = int8_convrot.channel_flatness(layer.weight, layer.weight_scale, layer.group)
    sylvester = int8_convrot.channel_flatness(layer.weight, layer.weight_scale, layer.group, sylvester=True)
    if sylvester < regular - SYLVESTER_MARGIN:
        raise CheckpointError(
            f"{file.name}: '{name}.weight' was rotated with the Sylvester (Walsh) Hadamard matrix, not ConvRot's "
            f"regular one (channel-structure cosine {sylvester:.3f} un-rotated with Sylvester vs {regular:.3f} with "
            "the regular matrix); it would compute noise. Use the Comfy-Org int8_convrot file or re-export it "
            "with comfy-kitchen's ConvRot.")


def bump_weights_version(model: torch.nn.Module) -> None:
    """Weights changed (load, LoRA merge/unmerge): caches keyed on `model.weights_version` must miss."""
    model.weights_version = getattr(model, "weights_version", 0) + 1


def trained_sampling(path: str | Path, key: str) -> float | None:
    """A sampling setting a single-file DiT's header names (`save_dit(video_shift=..., guidance=...)`: the
    VIDEO_SHIFT_METADATA or GUIDANCE_METADATA key), else None."""
    path = Path(path)
    if not path.is_file():
        return None
    with safe_open(path, framework="pt", device="cpu") as f:
        value = (f.metadata() or {}).get(key)
    try:
        return None if value is None else float(value)
    except ValueError:
        raise CheckpointError(f"{path.name}: the header's {key!r} is {value!r}, not a number") from None


def load_dit(path: str | Path, config: H3Config | None = None, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu", layout: str | None = None) -> H3DiT:
    """Load an H3 DiT from any layout, strictly: every tensor exactly once, no extra key, every shape and dtype
    checked.

    `path` is a .safetensors file or a directory with an index + shards or a single model file, and optionally
    config.json (else the config is inferred from the shapes). Shards are read one at a time into a model built on
    the meta device, so host memory holds at most one shard beyond the model itself. Quantized layers keep their
    stored dtypes; fp32 islands (patch projections, heads, time embedder or curve AdaLN) load fp32 whatever the file
    stores; everything else loads in `dtype`.
    """
    path = Path(path)
    files, weight_map, config_json = _checkpoint_files(path)
    found, metadata = _read_headers(files)
    prefix = next((p for p in KEY_PREFIXES if all(k.startswith(p) for k in found)), "")
    shapes = {k[len(prefix):]: shape for k, (_, shape, _) in found.items()}
    layout = layout or detect_layout(shapes, config_json, bool(weight_map))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    looked_in = ", ".join(p.name for p in files)
    if CURVE_TABLE in shapes and (embedder := next((k for k in found if ".time_embedder." in "." + k), None)):
        raise CheckpointError(f"{found[embedder][0].name}: a pruned (curve AdaLN) checkpoint has '{prefix}"
                              f"{CURVE_TABLE}' and must not also carry '{embedder}'; the file mixes a pruned and a "
                              "full model")
    quant, marker_tensors = _quant_specs(files, found, prefix, metadata)
    if quant and layout != "comfy":
        raise CheckpointError(f"{looked_in}: quantized weights load from Comfy single files only, not the "
                              f"{layout} layout")

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
    for name, spec in quant.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            linear = None
        if not isinstance(linear, torch.nn.Linear):
            raise CheckpointError(f"{looked_in}: quantization marker for '{prefix}{name}', which is not a linear "
                                  "layer of the H3 DiT")
        if spec.format == "int8_convrot" and linear.in_features % spec.group:
            raise CheckpointError(f"{looked_in}: '{prefix}{name}' has {linear.in_features} inputs, not a multiple of "
                                  f"its ConvRot group {spec.group}")
    replace_linears(model, quant)
    # Our key -> {file key: meta tensor of the expected shape}; q/k/v of diffusers are three file keys.
    plan = {k: _to_layout({k: t}, layout, heads) for k, t in model.state_dict().items()}
    owner = {fk: k for k, group in plan.items() for fk in group}
    expected = {fk: tuple(t.shape) for group in plan.values() for fk, t in group.items()}
    rope = rope_inv_freq(config)
    if layout == "original" or (layout == "comfy" and ROPE_KEY in shapes):
        expected[ROPE_KEY] = tuple(rope.shape)
    if marker_tensors:
        expected.update({f"{name}.{MARKER}": shapes.get(f"{name}.{MARKER}") for name in quant})

    for key, (file, _, _) in found.items():
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
        allowed, stored = _allowed_dtypes(key, quant), found[raw][2]
        if stored not in allowed:
            raise CheckpointError(f"wrong dtype for '{raw}' in {found[raw][0].name}: file has {stored}, expected "
                                  f"{' or '.join(allowed)}" + (" (a quantized weight without its comfy_quant marker)"
                                                               if stored in ("I8", "F8_E4M3") else ""))

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
                if key.endswith("." + MARKER):
                    continue
                ours = owner[key]
                group = pending.setdefault(ours, {})
                group[key] = f.get_tensor(raw)
                if len(group) == len(plan[ours]):
                    tensor = _from_layout(pending.pop(ours), layout, heads)[ours]
                    part[ours] = tensor.to(device=device, dtype=_target_dtype(ours, tensor.dtype, dtype, config, quant))
        model.load_state_dict(part, strict=False, assign=True)

    model.rope_inv_freq = rope.to(device)
    model.set_dtype(dtype).eval().requires_grad_(False)
    fuse_swiglu(model, SwiGLU)
    _check_rotation(model, files[0])
    bump_weights_version(model)
    return model


def _target_dtype(key: str, stored: torch.dtype, dtype: torch.dtype, config: H3Config,
                  quant: dict[str, QuantSpec]) -> torch.dtype:
    module, _, suffix = key.rpartition(".")
    if module in quant and suffix != "bias":
        return stored  # quantized weights and their fp32 scales run as stored
    return torch.float32 if keeps_fp32(key, config) else dtype


def quant_specs(model: torch.nn.Module) -> dict[str, QuantSpec]:
    """The quantized layers of a model (see engine/quant/transform.py) as {name: QuantSpec}."""
    specs = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            specs[name] = QuantSpec("float8_e4m3fn", input_scale=m.input_scale is not None)
        elif isinstance(m, int8_convrot.Int8ConvRotLinear):
            specs[name] = QuantSpec("int8_convrot", group=m.group)
    return specs


def save_dit(model: H3DiT, path: str | Path, layout: str = "comfy", shards: int = 1, markers: str = "tensor",
             curve_dtype: torch.dtype = torch.float16, video_shift: float | None = None,
             guidance: float | None = None) -> Path:
    """Write `model` in a layout: comfy = one file at `path`; original/diffusers = a directory with config.json,
    and with `shards` > 1 an index plus `{model|diffusion_pytorch_model}-0000i-of-0000N.safetensors`.

    A quantized model (comfy only) is written in Comfy's schema; `markers` says where its layers are named:
    "tensor" (`<layer>.comfy_quant` U8 JSON), "metadata" (`__metadata__` _quantization_metadata) or "both". A
    pruned model's AdaLN projections are stored in `curve_dtype` (the Comfy files store F16; they load as fp32).
    `video_shift` and `guidance` (comfy only): the video schedule's shift the weights were trained for and the
    classifier-free guidance scale to sample them with, in the header."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config, path = model.config, Path(path)
    sd = _to_layout({k: v.detach().cpu() for k, v in model.state_dict().items()}, layout,
                    config.num_attention_heads)
    if layout != "diffusers":
        sd[ROPE_KEY] = rope_inv_freq(config)
    if config.curve:
        sd = {k: v.to(curve_dtype) if k.endswith(("adaln_proj.linear.weight", "adaln_proj.linear.bias",
                                                  "norm_out.linear.weight", "norm_out.linear.bias")) else v
              for k, v in sd.items()}
    quant = quant_specs(model)
    if quant and layout != "comfy":
        raise ValueError("quantized models are written as Comfy single files only")
    if layout == "comfy":
        if shards != 1:
            raise ValueError("a comfy checkpoint is a single file")
        layers = {name: comfy_quant_marker(spec) for name, spec in quant.items()}
        if markers in ("tensor", "both"):
            for name, marker in layers.items():
                sd[f"{name}.{MARKER}"] = torch.tensor(list(json.dumps(marker).encode()), dtype=torch.uint8)
        metadata = {}
        if quant and markers in ("metadata", "both"):
            metadata[QUANT_METADATA] = json.dumps({"format_version": "1.0", "layers": layers})
        for key, value in ((VIDEO_SHIFT_METADATA, video_shift), (GUIDANCE_METADATA, guidance)):
            if value is not None:
                metadata[key] = repr(float(value))
        _write(sd, path, metadata or None)
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


def _write(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    # Clones: q/k/v thirds and state-dict views share storage, which safetensors refuses.
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(path), metadata=metadata)
