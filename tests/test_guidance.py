"""Guidance for the embedded default (training/guidance.py): the guided teacher is v_u + w (v_c - v_u) of the
prompt and the zeroed prompt; caption dropout hides the prompt; guidance distillation teaches the student, in one
forward, what the teacher gives in two."""

import copy

import numpy as np
import pytest
import torch

from engine.kernels import attention
from engine.models.h3.pipeline import Canvas, GenerateRequest, H3Pipeline
from training.guidance import GuidedDiT, guided
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


def test_a_pipeline_samples_with_the_guided_dit(tiny):
    """GuidedDiT drops in for the pipeline's DiT: a t2va job runs, and differs from the plain DiT's."""
    pipe, _ = tiny
    req = GenerateRequest(prompt="a large red ball stays still on a black background", seed=3, steps=3)
    dit, canvas = pipe.dit, pipe.canvas
    pipe.canvas = Canvas(short_edge=32, max_pixels=32 * 32, default_steps=3)  # small, so it runs in seconds
    try:
        plain = pipe.generate(req).frames
        pipe.dit = GuidedDiT(dit, 4.0)
        steered = pipe.generate(req).frames
    finally:
        pipe.dit, pipe.canvas = dit, canvas
    assert steered.shape == plain.shape and not torch.equal(steered, plain)


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
    """Student = teacher at the start: the distillation loss is zero at scale 1 and (w-1)^2 |v_c - v_u|^2 > 0 at
    w = 20 (a large scale: the random tiny DiT hardly reads its prompt); training on it lowers it."""
    pipe, data = tiny
    teacher = copy.deepcopy(pipe.dit).eval().requires_grad_(False)
    student = copy.deepcopy(pipe.dit).train().requires_grad_(True)

    def loss(scale, seed=0):
        return dit_loss(student, [data[0]] * 2, "t2va", np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                        teacher=teacher, guidance=scale)

    with torch.no_grad():
        assert loss(1.0).item() < 1e-9
        start = loss(20.0).item()
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
