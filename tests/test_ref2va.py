"""Ref2VA on the engine side: reference normalisation against diffusers' setup step, the limits an artist meets,
the task on a tiny pipeline (deterministic, order-sensitive, frozen references), the partition swap and the
queue's bounded reordering."""

from collections import deque

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from PIL import Image

from engine.models.h3 import layout as L
from engine.models.h3 import references as R
from engine.models.h3.pipeline import GenerateRequest, H3Pipeline
from engine.runtime.jobs import JobSpec
from engine.server.scheduler import MAX_OVERTAKEN, Job, next_job, run_order

STEPS = 3


def picture(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def clip(frames, h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (frames, h, w, 3), dtype=np.uint8)


def hum(seconds, rate=32000, pitch=330.0):
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([np.sin(2 * np.pi * pitch * t)] * 2).astype(np.float32) * 0.3


@pytest.mark.parametrize("fps,frames,size", [(24.0, 30, (96, 160)), (30.0, 20, (360, 640)),
                                             (12.0, 10, (300, 200)), (25.0, 140, (768, 1344))])
def test_video_normalisation_equals_diffusers(fps, frames, size):
    video = clip(frames, *size)
    num_frames = 124
    ours = R.normalise_video(video, fps, 1, num_frames, L.SHORT_EDGE, L.MAX_PIXELS)
    ref = MiniMaxH3Ref2VASetupStep._normalize_video_condition(video, fps, num_frames, 32, L.SHORT_EDGE,
                                                               L.MAX_PIXELS, 24.0)
    assert ours.shape == ref.shape and np.array_equal(ours, ref)


@pytest.mark.parametrize("size", [(300, 200), (1080, 1920), (2048, 2048), (4000, 1000)])
def test_image_normalisation_equals_diffusers(size):
    """The "diffusers" mode is the released recipe: short edge 2048, sides rounded to 32, LANCZOS."""
    image = picture(*size)
    ours = R.normalise_image(image, 1, "diffusers", 1344 * 768, R.REFERENCE_SHORT_EDGE)
    h, w = size
    scale = R.REFERENCE_SHORT_EDGE / min(h, w)
    th, tw = max(32, round(h * scale / 32) * 32), max(32, round(w * scale / 32) * 32)
    pil = VaeImageProcessor(vae_scale_factor=16).numpy_to_pil(image.astype(np.float32) / 255.0)[0]
    if pil.size != (tw, th):
        pil = VaeImageProcessor(vae_scale_factor=16).resize(pil, height=th, width=tw)
    assert np.array_equal(ours, np.asarray(pil))


def test_resize_modes():
    target = 1344 * 768
    assert R.reference_size(768, 1024, "diffusers", target) == (2048, 2720)  # upscaled, no area cap
    assert R.reference_size(3000, 4000, "match", target) == (864, 1184)  # the target's area (1.02 M px)
    assert R.reference_size(480, 640, "match", target) == (480, 640)  # never upscaled
    assert R.reference_size(480, 640, "max", target) == (480, 640)
    assert R.reference_size(3000, 4000, "max", target) == (2048, 2720)  # downscaled past 2048 only
    with pytest.raises(L.LayoutError, match="diffusers, match, max"):
        R.reference_size(480, 640, "large", target)


@pytest.mark.parametrize("refs,message", [
    ([R.ImageReference(picture(64, 64))] * 10, "10 reference images given; MiniMax-H3 takes at most 9"),
    ([R.VideoReference(clip(30, 64, 64))] * 4, "4 reference videos given; MiniMax-H3 takes at most 3"),
    ([R.ImageReference(picture(64, 64))] + [R.AudioReference(hum(1))] * 4, "4 reference sounds given"),
    ([R.ImageReference(picture(64, 64))] * 9 + [R.VideoReference(clip(30, 64, 64))] * 3
     + [R.AudioReference(hum(1))], "13 references given; MiniMax-H3 takes at most 12 in all"),
    ([R.AudioReference(hum(1))], "cannot take sound alone"),
    ([], "needs at least one reference"),
])
def test_reference_limits_name_the_limit(refs, message):
    with pytest.raises(L.LayoutError, match=message):
        R.check_references(refs)


@pytest.mark.parametrize("ref,message", [
    (R.VideoReference(clip(4, 64, 64)), r"4 frames at 24 fps; a reference video needs at least 13 \(0.54 s\)"),
    (R.VideoReference(clip(6, 64, 64), fps=12.0), "12 frames at 24 fps"),  # 0.5 s at 12 fps
    (R.ImageReference(picture(64, 400)), "1:4 to 4:1"),
    (R.ImageReference(np.zeros((64, 64, 3), np.float32)), r"must be an RGB image \(uint8"),
    (R.AudioReference(np.zeros((3, 100), np.float32)), "mono or stereo"),
    (R.VideoReference(clip(30, 64, 64), fps=0.0), "positive frame rate"),
])
def test_bad_references_get_a_clear_error(ref, message):
    refs = [ref] if ref.kind != "audio" else [R.ImageReference(picture(64, 64)), ref]
    with pytest.raises(L.LayoutError, match=message):
        R.normalise(refs, 124, "diffusers", 224 * 128, 128, 224 * 128, 256)


@pytest.fixture(scope="module")
def pipe():
    p = H3Pipeline.from_preset("tiny")
    p.encode_mp4 = False
    return p


def mixed_references():
    return [R.ImageReference(picture(100, 80, 1)), R.VideoReference(clip(40, 96, 160, 2), 30.0, hum(1.4), 32000),
            R.AudioReference(hum(2.0, 16000, 440.0), 16000), R.ImageReference(picture(64, 128, 3))]


def ref2va(pipe, references, seed=0, **kw):
    return pipe.generate(GenerateRequest("a red ball bounces, humming", steps=STEPS, seed=seed, references=references,
                                         **kw))


def test_ref2va_runs_deterministically_and_reads_the_order(pipe):
    first = ref2va(pipe, mixed_references())
    assert pipe.partitions.active == "ref2va"
    again = ref2va(pipe, mixed_references())
    assert first.frames.shape == (124, 128, 224, 3) and first.audio.shape == (2, round(124 / 24 * 32000))
    assert torch.equal(first.frames, again.frames) and torch.equal(first.audio, again.audio)
    refs = mixed_references()
    swapped = ref2va(pipe, [refs[3], refs[1], refs[2], refs[0]])
    assert not torch.equal(first.video_latents, swapped.video_latents)
    assert not torch.equal(ref2va(pipe, mixed_references(), seed=1).video_latents, first.video_latents)


def test_ref2va_result_depends_on_the_references(pipe):
    base = ref2va(pipe, [R.ImageReference(picture(100, 80, 1))])
    other = ref2va(pipe, [R.ImageReference(picture(100, 80, 2))])
    assert not torch.equal(base.video_latents, other.video_latents)


def test_partition_swap_gives_what_fresh_engines_give(pipe):
    """fl2va -> ref2va -> fl2va on one engine equals each job on a fresh engine."""
    t2va = GenerateRequest("waves on a beach at dusk", steps=STEPS, seed=4)
    refs = [R.ImageReference(picture(100, 80, 1)), R.AudioReference(hum(1.0))]
    fresh = H3Pipeline.from_preset("tiny")
    fresh.encode_mp4 = False
    expect_t2va = fresh.generate(t2va).video_latents
    fresh_ref = H3Pipeline.from_preset("tiny")
    fresh_ref.encode_mp4 = False
    expect_ref = ref2va(fresh_ref, refs).video_latents
    assert torch.equal(pipe.generate(t2va).video_latents, expect_t2va)
    assert torch.equal(ref2va(pipe, refs).video_latents, expect_ref)
    assert torch.equal(pipe.generate(t2va).video_latents, expect_t2va)
    status = pipe.partitions.describe()
    assert status["active"] == "fl2va" and status["idle"] == {"ref2va": "device"} and status["swaps"] >= 2
    assert status["last_swap"]["to"] == "fl2va" and status["last_swap"]["seconds"] >= 0


def test_a_partition_dropped_for_want_of_host_memory_is_read_again(monkeypatch):
    from engine.models.h3 import partitions as P

    reads = []

    def read():
        reads.append(1)
        return torch.nn.Linear(2, 2)

    parts = P.Partitions("fl2va", "cpu", {"fl2va": read, "ref2va": read})
    monkeypatch.setattr(P, "host_available_bytes", lambda: 0)
    monkeypatch.setattr(parts, "_fits", lambda size: False)  # as on a GPU with room for one DiT
    first = torch.nn.Linear(2, 2)
    ref = parts.activate("ref2va", first)
    assert first.weight.device.type == "meta" and parts.describe()["idle"] == {"fl2va": "disk"}
    back = parts.activate("fl2va", ref)
    assert len(reads) == 2 and back.weight.device.type == "cpu" and parts.swaps[-1]["source"] == "disk"


def test_lora_of_the_other_partition_is_refused(pipe, tmp_path):
    lora = tmp_path / "minimax_h3_fl2va_turbo_lora.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(L.LayoutError, match="is for the FL2VA DiT"):
        ref2va(pipe, [R.ImageReference(picture(64, 64))], loras=[(str(lora), 1.0)])


def test_references_past_the_memory_plan_are_refused_before_encoding(pipe):
    videos = [R.VideoReference(clip(362, 128, 224, i), audio=hum(15.0)) for i in range(3)]
    with pytest.raises(L.LayoutError, match=r"more than the \d+ this engine's memory plan allows"):
        ref2va(pipe, videos, seconds=15.0)


def test_keyframes_and_references_together_are_refused(pipe):
    with pytest.raises(L.LayoutError, match="keyframes .* or references, not both"):
        ref2va(pipe, [R.ImageReference(picture(64, 64))], first_frame=picture(128, 224))


def swaps(tasks) -> int:
    """DiT partition swaps running `tasks` in this order from the FL2VA one (upscale needs neither)."""
    active, count = "fl2va", 0
    for task in tasks:
        wanted = {"ref2va": "ref2va", "upscale": active}.get(task, "fl2va")
        count, active = count + (wanted != active), wanted
    return count


def test_queue_groups_by_partition_and_bounds_overtaking():
    tasks = [str(t) for t in np.random.default_rng(0).choice(["t2va", "ref2va", "edit", "ref2va", "upscale"], 20)]
    queue = deque(Job(JobSpec(job=f"{i:032x}", task=t, params={})) for i, t in enumerate(tasks))
    index = {job.id: i for i, job in enumerate(queue)}
    planned = [index[job.id] for job in run_order(queue, "fl2va")]  # what waiting clients are told
    order, active = [], "fl2va"
    while queue:
        job = next_job(queue, active)
        active = {"ref2va": "ref2va", "upscale": active}.get(job.spec.task, "fl2va")
        order.append(index[job.id])
    assert sorted(order) == list(range(20)) and order == planned
    for position, i in enumerate(order):  # later jobs that ran before job i
        assert sum(j > i for j in order[:position]) <= MAX_OVERTAKEN
    assert swaps(tasks[i] for i in order) < swaps(tasks)


def test_generate_cli_takes_ordered_references(tmp_path):
    """`python -m engine generate --ref-image ... --ref-video ... --ref-audio ...` on the tiny preset; an unreadable
    reference file is a clear error, not a trace."""
    import subprocess
    import sys
    import wave

    import av

    from engine.io.video import encode_mp4_bytes

    Image.fromarray(picture(96, 80, 1)).save(tmp_path / "who.png")
    (tmp_path / "motion.mp4").write_bytes(encode_mp4_bytes(clip(30, 64, 96, 2), 30, hum(1.0), 32000))
    with wave.open(str(tmp_path / "voice.wav"), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes((hum(1.0, 16000)[0] * 32767).astype("<i2").tobytes())
    out = tmp_path / "out.mp4"
    base = [sys.executable, "-m", "engine", "generate", "--preset", "tiny", "--prompt", "a ball, humming",
            "--steps", "3", "--out", str(out)]
    refs = ["--ref-image", str(tmp_path / "who.png"), "--ref-video", str(tmp_path / "motion.mp4"),
            "--ref-audio", str(tmp_path / "voice.wav"), "--ref-size", "match"]
    proc = subprocess.run(base + refs, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with av.open(str(out)) as container:
        assert sorted(s.type for s in container.streams) == ["audio", "video"]
    (tmp_path / "broken.png").write_bytes(b"not an image")
    proc = subprocess.run(base + ["--ref-image", str(tmp_path / "broken.png")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "reference image" in proc.stderr and "could not be read" in proc.stderr
    assert "Traceback" not in proc.stderr
