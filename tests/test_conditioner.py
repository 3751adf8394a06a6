"""The Qwen3-VL conditioner on the tiny preset: presentation, tags, hidden_states[layer], errors, local loading."""

import numpy as np
import pytest
import torch

from engine.models.h3.conditioner import (TINY_LAYER, Conditioner, build_tiny_conditioner, build_tiny_image_processor,
                                          build_tiny_qwen3vl, build_tiny_tokenizer)
from engine.models.h3.config import TEXT_TAG, TINY, VIDEO_TAG

PROMPT = "A red fox trots through fresh snow; wind hisses, a crow calls."


@pytest.fixture(scope="module")
def conditioner():
    return build_tiny_conditioner()


def keyframe(seed, height=128, width=224):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def prompt_ids(text):
    return build_tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_t2va_shape_tags_determinism(conditioner):
    hidden, tags = conditioner.encode(PROMPT)
    assert hidden.shape == (1, len(prompt_ids(PROMPT)), TINY.text_dim)
    assert hidden.dtype == torch.float32
    assert tags.dtype == torch.long and torch.all(tags == TEXT_TAG)
    again, _ = build_tiny_conditioner(seed=0).encode(PROMPT)
    assert torch.equal(hidden, again)
    other, _ = build_tiny_conditioner(seed=1).encode(PROMPT)
    assert not torch.allclose(hidden, other)
    shifted, _ = conditioner.encode(PROMPT.replace("fox", "cat"))
    assert not torch.allclose(hidden, shifted)


@pytest.mark.parametrize("num_keyframes", [1, 2])
def test_fl2va_presentation(conditioner, num_keyframes):
    images = [keyframe(i) for i in range(num_keyframes)]
    hidden, tags = conditioner.encode(PROMPT, images)

    grids = build_tiny_image_processor()(images=images, return_tensors="pt")["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 6]] * num_keyframes  # 128x224 -> 64x96 pixels under the tiny budget
    expected = []
    for i, grid in enumerate(grids, 1):
        expected += [TEXT_TAG] * len(prompt_ids(f"<Picture {i}>: ")) + [VIDEO_TAG] * (int(grid.prod()) // 4 + 2)
    expected += [TEXT_TAG] * len(prompt_ids(PROMPT))
    assert tags.tolist() == expected
    assert hidden.shape == (1, len(expected), TINY.text_dim)

    t2va, _ = conditioner.encode(PROMPT)
    assert hidden.shape[1] == t2va.shape[1] + num_keyframes * (len(prompt_ids("<Picture 1>: ")) + 6 + 2)
    # The pixels reach the conditioner: another keyframe changes the prompt rows after it.
    other, _ = conditioner.encode(PROMPT, [keyframe(i + 10) for i in range(num_keyframes)])
    assert not torch.allclose(hidden[0, -5:], other[0, -5:])


@pytest.mark.parametrize("num_keyframes", [0, 2])
def test_hidden_equals_full_forward_hidden_state(conditioner, num_keyframes):
    """Truncated stack == hidden_states[layer] of the untruncated model's full forward (pre final norm)."""
    images = [keyframe(i) for i in range(num_keyframes)]
    hidden, tags = conditioner.encode(PROMPT, images)

    full = build_tiny_qwen3vl(seed=0)
    tok = build_tiny_tokenizer()
    ids = []
    vision = {}
    if images:
        vision = dict(build_tiny_image_processor()(images=images, return_tensors="pt"))
        for i, grid in enumerate(vision["image_grid_thw"], 1):
            ids += prompt_ids(f"<Picture {i}>: ") + tok.convert_tokens_to_ids(
                ["<|vision_start|>"] + ["<|image_pad|>"] * (int(grid.prod()) // 4) + ["<|vision_end|>"])
    ids = torch.tensor([ids + prompt_ids(PROMPT)])
    with torch.no_grad():
        out = full(input_ids=ids, mm_token_type_ids=(ids == full.config.image_token_id).long(),
                   output_hidden_states=True, use_cache=False, **vision)
    assert len(out.hidden_states) == full.config.text_config.num_hidden_layers + 1 > TINY_LAYER + 1
    torch.testing.assert_close(hidden, out.hidden_states[TINY_LAYER], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(hidden, out.hidden_states[-1])
    assert len(conditioner.model.model.language_model.layers) == TINY_LAYER


def test_prompt_errors(conditioner):
    for prompt in ("", "   \n\t"):
        with pytest.raises(ValueError, match="The prompt is empty: describe the video and its sound."):
            conditioner.encode(prompt)
    limit = conditioner.max_prompt_tokens
    with pytest.raises(ValueError, match=f"{limit + 1} tokens long.*at most {limit}"):
        conditioner.encode("a" * (limit + 1))
    conditioner.encode("a" * limit)
    with pytest.raises(ValueError, match="uint8"):
        conditioner.encode(PROMPT, [keyframe(0).astype(np.float32)])


def test_from_pretrained_local_folders(tmp_path, conditioner):
    build_tiny_qwen3vl(seed=0).save_pretrained(tmp_path / "text_encoder")
    build_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    build_tiny_image_processor().save_pretrained(tmp_path / "processor")
    loaded = Conditioner.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", layer=TINY_LAYER)
    assert len(loaded.model.model.language_model.layers) == TINY_LAYER
    images = [keyframe(0), keyframe(1)]
    hidden, tags = loaded.encode(PROMPT, images)
    ref_hidden, ref_tags = conditioner.encode(PROMPT, images)
    assert torch.equal(tags, ref_tags)
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=0)

    with pytest.raises(ValueError, match="at least 9 decoder layers"):
        Conditioner(build_tiny_qwen3vl(), build_tiny_tokenizer(), build_tiny_image_processor(), layer=9)


def test_from_pretrained_rejects_incomplete_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    build_tiny_qwen3vl(seed=0).save_pretrained(tmp_path / "text_encoder")
    build_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    build_tiny_image_processor().save_pretrained(tmp_path / "processor")
    weights = tmp_path / "text_encoder" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="1 missing keys .*layers.1.mlp.up_proj.weight"):
        Conditioner.from_pretrained(tmp_path, dtype=torch.float32, layer=TINY_LAYER)
