"""ComfyUI's way of choosing H3 model files: combos of the files in its `diffusion_models`, `text_encoders`, `vae`
and `loras` folders (folder_paths, so extra_model_paths.yaml is respected), or of the files a remote engine lists
(`GET /v1/models`). Names resolve inside those folders only. No torch.

Outside ComfyUI (the pack's tests) the folders are those under $H3FORGE_COMFY_MODELS.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from . import comfy_compat

FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
SUFFIX = ".safetensors"


class ModelFileError(ValueError):
    """A chosen file that cannot be used; the message says what is allowed."""


def _roots(folder: str) -> list[Path]:
    if folder not in FOLDERS:
        raise ModelFileError(f"Unknown model folder {folder!r}; use one of {', '.join(FOLDERS)}.")
    if comfy_compat.IN_COMFYUI:
        import folder_paths

        return [Path(p) for p in folder_paths.get_folder_paths(folder)]
    root = os.environ.get("H3FORGE_COMFY_MODELS")
    return [Path(root) / folder] if root else []


def choices(folder: str) -> list[str]:
    """The .safetensors files of a model folder, as names relative to it (ComfyUI's combo values)."""
    names = set()
    for root in _roots(folder):
        if root.is_dir():
            names.update(p.relative_to(root).as_posix() for p in root.rglob("*" + SUFFIX) if p.is_file())
    return sorted(names)


def full_path(folder: str, name: str) -> Path:
    """The file a combo value names, inside one of the folder's roots, or ModelFileError."""
    for root in _roots(folder):
        base = root.resolve()
        path = (base / name).resolve()
        if not path.is_relative_to(base):
            raise ModelFileError(f"The {folder} file {name!r} is outside ComfyUI's {folder} folders; pick a file "
                                 "from the list.")
        if path.is_file():
            return path
    raise ModelFileError(f"No {folder} file {name!r} in ComfyUI's {folder} folders "
                         f"({', '.join(str(r) for r in _roots(folder)) or 'none configured'}).")


def lora_specs(chain: list[tuple[str, float]]) -> list[str]:
    """Chosen (LoRA name, strength) pairs -> the engine's `path:strength` list; strength 0 drops a LoRA."""
    return [f"{full_path('loras', name)}:{strength:g}" for name, strength in chain if name and strength != 0]


def remote_choices(url: str, token: str, timeout: float = 5.0) -> dict[str, list[str]]:
    """What a remote engine has (`GET /v1/models`): {folder: [names]}; names the engine resolves itself."""
    http = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/")
    http = http.removesuffix("/v1/ws")
    request = urllib.request.Request(http + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        listing = json.loads(response.read())
    return {folder: [entry["name"] for entry in listing.get("folders", {}).get(folder, [])] for folder in FOLDERS}
