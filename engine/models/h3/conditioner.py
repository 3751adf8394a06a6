"""The Qwen3-VL text/vision conditioner of MiniMax-H3 (specs/h3.md §4, §6).

`Conditioner.encode` builds the presentation (t2va: the prompt alone; fl2va: `"<Picture i>: "` plus a vision block
per keyframe, then the prompt), runs Qwen3-VL up to decoder layer `layer` and returns `hidden_states[layer]` (the
unnormalised residual) with the per-token modality tags the DiT's AdaLN reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import logging

from engine.models.h3.config import TEXT_TAG, VIDEO_TAG

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
        images = list(images)
        if not prompt or not prompt.strip():
            raise ValueError("The prompt is empty: describe the video and its sound.")
        prompt_ids = self._text(prompt)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"The prompt is {len(prompt_ids)} tokens long; the text conditioner takes at most "
                             f"{self.max_prompt_tokens}. Shorten the prompt.")
        for i, image in enumerate(images, 1):
            if not (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
                    and image.shape[2] == 3):
                got = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
                raise ValueError(f"Keyframe {i} must be an RGB uint8 image [H, W, 3], got {got}.")

        device = self.model.device
        ids, tags, vision = [], [], {}
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            merge = self.image_processor.merge_size ** 2
            for i, grid in enumerate(vision["image_grid_thw"], 1):
                label = self._text(f"<Picture {i}>: ")
                block = [self.vision_start] + [self.image_pad] * (int(grid.prod()) // merge) + [self.vision_end]
                ids += label + block
                tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
            vision = {"pixel_values": vision["pixel_values"].to(device, self.model.dtype),
                      "image_grid_thw": vision["image_grid_thw"].to(device)}
        ids += prompt_ids
        tags += [TEXT_TAG] * len(prompt_ids)

        input_ids = torch.tensor([ids], device=device)
        # Qwen-internal token types (1 = image pad) drive its multimodal rotary layout.
        mm_token_type_ids = (input_ids == self.image_pad).long()
        out = self.model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=mm_token_type_ids, use_cache=False,
                               output_hidden_states=self.layer, **vision)
        return out.hidden_states[self.layer], torch.tensor(tags, dtype=torch.long)


# Tiny preset: byte-level tokens 0..255, then these specials.
TINY_SPECIALS = ["<|endoftext|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
TINY_LAYERS, TINY_LAYER = 3, 2


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


def build_tiny_qwen3vl(seed: int = 0, hidden_size: int = 32) -> Qwen3VLForConditionalGeneration:
    """The full (untruncated) tiny Qwen3-VL, weights drawn from `seed`."""
    ids = {t: 256 + i for i, t in enumerate(TINY_SPECIALS)}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=256 + len(TINY_SPECIALS), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=hidden_size,
                           num_position_embeddings=64, deepstack_visual_indexes=[1]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3VLForConditionalGeneration(config).eval()


def build_tiny_conditioner(seed: int = 0, hidden_size: int = 32) -> Conditioner:
    return Conditioner(build_tiny_qwen3vl(seed, hidden_size), build_tiny_tokenizer(), build_tiny_image_processor(),
                       layer=TINY_LAYER)
