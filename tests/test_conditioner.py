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
    return build_tiny_conditioner(final_norm=False)  # the release's reading (diffusers' and a models folder's)


def keyframe(seed, height=128, width=224):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def prompt_ids(text):
    return build_tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_t2va_shape_tags_determinism(conditioner):
    hidden, tags = conditioner.encode(PROMPT)
    assert hidden.shape == (1, len(prompt_ids(PROMPT)), TINY.text_dim)
    assert hidden.dtype == torch.float32
    assert tags.dtype == torch.long and torch.all(tags == TEXT_TAG)
    again, _ = build_tiny_conditioner(seed=0, final_norm=False).encode(PROMPT)
    assert torch.equal(hidden, again)
    other, _ = build_tiny_conditioner(seed=1, final_norm=False).encode(PROMPT)
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


@pytest.mark.parametrize("final_norm", [False, True])
@pytest.mark.parametrize("num_keyframes", [0, 2])
def test_hidden_equals_full_forward_hidden_state(num_keyframes, final_norm):
    """Truncated stack == hidden_states[layer] of the untruncated model's full forward: the residual (pre final
    norm) as the release reads it, or that RMS-normalised as the embedded default reads it, whatever transformers
    records as the truncated stack's last hidden state (5.17: after its final norm)."""
    conditioner = Conditioner(build_tiny_qwen3vl(seed=0), build_tiny_tokenizer(), build_tiny_image_processor(),
                              layer=TINY_LAYER, final_norm=final_norm)
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
    residual = out.hidden_states[TINY_LAYER]
    expected = torch.nn.functional.rms_norm(residual, residual.shape[-1:], eps=1e-6) if final_norm else residual
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-6)
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


# ------------------------------------------------------------------------------------------ diffusers conformance

def torchvision_usable():
    try:
        import torchvision.transforms.v2.functional  # noqa: F401  (the project's CPU torch has no build of it)
    except (ImportError, RuntimeError):
        return False
    return True


@pytest.fixture(scope="module")
def diffusers_processor(conditioner):
    """diffusers' `components.processor`: a Qwen3VLProcessor of our tokenizer, image and video processors."""
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    with pytest.MonkeyPatch.context() as mp:
        if not torchvision_usable():
            # Without torchvision transformers cannot name the video processor base class it checks against
            # ("VIDEO_PROCESSOR_MAPPING has no attribute '_extra_content'"); the check is all that is skipped.
            mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
        return Qwen3VLProcessor(image_processor=conditioner.image_processor, tokenizer=conditioner.tokenizer,
                                video_processor=conditioner.video_processor)


@pytest.fixture(scope="module")
def full_qwen():
    """The untruncated tiny Qwen3-VL of the conditioner's seed: diffusers reads hidden_states[layer] of a deeper
    stack and refuses one of exactly `layer` layers."""
    return build_tiny_qwen3vl(seed=0)


def diffusers_components(conditioner, processor, full_qwen):
    from types import SimpleNamespace

    return SimpleNamespace(tokenizer=conditioner.tokenizer, processor=processor, text_encoder=full_qwen,
                           text_encoder_layer=TINY_LAYER, text_tag=TEXT_TAG, video_tag=VIDEO_TAG, fps=24.0,
                           _execution_device=torch.device("cpu"))


def clip(seed, frames, height=128, width=224):
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def image_ref(seed):
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference
    return MiniMaxH3ImageReference(image=keyframe(seed))


def video_ref(seed, frames, sound=False):
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3VideoReference
    return MiniMaxH3VideoReference(frames=clip(seed, frames), audio=torch.zeros(2, 320) if sound else None)


def audio_ref():
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference
    return MiniMaxH3AudioReference(audio=torch.zeros(2, 320))


# name -> (references, the labels in order, the "<t seconds>" labels of each video)
MIXES = {
    "one-image": (lambda: [image_ref(0)], ["Picture 1"], []),
    "two-images-sound-video-audio": (
        lambda: [image_ref(0), image_ref(1), video_ref(2, 29, sound=True), audio_ref()],
        ["Picture 1", "Picture 2", "Audio 1", "Video 1", "Audio 2"], [["0.2", "1.0"]]),
    "silent-video": (lambda: [video_ref(3, 24)], ["Video 1"], [["0.2"]]),
    "video-image-audio-image": (
        lambda: [video_ref(4, 37, sound=True), image_ref(5), audio_ref(), image_ref(6)],
        ["Audio 1", "Video 1", "Picture 1", "Audio 2", "Picture 2"], [["0.2", "1.2"]]),
    # 49 frames: 5 samples at 2 fps (frames 0, 12, .., 48), the last repeated to pair up.
    "odd-samples": (lambda: [video_ref(7, 49)], ["Video 1"], [["0.2", "1.2", "2.0"]]),
    "29-frames": (lambda: [video_ref(8, 29)], ["Video 1"], [["0.2", "1.0"]]),
    # the shortest reference video (13 frames = 2 samples), and two videos of other lengths in one batch
    "shortest-video": (lambda: [image_ref(9), video_ref(10, 13)], ["Picture 1", "Video 1"], [["0.2"]]),
    "two-videos": (lambda: [video_ref(11, 25), image_ref(12), video_ref(13, 61, sound=True)],
                   ["Video 1", "Picture 1", "Audio 1", "Video 2"], [["0.2", "1.0"], ["0.2", "1.2", "2.2"]]),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_ref2va_presentation_equals_diffusers(conditioner, diffusers_processor, full_qwen, mix):
    """Token ids, tags, vision inputs and hidden_states[layer] against diffusers' MiniMaxH3Ref2VATextEncoderStep."""
    import re

    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.encoders import (MiniMaxH3Ref2VATextEncoderStep,
                                                                 get_qwen3vl_prompt_embeds)

    make, labels, seconds = MIXES[mix]
    references = make()
    step = MiniMaxH3Ref2VATextEncoderStep()
    vision, image_counts, video_counts, video_times = step._gather_vision_features(diffusers_processor,
                                                                                   references, 24.0)
    want_ids, want_tags = step._build_presentation(conditioner.tokenizer, PROMPT, references, image_counts,
                                                   video_counts, video_times, text_tag=TEXT_TAG, video_tag=VIDEO_TAG)

    ids, tags, ours = conditioner.ref2va_presentation(PROMPT, references)
    assert ids == want_ids
    assert tags == want_tags
    assert set(ours) == set(vision)
    for name in vision:
        assert torch.equal(ours[name], vision[name]), name

    # Independently of diffusers: the labels, the timestamps, the placeholder counts and the tags of each run.
    text = conditioner.tokenizer.decode(ids)
    assert re.findall(r"<((?:Picture|Audio|Video) \d+)>: ", text) == labels
    assert re.findall(r"<(\d+\.\d) seconds>", text) == [t for video in seconds for t in video]
    assert [len(times) for times in video_times] == [len(video) for video in seconds]
    tokenizer = conditioner.tokenizer
    image_pad, video_pad = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    assert all(n > 0 for n in image_counts + video_counts)
    assert ids.count(image_pad) == sum(image_counts)
    assert ids.count(video_pad) == sum(n * len(t) for n, t in zip(video_counts, video_times))
    blocks = re.findall(r"<\|vision_start\|>((?:<\|(?:image|video)_pad\|>)+)<\|vision_end\|>", text)
    images, videos = iter(image_counts), iter(zip(video_counts, video_times))
    want_blocks = []
    for ref in references:
        if ref.kind == "image":
            want_blocks.append(("image", next(images)))
        elif ref.kind == "video":
            tokens, times = next(videos)
            want_blocks += [("video", tokens)] * len(times)
    assert [(b[2:7], b.count("pad|>")) for b in blocks] == want_blocks
    ids_t = torch.tensor(ids)
    vision_rows = (ids_t == image_pad) | (ids_t == video_pad) | (ids_t == conditioner.vision_start) | (
        ids_t == conditioner.vision_end)
    assert torch.equal(torch.tensor(tags), torch.where(vision_rows, VIDEO_TAG, TEXT_TAG))
    assert ids[-len(prompt_ids(PROMPT)):] == prompt_ids(PROMPT)

    hidden, our_tags = conditioner.encode_references(PROMPT, references)
    assert our_tags.dtype == torch.long and our_tags.tolist() == want_tags
    with torch.no_grad():
        want = get_qwen3vl_prompt_embeds(full_qwen, diffusers_processor, want_ids, vision,
                                         text_encoder_layer=TINY_LAYER)
    assert hidden.dtype == torch.float32 and hidden.shape == (1, len(want_ids), TINY.text_dim)
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)

    # The whole diffusers block gives the same.
    state = PipelineState()
    state.set("prompt", PROMPT)
    state.set("normalized_references", references)
    with torch.no_grad():
        _, state = step(diffusers_components(conditioner, diffusers_processor, full_qwen), state)
    torch.testing.assert_close(hidden, state.get("prompt_embeds"), rtol=1e-5, atol=1e-5)
    assert torch.equal(our_tags, state.get("text_token_tags"))


@pytest.mark.parametrize("num_keyframes", [0, 1, 3])
def test_fl2va_equals_diffusers(conditioner, diffusers_processor, full_qwen, num_keyframes):
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    images = [keyframe(i) for i in range(num_keyframes)]
    hidden, tags = conditioner.encode(PROMPT, images)
    state = PipelineState()
    state.set("prompt", PROMPT)
    state.set("keyframes", images)
    with torch.no_grad():
        _, state = MiniMaxH3FL2VATextEncoderStep()(diffusers_components(conditioner, diffusers_processor,
                                                                        full_qwen), state)
    assert torch.equal(tags, state.get("text_token_tags"))
    torch.testing.assert_close(hidden, state.get("prompt_embeds"), rtol=1e-5, atol=1e-5)


def test_ref2va_order_matters(conditioner):
    a, b, video = image_ref(0), image_ref(1), video_ref(2, 29)
    ids_ab, tags_ab, _ = conditioner.ref2va_presentation(PROMPT, [a, b])
    ids_ba, tags_ba, _ = conditioner.ref2va_presentation(PROMPT, [b, a])
    assert ids_ab == ids_ba and tags_ab == tags_ba  # same sizes: only the pixels in the blocks swap
    hidden_ab, _ = conditioner.encode_references(PROMPT, [a, b])
    hidden_ba, _ = conditioner.encode_references(PROMPT, [b, a])
    assert not torch.allclose(hidden_ab, hidden_ba)
    ids_iv, _, _ = conditioner.ref2va_presentation(PROMPT, [a, video])
    ids_vi, _, _ = conditioner.ref2va_presentation(PROMPT, [video, a])
    assert ids_iv != ids_vi and sorted(ids_iv) == sorted(ids_vi)


@pytest.mark.parametrize("frames", [1, 12])
def test_ref2va_too_short_video(conditioner, diffusers_processor, frames):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    references = [image_ref(0), video_ref(1, frames)]
    message = (rf"Reference 2 \(a video\) is {frames} frames? long \({frames / 24:.2f} s at 24 fps\): too short\. "
               r".* at 2 fps, 2 frames at a time, so a reference video needs at least 13 frames \(0\.54 s\)\.")
    with pytest.raises(ValueError, match=message):
        conditioner.encode_references(PROMPT, references)
    with pytest.raises(ValueError, match="must run at least 13 frames"):  # diffusers draws the line there too
        MiniMaxH3Ref2VATextEncoderStep()._gather_vision_features(diffusers_processor, references, 24.0)
    conditioner.ref2va_presentation(PROMPT, [image_ref(0), video_ref(1, 13)])


def test_ref2va_errors(conditioner):
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference, MiniMaxH3VideoReference

    references = [image_ref(0), audio_ref()]
    for prompt in ("", "  \n"):
        with pytest.raises(ValueError, match="The prompt is empty: describe the video and its sound."):
            conditioner.encode_references(prompt, references)
    limit = conditioner.max_prompt_tokens
    with pytest.raises(ValueError, match=f"{limit + 1} tokens long.*at most {limit}"):
        conditioner.encode_references("a" * (limit + 1), references)
    with pytest.raises(ValueError, match=r"Reference 2 \(an image\) must be an RGB uint8 image"):
        conditioner.encode_references(PROMPT, [audio_ref(), MiniMaxH3ImageReference(image=keyframe(0) / 255.0)])
    with pytest.raises(ValueError, match=r"Reference 1 \(a video\) must be RGB uint8 frames \[F, H, W, 3\]"):
        conditioner.encode_references(PROMPT, [MiniMaxH3VideoReference(frames=keyframe(0))])
    with pytest.raises(ValueError, match=r"Reference 1 \(a video\) is at 30 fps.*normalised to 24 fps"):
        conditioner.encode_references(PROMPT, [MiniMaxH3VideoReference(frames=clip(0, 30), fps=30.0)])
    # Sounds alone never reach Qwen's vision tower: the labels and the prompt.
    ids, tags, vision = conditioner.ref2va_presentation(PROMPT, [audio_ref(), audio_ref()])
    assert vision == {} and conditioner.tokenizer.decode(ids) == "<Audio 1>: <Audio 2>: " + PROMPT
    assert set(tags) == {TEXT_TAG}


def test_video_processor_defaults_and_loading(tmp_path, conditioner):
    from engine.models.h3.conditioner import build_tiny_video_processor, load_video_processor
    from engine.models.h3.video_processor import QWEN3VL_VIDEO_SIZE

    tiny = build_tiny_video_processor()
    for name in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "resample"):
        assert getattr(tiny, name) == getattr(build_tiny_image_processor(), name), name
    # Given no video processor, the conditioner makes one of the image processor's geometry.
    plain = Conditioner(build_tiny_qwen3vl(), build_tiny_tokenizer(), build_tiny_image_processor(), layer=TINY_LAYER)
    assert plain.video_processor.patch_size == 16 and plain.video_processor.size.longest_edge == 25165824
    # No processor config in a folder (ComfyUI's tokenizer folder): Qwen3-VL's.
    qwen = load_video_processor(tmp_path)
    assert (qwen.patch_size, qwen.temporal_patch_size, qwen.merge_size) == (16, 2, 2)
    assert list(qwen.image_mean) == list(qwen.image_std) == [0.5] * 3
    assert {"shortest_edge": qwen.size.shortest_edge, "longest_edge": qwen.size.longest_edge} == QWEN3VL_VIDEO_SIZE

    # A models folder with processor/ holding both configs loads the same ref2va conditioning.
    build_tiny_qwen3vl(seed=0).save_pretrained(tmp_path / "models" / "text_encoder")
    build_tiny_tokenizer().save_pretrained(tmp_path / "models" / "tokenizer")
    build_tiny_image_processor().save_pretrained(tmp_path / "models" / "processor")
    tiny.save_pretrained(tmp_path / "models" / "processor")
    saved = (tmp_path / "models" / "processor" / "video_preprocessor_config.json").read_text()
    assert '"video_processor_type": "Qwen3VLVideoProcessor"' in saved
    loaded = Conditioner.from_pretrained(tmp_path / "models", dtype=torch.float32, layer=TINY_LAYER)
    assert loaded.video_processor.size == tiny.size
    # (no image reference: where torchvision is there AutoImageProcessor loads the torchvision image processor,
    # whose resize differs slightly from the PIL one the tiny builder makes)
    references = [video_ref(0, 29, sound=True), audio_ref(), video_ref(1, 13)]
    hidden, tags = loaded.encode_references(PROMPT, references)
    ref_hidden, ref_tags = conditioner.encode_references(PROMPT, references)
    assert torch.equal(tags, ref_tags)
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=0)


@pytest.mark.skipif(not torchvision_usable(), reason="torchvision cannot be imported with this torch")
def test_torch_video_processor_equals_torchvision():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from engine.models.h3.video_processor import QWEN3VL_VIDEO_SIZE, TorchQwen3VLVideoProcessor

    kwargs = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                  cap_pixels_per_frame=False)
    for size in ({"shortest_edge": 1024, "longest_edge": 36864}, QWEN3VL_VIDEO_SIZE):
        for resample in (3, 2):  # bicubic, bilinear
            real = Qwen3VLVideoProcessor(size=size, resample=resample, **kwargs)
            ours = TorchQwen3VLVideoProcessor(size=size, resample=resample, **kwargs)
            for shape in [(2, 128, 224, 3), (3, 130, 250, 3), (5, 480, 854, 3)]:
                videos = [clip(0, shape[0], *shape[1:3]), clip(1, shape[0], *shape[1:3]) // 5]
                a = real(videos=videos, do_sample_frames=False, return_tensors="pt")
                b = ours(videos=videos, do_sample_frames=False, return_tensors="pt")
                assert torch.equal(a["video_grid_thw"], b["video_grid_thw"])
                assert torch.equal(a["pixel_values_videos"], b["pixel_values_videos"])
