"""Masked Edit, Extend Video, Mask Preview and the mask helper nodes, called like ComfyUI calls them (its APIs'
stand-ins), against a real engine process on the tiny preset."""

import asyncio
import importlib
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from engine.models.h3 import layout as L
from engine.models.h3.mask import canvas_mask, cell_mask, latent_frame_spans
from engine.models.h3.pipeline import FULL_CANVAS, TINY_CANVAS
from engine.models.h3.request import Source
from engine.models.h3.source import prepare_clip
import test_pack_import as pack_checks
from test_nodes import engine_settings, fresh_comfy_state  # noqa: F401  (autouse: fresh ComfyUI stand-ins)
from test_pack_import import load_pack

STEPS = 3
FRAMES = 124

load_pack()
comfy = importlib.import_module("h3forge_pack.nodes.comfy_compat")
video_io = importlib.import_module("h3forge_pack.nodes.video_io")
from h3forge_pack.nodes.edit import H3ForgeMaskedEdit  # noqa: E402
from h3forge_pack.nodes.extend import H3ForgeExtendVideo  # noqa: E402
from h3forge_pack.nodes.masks import (CANVASES, H3ForgeMaskFeather, H3ForgeMaskFrameRange,  # noqa: E402
                                      H3ForgeMaskGrow, H3ForgeMaskPreview, H3ForgeMaskTrackBox, canvas_rules)
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo  # noqa: E402

NEW_NODES = ["H3ForgeMaskedEdit", "H3ForgeExtendVideo", "H3ForgeMaskPreview", "H3ForgeMaskFrameRange",
             "H3ForgeMaskTrackBox", "H3ForgeMaskGrow", "H3ForgeMaskFeather"]


@pytest.fixture(scope="module")
def settings(engine):
    return engine_settings(engine.url, engine.token)


@pytest.fixture(scope="module")
def t2v(settings):
    """(video, frames, audio, job_id) of a 5 s clip on the tiny preset's 1:1 canvas (128x128)."""
    return asyncio.run(H3ForgeTextToVideo().generate("a lighthouse on a cliff, gulls and surf", 5.0, "1:1", 0, 0,
                                                     STEPS, 3, engine=settings, unique_id="1"))


def video_of(frames, fps=24, audio=None):
    return comfy.VideoFromComponents(comfy.VideoComponents(images=frames, frame_rate=Fraction(fps), audio=audio))


def box(height=128, width=128, rows=(40, 90), cols=(30, 100), frames=1):
    mask = torch.zeros(frames, height, width)
    mask[:, rows[0]:rows[1], cols[0]:cols[1]] = 1.0
    return mask


@pytest.mark.parametrize("name", NEW_NODES)
def test_node_definitions_are_complete(name):
    pack_checks.test_node_definition_is_complete(name)
    cls = load_pack().NODE_CLASS_MAPPINGS[name]
    assert load_pack().NODE_DISPLAY_NAME_MAPPINGS[name].startswith("H3Forge ")
    if "engine" in cls.INPUT_TYPES().get("optional", {}):
        assert asyncio.iscoroutinefunction(getattr(cls, cls.FUNCTION))


def test_text_to_video_gives_its_job_id(t2v):
    video, frames, audio, job_id = t2v
    assert re.fullmatch(r"[0-9a-f]{32}", job_id) and frames.shape == (FRAMES, 128, 128, 3)
    assert H3ForgeTextToVideo.RETURN_NAMES == ("video", "frames", "audio", "job_id")


def test_masked_edit_end_to_end(settings, t2v):
    video, frames, audio, _ = t2v
    outputs = asyncio.run(H3ForgeMaskedEdit().edit(video, box(), "", "remove", 0.0, True, STEPS, 0,
                                                   engine=settings, unique_id="4"))
    edited, edited_frames, edited_audio, job_id = outputs
    assert edited_frames.shape == frames.shape and re.fullmatch(r"[0-9a-f]{32}", job_id)
    assert edited_audio["waveform"].shape == audio["waveform"].shape
    assert edited.get_components().frame_rate == Fraction(24)
    texts = [text for node, text in comfy.progress_texts if node == "4"]
    assert any("denoising 2/2" in text for text in texts) and "done" in texts[-1]


def test_masked_edit_sends_a_big_clip_as_mp4_with_a_per_frame_mask(settings, t2v, monkeypatch):
    video, frames, _, _ = t2v
    monkeypatch.setattr(video_io, "RAW_FRAMES_LIMIT", 0)  # every clip counts as big
    params, tensors = video_io.source_of(video)
    assert params == {} and list(tensors) == ["source_mp4"]
    track = asyncio.run(H3ForgeMaskTrackBox().track("0: 10, 10, 40, 40\n123: 80, 60, 40, 40", 128, 128, FRAMES))[0]
    _, edited_frames, _, _ = asyncio.run(H3ForgeMaskedEdit().edit(
        video, track, "a small boat", "replace", 0.9, False, STEPS, 1, engine=settings))
    assert edited_frames.shape == frames.shape


def test_a_loaded_file_goes_to_the_engine_as_it_is(tmp_path):
    """Load Video's VIDEO (a VideoFromFile) is sent as its file's bytes, and Mask Preview and References decode it
    as the engine does: the frames and sound ComfyUI's own decode gives. A VIDEO holding more than its file (what a
    later ComfyUI's trim on load adds) goes the decoded way."""
    encode = importlib.import_module("engine.io.video").encode_mp4_bytes
    g = torch.Generator().manual_seed(4)
    pixels = (torch.rand(30, 48, 64, 3, generator=g) * 255).to(torch.uint8).numpy()
    path = tmp_path / "clip.mp4"
    tone = 0.2 * np.sin(np.arange(32000) / 32000 * 2 * np.pi * np.array([[220.0], [330.0]])).astype(np.float32)
    path.write_bytes(encode(pixels, Fraction(30), tone, 32000, crf=12))
    video = comfy.VideoFromFile(str(path))
    params, tensors = video_io.source_of(video)
    assert params == {} and tensors["source_mp4"].tobytes() == path.read_bytes()
    frames, rate, sound, sample_rate = video_io.video_media(video)
    parts = video.get_components()  # ComfyUI's decode
    assert rate == parts.frame_rate == Fraction(30) and frames.shape == (30, 48, 64, 3)
    assert np.array_equal(frames, video_io.images_to_uint8(parts.images))
    comfy_sound, comfy_rate = video_io.audio_samples(parts.audio)  # ComfyUI's keeps the AAC frames' padding
    assert sample_rate == comfy_rate == 32000 and sound.shape == (2, 32000)
    assert np.array_equal(sound, comfy_sound[:, :32000])
    assert np.abs(sound[:, 2000:30000] - tone[:, 2000:30000]).max() < 0.05  # the tone, through AAC

    video._VideoFromFile__start_time = 0.5
    assert video_io.loaded_file(video) is None
    params, tensors = video_io.source_of(video)
    assert params["source_fps"] == 30.0 and np.array_equal(tensors["source_frames"], frames)


def test_masked_edit_errors_are_readable(settings, t2v):
    video = t2v[0]
    with pytest.raises(ValueError, match="H3Forge: .*mask is empty"):
        asyncio.run(H3ForgeMaskedEdit().edit(video, torch.zeros(1, 128, 128), "", "remove", 0.0, True, STEPS, 0,
                                             engine=settings))


def test_masked_edit_resizes_a_mask_of_another_size_and_says_so(settings, t2v):
    video, frames, _, _ = t2v
    comfy.progress_texts.clear()
    _, edited, _, _ = asyncio.run(H3ForgeMaskedEdit().edit(video, box(64, 64, (20, 45), (15, 50)), "", "remove",
                                                           0.0, True, STEPS, 0, engine=settings, unique_id="e"))
    assert edited.shape == frames.shape
    done = comfy.progress_texts[-1]
    assert done[0] == "e" and "mask 64x64 resized to the video's 128x128" in done[1], done


def test_extend_video_from_the_text_to_video_job(settings, t2v):
    video, frames, audio, job_id = t2v
    node = H3ForgeExtendVideo()
    out_video, out_frames, out_audio, out_job = asyncio.run(node.extend(
        video, "the fog rolls in\nnight falls", 3.0, 7, 15.0, STEPS, 0, engine=settings, source_job=job_id,
        unique_id="5"))
    assert out_frames.shape[0] > FRAMES + 3 * 24 - 1 and torch.equal(out_frames[:FRAMES], frames)
    assert out_audio["waveform"].shape[2] == round(out_frames.shape[0] / 24 * out_audio["sample_rate"])
    assert out_job != job_id and out_video.get_components().images.shape == out_frames.shape

    # A job the engine no longer has: the node sends the video instead.
    _, again, _, _ = asyncio.run(node.extend(video, "the fog rolls in", 3.0, 7, 15.0, STEPS, 0, engine=settings,
                                             source_job="0" * 32, unique_id="6"))
    assert torch.equal(again[:FRAMES], frames)
    assert any("No such job" in text and "Sending the video instead" in text
               for node_id, text in comfy.progress_texts if node_id == "6")


def engine_cells(frames_u8, fps, mask, strength, canvas):
    """What the engine's edit computes (engine/models/h3/edit.py), step by step."""
    clip = prepare_clip(Source(frames_u8, fps), canvas.short_edge, canvas.max_pixels)
    padded, _ = L.frames_for_seconds(clip.frames.shape[0] / 24)
    mask = torch.from_numpy((mask.numpy() * 255).round().astype(np.uint8).astype(np.float32) / 255)
    if mask.shape[0] > 1:
        mask = mask[clip.frame_index]
    drawn = canvas_mask(mask, padded, clip.height, clip.width)
    return clip, padded, cell_mask(drawn * strength, padded, clip.height, clip.width)


@pytest.mark.parametrize("strength", [1.0, 0.4])
def test_mask_preview_shows_exactly_the_engines_cells(strength):
    # 30 fps, 160x96 (resampled to 24 fps and resized onto the 224x128 canvas), a box moving across it.
    count = 150
    frames = torch.rand(count, 96, 160, 3, generator=torch.Generator().manual_seed(0))
    mask = asyncio.run(H3ForgeMaskTrackBox().track("0: 5, 5, 30, 20\n149: 120, 60, 33, 30", 160, 96, count))[0]
    mask = asyncio.run(H3ForgeMaskFeather().feather(mask, 4))[0]
    (overlay,) = asyncio.run(H3ForgeMaskPreview().preview(mask, "128p (tiny preset)", strength, False,
                                                         video=video_of(frames, 30)))

    frames_u8 = (frames * 255).round().to(torch.uint8).numpy()
    clip, padded, cells = engine_cells(frames_u8, 30.0, mask, strength, TINY_CANVAS)
    assert overlay.shape == (clip.frames.shape[0], 128, 224, 3) == (120, 128, 224, 3)
    base = clip.frames.float() / 255
    tinted = (overlay - base).abs().amax(-1) > 0  # [F, H, W]
    red = tinted.unflatten(1, (8, 16)).unflatten(3, (14, 16)).any(4).any(2)  # per 16x16 cell
    latent = [k for k, (a, b) in enumerate(latent_frame_spans(padded)) for _ in range(a, b)][:120]
    assert torch.equal(red, cells[latent] > 0)
    alpha = cells[latent].repeat_interleave(16, 1).repeat_interleave(16, 2)[..., None] * 0.5
    assert torch.allclose(overlay, base * (1 - alpha) + torch.tensor([1.0, 0, 0]) * alpha, atol=1e-6)
    assert red.any() and not red.all()


def test_mask_preview_asks_the_engine_for_its_canvas(settings, t2v):
    assert asyncio.run(canvas_rules("ask the engine", settings)) == (TINY_CANVAS.short_edge, TINY_CANVAS.max_pixels)
    assert CANVASES["128p (tiny preset)"] == (TINY_CANVAS.short_edge, TINY_CANVAS.max_pixels)
    assert CANVASES["768p (MiniMax-H3)"] == (FULL_CANVAS.short_edge, FULL_CANVAS.max_pixels)
    video, frames, _, _ = t2v
    (overlay,) = asyncio.run(H3ForgeMaskPreview().preview(box(), "ask the engine", 1.0, True, video=video,
                                                         engine=settings))
    assert overlay.shape == frames.shape
    assert torch.allclose(overlay[:, 1:16, 1:16], frames[:, 1:16, 1:16])  # outside the mask and off the grid
    assert torch.allclose(overlay[:, ::16, 1:16], frames[:, ::16, 1:16] * 0.6)  # cell borders, off the mask


def test_mask_preview_resizes_a_mask_of_another_size():
    frames = torch.rand(FRAMES, 128, 128, 3, generator=torch.Generator().manual_seed(2))
    half = box(64, 64, (20, 45), (15, 50))
    (small,) = asyncio.run(H3ForgeMaskPreview().preview(half, "128p (tiny preset)", 1.0, False, frames=frames))
    full = half.repeat_interleave(2, 1).repeat_interleave(2, 2)
    (same,) = asyncio.run(H3ForgeMaskPreview().preview(full, "128p (tiny preset)", 1.0, False, frames=frames))
    assert torch.equal(small, same) and not torch.equal(small, frames)
    with pytest.raises(ValueError, match="connect the video"):
        asyncio.run(H3ForgeMaskPreview().preview(box(), "128p (tiny preset)", 1.0, False))


def test_frame_range():
    node = H3ForgeMaskFrameRange()
    (out,) = asyncio.run(node.frame_range(2, 5, 64, 48, 10, box="10, 20, 30, 40"))
    expected = torch.zeros(10, 48, 64)
    expected[2:5, 20:48, 10:40] = 1
    assert torch.equal(out, expected)
    shape = torch.rand(48, 64)
    # The mask sets the size; end 0: to the last frame.
    (out,) = asyncio.run(node.frame_range(7, 0, 1, 1, 10, mask=shape))
    assert out.shape == (10, 48, 64) and torch.equal(out[7:], shape.expand(3, -1, -1)) and not out[:7].any()
    (out,) = asyncio.run(node.frame_range(1, 3, 64, 48, 10, video=video_of(torch.zeros(4, 20, 30, 3)), box="0, 0, 5, 5"))
    assert out.shape == (4, 20, 30) and out[1:3, :5, :5].all() and out.sum() == 50
    with pytest.raises(ValueError, match="do not fit"):
        asyncio.run(node.frame_range(8, 12, 64, 48, 10, box="0, 0, 5, 5"))
    with pytest.raises(ValueError, match="connect a mask or write a box"):
        asyncio.run(node.frame_range(0, 0, 64, 48, 10))


def test_grow_and_shrink():
    node = H3ForgeMaskGrow()
    dot = torch.zeros(1, 21, 21)
    dot[0, 10, 10] = 1
    (grown,) = asyncio.run(node.grow(dot, 3))
    assert torch.equal(grown[0], box(21, 21, (7, 14), (7, 14))[0])
    (shrunk,) = asyncio.run(node.grow(box(21, 21, (6, 15), (6, 15)), -2))
    assert torch.equal(shrunk[0], box(21, 21, (8, 13), (8, 13))[0])
    (edge,) = asyncio.run(node.grow(box(21, 21, (0, 9), (0, 21)), -2))  # the image border does not eat into the mask
    assert torch.equal(edge[0], box(21, 21, (0, 7), (0, 21))[0])
    # Against a direct window maximum, per frame, on random values.
    masks = torch.rand(3, 17, 23, generator=torch.Generator().manual_seed(1))
    (out,) = asyncio.run(node.grow(masks, 4))
    padded = torch.nn.functional.pad(masks, (4, 4, 4, 4))
    direct = padded.unfold(1, 9, 1).unfold(2, 9, 1).amax((-1, -2))
    assert torch.equal(out, direct)


def test_feather_is_monotone():
    half = torch.zeros(2, 40, 80)
    half[:, :, :40] = 1
    (soft,) = asyncio.run(H3ForgeMaskFeather().feather(half, 8))
    row = soft[0, 20]
    assert (row[1:] <= row[:-1] + 1e-6).all()  # fades out moving away from the masked side
    assert (row[:30] == 1).all() and (row[50:] == 0).all()
    assert 0 < row[36] < 1 and 0 < row[43] < 1 and abs(row[39] + row[40] - 1) < 1e-6
    assert torch.equal(soft[0], soft[1])
    (same,) = asyncio.run(H3ForgeMaskFeather().feather(half, 0))
    assert torch.equal(same, half)


def test_whole_clip_conversions_give_the_same_values_a_few_frames_at_a_time(monkeypatch):
    g = torch.Generator().manual_seed(3)
    masks, images = torch.rand(5, 17, 23, generator=g), torch.rand(5, 17, 23, 4, generator=g) * 1.2 - 0.1
    masks[:, 3:9, 4:12] = 1

    def converted():
        return ([asyncio.run(H3ForgeMaskGrow().grow(masks, pixels))[0] for pixels in (3, -2)]
                + [asyncio.run(H3ForgeMaskFeather().feather(masks, 4))[0]]
                + [torch.from_numpy(video_io.mask_to_uint8(m)) for m in (masks, masks[:1].expand(5, -1, -1))]
                + [torch.from_numpy(video_io.images_to_uint8(images))])

    whole = converted()
    monkeypatch.setattr(video_io, "CHUNK_ELEMENTS", 2 * 17 * 23)  # two frames a chunk, the last one alone
    assert video_io.frame_chunks(masks) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    chunked = converted()
    assert [t.shape for t in whole] == [(5, 17, 23)] * 4 + [(17, 23), (5, 17, 23, 3)]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_track_box_interpolates_between_keyframes():
    (out,) = asyncio.run(H3ForgeMaskTrackBox().track("# car\n0: 0, 0, 10, 10\n10: 20, 10, 10, 10", 40, 30, 21))
    assert out.shape == (21, 30, 40)
    assert torch.equal(out[5], box(30, 40, (5, 15), (10, 20))[0])  # halfway: x 10, y 5
    assert torch.equal(out[0], box(30, 40, (0, 10), (0, 10))[0])
    assert all(torch.equal(out[k], out[10]) for k in range(10, 21))  # held after the last keyframe
    (single,) = asyncio.run(H3ForgeMaskTrackBox().track("3: 1, 2, 3, 4", 8, 8, 2))
    assert torch.equal(single[0], single[1]) and single[0].sum() == 12


def test_validate_inputs():
    edit, extend = H3ForgeMaskedEdit.VALIDATE_INPUTS, H3ForgeExtendVideo.VALIDATE_INPUTS
    assert edit() is True and edit(prompt="", preset="remove") is True
    assert "needs a prompt" in edit(prompt=" ", preset="replace")
    assert "remove, replace, repaint" in edit(preset="erase")
    assert "steps" in edit(steps=1) and "LoRA line 1" in edit(lora_list="x.safetensors:strong")
    assert extend() is True and extend(prompts="a\n\nb", steps=5) is True
    assert "at least one prompt" in extend(prompts="\n  \n")
    assert "steps" in extend(steps=1001)
    assert "keyframe line 2" in H3ForgeMaskTrackBox.VALIDATE_INPUTS(keyframes="0: 1, 2, 3, 4\nten: 1, 2, 3, 4")
    assert "two keyframes" in H3ForgeMaskTrackBox.VALIDATE_INPUTS(keyframes="0: 1, 2, 3, 4\n0: 1, 2, 3, 4")
    assert H3ForgeMaskTrackBox.VALIDATE_INPUTS(keyframes="0: 1, 2, 3, 4\n9: 5, 6, 7, 8") is True
    assert "after start" in H3ForgeMaskFrameRange.VALIDATE_INPUTS(start=5, end=5)
    assert "x, y, width, height" in H3ForgeMaskFrameRange.VALIDATE_INPUTS(box="1, 2, 3")
    assert H3ForgeMaskFrameRange.VALIDATE_INPUTS(start=5, end=0, box="") is True


def test_a_real_size_source_keeps_comfyuis_event_loop_responsive(settings):
    """The removal workflow's nodes on the shipped 1344x768 x 124-frame source, run the way ComfyUI runs them (one
    event loop, Mask Preview and Masked Edit at once, the source from Load Video): a timer on that loop keeps firing
    on time throughout, so other nodes' connection timeouts and ComfyUI's own messages are never starved. (The
    decoded way for clips as big is test_masked_edit_sends_a_big_clip_as_mp4_with_a_per_frame_mask's.)"""
    video = comfy.VideoFromFile(str(pack_checks.PACK / "workflows" / "example_inputs" / "h3_scene.mp4"))
    assert video.get_dimensions() == (1344, 768) and video.get_frame_count() == FRAMES
    tick, lateness = 0.1, []

    async def timer(stop: asyncio.Event):
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            due = loop.time() + tick
            await asyncio.sleep(tick)
            lateness.append(loop.time() - due)

    async def workflow():
        stop = asyncio.Event()
        ticking = asyncio.create_task(timer(stop))
        (mask,) = await H3ForgeMaskTrackBox().track("0: 197, 245, 277, 277\n123: 610, 245, 277, 277", 1344, 768,
                                                    FRAMES, video=video)
        (mask,) = await H3ForgeMaskGrow().grow(mask, 24)
        overlay, edited = await asyncio.gather(
            H3ForgeMaskPreview().preview(mask, "ask the engine", 1.0, True, video=video, engine=settings),
            H3ForgeMaskedEdit().edit(video, mask, "", "remove", 0.0, True, STEPS, 0, engine=settings))
        stop.set()
        await ticking
        return overlay[0], edited[1]

    overlay, edited = asyncio.run(workflow())
    assert overlay.shape == edited.shape == (FRAMES, 128, 224, 3)
    assert len(lateness) > 20 and max(lateness) < 0.5, f"the loop stalled for {max(lateness):.2f} s"
