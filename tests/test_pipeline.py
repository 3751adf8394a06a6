"""The H3 pipeline end to end on the embedded `tiny` preset: t2va, fl2va, determinism, LoRA, bad input, CLI."""

import subprocess
import sys

import av
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.io.video import read_video
from engine.models.h3.layout import LayoutError
from engine.models.h3.pipeline import GenerateRequest, H3Pipeline, StepEvent

STEPS = 4  # grid points: 3 DiT evaluations


@pytest.fixture(scope="module")
def pipe():
    return H3Pipeline.from_preset("tiny")


def test_t2va_shapes_progress_and_determinism(pipe):
    events = []
    req = GenerateRequest(prompt="a cat playing piano in the rain", seconds=5, steps=STEPS, seed=3)
    result = pipe.generate(req, on_step=events.append)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [1, 2, 3] and all(e.total == 3 for e in steps)
    assert result.frames.shape == (124, 128, 224, 3) and result.frames.dtype == torch.uint8
    assert result.audio.shape == (2, round(124 / 24 * 32000)) and result.audio.dtype == torch.float32
    assert result.video_latents.shape == (1, 24, 37, 8, 14)
    assert result.audio_latents.shape == (2, 32, 207)
    assert result.frames.float().std() > 0 and torch.isfinite(result.audio).all()
    frames, fps, audio, rate = read_video(result.mp4)  # encoded while the video VAE decoded
    assert frames.shape == tuple(result.frames.shape) and fps == 24 and rate == 32000
    assert abs(audio.shape[1] - result.audio.shape[1]) <= 1024  # AAC frames are 1024 samples
    assert "mp4_s" in result.timings and result.notes[-1].startswith("MP4 encoded with libx264 (veryfast, ")
    again = pipe.generate(req)
    assert torch.equal(again.video_latents, result.video_latents)
    assert torch.equal(again.audio_latents, result.audio_latents)
    other = pipe.generate(GenerateRequest(prompt=req.prompt, seconds=5, steps=STEPS, seed=4))
    assert not torch.equal(other.video_latents, result.video_latents)


def test_canvas_from_aspect_and_size(pipe):
    assert pipe.plan(GenerateRequest(prompt="x", aspect="9:16"))[1:3] == (224, 128)
    frames, h, w, steps, notes = pipe.plan(GenerateRequest(prompt="x", seconds=6.0, width=130, height=128))
    assert (frames, h, w, steps) == (158, 128, 128, 8)
    assert any("snapped to 158 frames" in n for n in notes) and any("128x128" in n for n in notes)


def test_fl2va_first_and_last_frame(pipe):
    rng = np.random.default_rng(0)
    first = rng.integers(0, 255, (90, 160, 3), dtype=np.uint8)
    last = rng.integers(0, 255, (200, 100, 3), dtype=np.uint8)
    both = pipe.generate(GenerateRequest(prompt="a door opens", steps=STEPS, first_frame=first, last_frame=last))
    plain = pipe.generate(GenerateRequest(prompt="a door opens", steps=STEPS))
    assert both.frames.shape == (124, 128, 224, 3)  # canvas from the first frame's 16:9 aspect
    assert not torch.equal(both.video_latents, plain.video_latents)
    portrait = pipe.plan(GenerateRequest(prompt="x", first_frame=last))
    assert portrait[1] > portrait[2]  # a portrait first frame picks a portrait canvas


@pytest.mark.parametrize("kwargs, message", [
    (dict(seconds=30), "5 to 15 s per window"),
    (dict(seconds=-1), "positive"),
    (dict(width=256), "both width and height"),
    (dict(aspect="5:1"), "1:4 to 4:1"),
    (dict(aspect="wide"), "16:9"),
    (dict(width=1920, height=1088), "canvas budget"),
    (dict(steps=1), "Steps must be between 2"),
    (dict(prompt="   "), "prompt is empty"),
    (dict(first_frame=np.zeros((64, 64, 3), np.float32)), "RGB image"),
    (dict(loras=[("missing.safetensors", 1.0)]), "not found"),
])
def test_bad_input_is_refused_clearly(pipe, kwargs, message):
    req = GenerateRequest(**{"prompt": "a dog", "steps": STEPS, **kwargs})
    with pytest.raises(LayoutError, match=message):
        pipe.generate(req)


def test_lora_merged_for_one_request_only(pipe, tmp_path):
    g = torch.Generator().manual_seed(0)
    hidden = pipe.dit.config.hidden_size
    lora = {f"blocks.{i}.mlp.fc2.lora_A.weight": torch.randn(4, pipe.dit.config.ffn_dim, generator=g)
            for i in range(pipe.dit.config.num_layers)}
    lora |= {f"blocks.{i}.mlp.fc2.lora_B.weight": torch.randn(hidden, 4, generator=g)
             for i in range(pipe.dit.config.num_layers)}
    path = tmp_path / "style.safetensors"
    save_file(lora, str(path))
    before = {k: v.clone() for k, v in pipe.dit.state_dict().items()}
    req = GenerateRequest(prompt="a dog", steps=STEPS)
    with_lora = pipe.generate(GenerateRequest(prompt="a dog", steps=STEPS, loras=[(str(path), 0.5)]))
    assert all(torch.equal(before[k], v) for k, v in pipe.dit.state_dict().items())
    assert not torch.equal(with_lora.video_latents, pipe.generate(req).video_latents)


def test_lora_paths_are_confined_to_the_models_dir(tmp_path):
    pipe = H3Pipeline.__new__(H3Pipeline)
    pipe.lora_roots = (tmp_path,)
    with pytest.raises(LayoutError, match="outside the models directory"):
        pipe.resolve_lora("../../etc/passwd")


def test_generate_cli_writes_playable_mp4(tmp_path):
    out = tmp_path / "out.mp4"
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--preset", "tiny", "--prompt",
                           "waves on a beach", "--seconds", "5", "--steps", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with av.open(str(out)) as container:
        video = [s for s in container.streams if s.type == "video"]
        audio = [s for s in container.streams if s.type == "audio"]
        assert len(video) == 1 and len(audio) == 1
        assert video[0].codec_context.name == "h264" and audio[0].codec_context.name == "aac"
        assert video[0].average_rate == 24
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == 124 and (frames - 5) % 17 == 0
    assert "wrote" in proc.stderr


def test_generate_cli_bad_input_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", "x", "--seconds", "40",
                           "--out", str(tmp_path / "x.mp4")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: MiniMax-H3 generates 5 to 15 s per window" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prompt_cache_skips_the_conditioner_for_repeated_prompts(pipe):
    req = GenerateRequest(prompt="a lighthouse at dusk", steps=STEPS)
    first = pipe.generate(req)
    hits = pipe.prompt_cache.hits
    conditioner, pipe.conditioner = pipe.conditioner, None  # offloaded: only cached prompts can run
    try:
        again = pipe.generate(req)
        with pytest.raises(RuntimeError, match="not cached"):
            pipe.generate(GenerateRequest(prompt="a different prompt", steps=STEPS))
    finally:
        pipe.conditioner = conditioner
    assert pipe.prompt_cache.hits == hits + 1
    assert torch.equal(first.video_latents, again.video_latents)
