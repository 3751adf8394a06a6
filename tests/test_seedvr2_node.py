"""H3Forge Upscale, called like ComfyUI calls it (its APIs' stand-ins), against a real engine process on the tiny
preset: SeedVR2 (3B and 7B) to the requested size with the sound and the exact frame rate kept, from the clip and from a
stored job; what each method sends; settings checks; the shipped workflows."""

import asyncio
import importlib
import re
from fractions import Fraction

import pytest
import torch

import test_pack_import as pack_checks
from test_nodes import engine_settings, fresh_comfy_state  # noqa: F401  (autouse: fresh ComfyUI stand-ins)
from test_pack_import import load_pack

load_pack()
comfy = importlib.import_module("h3forge_pack.nodes.comfy_compat")
from h3forge_pack.nodes.upscale import H3ForgeUpscale, task_of  # noqa: E402

RATE = Fraction(30000, 1001)
SAMPLE_RATE = 44100
FRAMES, HEIGHT, WIDTH = 9, 32, 48


@pytest.fixture(scope="module")
def settings(engine):
    return engine_settings(engine.url, engine.token)


def clip(frames=FRAMES, rate=RATE):
    """A 48x32 clip (9 frames at 29.97 fps by default) with a stereo tone."""
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(frames, HEIGHT, WIDTH, 3, generator=gen)
    t = torch.arange(round(frames / rate * SAMPLE_RATE)) / SAMPLE_RATE
    waveform = torch.stack([torch.sin(2 * torch.pi * 440 * t), 0.5 * torch.sin(2 * torch.pi * 660 * t)])[None]
    audio = {"waveform": waveform.float(), "sample_rate": SAMPLE_RATE}
    return comfy.VideoFromComponents(comfy.VideoComponents(images=images, frame_rate=rate, audio=audio))


class StoredVideo:
    """A VIDEO whose frames the node must not need: the engine has them under source_job."""

    def get_frame_rate(self):
        return RATE

    def get_components(self):
        raise AssertionError("the node should reuse the stored job, not send the video")


def upscale(settings, source, method="SeedVR2", model="3B", resolution="custom", width=96, height=64, scale=2.0,
            color_fix="wavelet", batch_frames=0, tiling=True, refine_prompt="", strength=0.5, refine_steps=0, **extra):
    return asyncio.run(H3ForgeUpscale().upscale(source, method, model, resolution, width, height, scale, color_fix,
                                                3, batch_frames, tiling, refine_prompt, strength, refine_steps,
                                                engine=settings, unique_id="5", **extra))


@pytest.fixture(scope="module")
def upscaled(settings):
    return upscale(settings, clip())


def test_node_definition_is_complete():
    pack_checks.test_node_definition_is_complete("H3ForgeUpscale")
    assert load_pack().NODE_DISPLAY_NAME_MAPPINGS["H3ForgeUpscale"] == "H3Forge Upscale (SeedVR2 / H3 refine)"
    assert asyncio.iscoroutinefunction(H3ForgeUpscale.upscale)


def test_upscales_to_the_requested_size_and_keeps_the_sound(upscaled):
    video, frames, audio, job = upscaled
    assert frames.shape == (FRAMES, 64, 96, 3) and frames.dtype == torch.float32
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    source = clip().get_components()
    assert audio["sample_rate"] == SAMPLE_RATE and torch.equal(audio["waveform"], source.audio["waveform"])
    parts = video.get_components()
    assert video.get_frame_rate() == RATE and torch.equal(parts.images, frames)
    assert torch.equal(parts.audio["waveform"], source.audio["waveform"])
    assert re.fullmatch("[0-9a-f]{32}", job)


def test_upscale_from_the_stored_job(settings, upscaled):
    first = upscaled[3]
    video, frames, audio, job = upscale(settings, StoredVideo(), resolution="scale",
                                        scale=1.5, source_job=first)
    assert frames.shape == (FRAMES, 96, 144, 3) and job != first
    assert video.get_frame_rate() == RATE and torch.equal(audio["waveform"], upscaled[2]["waveform"])


def test_upscale_with_7b(settings):
    video, frames, audio, _ = upscale(settings, clip(), model="7B", resolution="scale", scale=2.0, color_fix="lab",
                                      tiling=False)
    assert frames.shape == (FRAMES, 64, 96, 3) and video.get_frame_rate() == RATE
    assert torch.equal(audio["waveform"], clip().get_components().audio["waveform"])


@pytest.mark.parametrize("method, resolution, task, expected", [
    ("SeedVR2", "1080p", "upscale", {"model": "7b", "resolution": "1080p", "batch_frames": 33}),
    ("SeedVR2", "4K", "upscale", {"resolution": "4K"}),
    ("SeedVR2", "custom", "upscale", {"width": 96, "height": 64}),
    ("SeedVR2", "scale", "upscale", {"scale": 1.5}),
    ("H3 latent refine", "1080p", "refine", {"prompt": "rain", "scale": 1.5, "strength": 0.4, "steps": 5}),
])
def test_the_engine_accepts_what_the_node_sends(method, resolution, task, expected):
    """Each method and size mode maps to params the engine's own checks accept (the H3 refine pass itself runs in
    test_tasks_wire.py)."""
    from engine import protocol

    got_task, params = task_of(method, "7B", resolution, 96, 64, 1.5, "lab", 3, 33, False, "rain", 0.4, 5)
    assert got_task == task and params.items() >= expected.items()
    checked = protocol.validate_task(task, {**params, "source_job": "a" * 32}, {})
    assert checked["seed"] == 3 and ("color_fix" in checked) == (task == "upscale")


@pytest.mark.parametrize("settings_, words", [
    (dict(method="H3 latent refine", scale=3.0, refine_prompt="x"), "1.5 or 2"),
    (dict(method="H3 latent refine", scale=2.0, refine_prompt="  "), "needs refine_prompt"),
    (dict(method="SeedVR2", resolution="custom", width=0, height=0), "width and/or height"),
    (dict(method="SeedVR2", resolution="1080p", width=9000), "width must be from 0 to 8192"),
    (dict(method="H3 latent refine", refine_prompt="x", refine_steps=1), "refine_steps must be 0"),
])
def test_settings_are_checked(settings_, words):
    assert words in H3ForgeUpscale.VALIDATE_INPUTS(**settings_)
    with pytest.raises(ValueError, match=re.escape(words)):
        asyncio.run(H3ForgeUpscale().upscale(clip(), **{**dict(
            method="SeedVR2", model="3B", resolution="custom", width=96, height=64, scale=2.0, color_fix="wavelet",
            seed=0, batch_frames=0, tiling=True, refine_prompt="", strength=0.5, refine_steps=0), **settings_}))
    assert H3ForgeUpscale.VALIDATE_INPUTS(method="SeedVR2", resolution="1080p") is True
    assert H3ForgeUpscale.VALIDATE_INPUTS() is True


def test_workflows_feed_the_upscaler():
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "workflows"
    for name, source, linked in (("h3_t2v_seedvr2_1080p.json", "H3ForgeTextToVideo", {"source", "source_job"}),
                                 ("seedvr2_upscale_video.json", "LoadVideo", {"source"})):
        workflow = json.loads((folder / name).read_text())
        nodes = {n["id"]: n for n in workflow["nodes"]}
        links = {link[0]: link for link in workflow["links"]}
        up = next(n for n in nodes.values() if n["type"] == "H3ForgeUpscale")
        inputs = {slot["name"]: links[slot["link"]] for slot in up["inputs"] if slot["link"] is not None}
        assert linked <= set(inputs) and all(nodes[inputs[k][1]]["type"] == source for k in linked)
        assert up["widgets_values"][:3] == ["SeedVR2", "3B", "1080p"]
        out = next(link for link in workflow["links"] if link[1] == up["id"] and link[2] == 0)
        assert nodes[out[3]]["type"] == "H3ForgePreview"
