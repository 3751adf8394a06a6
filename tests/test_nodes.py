"""The node functions end to end against a real engine process on the tiny preset (ComfyUI's APIs stand-ins)."""

import asyncio
import importlib
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from engine_fixture import free_port
from test_pack_import import load_pack

PROMPT = "rain on a tin roof, thunder rolls in the distance"
STEPS = 3  # sigma grid points: 2 DiT evaluations

load_pack()
comfy = importlib.import_module("h3forge_pack.nodes.comfy_compat")
launcher = importlib.import_module("h3forge_pack.nodes.launcher")
from h3forge_pack.nodes.client import EngineError  # noqa: E402
from h3forge_pack.nodes.engine_node import (H3ForgeEngine, client_for, default_settings,  # noqa: E402
                                            speed_params)
from h3forge_pack.nodes.preview import H3ForgePreview  # noqa: E402
from h3forge_pack.nodes.t2v import H3ForgeTextToVideo, parse_lora_list  # noqa: E402

assert not comfy.IN_COMFYUI


def engine_settings(url: str, token: str = "", auto_launch: bool = False, attention: str = "auto",
                    sparse_attention: str = "engine default") -> dict:
    return H3ForgeEngine().configure(url, token, auto_launch, "tiny", "", "cpu", 1, attention, sparse_attention)[0]


@pytest.fixture(scope="module")
def settings(engine):
    """H3Forge Engine node settings for the module's real engine (tests/engine_fixture.py)."""
    return engine_settings(engine.url, engine.token)


@pytest.fixture(autouse=True)
def fresh_comfy_state():
    comfy.ProgressBar.created.clear()
    comfy.progress_texts.clear()
    comfy.interrupt_current_processing(False)
    yield
    comfy.interrupt_current_processing(False)


def generate(settings, seconds=5.0, steps=STEPS, seed=1, size=(0, 0), aspect="16:9", unique_id="7", **extra):
    node = H3ForgeTextToVideo()
    return asyncio.run(node.generate(PROMPT, seconds, aspect, *size, steps, seed, engine=settings,
                                     unique_id=unique_id, **extra))


@pytest.fixture(scope="module")
def t2va(settings):
    """One t2va job at the default canvas, with what the ComfyUI stand-ins recorded during it."""
    comfy.ProgressBar.created.clear()
    comfy.progress_texts.clear()
    outputs = generate(settings)
    return outputs, list(comfy.ProgressBar.created), list(comfy.progress_texts)


def test_text_to_video_end_to_end(t2va):
    (video, frames, audio, _), bars, texts = t2va

    assert frames.dtype == torch.float32 and frames.ndim == 4 and frames.shape[0] == 124 and frames.shape[3] == 3
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    rate = audio["sample_rate"]
    waveform = audio["waveform"]
    assert waveform.dtype == torch.float32 and waveform.ndim == 3 and waveform.shape[:2] == (1, 2)
    assert waveform.shape[2] == round(124 / 24 * rate)

    parts = video.get_components()
    assert parts.frame_rate == Fraction(24)
    assert parts.images.shape == frames.shape and torch.equal(parts.images, frames)
    assert parts.audio["sample_rate"] == rate and parts.audio["waveform"].shape == waveform.shape

    (bar,) = bars
    assert bar.node_id == "7"
    # The bar counts each phase the engine reports: the denoise steps, then the decode's chunks to their end.
    updates = [(value, total) for value, total, _ in bar.updates]
    assert updates[:3] == [(0, STEPS - 1), (1, STEPS - 1), (2, STEPS - 1)]
    assert len(updates) > 3 and updates[-1][0] == updates[-1][1]
    previews = [preview for _, _, preview in bar.updates if preview is not None]
    assert previews, "no live preview reached the progress bar"  # the engine sends at most 4 a second
    for kind, image, max_size in previews:
        assert kind == "JPEG" and isinstance(image, Image.Image) and image.mode == "RGB" and max_size > 0
    mine = [text for node_id, text in texts if node_id == "7"]
    assert mine and all(text.startswith("H3Forge: ") for text in mine)
    assert any("denoising 2/2" in text for text in mine) and any(text.startswith("H3Forge: decoding") for text in mine)
    assert "done" in mine[-1]


def test_streamed_frames_become_the_image_output_before_the_result_arrives(settings, monkeypatch):
    client = importlib.import_module("h3forge_pack.nodes.client")
    video_io = importlib.import_module("h3forge_pack.nodes.video_io")
    converted, at_result = [], []
    convert, result_frames = video_io.ResultImages.convert, client._JobWatch.result_frames

    def counted(self, start, total, frames):
        convert(self, start, total, frames)
        converted.append(len(frames))

    async def noted(self, start, total, rest):
        at_result.append((sum(converted), start))  # frames converted when the result message is handled
        return await result_frames(self, start, total, rest)

    monkeypatch.setattr(video_io.ResultImages, "convert", counted)
    monkeypatch.setattr(client._JobWatch, "result_frames", noted)
    video, frames, audio, job = generate(settings, steps=2, size=(64, 64))
    # Every frame was streamed and converted, chunk by chunk, before the result (which carried none) arrived.
    assert at_result == [(124, 124)] and converted == [17] * 7 + [5]

    # The outputs are the full result's, converted at the end as before streaming.
    stored = asyncio.run(client_for(settings).attach(job))
    assert frames.dtype == torch.float32 and frames.shape == (124, 64, 64, 3)
    assert torch.equal(frames, torch.from_numpy(stored.frames.astype(np.float32)).div_(255.0))
    assert torch.equal(audio["waveform"], torch.from_numpy(stored.audio.copy())[None]) and audio["sample_rate"] == 32000
    parts = video.get_components()
    assert parts.images is frames and parts.audio is audio and parts.frame_rate == Fraction(24)


def test_first_frame_runs_fl2va(settings):
    # A portrait first frame with aspect "auto": the engine takes the canvas from the image it received.
    first = torch.rand(1, 160, 96, 3)
    _, frames, audio, _ = generate(settings, aspect="auto", first_frame=first)
    assert frames.shape[0] == 124 and frames.shape[1] > frames.shape[2]
    assert audio["waveform"].shape[2] == round(124 / 24 * audio["sample_rate"])


def test_preview_writes_playable_mp4_with_audio(t2va):
    (video, frames, audio, _), _, _ = t2va
    ui = asyncio.run(H3ForgePreview().preview(video))["ui"]
    assert ui["animated"] == (True,)
    (entry,) = ui["images"]
    assert entry["type"] == "temp" and entry["subfolder"] == "" and entry["format"] == "video/h264-mp4"
    path = Path(comfy.get_temp_directory()) / entry["filename"]
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.width, stream.height) == ("h264", frames.shape[2], frames.shape[1])
        assert container.streams.audio[0].sample_rate == audio["sample_rate"]
        decoded = sum(1 for _ in container.decode(video=0))
    with av.open(str(path)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert decoded == 124
    assert samples >= 0.95 * audio["waveform"].shape[2]
    path.unlink()


def test_engine_error_is_readable(settings):
    with pytest.raises((ValueError, RuntimeError)) as caught:
        generate(settings, seconds=30.0)
    message = str(caught.value)
    assert message.startswith("H3Forge: ") and "30 s" in message and "Traceback" not in message


@pytest.mark.parametrize("when", ["first_step", "before_progress"])
def test_interrupt_cancels_engine_job(settings, when):
    async def scenario():
        node = H3ForgeTextToVideo()
        job = asyncio.ensure_future(
            node.generate(PROMPT, 5.0, "16:9", 64, 64, 400, 5, engine=settings, unique_id="9"))
        if when == "first_step":  # ComfyUI's progress hook sees the flag at the next update
            while not (comfy.ProgressBar.created and comfy.ProgressBar.created[0].updates):
                assert not job.done(), job.exception()
                await asyncio.sleep(0.01)
        else:  # only the node's watcher can see it
            await asyncio.sleep(0)
        started = time.monotonic()
        comfy.interrupt_current_processing(True)  # what ComfyUI's Cancel button does
        with pytest.raises(comfy.InterruptProcessingException):
            await job
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 10
    updates = comfy.ProgressBar.created[0].updates if comfy.ProgressBar.created else []
    assert len(updates) < 10  # stopped long before step 399
    assert not comfy.processing_interrupted()  # ComfyUI's flag was consumed by the re-raise
    status = asyncio.run(client_for(settings).status())
    assert status["running"] is None and status["queue"] == []

    _, frames, _, _ = generate(settings, size=(64, 64))  # the engine serves the next job
    assert frames.shape == (124, 64, 64, 3)


def test_auto_launch_starts_engine_once_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("H3FORGE_TOKEN_FILE", str(tmp_path / "token"))  # keep the test out of ~/.h3forge
    url = f"ws://127.0.0.1:{free_port()}"
    settings = engine_settings(url, auto_launch=True)
    try:
        _, frames, _, _ = generate(settings, size=(64, 64))
        first = launcher.launched(url)
        assert first is not None and frames.shape[0] == 124
        assert first.token_file == tmp_path / "token" and first.log_file.is_file()
        # The second prompt finds the running engine: its answer (a refusal, to keep this quick) comes from it.
        with pytest.raises(ValueError, match="30 s"):
            generate(settings, seconds=30.0)
        second = launcher.launched(url)
        assert second is first and second.pid == first.pid and second.alive()
    finally:
        engine = launcher.launched(url)
        if engine is not None:
            engine.stop()
    assert launcher.probe(url) is None


def test_bundled_engine_that_cannot_load_is_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("H3FORGE_TOKEN_FILE", str(tmp_path / "token"))
    url = f"ws://127.0.0.1:{free_port()}"
    settings = {**engine_settings(url, auto_launch=True), "models_dir": str(tmp_path / "no-such-models")}
    try:
        with pytest.raises(RuntimeError) as caught:
            generate(settings, size=(64, 64))
    finally:
        engine = launcher.launched(url)
        if engine is not None:
            engine.stop()
    message = str(caught.value)
    assert message.startswith("H3Forge: ") and "no-such-models" in message


def test_a_dropped_connection_waits_for_the_exiting_bundled_engine_and_shows_why_it_exited(tmp_path, monkeypatch):
    # A bundled engine that fails to load its models answers /v1/health while loading, then closes its connections
    # and takes a while to exit: the artist must still see its exit code and log, not a bare "unreachable".
    monkeypatch.setenv("H3FORGE_LOG_DIR", str(tmp_path))
    engine_node = importlib.import_module("h3forge_pack.nodes.engine_node")
    url = f"ws://127.0.0.1:{free_port()}"
    port = launcher.host_port(url)[1]
    launcher.log_file(port).write_text("event=engine.load_failed models/transformer: no such file or directory\n")
    process = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(2); sys.exit(3)"])
    launcher._launched[launcher.host_port(url)] = launcher.LaunchedEngine(process, url, port, tmp_path / "t", [])
    try:
        t0 = time.perf_counter()
        wrong_input = asyncio.run(engine_node.readable_error(EngineError("invalid_request", "steps: at most 50"), url))
        assert str(wrong_input) == "H3Forge: steps: at most 50" and time.perf_counter() - t0 < 1
        lost = asyncio.run(engine_node.readable_error(EngineError("unreachable", "no answer to the hello"), url))
        assert "exited with code 3" in str(lost) and "models/transformer: no such file" in str(lost)
    finally:
        process.kill()
        process.wait()
        launcher._launched.pop(launcher.host_port(url), None)


def test_unreachable_engine_without_auto_launch_is_readable():
    url = f"ws://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as caught:
        generate(engine_settings(url, auto_launch=False))
    message = str(caught.value)
    assert message.startswith("H3Forge: ") and url in message and "auto_launch" in message
    assert launcher.launched(url) is None


def test_auto_launch_only_starts_local_engines():
    with pytest.raises(RuntimeError, match="only starts engines on this machine"):
        generate(engine_settings("ws://192.0.2.1:8190", auto_launch=True))


def test_defaults_without_engine_node(monkeypatch):
    for name in ("H3FORGE_URL", "H3FORGE_TOKEN", "H3FORGE_AUTO_LAUNCH", "H3FORGE_MODELS"):
        monkeypatch.delenv(name, raising=False)
    assert default_settings() == engine_settings("ws://127.0.0.1:8190", auto_launch=True) | {"device": "auto",
                                                                                              "preset": "toy"}
    monkeypatch.setenv("H3FORGE_URL", "ws://gpu-host:9000")
    monkeypatch.setenv("H3FORGE_TOKEN", "secret")
    monkeypatch.setenv("H3FORGE_AUTO_LAUNCH", "0")
    monkeypatch.setenv("H3FORGE_MODELS", "/models/h3")
    assert default_settings() == {"url": "ws://gpu-host:9000", "token": "secret", "auto_launch": False,
                                 "preset": "toy", "models_dir": "/models/h3", "device": "auto", "gpus": 1,
                                 "attention": "auto", "sparse_attention": "engine default"}


def test_engine_node_speed_options_reach_the_h3_jobs(settings, t2va):
    assert speed_params(settings) == {} and speed_params(None) == {}  # the engine's own settings
    assert speed_params({**settings, "sparse_attention": "off (dense)"}) == {"vsa_sparsity": 0.0}
    sparse = engine_settings(settings["url"], settings["token"], attention="sdpa", sparse_attention="87.5%")
    assert speed_params(sparse) == {"attention": "sdpa", "vsa_sparsity": 0.875}
    frames = generate(sparse)[1]
    assert frames.shape == t2va[0][1].shape and not torch.equal(frames, t2va[0][1])


def test_validate_inputs_without_engine():
    validate = H3ForgeTextToVideo.VALIDATE_INPUTS
    assert validate() is True
    assert validate(width=512, height=288, steps=5, lora_list="turbo.safetensors:1.0") is True
    assert "both width and height" in validate(width=512)
    assert "multiple of 32" in validate(width=500, height=288)
    assert "steps" in validate(steps=1)
    assert "LoRA line 2" in validate(lora_list="a.safetensors:0.5\nb.safetensors:strong")


def test_lora_list_parsing():
    text = "# speed\nturbo.safetensors:1.0\n\nloras/style.safetensors : 0.6\nplain.safetensors\n"
    assert parse_lora_list(text) == [["turbo.safetensors", 1.0], ["loras/style.safetensors", 0.6],
                                     ["plain.safetensors", 1.0]]


def references_node(**inputs):
    from h3forge_pack.nodes.references import H3ForgeReferences

    inputs = {"image_size": "diffusers", "max_megapixels": 8.0, "keep_video_sound": True, **inputs}
    return asyncio.run(H3ForgeReferences().collect(**inputs))[0]


def test_references_run_ref2va(settings):
    """Two images, then a video with its sound and a sound, chained over two References nodes, through Text to
    Video to a ref2va job on the real engine."""
    images = torch.rand(2, 96, 80, 3)
    sound = {"waveform": torch.rand(1, 2, 48000) * 0.2 - 0.1, "sample_rate": 48000}
    clip = comfy.VideoFromComponents(comfy.VideoComponents(images=torch.rand(30, 64, 96, 3), audio=sound,
                                                           frame_rate=Fraction(30)))
    first = references_node(images=images)
    chain = references_node(references=first, video=clip, audio=sound, image_size="match")
    assert [item["kind"] for item in chain["items"]] == ["image", "image", "video", "audio"]
    assert chain["image_size"] == "match" and chain["items"][2]["fps"] == 30.0
    video, frames, audio, job = generate(settings, references=chain)
    assert frames.shape[0] == 124 and audio["waveform"].shape[1] == 2 and len(job) == 32
    assert any("encoding" in text and "(references)" in text for _, text in comfy.progress_texts)


def test_references_name_the_limit():
    with pytest.raises(ValueError, match="10 reference images given; MiniMax-H3 takes at most 9"):
        references_node(images=torch.rand(10, 32, 32, 3))
    with pytest.raises(ValueError, match="cannot take sound alone"):
        references_node(audio={"waveform": torch.zeros(1, 1, 100), "sample_rate": 16000})


def test_references_and_keyframes_together_are_refused(settings):
    refs = references_node(images=torch.rand(1, 64, 64, 3))
    with pytest.raises(ValueError, match="references or first_frame / last_frame, not both"):
        generate(settings, references=refs, first_frame=torch.rand(1, 64, 64, 3))


def test_references_shrink_images_past_the_pixel_budget():
    refs = references_node(images=torch.rand(2, 1500, 2000, 3), max_megapixels=0.75)
    assert [item["image"].shape for item in refs["items"]] == [(750, 1000, 3)] * 2
    kept = references_node(images=torch.rand(1, 150, 200, 3), max_megapixels=0.0)
    assert kept["items"][0]["image"].shape == (150, 200, 3)
