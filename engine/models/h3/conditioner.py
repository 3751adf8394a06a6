"""The Qwen3-VL text/vision conditioner of MiniMax-H3 (specs/h3.md §4, §6).

`Conditioner.encode` builds the presentation (t2va: the prompt alone; fl2va: `"<Picture i>: "` plus a vision block
per keyframe, then the prompt), runs Qwen3-VL up to decoder layer `layer` and returns `hidden_states[layer]` (the
unnormalised residual; the embedded default's normalised, see `Conditioner`) with the per-token modality tags the
DiT's AdaLN reads. `Conditioner.encode_references` does the same for ref2va: a label per reference in order,
numbered per kind (`"<Picture i>: "` + a vision block; `"<Audio j>: "` alone; `"<Video k>: "` + a `"<t seconds>"`
label and a vision block per merged pair of the frames read at 2 fps), then the prompt; it equals diffusers'
`MiniMaxH3Ref2VATextEncoderStep`.

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
import torch.nn.functional as F
from torch import nn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from safetensors import SafetensorError, safe_open
from transformers.initialization import no_init_weights
from transformers.utils import logging

from engine.models.h3.checkpoint import CheckpointError
from engine.models.h3.model_files import read_header
from engine.models.h3.config import TEXT_TAG, VIDEO_TAG
from engine.models.h3.layout import FPS
from engine.models.h3.video_processor import VIDEO_PROCESSOR_CLASS, video_processor_like
from engine.quant import nvfp4
from engine.quant.transform import QuantSpec, replace_linears

REAL_LAYER = 50
MAX_PROMPT_TOKENS = 2048
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
REFERENCE_SAMPLE_FPS = 2.0  # Qwen reads a 24 fps reference video at 2 fps: every 12th frame
# Qwen-internal token types (Qwen3VLProcessor.create_mm_token_type_ids): they drive its per-modality rotary layout.
MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2


class Conditioner:
    """Qwen3-VL truncated to its first `layer` decoder layers; the LM head is dropped (never used).

    `video_processor` (Qwen3-VL's, for ref2va reference videos) defaults to one of the image processor's geometry
    with Qwen3-VL's video pixel budget (`video_processor_like`)."""

    def __init__(self, model: Qwen3VLForConditionalGeneration, tokenizer, image_processor, layer: int = REAL_LAYER,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS, video_processor=None, final_norm: bool = False):
        lm = model.model.language_model
        if len(lm.layers) < layer:
            raise ValueError(f"The conditioner needs at least {layer} decoder layers, the model has {len(lm.layers)}.")
        del lm.layers[layer:]
        lm.config.num_hidden_layers = layer
        # We want the residual after layer `layer`, now the last one. transformers releases differ on whether the
        # last recorded hidden state has passed the final norm (5.17: it has; 5.25: not), so the norm goes and
        # `final_norm` says whether to apply one (weightless, as the file holds none) ourselves: the embedded
        # default's text encoder and DiT were trained on 5.17's normalised states, the release reads the residual.
        lm.norm = nn.Identity()
        self.final_norm = final_norm
        model.lm_head = None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor_like(image_processor) if video_processor is None else video_processor
        if getattr(self.video_processor, "cap_pixels_per_frame", False) is None:
            # Unset, transformers warns and reads it as False (uncapped), which is what diffusers runs today.
            self.video_processor.cap_pixels_per_frame = False
        self.layer = layer
        self.max_prompt_tokens = max_prompt_tokens
        self.vision_start, self.vision_end, self.image_pad, self.video_pad = (
            tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD))
        expected = {"vision_start_token_id": self.vision_start, "vision_end_token_id": self.vision_end,
                    "image_token_id": self.image_pad, "video_token_id": self.video_pad}
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
        video_processor = load_video_processor(directory / "processor", image_processor)
        return cls(model, tokenizer, image_processor, layer, max_prompt_tokens, video_processor)

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
            video_processor = build_tiny_video_processor()
        else:
            layer = REAL_LAYER if layer is None else layer
            config = config or qwen3vl_32b_config(layer)
            if tokenizer_dir is None:
                raise CheckpointError(
                    f"{Path(path).name}: a Qwen3-VL text-encoder file holds no tokenizer; give the tokenizer folder "
                    "(--tokenizer-dir: the tokenizer/ of the MiniMax-H3 release, or ComfyUI's "
                    "comfy/text_encoders/qwen25_tokenizer).")
            tokenizer, image_processor = load_tokenizer(tokenizer_dir), load_image_processor(tokenizer_dir)
            video_processor = load_video_processor(tokenizer_dir)
        model = load_text_encoder_file(path, config, dtype, device)
        return cls(model, tokenizer, image_processor, layer, max_prompt_tokens, video_processor, final_norm=bool(tiny))

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
            _check_pixels(image, 3, f"Keyframe {i}", "an RGB uint8 image [H, W, 3]")
        vision, grids = self._image_features([image for group in images for image in group])
        grids = iter(grids)
        rows = [self._rows(prompt, [next(grids) for _ in group]) for prompt, group in zip(prompts, images)]
        if any(tags != rows[0][1] for _, tags in rows):
            raise ValueError("encode_batch needs prompts of one token layout")
        return self._forward([ids for ids, _ in rows], rows[0][1], vision)

    @torch.no_grad()
    def encode_references(self, prompt: str, references: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """ref2va: (hidden [1, Nt, hidden] in the model dtype on its device, tags [Nt] long on CPU), as `encode`.

        `references` in request order, each with `.kind` ("image": `.image` uint8 [H, W, 3]; "video": `.frames`
        uint8 [F, H, W, 3] at 24 fps; "audio") and `.has_audio`, already normalised (engine/models/h3/references.py).
        Sounds add only their `"<Audio j>: "` label; images and videos go through Qwen's vision tower, batched per
        kind as diffusers batches them (Qwen fills the n-th pad run of a kind with the n-th item of its batch).
        """
        ids, tags, vision = self.ref2va_presentation(prompt, references)
        return self._forward([ids], tags, vision)

    def ref2va_presentation(self, prompt: str, references: Sequence) -> tuple[list[int], list[int], dict]:
        """The ref2va presentation of `encode_references`: token ids, row tags and the vision inputs (CPU tensors
        by Qwen's parameter names: pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw)."""
        references = list(references)
        prompt_ids = self._prompt_ids(prompt)
        images, videos = [], []
        for i, ref in enumerate(references, 1):
            if ref.kind == "image":
                images.append(_check_pixels(ref.image, 3, f"Reference {i} (an image)", "an RGB uint8 image "
                                            "[H, W, 3]"))
            elif ref.kind == "video":
                if getattr(ref, "fps", FPS) != FPS:
                    raise ValueError(f"Reference {i} (a video) is at {ref.fps:g} fps; the conditioner takes "
                                     f"reference videos normalised to {FPS} fps.")
                videos.append(self._sample_reference_frames(
                    _check_pixels(ref.frames, 4, f"Reference {i} (a video)", "RGB uint8 frames [F, H, W, 3]"), i))
            elif ref.kind != "audio":
                raise ValueError(f"Reference {i} is a {ref.kind!r}; references are images, videos or sounds.")
        vision, image_grids = self._image_features(images)
        video_blocks = []
        if videos:
            features = self.video_processor(videos=[frames for frames, _ in videos], do_sample_frames=False,
                                            return_tensors="pt")
            merge = self.video_processor.merge_size ** 2
            for (_, timestamps), grid in zip(videos, features["video_grid_thw"]):
                if int(grid[0]) != len(timestamps):
                    raise ValueError(f"The video processor merged a reference video into {int(grid[0])} vision "
                                     f"blocks, but the presentation labels {len(timestamps)}.")
                video_blocks.append((int(grid[1]) * int(grid[2]) // merge, timestamps))
            vision |= {"pixel_values_videos": features["pixel_values_videos"],
                       "video_grid_thw": features["video_grid_thw"]}

        ids, tags = [], []
        counts = {"image": 0, "video": 0, "audio": 0}
        image_grids, video_blocks = iter(image_grids), iter(video_blocks)
        for ref in references:
            if ref.has_audio:
                counts["audio"] += 1
                self._label(ids, tags, f"<Audio {counts['audio']}>: ")
            if ref.kind == "image":
                counts["image"] += 1
                self._picture(ids, tags, counts["image"], next(image_grids))
            elif ref.kind == "video":
                counts["video"] += 1
                self._label(ids, tags, f"<Video {counts['video']}>: ")
                tokens, timestamps = next(video_blocks)
                for timestamp in timestamps:
                    # "{:.1f}" rounds half to even: the first block of a 2 fps pair (0.25 s) reads "<0.2 seconds>".
                    self._label(ids, tags, f"<{timestamp:.1f} seconds>")
                    self._vision_block(ids, tags, self.video_pad, tokens)
        return ids + prompt_ids, tags + [TEXT_TAG] * len(prompt_ids), vision

    def _sample_reference_frames(self, frames: np.ndarray, index: int) -> tuple[np.ndarray, list[float]]:
        """The frames Qwen reads of a 24 fps reference video (every 12th, i.e. 2 fps) and the timestamp of each
        vision block: the sampled frames merge in pairs (the last repeated to pair up), a block is labelled with
        the mean of its two frames' times (diffusers' `_sample_video_condition_frames`)."""
        stride, merge_t = FPS / REFERENCE_SAMPLE_FPS, self.video_processor.temporal_patch_size
        indices, cursor = [], 0.0
        while round(cursor) < len(frames):
            if not indices or round(cursor) > indices[-1]:
                indices.append(round(cursor))
            cursor += stride
        if len(indices) < merge_t:
            minimum = round((merge_t - 1) * stride) + 1
            raise ValueError(
                f"Reference {index} (a video) is {len(frames)} frame{'s' if len(frames) != 1 else ''} long "
                f"({len(frames) / FPS:.2f} s at {FPS} fps): too short. The text encoder reads reference videos at "
                f"{REFERENCE_SAMPLE_FPS:g} fps, {merge_t} frames at a time, so a reference video needs at least "
                f"{minimum} frames ({minimum / FPS:.2f} s). Use a longer clip, or give a still as an image reference.")
        times = [i / REFERENCE_SAMPLE_FPS for i in range(len(indices))]
        times += [times[-1]] * (-len(times) % merge_t)
        blocks = [(times[i] + times[i + merge_t - 1]) / 2 for i in range(0, len(times), merge_t)]
        return frames[indices], blocks

    def _image_features(self, images: list[np.ndarray]) -> tuple[dict, list[torch.Tensor]]:
        """The vision inputs of images (keyframes or image references) in one image-processor call, and their
        image_grid_thw rows."""
        if not images:
            return {}, []
        features = self.image_processor(images=images, return_tensors="pt")
        return ({"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"]},
                list(features["image_grid_thw"]))

    def _forward(self, rows: list[list[int]], tags: list[int], vision: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states[layer] of token rows of one layout (`tags`) with their vision inputs."""
        device = self.model.device
        vision = {k: v.to(device, self.model.dtype) if k.startswith("pixel_") else v.to(device)
                  for k, v in vision.items()}
        input_ids = torch.tensor(rows, device=device)
        # Qwen-internal token types (as Qwen3VLProcessor.create_mm_token_type_ids builds them) drive its
        # multimodal rotary layout; vision start / end are text there.
        mm_token_type_ids = torch.full_like(input_ids, MM_TEXT)
        mm_token_type_ids[input_ids == self.image_pad] = MM_IMAGE
        mm_token_type_ids[input_ids == self.video_pad] = MM_VIDEO
        out = self.model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=mm_token_type_ids, use_cache=False,
                               output_hidden_states=self.layer, **vision)
        hidden = out.hidden_states[self.layer]
        if self.final_norm:
            hidden = F.rms_norm(hidden, hidden.shape[-1:], eps=self.model.config.text_config.rms_norm_eps)
        return hidden, torch.tensor(tags, dtype=torch.long)

    def _prompt_ids(self, prompt: str) -> list[int]:
        if not prompt or not prompt.strip():
            raise ValueError("The prompt is empty: describe the video and its sound.")
        prompt_ids = self._text(prompt)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"The prompt is {len(prompt_ids)} tokens long; the text conditioner takes at most "
                             f"{self.max_prompt_tokens}. Shorten the prompt.")
        return prompt_ids

    def _label(self, ids: list[int], tags: list[int], text: str) -> None:
        label = self._text(text)
        ids += label
        tags += [TEXT_TAG] * len(label)

    def _vision_block(self, ids: list[int], tags: list[int], pad: int, tokens: int) -> None:
        ids += [self.vision_start] + [pad] * tokens + [self.vision_end]
        tags += [VIDEO_TAG] * (tokens + 2)

    def _picture(self, ids: list[int], tags: list[int], ordinal: int, grid: torch.Tensor) -> None:
        """`"<Picture i>: "` and the vision block of an image of this image_grid_thw."""
        self._label(ids, tags, f"<Picture {ordinal}>: ")
        self._vision_block(ids, tags, self.image_pad, int(grid.prod()) // self.image_processor.merge_size ** 2)

    def _rows(self, prompt: str, grids: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """Token ids and row tags of one prompt after its keyframes' blocks (`grids`: their image_grid_thw)."""
        prompt_ids = self._prompt_ids(prompt)
        ids, tags = [], []
        for i, grid in enumerate(grids, 1):
            self._picture(ids, tags, i, grid)
        return ids + prompt_ids, tags + [TEXT_TAG] * len(prompt_ids)


def _check_pixels(pixels, ndim: int, what: str, want: str) -> np.ndarray:
    if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == ndim
            and pixels.shape[-1] == 3 and pixels.size):
        got = f"{pixels.dtype} {list(pixels.shape)}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise ValueError(f"{what} must be {want}, got {got}.")
    return pixels


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


def load_video_processor(directory: str | Path, image_processor=None):
    """The video processor of `processor/` of a models folder, or of a folder's own configs, read as transformers
    reads it for diffusers' `Qwen3VLProcessor`: the nested `processor_config.json` entry, else
    `video_preprocessor_config.json`, else `preprocessor_config.json` (the image processor's). Without any: Qwen3-VL's
    (specs/h3.md §4), of `image_processor`'s geometry (default: `load_image_processor`'s)."""
    directory = Path(directory)
    for folder in (directory / "processor", directory):
        nested = folder / "processor_config.json"
        if ((folder / "video_preprocessor_config.json").is_file() or (folder / "preprocessor_config.json").is_file()
                or (nested.is_file() and "video_processor" in json.loads(nested.read_text()))):
            return VIDEO_PROCESSOR_CLASS.from_pretrained(folder, local_files_only=True)
    return video_processor_like(image_processor or load_image_processor(directory))


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


def build_tiny_video_processor() -> Qwen3VLVideoProcessor:
    """The tiny image processor's geometry, with a tiny pixel budget over a whole clip: two 128x224 frames become
    96x160 pixels = 15 vision tokens per merged pair, four become 64x96 = 6."""
    processor = video_processor_like(build_tiny_image_processor(),
                                     size={"shortest_edge": 32 * 32, "longest_edge": 4 * 96 * 96})
    processor.cap_pixels_per_frame = False  # transformers' default today, stated (unset it warns)
    return processor


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


def build_tiny_conditioner(seed: int = 0, hidden_size: int = 32, final_norm: bool = True) -> Conditioner:
    """The embedded default's conditioner (normalised states) with weights drawn from `seed`; `final_norm=False`
    reads the residual as the release does."""
    return Conditioner(build_tiny_qwen3vl(seed, hidden_size), build_tiny_tokenizer(), build_tiny_image_processor(),
                       layer=TINY_LAYER, video_processor=build_tiny_video_processor(), final_norm=final_norm)
