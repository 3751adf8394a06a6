"""SeedVR2 checkpoints (specs/seedvr2.md §5): strict loading of the official DiT, VAE and text-embedding files,
and writing models in the same layout (tests, random-weight fixtures).

Files: `.safetensors` (fp16 / bf16 / fp8 e4m3) or `.pth` (a plain state dict, read with `weights_only=True`; never
a general unpickle). Loading is strict: every model tensor present once, no extra key, every shape checked; errors
name the first offending key and the file. The plain fp8 7B file is refused (known broken: its last block does not
survive fp8; the `_mixed_block35_fp16` file keeps that block in fp16).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.models.seedvr2.config import NADIT_3B, NADIT_7B, VAE, NaDiTConfig, VAEConfig
from engine.models.seedvr2.nadit import FP32_PARAMS, NaDiT, rope_freqs
from engine.models.seedvr2.vae import VideoVAE

ROPE_SUFFIX = ".attn.rope.rope.freqs"
# The official file names, in order of preference.
DIT_FILES = {
    "3b": ("seedvr2_ema_3b_fp16.safetensors", "seedvr2_ema_3b.pth", "seedvr2_ema_3b_fp8_e4m3fn.safetensors"),
    "7b": ("seedvr2_ema_7b_fp16.safetensors", "seedvr2_ema_7b.pth", "seedvr2_ema_7b_sharp_fp16.safetensors",
           "seedvr2_ema_7b_fp8_e4m3fn_mixed_block35_fp16.safetensors",
           "seedvr2_ema_7b_sharp_fp8_e4m3fn_mixed_block35_fp16.safetensors"),
}
VAE_FILES = ("ema_vae_fp16.safetensors", "ema_vae.pth")
TEXT_FILE = "pos_emb.pt"
SUBDIRS = ("", "seedvr2", "SeedVR2", "SeedVR2-3B", "SeedVR2-7B")
CONFIG_METADATA = "config"  # the safetensors header entry where the embedded default's files record their architecture
# Old diffusers attention-block names some VAE state dicts still use.
LEGACY_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the key and the file."""


def is_broken_fp8_7b(name: str) -> bool:
    name = name.lower()
    return "7b" in name and "fp8" in name and "mixed" not in name


def _refuse_broken(path: Path) -> None:
    if is_broken_fp8_7b(path.name):
        raise CheckpointError(
            f"{path.name}: the plain fp8 SeedVR2 7B file is known to be broken (its last block does not survive "
            "fp8 and the output is corrupted). Use seedvr2_ema_7b_fp8_e4m3fn_mixed_block35_fp16.safetensors "
            "(last block kept in fp16) or seedvr2_ema_7b_fp16.safetensors.")


class _Reader:
    """Keys, shapes, dtypes and tensors of one checkpoint file, without reading data for the header checks."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file")
        if path.suffix == ".safetensors":
            try:
                self._file = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise CheckpointError(f"{path.name}: is truncated or not a safetensors file ({e})") from e
            self.keys = list(self._file.keys())
            self._sd = None
        else:
            self._sd = _load_pickled_state_dict(path)
            self.keys = list(self._sd)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._sd is not None:
            return tuple(self._sd[key].shape)
        return tuple(self._file.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._sd[key] if self._sd is not None else self._file.get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.get(key).dtype


def _load_pickled_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path.name}: refused, it holds more than tensors (weights-only loading): {e}") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path.name}: is truncated or not a PyTorch checkpoint ({e})") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise CheckpointError(f"{path.name}: is not a flat state dict of tensors")
    return sd


def _check_keys(reader: _Reader, expected: dict[str, tuple[int, ...]], rename=lambda k: k) -> dict[str, str]:
    """Strict key and shape check; returns model key -> file key."""
    names = {}
    for raw in reader.keys:
        key = rename(raw)
        if key not in expected:
            raise CheckpointError(f"{reader.path.name}: unexpected key '{raw}'")
        if key in names:
            raise CheckpointError(f"{reader.path.name}: key '{key}' appears twice (as '{names[key]}' and '{raw}')")
        names[key] = raw
    for key, shape in expected.items():
        if key not in names:
            raise CheckpointError(f"{reader.path.name}: missing key '{key}'")
        if reader.shape(names[key]) != shape:
            raise CheckpointError(f"shape mismatch for '{names[key]}' in {reader.path.name}: file has "
                                  f"{list(reader.shape(names[key]))}, model expects {list(shape)}")
    return names


# ---------------------------------------------------------------------------------------------- DiT

def infer_dit_config(shapes: dict[str, tuple[int, ...]]) -> NaDiTConfig:
    """Config from tensor shapes: the 3B family (dit_v2) has `vid_out_norm`, the 7B family does not. The window
    settings are the released ones."""
    def dim(key: str, axis: int) -> int:
        if key not in shapes:
            raise CheckpointError(f"cannot infer the config: missing key '{key}'")
        return int(shapes[key][axis])

    layers = 1 + max((int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    if layers == 0:
        raise CheckpointError("cannot infer the config: no 'blocks.N.' keys")
    mm_layers = next((i for i in range(layers) if f"blocks.{i}.attn.proj_qkv.all.weight" in shapes), layers)
    s0 = "all" if mm_layers == 0 else "vid"
    family = NADIT_3B if "vid_out_norm.weight" in shapes else NADIT_7B
    head_dim = dim(f"blocks.0.attn.norm_q.{s0}.weight", 0)
    width = dim("vid_in.proj.weight", 0)
    patch = family.patch_size[0] * family.patch_size[1] * family.patch_size[2]
    return NaDiTConfig(
        dim=width, heads=dim(f"blocks.0.attn.proj_qkv.{s0}.weight", 0) // (3 * head_dim), head_dim=head_dim,
        num_layers=layers, mm_layers=mm_layers,
        mlp="swiglu" if f"blocks.0.mlp.{s0}.proj_in_gate.weight" in shapes else "gelu",
        mlp_dim=dim(f"blocks.0.mlp.{s0}.proj_in.weight", 0), rope=family.rope,
        last_block_vid_only=family.last_block_vid_only, output_norm=family.output_norm,
        in_channels=dim("vid_in.proj.weight", 1) // patch, out_channels=dim("vid_out.proj.weight", 0) // patch,
        text_dim=dim("txt_in.weight", 1), freq_dim=dim("emb_in.proj_in.weight", 1),
    )


def _check_rope(reader: _Reader, key: str, config: NaDiTConfig) -> None:
    stored = reader.get(key)
    ours = rope_freqs(config)
    # Compare at the file's precision (fp8 files store these too); the model always uses its fp32 values.
    if not torch.allclose(stored.float(), ours.to(stored.dtype).float(), rtol=4 * torch.finfo(stored.dtype).eps,
                          atol=1e-6):
        raise CheckpointError(f"{reader.path.name}: '{key}' does not match the {config.rope} RoPE of a "
                              f"head_dim={config.head_dim} model")


def load_nadit(path: str | Path, config: NaDiTConfig | None = None, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu") -> NaDiT:
    """Load a SeedVR2 DiT (3B or 7B; config inferred from the shapes when not given) strictly."""
    path = Path(path)
    _refuse_broken(path)
    reader = _Reader(path)
    if config is None:
        config = infer_dit_config({k: reader.shape(k) for k in reader.keys})
    with torch.device("meta"):
        model = NaDiT(config)
    names = _check_keys(reader, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    if config.rope == "pixel3d" and config.num_layers > 1:
        last = f"blocks.{config.num_layers - 1}.attn.proj_qkv.vid.weight"
        if last in names and reader.dtype(names[last]).itemsize == 1:
            raise CheckpointError(f"{path.name}: the last block of this 7B checkpoint is stored in fp8, which is "
                                  "known to break the model; use the _mixed_block35_fp16 or the fp16 file.")

    state = {}
    for key, raw in names.items():
        if key.endswith(ROPE_SUFFIX):
            _check_rope(reader, raw, config)
            state[key] = rope_freqs(config).to(device)
            continue
        target = torch.float32 if any(p in key for p in FP32_PARAMS) else dtype
        state[key] = reader.get(raw).to(device=device, dtype=target)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------- VAE

def _vae_key(key: str) -> str:
    m = re.fullmatch(r"(.*\.attentions\.0)\.(query|key|value|proj_attn)\.(weight|bias)", key)
    return f"{m.group(1)}.{LEGACY_VAE_ATTENTION[m.group(2)]}.{m.group(3)}" if m else key


def load_vae(path: str | Path, config: VAEConfig = VAE, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> VideoVAE:
    """Load the SeedVR2 VAE strictly (old diffusers attention names query/key/value/proj_attn are accepted)."""
    reader = _Reader(Path(path))
    with torch.device("meta"):
        model = VideoVAE(config)
    names = _check_keys(reader, {k: tuple(v.shape) for k, v in model.state_dict().items()}, rename=_vae_key)
    state = {key: reader.get(raw).to(device=device, dtype=dtype) for key, raw in names.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------- text, files

def load_text_embedding(path: str | Path, text_dim: int = 5120) -> torch.Tensor:
    """The precomputed positive prompt embedding (`pos_emb.pt`, bf16 [58, 5120]), weights-only."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        emb = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path.name}: refused, it holds more than a tensor (weights-only loading): {e}") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path.name}: is truncated or not a PyTorch file ({e})") from e
    if not torch.is_tensor(emb) or emb.dim() != 2 or emb.shape[0] < 1 or emb.shape[1] != text_dim \
            or not emb.is_floating_point():
        got = f"{emb.dtype} {list(emb.shape)}" if torch.is_tensor(emb) else type(emb).__name__
        raise CheckpointError(f"{path.name}: expected a float tensor [L, {text_dim}], got {got}")
    return emb


def find_models(models_dir: str | Path, size: str) -> tuple[Path, Path, Path]:
    """(DiT, VAE, pos_emb) files for `size` ("3b" / "7b") in `models_dir` or a seedvr2 subfolder."""
    if size not in DIT_FILES:
        raise ValueError(f"size must be one of {sorted(DIT_FILES)}, got {size!r}")
    root = Path(models_dir)
    dirs = [root / sub for sub in SUBDIRS if (root / sub).is_dir()]

    def first(names) -> Path | None:
        return next((d / n for n in names for d in dirs if (d / n).is_file()), None)

    dit = first(DIT_FILES[size])
    if dit is None:
        broken = first(n for n in (f"seedvr2_ema_{size}_fp8_e4m3fn.safetensors",
                                   f"seedvr2_ema_{size}_sharp_fp8_e4m3fn.safetensors") if is_broken_fp8_7b(n))
        if broken is not None:
            _refuse_broken(broken)
        raise CheckpointError(f"no SeedVR2 {size.upper()} DiT in {root} (looked for: {', '.join(DIT_FILES[size])})")
    vae, text = first(VAE_FILES), first((TEXT_FILE,))
    if vae is None:
        raise CheckpointError(f"no SeedVR2 VAE in {root} (looked for: {', '.join(VAE_FILES)})")
    if text is None:
        raise CheckpointError(f"no {TEXT_FILE} (the SeedVR2 text embedding) in {root}")
    return dit, vae, text


def recorded_config(path: str | Path, kind: type[NaDiTConfig] | type[VAEConfig]):
    """The architecture (a `kind`) a `.safetensors` file's header records (`save_checkpoint(..., config=)`), else
    None: the official files and the tiny presets' record none."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(CONFIG_METADATA)
    except SafetensorError as e:
        raise CheckpointError(f"{path.name}: is truncated or not a safetensors file ({e})") from e
    if text is None:
        return None
    try:
        values = json.loads(text)
        fields = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in fields})
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path.name}: its header's '{CONFIG_METADATA}' is not a {kind.__name__} ({e})") from e


def save_checkpoint(model: torch.nn.Module, path: str | Path, dtype: torch.dtype | None = None,
                    config: NaDiTConfig | VAEConfig | None = None) -> Path:
    """Write `model`'s state dict in the official layout: `.safetensors` or `.pth` by the suffix; a `.safetensors`
    file's header records `config` when given (`recorded_config` reads it back)."""
    path = Path(path)
    sd = {k: (v if dtype is None else v.to(dtype)).detach().cpu().contiguous().clone()
          for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        metadata = None if config is None else {CONFIG_METADATA: json.dumps(dataclasses.asdict(config))}
        save_file(sd, str(path), metadata=metadata)
    else:
        torch.save(sd, path)
    return path
