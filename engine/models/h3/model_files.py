"""The model files under a ComfyUI-style models folder, and what each one is, from its safetensors header alone.

    <root>/diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors
    <root>/text_encoders/qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors
    <root>/vae/minimax_h3_video_vae_fp16.safetensors, minimax_h3_audio_vae_fp32.safetensors
    <root>/loras/*.safetensors

No torch: the header (8-byte length, then JSON) names every tensor's dtype and shape, which tells the kind
(DiT, text encoder, video or audio VAE, LoRA), pruned or not, and the weight format. Names are resolved inside
their folder only; a path that leaves it is refused.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
MAX_HEADER = 64 << 20
PRECISION = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


class ModelFileError(ValueError):
    """A model file name that cannot be used; the message says what is allowed."""


def read_header(path: Path) -> dict:
    """{tensor name: {"dtype", "shape", ...}} plus "__metadata__" when present."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelFileError(f"{path.name}: is truncated or not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ModelFileError(f"{path.name}: is not a safetensors file (header of {size} bytes)")
        try:
            return json.loads(f.read(size))
        except ValueError:
            raise ModelFileError(f"{path.name}: is truncated or not a safetensors file") from None


def _kind(keys: set[str]) -> str:
    if any(".lora_" in k or ".lora_down." in k or k.startswith("lora_unet_") for k in keys):
        return "lora"
    if any(k.endswith("adaln_t_table") or ".adaln_proj." in k for k in keys):
        return "dit"
    if any(".layers.0.self_attn." in k for k in keys):
        return "text_encoder"
    if any("decoder.transformer_blocks." in k for k in keys):
        return "video_vae"
    if any("dec_in_proj." in k for k in keys):
        return "audio_vae"
    return "unknown"


def describe_file(path: str | Path) -> dict:
    """{"name", "bytes", "kind", "format", "pruned"}: format is fp8_scaled / int8_convrot / nvfp4_awq / int8 for
    quantized files, else the precision most of the weights are stored in (bf16, fp16, fp32)."""
    path = Path(path)
    header = read_header(path)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    keys = set(tensors)
    dtypes = Counter(v.get("dtype") for k, v in tensors.items() if k.endswith(".weight"))
    metadata = header.get("__metadata__") or {}
    if dtypes.get("F8_E4M3") or "float8_e4m3fn" in metadata.get("_quantization_metadata", ""):
        fmt = "fp8_scaled"
    elif any(k.endswith(".weight_scale_2") for k in keys):
        fmt = "nvfp4_awq" if any(k.endswith(".pre_quant_scale") for k in keys) else "nvfp4"
    elif dtypes.get("I8"):
        fmt = "int8_convrot" if any("convrot" in k for k in keys) or _convrot_marked(path, header) else "int8"
    else:
        fmt = PRECISION.get(max((d for d in dtypes if d in PRECISION), key=dtypes.__getitem__, default=""), "unknown")
    kind = _kind(keys)
    return {"name": path.name, "bytes": path.stat().st_size, "kind": kind, "format": fmt,
            "pruned": kind == "dit" and any(k.endswith("adaln_t_table") for k in keys)}


def _convrot_marked(path: Path, header: dict) -> bool:
    """Whether an int8 file's first comfy_quant marker (a few dozen bytes of JSON) says convrot."""
    marker = next((v for k, v in header.items() if k.endswith(".comfy_quant")), None)
    if marker is None:
        return False
    start, end = marker["data_offsets"]
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + size + start)
        return b'"convrot": true' in f.read(min(end - start, 4096))


class ModelRoots:
    """Where an engine may read model files: per ComfyUI folder, the directories searched in order (the models
    folder's own subfolder first, then each `--model-path FOLDER=DIR`, as ComfyUI's extra_model_paths.yaml adds).
    A name is relative to one of them or an absolute path inside one; anything else is refused."""

    def __init__(self, models_dir: str | Path | None = None, extra: tuple[tuple[str, str], ...] = ()):
        self.folders: dict[str, list[Path]] = {folder: [] for folder in FOLDERS}
        if models_dir:
            for folder in FOLDERS:
                self.folders[folder].append(Path(models_dir).expanduser().resolve() / folder)
        for folder, directory in extra:
            if folder not in FOLDERS:
                raise ModelFileError(f"Unknown model folder {folder!r} in --model-path; use one of "
                                     f"{', '.join(FOLDERS)}.")
            self.folders[folder].append(Path(directory).expanduser().resolve())

    def resolve(self, folder: str, name: str | Path) -> Path:
        """The file `name` means in `folder`, or ModelFileError (unknown folder, outside every root, no such file)."""
        if folder not in FOLDERS:
            raise ModelFileError(f"Unknown model folder {folder!r}; use one of {', '.join(FOLDERS)}.")
        roots = self.folders[folder]
        inside = False
        for base in roots:
            path = (base / name).resolve()
            if path.is_relative_to(base):
                inside = True
                if path.is_file():
                    return path
        where = ", ".join(str(r) for r in roots) or "none configured: start the engine with --models DIR"
        if not inside:
            raise ModelFileError(f"The {folder} file {str(name)!r} is outside the engine's {folder} folders "
                                 f"({where}); give a name from those folders (GET /v1/models lists them).")
        raise ModelFileError(f"No {folder} file {str(name)!r} in the engine's {folder} folders ({where}); "
                             "GET /v1/models lists the files it has.")

    def listing(self) -> dict[str, list[dict]]:
        """Every .safetensors file of each folder, names relative to the root that holds it (first root wins)."""
        out: dict[str, list[dict]] = {}
        for folder, roots in self.folders.items():
            entries, seen = [], set()
            for base in roots:
                files = sorted(p for p in base.rglob("*.safetensors") if p.is_file()) if base.is_dir() else []
                for p in files:
                    name = p.relative_to(base).as_posix()
                    if name in seen:
                        continue
                    seen.add(name)
                    try:
                        entry = describe_file(p)
                    except (ModelFileError, OSError, KeyError, TypeError) as e:
                        entry = {"kind": "unreadable", "error": str(e)}
                    entries.append({**entry, "name": name})
            out[folder] = entries
        return out


def list_models(root: str | Path) -> dict[str, list[dict]]:
    """Every .safetensors file of each ComfyUI model folder under `root`, by folder, names relative to it."""
    return ModelRoots(root).listing()


def resolve(root: str | Path, folder: str, name: str) -> Path:
    """`name` inside `root/folder`, or ModelFileError (unknown folder, a path leaving the folder, no such file)."""
    return ModelRoots(root).resolve(folder, name)
