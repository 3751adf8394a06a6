"""The Qwen3-VL text/vision conditioner of MiniMax-H3 (specs/h3.md §4, §6).

`Conditioner.encode` builds the presentation (t2va: the prompt alone; fl2va: `"<Picture i>: "` plus a vision block
per keyframe, then the prompt), runs Qwen3-VL up to decoder layer `layer` and returns `hidden_states[layer]` (the
unnormalised residual) with the per-token modality tags the DiT's AdaLN reads.

Weights come from a models folder (`text_encoder/`, transformers layout) or from a Comfy-Org single file
`qwen3vl_32b_minimax_h3_{bf16,int8_convrot,nvfp4_awq}.safetensors` (notes/h3_quantized_files.md §3, §5): flat
Qwen2-VL names (`model.layers.*`, `visual.*`), the 50 layers used, no final norm, no LM head; int8_convrot layers
stay int8 (dequantized per layer on the fly, as ComfyUI runs text encoders at full precision), NVFP4-AWQ layers and
the int8 embedding are dequantized at load with the AWQ `pre_quant_scale` folded into the weight.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from safetensors import SafetensorError, safe_open
from transformers.initialization import no_init_weights
from transformers.utils import logging

from engine.models.h3.checkpoint import CheckpointError
from engine.models.h3.model_files import read_header
from engine.models.h3.config import TEXT_TAG, VIDEO_TAG
from engine.quant import nvfp4
from engine.quant.transform import QuantSpec, replace_linears

REAL_LAYER = 50
MAX_PROMPT_TOKENS = 2048
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"


class Conditioner:
    """Qwen3-VL truncated to its first `layer` decoder layers; the LM head is dropped (never used)."""

    def __init__(self, model: Qwen3VLForConditionalGeneration, tokenizer, image_processor, layer: int = REAL_LAYER,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS):
        lm = model.model.language_model
        if len(lm.layers) < layer:
            raise ValueError(f"The conditioner needs at least {layer} decoder layers, the model has {len(lm.layers)}.")
        del lm.layers[layer:]
        lm.config.num_hidden_layers = layer
        # The last recorded hidden state is replaced by the final-norm output unless told otherwise; we want the
        # residual after layer `layer`, which is now the last one.
        lm.config.tie_last_hidden_states = False
        model.lm_head = None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.layer = layer
        self.max_prompt_tokens = max_prompt_tokens
        self.vision_start, self.vision_end, self.image_pad = (
            tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD))
        expected = {"vision_start_token_id": self.vision_start, "vision_end_token_id": self.vision_end,
                    "image_token_id": self.image_pad}
        for name, token_id in expected.items():
            if getattr(model.config, name) != token_id:
                raise ValueError(f"Tokenizer and model disagree on {name}: {token_id} vs "
                                 f"{getattr(model.config, name)}.")

    def to(self, device) -> "Conditioner":
        self.model.to(device)
        return self

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                        layer: int = REAL_LAYER, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> "Conditioner":
        """Local `text_encoder/`, `tokenizer/`, `processor/` folders (diffusers and original MiniMax layouts)."""
        directory = Path(directory)
        config = AutoConfig.from_pretrained(directory / "text_encoder", local_files_only=True)
        config.text_config.num_hidden_layers = layer  # layers past `layer` are never loaded
        # transformers only logs missing / unexpected keys (a long table here: the skipped layers); check them instead.
        model_logger = logging.get_logger("transformers.modeling_utils")
        level = model_logger.level
        model_logger.setLevel(logging.ERROR)
        try:
            model, info = Qwen3VLForConditionalGeneration.from_pretrained(
                directory / "text_encoder", config=config, dtype=dtype, local_files_only=True, output_loading_info=True)
        finally:
            model_logger.setLevel(level)
        skipped = re.compile(r"language_model\.layers\.(\d+)\.")
        unexpected = [k for k in info["unexpected_keys"] if not ((m := skipped.search(k)) and int(m[1]) >= layer)]
        missing = info["missing_keys"]
        if missing or unexpected:
            raise ValueError(f"{directory / 'text_encoder'} does not match Qwen3-VL: {len(missing)} missing keys "
                             f"(first: {min(missing, default=None)}), {len(unexpected)} unexpected "
                             f"(first: {min(unexpected, default=None)}).")
        model.to(device)  # a device_map would load straight to the GPU but needs accelerate
        tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer", local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(directory / "processor", local_files_only=True)
        return cls(model, tokenizer, image_processor, layer, max_prompt_tokens)

    @classmethod
    def from_single_file(cls, path: str | Path, tokenizer_dir: str | Path | None = None,
                         config: Qwen3VLConfig | None = None, dtype: torch.dtype = torch.bfloat16, device="cpu",
                         layer: int | None = None, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> "Conditioner":
        """A Comfy-Org text-encoder file. Without `config` the header tells the architecture: the released
        Qwen3-VL-32B, whose tokenizer the file lacks (`tokenizer_dir`: see `load_tokenizer`), or the embedded
        default's, whose byte-level tokenizer is built in."""
        tiny = tiny_text_encoder_shape(path) if config is None else None
        if tiny:
            config, layer = tiny_qwen3vl_config(*tiny), tiny[1] if layer is None else layer
            tokenizer, image_processor = build_tiny_tokenizer(), build_tiny_image_processor()
        else:
            layer = REAL_LAYER if layer is None else layer
            config = config or qwen3vl_32b_config(layer)
            if tokenizer_dir is None:
                raise CheckpointError(
                    f"{Path(path).name}: a Qwen3-VL text-encoder file holds no tokenizer; give the tokenizer folder "
                    "(--tokenizer-dir: the tokenizer/ of the MiniMax-H3 release, or ComfyUI's "
                    "comfy/text_encoders/qwen25_tokenizer).")
            tokenizer, image_processor = load_tokenizer(tokenizer_dir), load_image_processor(tokenizer_dir)
        model = load_text_encoder_file(path, config, dtype, device)
        return cls(model, tokenizer, image_processor, layer, max_prompt_tokens)

    @property
    def hidden_size(self) -> int:
        return self.model.config.text_config.hidden_size

    def _text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def encode(self, prompt: str, images: Sequence[np.ndarray] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [1, Nt, hidden] in the model dtype on its device, tags [Nt] long on CPU: text 1, vision block 0).

        `images` are the fl2va keyframes (uint8 [H, W, 3]) in packed order; each gets a `"<Picture i>: "` block.
        """
        return self.encode_batch([prompt], [images])

    def encode_batch(self, prompts: Sequence[str], images: Sequence[Sequence[np.ndarray]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode` of prompts whose token rows line up (same length and tags), in one pass: hidden [B, Nt,
        hidden], tags [Nt] (the embedded default's training encodes its clips' prompts in such batches)."""
        images = [list(group) for group in images]
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} keyframe lists")
        for i, image in enumerate((image for group in images for image in group), 1):
            if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
                    and image.shape[2] == 3):
                got = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
                raise ValueError(f"Keyframe {i} must be an RGB uint8 image [H, W, 3], got {got}.")
        device = self.model.device
        pictures = [image for group in images for image in group]
        vision, grids = {}, iter(())
        if pictures:
            vision = self.image_processor(images=pictures, return_tensors="pt")
            grids = iter(vision["image_grid_thw"])
            vision = {"pixel_values": vision["pixel_values"].to(device, self.model.dtype),
                      "image_grid_thw": vision["image_grid_thw"].to(device)}
        rows = [self._rows(prompt, [next(grids) for _ in group]) for prompt, group in zip(prompts, images)]
        if any(tags != rows[0][1] for _, tags in rows):
            raise ValueError("encode_batch needs prompts of one token layout")
        input_ids = torch.tensor([ids for ids, _ in rows], device=device)
        # Qwen-internal token types (1 = image pad) drive its multimodal rotary layout.
        mm_token_type_ids = (input_ids == self.image_pad).long()
        out = self.model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=mm_token_type_ids, use_cache=False,
                               output_hidden_states=self.layer, **vision)
        return out.hidden_states[self.layer], torch.tensor(rows[0][1], dtype=torch.long)

    def _rows(self, prompt: str, grids: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """Token ids and row tags of one prompt after its keyframes' blocks (`grids`: their image_grid_thw)."""
        if not prompt or not prompt.strip():
            raise ValueError("The prompt is empty: describe the video and its sound.")
        prompt_ids = self._text(prompt)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"The prompt is {len(prompt_ids)} tokens long; the text conditioner takes at most "
                             f"{self.max_prompt_tokens}. Shorten the prompt.")
        ids, tags, merge = [], [], self.image_processor.merge_size ** 2
        for i, grid in enumerate(grids, 1):
            label = self._text(f"<Picture {i}>: ")
            block = [self.vision_start] + [self.image_pad] * (int(grid.prod()) // merge) + [self.vision_end]
            ids += label + block
            tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        return ids + prompt_ids, tags + [TEXT_TAG] * len(prompt_ids)


# ---------------------------------------------------------------------------------------------- Comfy single files

QWEN25_VOCAB = 151665  # tokens in Qwen2.5's tokenizer files (ComfyUI's comfy/text_encoders/qwen25_tokenizer)
QWEN3_ADDED = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # Qwen3's ids 151665-151668
H3_ADDED = ["<d>", "</d>", "<|cutoff|>", "<|lyrics_start|>", "<|lyrics_end|>", "<|caption_start|>",
            "<|caption_end|>"]  # ids 151669-151675 (specs/h3.md §4)


def load_tokenizer(directory: str | Path):
    """The H3 tokenizer from a folder: a models folder with `tokenizer/`, or a folder of tokenizer files. Qwen2.5's
    files (what ComfyUI tokenizes H3 prompts with) lack the tokens Qwen3 and H3 add; they are added at their ids."""
    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(
        directory / "tokenizer" if (directory / "tokenizer").is_dir() else directory, local_files_only=True)
    if len(tokenizer) == QWEN25_VOCAB:
        tokenizer.add_tokens(QWEN3_ADDED, special_tokens=True)
    vocab = tokenizer.get_vocab()
    if len(tokenizer) == QWEN25_VOCAB + len(QWEN3_ADDED) and H3_ADDED[0] not in vocab:
        tokenizer.add_tokens(H3_ADDED, special_tokens=True)
        vocab = tokenizer.get_vocab()
    if len(tokenizer) >= QWEN25_VOCAB:  # a Qwen vocabulary: H3's tokens must sit where the model learned them
        for i, token in enumerate(H3_ADDED):
            if vocab.get(token) != QWEN25_VOCAB + len(QWEN3_ADDED) + i:
                raise CheckpointError(f"{directory}: the tokenizer has {token!r} at id {vocab.get(token)}, not "
                                      f"{QWEN25_VOCAB + len(QWEN3_ADDED) + i}; use the MiniMax-H3 or Qwen3-VL "
                                      "tokenizer (or Qwen2.5's files).")
    return tokenizer


def load_image_processor(directory: str | Path):
    """`processor/` of a models folder, a folder's own preprocessor config, else Qwen3-VL's (specs/h3.md §4)."""
    directory = Path(directory)
    for folder in (directory / "processor", directory):
        if (folder / "preprocessor_config.json").is_file():
            return AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216})


def qwen3vl_32b_config(layers: int = REAL_LAYER) -> Qwen3VLConfig:
    """Qwen3-VL-32B as the Comfy files hold it (ComfyUI `Qwen3VL_32BConfig`, specs/h3.md §4), `layers` kept."""
    return Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=layers,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         max_position_embeddings=262144,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                           hidden_act="gelu_pytorch_tanh"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False)


def comfy_text_encoder_name(key: str) -> str:
    """transformers Qwen3-VL key -> the flat Qwen2-VL name of the Comfy file."""
    if key.startswith("model.visual."):
        return key[len("model."):]
    return "model." + key[len("model.language_model."):]


def text_encoder_file_tensors(model: Qwen3VLForConditionalGeneration) -> dict[str, torch.Tensor]:
    """A Qwen3-VL as the bf16 Comfy text-encoder file holds it (flat names; no LM head, no final norm)."""
    return {comfy_text_encoder_name(k): v.detach().bfloat16().contiguous().cpu()
            for k, v in model.state_dict().items() if k not in ("lm_head.weight", "model.language_model.norm.weight")}


def _read_marker(f, key: str, path: Path) -> dict:
    raw = bytes(f.get_tensor(key).tolist())
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path.name}: '{key}' is not UTF-8 JSON ({raw[:40]!r})") from None


def _te_format(marker: dict, where: str) -> str:
    fmt = marker.get("format")
    if fmt == "int8_tensorwise":
        return "int8_convrot" if marker.get("convrot") else "int8"
    if fmt == "nvfp4":
        return "nvfp4"
    raise CheckpointError(f"{where}: quantization format {fmt!r} is not a Comfy text-encoder format "
                          "(int8_tensorwise with or without convrot, nvfp4)")


def _te_expected(fmt: str | None, name: str, shape: tuple, keys: set) -> dict[str, tuple[str, tuple]]:
    """File keys of one weight of the given format -> (safetensors dtype or 'float', shape)."""
    module = name[:-len(".weight")]
    if fmt is None:
        return {name: ("float", shape)}
    marker = {f"{module}.comfy_quant": ("U8", None)}
    if fmt in ("int8", "int8_convrot"):
        return {name: ("I8", shape), f"{module}.weight_scale": ("F32", (shape[0], 1)), **marker}
    packed, scales = nvfp4.stored_shapes(*shape)
    out = {name: ("U8", packed), f"{module}.weight_scale": ("F8_E4M3", scales),
           f"{module}.weight_scale_2": ("F32", ()), **marker}
    if f"{module}.pre_quant_scale" in keys:
        out[f"{module}.pre_quant_scale"] = ("float", (shape[1],))
    return out


def load_text_encoder_file(path: str | Path, config: Qwen3VLConfig, dtype: torch.dtype = torch.bfloat16,
                           device="cpu") -> Qwen3VLForConditionalGeneration:
    """A Comfy text-encoder single file into transformers' Qwen3-VL, strictly (every key once, shapes and dtypes
    checked; errors name the key and the file). The model keeps `config.text_config.num_hidden_layers` layers."""
    path = Path(path)
    try:
        f = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path.name}: is truncated or not a safetensors file ({e})") from e
    with f:
        found = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        formats = {k[:-len(".comfy_quant")]: _te_format(_read_marker(f, k, path), f"{path.name}: '{k}'")
                   for k in found if k.endswith(".comfy_quant")}

        with no_init_weights(), torch.device(device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = Qwen3VLForConditionalGeneration(config).eval()
            finally:
                torch.set_default_dtype(previous)
        model.lm_head = None  # never used: the conditioning is a hidden state
        state = {k: v for k, v in model.state_dict().items() if k != "model.language_model.norm.weight"}
        plan = {}  # model weight -> (format, {file key: (dtype, shape)})
        for key, tensor in state.items():
            name = comfy_text_encoder_name(key)
            fmt = formats.get(name[:-len(".weight")]) if name.endswith(".weight") else None
            plan[key] = (fmt, _te_expected(fmt, name, tuple(tensor.shape), found.keys()))
        quant = [k for k, (fmt, _) in plan.items() if fmt == "int8_convrot"]
        for key in quant:
            del state[key]  # frees the float weight once its int8 layer replaces it
        replace_linears(model, {k[:-len(".weight")]: QuantSpec("int8_convrot", full_precision=True) for k in quant})
        expected = {fk: spec for _, group in plan.values() for fk, spec in group.items()}
        for key in found:
            if key not in expected:
                raise CheckpointError(f"{path.name}: unexpected key '{key}'")
        for key, (want_dtype, want_shape) in expected.items():
            if key not in found:
                raise CheckpointError(f"missing key '{key}' (looked in: {path.name})")
            have_dtype, have_shape = found[key]
            if want_shape is not None and have_shape != want_shape:
                raise CheckpointError(f"shape mismatch for '{key}' in {path.name}: file has {list(have_shape)}, "
                                      f"model expects {list(want_shape)}")
            if have_dtype != want_dtype and not (want_dtype == "float" and have_dtype in ("BF16", "F16", "F32")):
                raise CheckpointError(f"wrong dtype for '{key}' in {path.name}: file has {have_dtype}, expected "
                                      f"{'BF16, F16 or F32' if want_dtype == 'float' else want_dtype}")

        with torch.no_grad():
            for key, (fmt, group) in plan.items():
                name = comfy_text_encoder_name(key)
                module = name[:-len(".weight")]
                if fmt == "int8_convrot":
                    layer = model.get_submodule(key[:-len(".weight")])
                    layer.weight = f.get_tensor(name).to(device)
                    layer.weight_scale = f.get_tensor(f"{module}.weight_scale").to(device)
                    continue
                if fmt == "int8":
                    value = f.get_tensor(name).to(device).float() * f.get_tensor(f"{module}.weight_scale").to(device)
                elif fmt == "nvfp4":
                    out_features, in_features = state[key].shape
                    value = nvfp4.dequantize_weight(
                        f.get_tensor(name).to(device), f.get_tensor(f"{module}.weight_scale").to(device),
                        f.get_tensor(f"{module}.weight_scale_2"), out_features, in_features, torch.float32)
                    if f"{module}.pre_quant_scale" in group:  # y = (x * s) W^T = x (W * s)^T
                        value = value * f.get_tensor(f"{module}.pre_quant_scale").to(device).float()
                else:
                    value = f.get_tensor(name)
                state[key].copy_(value)
    return model


# Tiny preset: byte-level tokens 0..255, then these specials.
TINY_SPECIALS = ["<|endoftext|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
TINY_LAYERS, TINY_LAYER = 3, 2
TINY_VOCAB = 256 + len(TINY_SPECIALS)
EMBED_KEY = "model.embed_tokens.weight"  # in the Comfy file's flat names


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (one token per byte, no merges) plus the Qwen vision specials, built offline."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's geometry (patch 16, temporal 2, merge 2, mean/std 0.5) with a tiny pixel budget:
    a 128x224 keyframe becomes 64x96 pixels = 6 vision tokens."""
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96})


def tiny_qwen3vl_config(hidden_size: int = 32, layers: int = TINY_LAYERS) -> Qwen3VLConfig:
    """The embedded default's Qwen3-VL: the byte-level vocabulary, 3 layers, a 2-block vision tower."""
    ids = {t: 256 + i for i, t in enumerate(TINY_SPECIALS)}
    return Qwen3VLConfig(
        text_config=dict(vocab_size=TINY_VOCAB, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=hidden_size,
                           num_position_embeddings=64, deepstack_visual_indexes=[1]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END])


def tiny_text_encoder_shape(path: str | Path) -> tuple[int, int] | None:
    """(hidden size, layers kept) when a text-encoder file holds the embedded default's architecture (its
    byte-level vocabulary), else None (the released Qwen3-VL-32B)."""
    header = read_header(Path(path))
    shape = header.get(EMBED_KEY, {}).get("shape")
    if not shape or shape[0] != TINY_VOCAB:
        return None
    layers = {int(m.group(1)) for k in header if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    return int(shape[1]), len(layers)


def build_tiny_qwen3vl(seed: int = 0, hidden_size: int = 32) -> Qwen3VLForConditionalGeneration:
    """The full (untruncated) tiny Qwen3-VL, weights drawn from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3VLForConditionalGeneration(tiny_qwen3vl_config(hidden_size)).eval()


def build_tiny_conditioner(seed: int = 0, hidden_size: int = 32) -> Conditioner:
    return Conditioner(build_tiny_qwen3vl(seed, hidden_size), build_tiny_tokenizer(), build_tiny_image_processor(),
                       layer=TINY_LAYER)
