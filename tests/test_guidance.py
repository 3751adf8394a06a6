"""Classifier-free guidance for the embedded default (engine/models/h3/denoise.py `guided`): v_u + w (v_c - v_u) of the
prompt and the zeroed prompt; a DiT file names the scale text-to-video and edits sample with; caption dropout hides
the prompt; guidance distillation teaches a student, in one forward, what the teacher gives in two."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kernels import attention
from engine.models.h3.checkpoint import save_dit
from engine.models.h3.denoise import guided
from engine.models.h3.pipeline import TOY_FILES, Canvas, GenerateRequest, H3Pipeline
from engine.models.h3.request import EditRequest, ExtendRequest, Source
from training.train import dit_loss, prepare, toy_clips


@pytest.fixture(scope="module")
def tiny():
    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    return pipe, prepare(pipe, toy_clips(range(2), 96, 64, 0.9, 1))


def dit_inputs(pipe, seed=0):
    """A random packed input of the tiny DiT: (video, audio, text, *layout) as `denoise` passes them."""
    from engine.models.h3 import layout as L

    g = torch.Generator().manual_seed(seed)
    c = pipe.dit.config
    T, h, w, Ta = 2, 4, 6, 8
    tags = torch.zeros(5, dtype=torch.long)
    layout = L.build_layout(tags, T, h, w, Ta, c.patch_size[1:])
    timestep, idx = L.row_timesteps(layout, 0.6, 0.7, t_text=0.6)
    video = torch.randn(1, T * (h // c.patch_size[1]) * (w // c.patch_size[2]), c.in_channels * 4, generator=g)
    audio = torch.randn(1, L.AUDIO_CHANNELS * Ta, c.audio_in_channels, generator=g)
    text = torch.randn(1, tags.numel(), c.text_dim, generator=g)
    return video, audio, text, timestep, idx, layout.token_tags, layout.position_ids, layout.video_indices, \
        layout.audio_indices, layout.text_indices


def test_guided_output_is_the_prompt_branch_pushed_from_the_unconditional_one(tiny):
    pipe, _ = tiny
    video, audio, text, *layout = dit_inputs(pipe)
    with torch.no_grad():
        v_c, a_c = pipe.dit(video, audio, text, *layout)
        v_u, a_u = pipe.dit(video, audio, torch.zeros_like(text), *layout)
        v1, a1 = guided(pipe.dit, 1.0, video, audio, text, *layout)
        v3, a3 = guided(pipe.dit, 3.0, video, audio, text, *layout)
    assert torch.allclose(v1, v_c, atol=1e-5) and torch.allclose(a1, a_c, atol=1e-5)
    assert torch.allclose(v3, v_u + 3 * (v_c - v_u), atol=1e-4)
    assert torch.allclose(a3, a_u + 3 * (a_c - a_u), atol=1e-4)
    assert (v3 - v_c).abs().max() > 1e-3  # the prompt moves the tiny DiT, so guidance does too


def test_the_dit_file_names_the_guidance_text_to_video_samples_with(tmp_path):
    """`save_dit(guidance=...)` writes the scale in the header, `from_files` reads it (the released files name none:
    1, one forward a step) and `describe` reports it; a t2va job, a masked edit and an extension then differ from the
    plain DiT's (only inside the edit's mask, only after the extended source), a first-frame job (its picture rows
    hold it) does not."""
    toy = Path(__file__).resolve().parents[1] / "engine" / "weights" / "toy"
    files = {k: toy / TOY_FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")}
    attention.set_backend("sdpa")
    plain = H3Pipeline.from_files(*files.values(), device="cpu", dtype=torch.float32)
    save_dit(plain.dit, tmp_path / "dit.safetensors", guidance=4.0)
    save_dit(plain.dit, tmp_path / "distilled.safetensors")
    steered = H3Pipeline.from_files(tmp_path / "dit.safetensors", *list(files.values())[1:], device="cpu",
                                    dtype=torch.float32)
    assert steered.guidance == 4.0 and steered.describe()["guidance"] == 4.0
    assert H3Pipeline.from_files(tmp_path / "distilled.safetensors", *list(files.values())[1:], device="cpu",
                                 dtype=torch.float32).guidance == 1.0
    small = Canvas(short_edge=32, max_pixels=64 * 32, default_steps=3)  # so it runs in seconds
    req = GenerateRequest(prompt="a large red ball stays still on a black background", seed=3, steps=3)
    first = GenerateRequest(prompt=req.prompt, seed=3, steps=3,
                            first_frame=np.full((32, 64, 3), 40, np.uint8))
    plain.guidance = 1.0
    out = {}
    for name, pipe in (("plain", plain), ("steered", steered)):
        pipe.canvas = small
        out[name] = [pipe.generate(r).frames for r in (req, first)]
    assert not torch.equal(out["steered"][0], out["plain"][0])
    assert torch.equal(out["steered"][1], out["plain"][1])
    source = out["plain"][0]
    mask = torch.zeros(source.shape[:3])
    mask[:, :, 32:] = 1  # the right half, two latent cells wide
    edit = EditRequest(Source(source, 24.0), mask, prompt="a large blue box stays still on a black background",
                       seed=3, steps=3)
    edited = {name: pipe.edit(edit).frames for name, pipe in (("plain", plain), ("steered", steered))}
    assert not torch.equal(edited["steered"][..., 32:, :], edited["plain"][..., 32:, :])
    assert torch.equal(edited["steered"][..., :32, :], edited["plain"][..., :32, :])
    extend = ExtendRequest(Source(source, 24.0), seconds=1.0, prompts=[req.prompt], window_seconds=5.0, seed=3,
                           steps=3)
    extended = {name: pipe.extend(extend).frames for name, pipe in (("plain", plain), ("steered", steered))}
    kept = len(source)  # 17n + 5 frames: all of them come back as they were
    assert len(extended["steered"]) > kept and torch.equal(extended["steered"][:kept], source)
    assert not torch.equal(extended["steered"][kept:], extended["plain"][kept:])


def test_caption_dropout_hides_the_prompt(tiny):
    """With every caption dropped the loss no longer depends on the prompt; with none dropped it does."""
    pipe, data = tiny
    other = [{**data[0], "text": {k: v + 1 for k, v in data[0]["text"].items()}}]

    def loss(batch, drop):
        with torch.no_grad():
            return dit_loss(pipe.dit, batch, "t2va", np.random.default_rng(0), torch.Generator().manual_seed(0),
                            caption_drop=drop).item()

    assert loss([data[0]], 1.0) == loss(other, 1.0)
    assert loss([data[0]], 0.0) != loss(other, 0.0)


def test_guidance_distillation_moves_the_student_to_the_guided_teacher(tiny):
    """Student = teacher at the start: the distillation loss (w-1)^2 |v_c - v_u|^2 vanishes as the scale nears 1 and
    is > 0 at w = 20 (a large scale: the random tiny DiT hardly reads its prompt); training on it lowers it. At
    exactly 1 nothing is distilled: the loss is the flow's (what --dit-data-tasks gives a layout learning the data)."""
    pipe, data = tiny
    teacher = copy.deepcopy(pipe.dit).eval().requires_grad_(False)
    student = copy.deepcopy(pipe.dit).train().requires_grad_(True)

    def loss(scale, seed=0, teacher=teacher):
        return dit_loss(student, [data[0]] * 2, "t2va", np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                        teacher=teacher, guidance=scale)

    with torch.no_grad():
        start = loss(20.0).item()
        assert loss(1.001).item() < 1e-6 * start
        assert loss(1.0).item() == loss(1.0, teacher=None).item() > 1e-2
    assert start > 1e-4
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    for _ in range(15):
        opt.zero_grad()
        loss(20.0).backward()
        opt.step()
    with torch.no_grad():
        assert loss(20.0).item() < 0.5 * start


def test_distillation_keeps_the_flow_loss_on_the_conditioned_layouts(tiny):
    """Only the t2va layout is distilled: a keyframe layout's loss with a teacher is the plain flow loss."""
    pipe, data = tiny
    teacher = copy.deepcopy(pipe.dit).eval().requires_grad_(False)

    def loss(task, **distil):
        with torch.no_grad():
            return dit_loss(pipe.dit, [data[0]] * 2, task, np.random.default_rng(0), torch.Generator().manual_seed(0),
                            **distil).item()

    assert loss("first", teacher=teacher, guidance=20.0) == loss("first")
    assert loss("t2va", teacher=teacher, guidance=20.0) != loss("t2va")
