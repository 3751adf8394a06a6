"""ComfyUI's way of choosing H3 model files: combos of the files in its `diffusion_models`, `text_encoders`, `vae`
and `loras` folders (folder_paths, so extra_model_paths.yaml is respected), or of the files a remote engine lists
(`GET /v1/models`). Names resolve inside those folders only. No torch.

Outside ComfyUI (the pack's tests) the folders are those under the models folders listed in $H3FORGE_COMFY_MODELS
(os.pathsep-separated).
"""

from __future__ import annotations

import json
import os
import time
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
    return [Path(r) / folder for r in os.environ.get("H3FORGE_COMFY_MODELS", "").split(os.pathsep) if r]


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


def roots() -> list[tuple[str, Path]]:
    """(folder, directory) for every root of every model folder, for an engine this ComfyUI starts
    (`--model-path folder=dir`): it then reads the same files under the same names."""
    return [(folder, root) for folder in FOLDERS for root in _roots(folder)]


# What `auto` picks for the files that go with a chosen DiT: the kind a file's header shows, full precision first.
PREFERRED_FORMATS = ("bf16", "fp16", "fp32", "int8_convrot", "fp8_scaled", "nvfp4_awq")


def auto_choice(folder: str, kind: str) -> str:
    """The file of `kind` (text_encoder, video_vae, audio_vae) in a folder, or ModelFileError saying none is there."""
    try:  # the header reader has no torch; imported here, so the pack's import stays light
        from ..engine.models.h3.model_files import describe_file  # inside ComfyUI: the pack is one package
    except ImportError:
        from engine.models.h3.model_files import describe_file  # the repository root on sys.path (tests)
    found = []
    for name in choices(folder):
        try:
            info = describe_file(full_path(folder, name))
        except (ValueError, OSError, KeyError, TypeError):
            continue
        if info["kind"] == kind:
            rank = PREFERRED_FORMATS.index(info["format"]) if info["format"] in PREFERRED_FORMATS else 99
            found.append((rank, name))
    if not found:
        raise ModelFileError(f"No {kind.replace('_', ' ')} file in ComfyUI's {folder} folders "
                             f"({', '.join(str(r) for r in _roots(folder)) or 'none configured'}); download it "
                             f"there or pick one in the H3Forge Engine node.")
    return min(found)[1]


def comfy_tokenizer_dir() -> Path | None:
    """ComfyUI's own Qwen2.5 tokenizer files (what ComfyUI tokenizes H3 prompts with), when running inside it."""
    if not comfy_compat.IN_COMFYUI:
        return None
    import folder_paths

    path = Path(folder_paths.base_path) / "comfy" / "text_encoders" / "qwen25_tokenizer"
    return path if path.is_dir() else None


_remote_cache: dict[str, tuple[float, dict[str, list[str]]]] = {}
REMOTE_CACHE_S = 30.0


def remote_choices_cached(url: str, token: str) -> dict[str, list[str]]:
    """remote_choices for combos (asked on every /object_info): cached a while, empty while the engine is away."""
    now = time.monotonic()
    hit = _remote_cache.get(url)
    if hit is not None and now - hit[0] < REMOTE_CACHE_S:
        return hit[1]
    try:
        listing = remote_choices(url, token, timeout=2.0)
    except (OSError, ValueError):
        listing = {folder: [] for folder in FOLDERS}
    _remote_cache[url] = (now, listing)
    return listing


def remote_choices(url: str, token: str, timeout: float = 5.0) -> dict[str, list[str]]:
    """What a remote engine has (`GET /v1/models`): {folder: [names]}; names the engine resolves itself."""
    http = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/")
    http = http.removesuffix("/v1/ws")
    request = urllib.request.Request(http + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        listing = json.loads(response.read())
    return {folder: [entry["name"] for entry in listing.get("folders", {}).get(folder, [])] for folder in FOLDERS}
