"""MiniMax-H3 end to end: the components, the shared stages, and t2va / fl2va.

request -> canvas/frames rules -> conditioner (prompt cache) -> keyframe latents -> packed layout -> the denoise
loop (AdaLN cache, optional VSA) -> audio VAE decode + video VAE decode, streamed chunk by chunk into the MP4
encoder. Masked edit, extension and latent refine (edit.py, extend.py, refine.py) reuse these stages. Presets
build every component offline from a seed (`tiny`); `from_models` loads real checkpoints from a models directory.

`on_step` gets a StepEvent after every denoise step and a PhaseEvent (engine.models.phases) at the start of the
denoise loop and at every chunk boundary of the other long phases: "reading source", "encoding" (per VAE clip),
"decoding" (the sound, then per VAE chunk), "muxing" (rank 0's wait for its MP4 encoder). Raise from it to stop.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from engine.cache.adaln import AdaLNCache
from engine.cache.prompt import PromptCache, prompt_key
from engine.kernels import attention, capability, fused, vsa
from engine.models.h3 import layout as L
from engine.models.h3.checkpoint import GUIDANCE_METADATA, VIDEO_SHIFT_METADATA, load_dit, trained_sampling
from engine.models.h3.conditioner import Conditioner, build_tiny_conditioner
from engine.models.h3.config import TINY, H3Config
from engine.models.h3.denoise import Target, denoise
from engine.models.h3.schedule import VIDEO_SHIFT
from engine.models.h3.dit import H3DiT, build_dit
from engine.models.h3.lora import load_lora, merge_lora, unmerge_lora
from engine.models.h3.partitions import PARTITIONS, Partitions
from engine.models.h3.references import REFERENCE_SHORT_EDGE, check_image
from engine.models.h3.request import (Cancelled, EditRequest, ExtendRequest, GenerateRequest, GenerateResult,
                                      RefineRequest, StepEvent)
from engine.models.h3.vae import AudioVAE, VideoVAE, build_tiny_audio_vae, build_tiny_video_vae
from engine.models.phases import DecodedFrames, Phase, PhaseEvent
from engine.parallel import tensor
from engine.parallel.mesh import Mesh, Parallel
from engine.runtime.streaming import BlockStreamer, dit_units, move_unstreamed

KEYFRAME_NOISE_AUG = L.CONDITION_TIMESTEP


@dataclass(frozen=True)
class Canvas:
    """The canvas rules and defaults a set of weights was trained for."""

    short_edge: int = L.SHORT_EDGE
    max_pixels: int = L.MAX_PIXELS
    default_steps: int = 50
    reference_short_edge: int = REFERENCE_SHORT_EDGE  # ref2va image references ("diffusers" / "max" modes)

    @property
    def max_rows(self) -> int:
        """The longest packed sequence a request may build: twice a 15 s clip's at the full canvas (what the
        engine's memory plan is sized for; only references can pass it)."""
        frames = L.frames_for_seconds(L.MAX_SECONDS)[0]
        rows = L.latent_frames(frames) * self.max_pixels // L.CANVAS_MULTIPLE ** 2
        return 2 * (rows + L.AUDIO_CHANNELS * L.audio_latents(frames))


FULL_CANVAS = Canvas()
TINY_CANVAS = Canvas(short_edge=128, max_pixels=128 * 224, default_steps=8, reference_short_edge=256)
# The trained embedded default ("toy" preset, training/train.py): Comfy-Org single files in engine/weights/toy.
TOY_FILES = {"dit": "minimax_h3_fl2va_toy_bf16.safetensors", "text_encoder": "qwen3vl_toy_bf16.safetensors",
             "video_vae": "minimax_h3_toy_video_vae_fp16.safetensors",
             "audio_vae": "minimax_h3_toy_audio_vae_fp32.safetensors"}


def partition_loaders(fl2va: str | Path, ref2va: str | Path | None, dtype: torch.dtype, device) -> dict:
    """How each DiT partition is read from disk (Ref2VA only where its weights are there)."""
    loaders = {"fl2va": lambda: load_dit(fl2va, dtype=dtype, device=device)}
    if ref2va:
        loaders["ref2va"] = lambda: load_dit(ref2va, dtype=dtype, device=device)
    return loaders


def parse_aspect(aspect: str) -> tuple[float, float]:
    try:
        w, h = (float(x) for x in aspect.replace("x", ":").split(":"))
    except ValueError:
        raise L.LayoutError(f"Aspect ratio must look like 16:9, got {aspect!r}.") from None
    return w, h


def fit_stretch(image: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize((width, height), Image.LANCZOS))


def fit_cover(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Scale to cover the canvas, then centre-crop (the reference's treatment of a last frame)."""
    ih, iw = image.shape[:2]
    scale = max(width / iw, height / ih)
    nw, nh = max(width, round(iw * scale)), max(height, round(ih * scale))
    resized = Image.fromarray(image).resize((nw, nh), Image.LANCZOS)
    left, top = (nw - width) // 2, (nh - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)))


class H3Pipeline:
    def __init__(self, dit: H3DiT, video_vae: VideoVAE, audio_vae: AudioVAE, conditioner: Conditioner,
                 canvas: Canvas, device: torch.device, name: str, lora_roots: Sequence[str | Path] = (),
                 loaders: dict[str, Callable[[], H3DiT]] | None = None):
        """`dit` is the FL2VA partition's; `loaders` read a partition's DiT ("ref2va": on the first ref2va job;
        "fl2va": again, when it was dropped for want of host memory)."""
        self.dit, self.video_vae, self.audio_vae, self.conditioner = dit, video_vae, audio_vae, conditioner
        self.partitions = Partitions("fl2va", device, loaders or {})
        self.canvas, self.device, self.name = canvas, device, name
        self.lora_roots = tuple(Path(r) for r in lora_roots)  # LoRA files must lie inside one (none: any path)
        self.adaln_cache: AdaLNCache | None = AdaLNCache()  # None: every step computes its AdaLN tables
        self.prompt_cache = PromptCache()
        self.vsa_sparsity = 0.0  # fraction of video cubes each video query cube skips (0.875 = top 1/8)
        self.vsa_gates = None  # trained `to_gate_compress` weights per attention module (FastH3 VSA checkpoints)
        self.encode_mp4 = True  # encode the result's MP4 while the VAE decodes (GenerateResult.mp4)
        self.streamer: BlockStreamer | None = None  # `stream_blocks`: the DiT's blocks live in host memory
        self.text_streamer: BlockStreamer | None = None  # `stream_text_encoder`: its layers live in host memory
        self.memory_plan = None  # engine.runtime.placement.EnginePlan, when the engine planned its memory
        self.parallel = Parallel(Mesh(1))  # this rank's TP and Ulysses groups (engine/parallel/mesh.py)
        self.video_shift = VIDEO_SHIFT  # the video schedule's shift; a DiT file may name the one it was trained for
        self.guidance = 1.0  # t2va's, edits' and extensions' guidance scale; a DiT file may name one (denoise.guided)

    @classmethod
    def from_preset(cls, preset: str = "toy", device: str | torch.device = "cpu", seed: int = 0,
                    config: H3Config | None = None, lora_roots: Sequence[str | Path] = ()) -> "H3Pipeline":
        """`toy`: the trained embedded default (its Comfy-Org single files under engine/weights/toy, fp32 on a
        CPU); `tiny`: every component at tiny width with weights drawn from `seed` (tests), no files needed."""
        if preset == "toy":
            from engine.models import TOY_WEIGHTS

            device = torch.device(device)
            # One DiT file serves both partitions until the toy training mix holds the references layout.
            pipe = cls.from_files(*(TOY_WEIGHTS / name for name in TOY_FILES.values()), device=device,
                                  dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                                  lora_roots=lora_roots, ref_dit=TOY_WEIGHTS / TOY_FILES["dit"])
            pipe.name = "toy"
            return pipe
        if preset != "tiny":
            raise ValueError(f"unknown preset {preset!r}: 'toy' (trained) or 'tiny' (random) are embedded; real "
                             "weights come from --models")
        device = torch.device(device)
        config = config or TINY
        dit = build_dit(config, seed=seed, device=device)
        return cls(dit, build_tiny_video_vae(seed).to(device), build_tiny_audio_vae(seed).to(device),
                   build_tiny_conditioner(seed, hidden_size=config.text_dim).to(device), TINY_CANVAS, device,
                   "tiny", lora_roots, {"fl2va": lambda: build_dit(config, seed=seed, device=device),
                                        "ref2va": lambda: build_dit(config, seed=seed + 1, device=device)})

    @classmethod
    def from_models(cls, models_dir: str | Path, device: str | torch.device = "cuda",
                    dtype: torch.dtype = torch.bfloat16) -> "H3Pipeline":
        """Real weights: diffusers layout (transformer/, vae/, audio_vae/, text_encoder/; Ref2VA in transformer_ref/)
        or the original MiniMax folder layout (FL2VA/ with transformer/, video_vae/, audio_vae/, text_encoder/;
        Ref2VA/transformer/). The Ref2VA DiT loads on the first ref2va job."""
        root, device = Path(models_dir), torch.device(device)
        ref = next((d for d in (root / "Ref2VA" / "transformer", root / "transformer_ref") if d.is_dir()), None)
        root = root / "FL2VA" if (root / "FL2VA").is_dir() else root
        dit = load_dit(root / "transformer", dtype=dtype, device=device)
        video_dir = root / "vae" if (root / "vae").is_dir() else root / "video_vae"
        return cls(dit, VideoVAE.from_pretrained(video_dir).to(device),
                   AudioVAE.from_pretrained(root / "audio_vae").to(device),
                   Conditioner.from_pretrained(root, dtype=dtype, device=device), FULL_CANVAS, device,
                   str(root), (Path(models_dir),),
                   partition_loaders(root / "transformer", ref, dtype, device))

    @classmethod
    def from_files(cls, dit: str | Path, text_encoder: str | Path, video_vae: str | Path, audio_vae: str | Path,
                   tokenizer_dir: str | Path | None = None, device: str | torch.device = "cuda",
                   dtype: torch.dtype = torch.bfloat16, lora_roots: Sequence[str | Path] = (),
                   configs: dict | None = None, ref_dit: str | Path | None = None) -> "H3Pipeline":
        """Comfy-Org single files (any DiT format, any text-encoder format, the two VAEs). The text encoder's header
        tells the architecture of the set: the released one (tokenizer from `tokenizer_dir`, which the files lack)
        or the embedded default's (tokenizer built in, its small canvas). `configs` may override the architectures
        ("text_encoder", "layer", "video_vae", "audio_vae", "canvas"). `ref_dit`: the Ref2VA partition's DiT file,
        loaded on the first ref2va job (default: the `minimax_h3_ref2va_*` file beside a `*fl2va*` DiT, if any)."""
        from engine.models.h3.conditioner import tiny_text_encoder_shape
        from engine.models.h3.model_files import describe_file
        from engine.models.h3.vae import (TINY_AUDIO_VAE, TINY_VIDEO_VAE, audio_vae_file_config, load_audio_vae_file,
                                          load_video_vae_file, video_vae_file_config)

        device, configs = torch.device(device), dict(configs or {})
        if "text_encoder" not in configs and tiny_text_encoder_shape(text_encoder):
            video = video_vae_file_config(video_vae) or dict(TINY_VIDEO_VAE)
            audio = audio_vae_file_config(audio_vae) or dict(TINY_AUDIO_VAE)
            configs = {"video_vae": video, "audio_vae": audio, "canvas": TINY_CANVAS, **configs}
        conditioner = Conditioner.from_single_file(text_encoder, tokenizer_dir, configs.get("text_encoder"),
                                                   dtype=dtype, device=device, layer=configs.get("layer"))
        if ref_dit is None and "fl2va" in Path(dit).name:
            sibling = Path(dit).with_name(Path(dit).name.replace("fl2va", "ref2va"))
            ref_dit = sibling if sibling.is_file() else None
        pipe = cls(load_dit(dit, dtype=dtype, device=device),
                   load_video_vae_file(video_vae, configs.get("video_vae")).to(device),
                   load_audio_vae_file(audio_vae, configs.get("audio_vae")).to(device), conditioner,
                   configs.get("canvas", FULL_CANVAS), device, Path(dit).name, lora_roots,
                   partition_loaders(dit, ref_dit, dtype, device))
        pipe.video_shift = trained_sampling(dit, VIDEO_SHIFT_METADATA) or VIDEO_SHIFT
        pipe.guidance = trained_sampling(dit, GUIDANCE_METADATA) or 1.0
        pipe.files = {role: describe_file(path) for role, path in (
            ("dit", dit), ("text_encoder", text_encoder), ("video_vae", video_vae), ("audio_vae", audio_vae))}
        return pipe

    def describe(self) -> dict:
        c = self.dit.config
        formats = sorted({type(m).__name__ for m in self.dit.modules() if hasattr(m, "requantize")})
        summary = self.weights_summary() + (f" · {self.memory_plan.describe()}" if self.memory_plan else "")
        return {"model": "MiniMax-H3", "weights": self.name, "device": str(self.device),
                "summary": summary, "files": getattr(self, "files", None),
                "dit": {"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                        "dtype": str(self.dit.dtype).removeprefix("torch."),
                        "adaln": f"curve (pruned, rank {c.time_embed_dim})" if c.curve else "full",
                        "quantized_layers": formats},
                "canvas": {"short_edge": self.canvas.short_edge, "max_pixels": self.canvas.max_pixels},
                "default_steps": self.canvas.default_steps, "guidance": self.guidance,
                "vsa_sparsity": self.vsa_sparsity,
                "adaln_cache": self.adaln_cache.stats() if self.adaln_cache else None,
                "streaming": self.streamer.stats() if self.streamer else None,
                "text_encoder_streaming": self.text_streamer.stats() if self.text_streamer else None,
                "memory_plan": self.memory_plan.as_dict() if self.memory_plan else None, "kernels": self.kernels(),
                "partitions": self.partitions.describe(),
                "prompt_cache": self.prompt_cache.stats()}

    def kernels(self) -> dict:
        """What each path runs on this device (engine/kernels/capability.py)."""
        return capability.kernel_choices(self.device.type, capability.capability(self.device),
                                         "fa3" in attention.backends(self.device), fused._have_triton())

    def weights_summary(self) -> str:
        """One line for the node status line and the dashboard: which files, formats and compute precisions."""
        files = getattr(self, "files", None)
        stored = files["dit"]["format"] if files else str(self.dit.dtype).removeprefix("torch.")
        compute = self.gemm_compute()
        how = stored + (", pruned" if files and files["dit"]["pruned"] else "")
        how += "" if compute == stored else f"; {compute}"
        dit = f"DiT {files['dit']['name']} ({how})" if files else f"H3 {self.name} ({how})"
        text_format = files["text_encoder"]["format"] if files else None
        online = self.text_encoder_quantized() if text_format in (None, "bf16", "fp16", "fp32") else None
        text = "; ".join(filter(None, (text_format, online and f"{online} weights dequantized per layer")))
        vae_fp8 = " · video VAE fp8" if self.video_vae.decode_fp8 else ""  # `--vae-precision fp8`
        if not files:
            return dit + (f" · text encoder {text}" if text else "") + vae_fp8
        return (f"{dit} · text encoder {text} · VAEs {files['video_vae']['format']}/{files['audio_vae']['format']}"
                + vae_fp8)

    def text_encoder_quantized(self) -> str | None:
        """fp8 / int8 when the text encoder's decoder GEMMs are stored quantized (`--text-encoder-precision`)."""
        from engine.models.h3.precision import stored_as

        if self.conditioner is None:
            return None
        return stored_as(self.conditioner.model.model.language_model.layers[0].self_attn.q_proj)

    def gemm_compute(self) -> str:
        """How the DiT's block GEMMs run: fp8 / int8 GEMMs, quantized weights dequantized per layer, or a float."""
        from engine.models.h3.precision import stored_as

        layer = self.dit.blocks[0].attn.qkv_proj
        d = self.device
        cap = capability.capability(d)
        stored = stored_as(layer)
        if stored == "fp8":
            return "fp8 GEMMs" if capability.fp8_gemm(d.type, cap) else "fp8 weights dequantized per layer"
        if stored == "int8":
            return "int8 W8A8" if capability.int8_gemm(d.type, cap) else "int8 weights dequantized per layer"
        return str(layer.weight.dtype).removeprefix("torch.")

    # ---- request rules -------------------------------------------------------------------------------------
    def plan(self, req: GenerateRequest) -> tuple[int, int, int, int, list[str]]:
        """(frames, height, width, steps, notes) for a request, or a LayoutError an artist can act on."""
        if not isinstance(req.prompt, str) or not req.prompt.strip():
            raise L.LayoutError("The prompt is empty: describe the video and its sound.")
        frames, note = L.frames_for_seconds(float(req.seconds))
        notes = [note] if note else []
        if (req.width is None) != (req.height is None):
            raise L.LayoutError("Give both width and height, or neither (then the aspect ratio picks the canvas).")
        if req.width is not None:
            height, width, note = L.check_canvas(int(req.height), int(req.width), max_pixels=L.MAX_PIXELS)
            notes += [note] if note else []
        else:
            if req.first_frame is not None and req.aspect is None:
                ih, iw = np.asarray(req.first_frame).shape[:2]
                aspect = (float(iw), float(ih))
            else:
                aspect = parse_aspect(req.aspect or "16:9")
            height, width = L.canvas_for_aspect(*aspect, self.canvas.short_edge, self.canvas.max_pixels)
        steps = self.canvas.default_steps if req.steps is None else int(req.steps)
        if not 2 <= steps <= 1000:
            raise L.LayoutError(f"Steps must be between 2 and 1000 sigma grid points (N points = N-1 model "
                                f"evaluations; 5 for a 4-step Turbo LoRA), got {steps}.")
        return frames, height, width, steps, notes

    # ---- generation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, req: GenerateRequest, on_step: Callable[[StepEvent], None] | None = None) -> GenerateResult:
        """t2va; fl2va with a first and/or last frame; ref2va with references (engine/models/h3/ref2va.py)."""
        frames, height, width, steps, notes = self.plan(req)
        if req.references:
            from engine.models.h3.ref2va import run_ref2va

            self.use_partition("ref2va", on_step)
            with self.loras(req.loras):
                return run_ref2va(self, req, frames, height, width, steps, notes, on_step)
        self.use_partition("fl2va", on_step)
        keyframes, images = [], []
        if req.first_frame is not None:
            keyframes.append("first")
            images.append(fit_stretch(check_image("The first frame", req.first_frame), height, width))
        if req.last_frame is not None:
            keyframes.append("last")
            images.append(fit_cover(check_image("The last frame", req.last_frame), height, width))

        with self.loras(req.loras):
            return self._generate(req, frames, height, width, steps, notes, keyframes, images, on_step)

    def use_partition(self, name: str, on_step=None) -> None:
        """Make `name`'s DiT the active one (engine/models/h3/partitions.py); on a streaming engine the outgoing
        DiT goes back to host memory whole and the incoming one streams with the same number of units resident."""
        if self.streamer is None or name == self.partitions.active:
            self.dit = self.partitions.activate(name, self.dit, on_step)
            return
        resident = self.streamer.resident
        self.streamer.detach()
        self.dit = self.partitions.activate(name, self.dit.to("cpu"), on_step)
        self.stream_blocks(resident)
        move_unstreamed(self.dit, [u.module for u in self.streamer.units], self.device)

    def stream_blocks(self, resident: int) -> None:
        """Keep the DiT's blocks, refiner blocks and AdaLN projections in host memory, `resident` of them on the
        device at a time, each copied in a step ahead of its use (engine/runtime/streaming.py); the output is
        bit-identical. Its AdaLN projections then stay in host memory, so the AdaLN cache keeps its tables only."""
        self.streamer = BlockStreamer(dit_units(self.dit), self.device, resident)
        self.partitions.on_host = True
        if self.adaln_cache is not None:
            self.adaln_cache.offload = False

    def stream_text_encoder(self, resident: int) -> None:
        """Keep the text encoder's decoder layers in host memory, `resident` of them on the device at a time: it
        runs once a job (and not at all for a cached prompt), so it need not hold the device between jobs."""
        layers = self.conditioner.model.model.language_model.layers
        self.text_streamer = BlockStreamer([(layer, ()) for layer in layers], self.device, resident)

    def place(self, device: torch.device, dit_resident: int = 0, text_resident: int = 0) -> None:
        """Move a pipeline loaded in host memory to `device`; with `dit_resident` / `text_resident` > 0 the DiT's /
        the text encoder's units wait in pinned host memory, that many on the device at a time, so a model larger
        than the GPU is never on it whole."""
        self.device = self.partitions.device = torch.device(device)
        if dit_resident:
            self.stream_blocks(dit_resident)
        if text_resident:
            self.stream_text_encoder(text_resident)
        for model, streamer in ((self.dit, self.streamer), (self.conditioner.model, self.text_streamer)):
            move_unstreamed(model, [u.module for u in streamer.units] if streamer else [], self.device)
        self.video_vae.place(self.device)
        self.audio_vae.to(self.device)

    def resolve_lora(self, path: str) -> Path:
        """A LoRA name relative to one of the LoRA roots (the models directory, ComfyUI's loras folders), or a path
        inside one; the first root holding the file wins. Without roots any readable path is taken."""
        if not self.lora_roots:
            if not Path(path).is_file():
                raise L.LayoutError(f"LoRA file {path!r} not found.")
            return Path(path)
        inside = False
        for root in (r.resolve() for r in self.lora_roots):
            p = (root / path).resolve()
            if root in p.parents:
                inside = True
                if p.is_file():
                    return p
        if not inside:
            raise L.LayoutError(f"LoRA path {path!r} is outside the models directory and the LoRA folders.")
        raise L.LayoutError(f"LoRA file {path!r} not found in " + ", ".join(str(r) for r in self.lora_roots) + ".")

    # ---- shared stages ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def loras(self, specs: list[tuple[str, float]]):
        """Merge the request's LoRAs for the duration of one task; the weights are restored after."""
        handles = []
        active = self.partitions.active
        for path, _ in specs:
            other = next((p for p in PARTITIONS if p != active and p in Path(path).name.lower()), None)
            if other:
                raise L.LayoutError(f"LoRA {Path(path).name} is for the {PARTITIONS[other]} DiT (its name says so), "
                                    f"but this job runs the {PARTITIONS[active]} DiT. Use a LoRA trained for "
                                    f"{PARTITIONS[active]}.")
        try:
            for path, scale in specs:
                lora = load_lora(self.resolve_lora(path), tensor.full_width(self.dit))
                handles.append(merge_lora(self.dit, tensor.shard_lora(self.dit, lora), float(scale)))
            yield
        finally:
            for handle in reversed(handles):
                unmerge_lora(self.dit, handle)

    def encode_prompt(self, prompt: str, images=(), references=()) -> tuple[torch.Tensor, torch.Tensor]:
        """Conditioner hidden states [1, Nt, text_dim] on the device and row tags, for t2va, fl2va (`images`: the
        keyframes) or ref2va (`references`: normalised, in order); repeated prompts come from the prompt cache, so
        the conditioner may be offloaded between requests."""
        if references:
            # The presentation depends on the pictures and the kinds in order (a sound adds only its label).
            kinds = ",".join(r.kind + ("+sound" if r.kind == "video" and r.has_audio else "") for r in references)
            media = [r.image if r.kind == "image" else r.frames for r in references if r.kind != "audio"]
            key = prompt_key(f"ref2va[{kinds}]\0{prompt}", media)
        else:
            key = prompt_key(prompt, images)
        cached = self.prompt_cache.get(key)
        if cached is None:
            if self.conditioner is None:
                raise RuntimeError("The text conditioner is offloaded and this prompt is not cached.")
            try:
                cached = (self.conditioner.encode_references(prompt, references) if references
                          else self.conditioner.encode(prompt, list(images)))
            finally:
                if self.text_streamer is not None:
                    self.text_streamer.release()
            self.prompt_cache.put(key, *cached)
        text, tags = cached
        return text.to(self.device), tags.cpu()

    def check_sequence(self, layout: L.PackedLayout) -> None:
        if layout.seq_len > self.canvas.max_rows:
            target = layout.seq_len - layout.num_condition_video_rows - layout.num_condition_audio_rows
            raise L.LayoutError(
                f"The references add {layout.seq_len - target} rows to the clip's {target}: {layout.seq_len} in all, "
                f"more than the {self.canvas.max_rows} this engine's memory plan allows (twice a 15 s clip at the "
                "full canvas). Use fewer or shorter reference videos, or the 'match' size for reference images.")

    def run_denoise(self, layout: L.PackedLayout, text: torch.Tensor, video: Target, audio: Target, steps: int,
                    on_step, geometry: tuple[int, int, int], stage: str = "denoising", start: int = 0,
                    cond_video=None, cond_audio=None, guidance: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The DiT loop with step events (clean estimate as latents) and the AdaLN cache."""
        T, h, w = geometry
        patch = self.dit.config.patch_size
        report = None
        if on_step is not None:
            def report(step, total, x0_rows):
                on_step(StepEvent(step, total, L.unpatchify(x0_rows, T, h, w, patch), stage))

            on_step(PhaseEvent("denoising", 0, steps - 1 - start, None if stage == "denoising" else stage))
        schedule = self.adaln_cache.schedule(self.dit) if self.adaln_cache else None
        layout = layout.to(self.device)
        try:
            with self.sparse_attention(layout):
                out = denoise(self.dit, layout, text, video, audio, steps, cond_video, cond_audio, report, schedule,
                              start, self.video_shift, guidance)
        finally:
            if self.streamer is not None:
                self.streamer.release()  # between jobs the host copies are the weights (LoRA merges land there)
        if schedule:
            schedule.finish()
        return out

    def sparse_attention(self, layout: L.PackedLayout):
        """VSA over the target video rows at `self.vsa_sparsity` (0: dense attention, exactly). Its kernels need
        Hopper: an older GPU runs dense attention (`kernels` in /v1/status says so)."""
        if self.vsa_sparsity <= 0 or self.kernels()["vsa"] == "dense":
            return contextlib.nullcontext()
        plan = vsa.build_plan(layout, self.dit.config.patch_size[1:])
        return vsa.active(plan, vsa.topk_for_sparsity(self.vsa_sparsity, plan.num_cubes), self.vsa_gates)

    def noise(self, gen: torch.Generator, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(self.device)

    def decode(self, video_latents: torch.Tensor, audio_latents: torch.Tensor, frames: int,
               timings: dict[str, float], notes: list[str], on_step=None,
               keep: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, bytes | None]:
        """Latents -> (uint8 frames [frames, H, W, 3], float32 audio [2, S], the MP4 of both or None), on the CPU.
        `keep` = (source frames uint8 [frames, H, W, 3], bool [frames, H, W]): where true the source's pixels
        replace the decoded ones (an edit's unmasked area), in the frames and the MP4 alike.

        The sound decodes first (it is small) so the MP4 encoder has it from the start; then each video VAE chunk's
        final frames go into the result, out with the chunk's "decoding" boundary (`PhaseEvent.frames`, which rank 0
        streams to clients) and, with `encode_mp4`, to the encoder, so sending and encoding overlap decoding.
        `timings` gains mp4_s (the wait for the encoder after the last chunk), `notes` the H.264 encoder used.
        """
        rate = self.audio_vae.sample_rate
        done = Phase(on_step, "decoding", 1 + VideoVAE.decode_chunk_count(video_latents.shape[2], frames), "sound")
        waveform = self.audio_vae.decode(audio_latents)[:, : round(frames / L.FPS * rate)].float().cpu()
        done.detail = "video"
        done()
        buffer, pixels, start = io.BytesIO(), None, 0
        codec = "auto" if self.device.type == "cuda" else "libx264"
        encoder = None
        if self.encode_mp4:
            from engine.io.video import Mp4Encoder  # PyAV only where MP4s are written (not in training)

            encoder = Mp4Encoder(buffer, L.FPS, waveform, rate, codec=codec)
        with encoder or contextlib.nullcontext():
            for chunk in self.video_vae.decode_chunks(video_latents):
                if pixels is None:  # written once, chunk by chunk: the streamed chunks are views of the result
                    pixels = torch.empty((frames, *chunk.shape[1:]), dtype=torch.uint8)
                stop = min(frames, start + chunk.shape[0])
                out = pixels[start:stop]
                if keep is not None:
                    source, kept = (k[start:stop] for k in keep)
                    torch.where(kept[..., None], source, chunk[:stop - start], out=out)
                else:
                    out.copy_(chunk[:stop - start])
                if encoder is not None:
                    encoder.add(out)
                done(frames=DecodedFrames(start, frames, out))
                start = stop
                if start == frames:
                    break
            if encoder is None:
                return pixels, waveform, None
            t_mp4 = time.perf_counter()
            muxed = Phase(on_step, "muxing", 1, "MP4", collective=False)  # rank 0 alone encodes
            encoder.close()
            muxed()
        timings["mp4_s"] = time.perf_counter() - t_mp4
        notes.append(f"MP4 encoded with {encoder.options.describe()}")
        return pixels, waveform, buffer.getvalue()

    def _generate(self, req, frames, height, width, steps, notes, keyframes, images, on_step) -> GenerateResult:
        timings, t0 = {}, time.perf_counter()
        cfg = self.dit.config
        text, text_tags = self.encode_prompt(req.prompt, images)
        timings["conditioner_s"] = time.perf_counter() - t0

        T, h, w = L.latent_frames(frames), height // L.VAE_SPATIAL, width // L.VAE_SPATIAL
        Ta = L.audio_latents(frames)
        layout = L.build_layout(text_tags, T, h, w, Ta, cfg.patch_size[1:], tuple(keyframes))

        # Draw order as the reference: each keyframe's noise, then video noise, then audio noise in row layout.
        gen = torch.Generator("cpu").manual_seed(int(req.seed))
        cond_rows = []
        for image in images:
            clean = self.video_vae.encode_image(torch.from_numpy(image.copy()).to(self.device)).float()
            noise = self.noise(gen, *clean.shape)
            cond_rows.append(L.patchify(KEYFRAME_NOISE_AUG * clean + (1 - KEYFRAME_NOISE_AUG) * noise))
        video = Target(L.patchify(self.noise(gen, 1, cfg.in_channels, T, h, w)))
        audio = Target(self.noise(gen, 1, L.AUDIO_CHANNELS * Ta, cfg.audio_in_channels))
        timings["encode_s"] = time.perf_counter() - t0 - timings["conditioner_s"]

        # Guidance for text alone: keyframe rows hold the picture (guided, first frames lost 0.2 dB on the toy DiT).
        return self.denoise_and_decode(layout, text, video, audio, steps, on_step, (T, h, w), frames, notes, timings,
                                       t0, cond_video=torch.cat(cond_rows, dim=1) if cond_rows else None,
                                       guidance=1.0 if keyframes else self.guidance)

    def denoise_and_decode(self, layout: L.PackedLayout, text: torch.Tensor, video: Target, audio: Target, steps: int,
                           on_step, geometry: tuple[int, int, int], frames: int, notes: list[str],
                           timings: dict[str, float], t0: float, cond_video=None, cond_audio=None,
                           guidance: float = 1.0) -> GenerateResult:
        """A generation's last two stages, timed into `timings` (total_s from t0): the denoise loop, the decode."""
        T, h, w = geometry
        t_loop = time.perf_counter()
        video_rows, audio_rows = self.run_denoise(layout, text, video, audio, steps, on_step, geometry,
                                                  cond_video=cond_video, cond_audio=cond_audio, guidance=guidance)
        timings["denoise_s"] = time.perf_counter() - t_loop
        t_dec = time.perf_counter()
        video_latents = L.unpatchify(video_rows, T, h, w, self.dit.config.patch_size)
        audio_latents = L.unpack_audio(audio_rows)[0]
        pixels, waveform, mp4 = self.decode(video_latents, audio_latents, frames, timings, notes, on_step)
        timings["decode_s"] = time.perf_counter() - t_dec
        timings["total_s"] = time.perf_counter() - t0
        return GenerateResult(pixels, waveform, self.audio_vae.sample_rate, L.FPS,
                              video_latents.cpu(), audio_latents.cpu(), notes, timings, mp4)

    # ---- other tasks ---------------------------------------------------------------------------------------------
    def edit(self, req: EditRequest, on_step=None) -> GenerateResult:
        from engine.models.h3.edit import run_edit

        self.use_partition("fl2va", on_step)
        with torch.no_grad(), self.loras(req.loras):
            return run_edit(self, req, on_step)

    def extend(self, req: ExtendRequest, on_step=None) -> GenerateResult:
        from engine.models.h3.extend import run_extend

        self.use_partition("fl2va", on_step)
        with torch.no_grad(), self.loras(req.loras):
            return run_extend(self, req, on_step)

    def refine(self, req: RefineRequest, on_step=None) -> GenerateResult:
        from engine.models.h3.refine import run_refine

        self.use_partition("fl2va", on_step)
        with torch.no_grad(), self.loras(req.loras):
            return run_refine(self, req, on_step)


__all__ = ["H3Pipeline", "GenerateRequest", "EditRequest", "ExtendRequest", "RefineRequest", "GenerateResult",
           "StepEvent", "Cancelled"]
