"""Packed layout, frame/canvas rules and schedules against diffusers' MiniMax-H3 builders and scheduler."""

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3 import before_denoise as ref_bd
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as ref_mp
from diffusers.modular_pipelines.minimax_h3 import references as ref_refs

from engine.models.h3 import layout as L
from engine.models.h3.config import AUDIO_TAG, TEXT_TAG, VIDEO_TAG
from engine.models.h3.schedule import AUDIO_SHIFT, VIDEO_SHIFT, euler_step, sigmas

REF_LAYOUT = ref_bd.MiniMaxH3PrepareLayoutStep.build_packed_sequence
REF_TIMESTEPS = ref_bd.MiniMaxH3SetTimestepsStep.build_row_timesteps


@pytest.mark.parametrize("aspect", [(16, 9), (9, 16), (1, 1)], ids=["16:9", "9:16", "1:1"])
@pytest.mark.parametrize("frames", [5, 22, 124])
@pytest.mark.parametrize("keyframes", [(), ("first",), ("last",), ("first", "last")])
def test_layout_equals_diffusers(aspect, frames, keyframes):
    height, width = L.canvas_for_aspect(*aspect)
    assert (height, width) == ref_mp.resolve_canvas_size(*aspect, 32, 768, 768 * 1344)
    T, h, w, Ta = L.latent_frames(frames), height // 16, width // 16, L.audio_latents(frames)
    assert T == ref_mp.video_latent_num_frames(frames, 17, 5)
    assert Ta == ref_mp.audio_latent_num_frames(frames)
    tags = torch.full((11,), TEXT_TAG)
    tags[3:8] = VIDEO_TAG
    ours = L.build_layout(tags, T, h, w, Ta, (2, 2), keyframes)
    assert_equals_diffusers(ours, REF_LAYOUT(tags, T, h, w, Ta, (1, 2, 2), 2, 2, 0, keyframes))


def assert_equals_diffusers(ours: L.PackedLayout, reference: tuple) -> None:
    """Our layout and row timesteps against diffusers' builders' outputs, bit for bit."""
    pos, token_tags, vid, aud, txt, ncv, nca = reference
    assert ours.position_ids.dtype == torch.float64
    assert torch.equal(ours.position_ids, pos)
    assert torch.equal(ours.token_tags, token_tags)
    assert torch.equal(ours.video_indices, vid) and torch.equal(ours.audio_indices, aud)
    assert torch.equal(ours.text_indices, txt)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ncv, nca)
    for t_v, t_a in [(0.0, 0.0), (0.4, 0.7), (0.9995, 0.99999)]:
        ts, idx = L.row_timesteps(ours, t_v, t_a)
        rts, ridx = REF_TIMESTEPS(vid, aud, ncv, nca, txt.numel(), t_v, t_a, max(t_v, 0.999), 1.0)
        assert torch.equal(ts, rts) and torch.equal(idx, ridx)


def test_frame_rules():
    assert [L.align_num_frames(n) for n in (1, 5, 6, 22, 23, 120, 124, 125, 362)] == \
        [ref_mp.align_num_frames(n, 17, 5) for n in (1, 5, 6, 22, 23, 120, 124, 125, 362)]
    assert L.frames_for_seconds(5.0)[0] == 124 and L.frames_for_seconds(15.0)[0] == 362
    frames, note = L.frames_for_seconds(5.2)
    assert frames == 141 and "snapped to 141 frames" in note
    with pytest.raises(L.LayoutError, match="5 to 15 s per window"):
        L.frames_for_seconds(30)
    with pytest.raises(L.LayoutError, match="positive"):
        L.frames_for_seconds(float("nan"))
    with pytest.raises(L.LayoutError, match="17n"):
        L.latent_frames(100)


def test_canvas_rules():
    assert L.check_canvas(768, 1344)[:2] == (768, 1344)
    h, w, note = L.check_canvas(770, 1350)
    assert (h, w) == (768, 1344) and "snapped to 1344x768" in note
    with pytest.raises(L.LayoutError, match="1:4 to 4:1"):
        L.check_canvas(64, 1024)
    with pytest.raises(L.LayoutError, match="canvas budget"):
        L.check_canvas(1080, 1920)
    with pytest.raises(L.LayoutError, match="1:4 to 4:1"):
        L.canvas_for_aspect(5, 1)


@pytest.mark.parametrize("steps", [2, 5, 9, 50])
def test_schedule_equals_diffusers(steps):
    for shift in (VIDEO_SHIFT, AUDIO_SHIFT):
        ref = MiniMaxH3Scheduler(shift=shift)
        ref.set_timesteps(steps)
        assert torch.equal(sigmas(steps, shift), ref.sigmas)
    # Euler steps, bit for bit, over a whole trajectory with a fixed velocity field.
    ref = MiniMaxH3Scheduler(shift=VIDEO_SHIFT)
    ref.set_timesteps(steps)
    sig = sigmas(steps, VIDEO_SHIFT)
    x = x_ref = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(3, 5, generator=torch.Generator().manual_seed(i + 1))
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        x = euler_step(x, v, float(t), float(sig[i]), float(sig[i + 1]))
        assert torch.equal(x, x_ref)


def test_patchify_round_trip():
    x = torch.randn(1, 24, 7, 6, 10)
    rows = L.patchify(x)
    assert torch.equal(rows[0], ref_bd.patchify_video_latents(x, (1, 2, 2)))
    assert torch.equal(L.unpatchify(rows, 7, 6, 10), x)
    a = torch.randn(1, 2, 32, 9)
    assert torch.equal(L.unpack_audio(L.pack_audio(a)), a)
    assert torch.equal(L.pack_audio(a)[0, :9], a[0, 0].T)


REF2VA_LAYOUT = ref_bd.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence
CANVAS = {a: L.canvas_for_aspect(*a) for a in [(16, 9), (9, 16), (1, 1), (4, 3), (21, 9)]}


def _image(aspect):
    h, w = CANVAS[aspect]
    return L.ReferenceBlock("image", 1, h // 16, w // 16)


def _video(aspect, frames=22, sound=0):
    h, w = CANVAS[aspect]
    return L.ReferenceBlock("video", frames, h // 16, w // 16, sound)


REF_MIXES = {
    "images": [_image((4, 3)), _image((9, 16))],
    "video+sound": [_video((16, 9), 22, 205)],
    "silent-video": [_video((4, 3), 22)],
    "audio+image": [L.ReferenceBlock("audio", audio_latents=90), _image((1, 1))],
    "9-images": [_image(a) for a in [(16, 9), (9, 16), (1, 1), (4, 3), (21, 9)] * 2][:9],
    "mixed": [_image((21, 9)), _video((9, 16), 22, 50), L.ReferenceBlock("audio", audio_latents=37),
              _image((1, 1)), _video((16, 9), 7)],
}


def _diffusers_refs(blocks):
    refs, video, audio = [], [], []
    for b in blocks:
        if b.kind == "image":
            refs.append(ref_refs.MiniMaxH3ImageReference(image=None))
        elif b.kind == "video":
            sound = torch.zeros(2, 1) if b.audio_latents else None
            refs.append(ref_refs.MiniMaxH3VideoReference(frames=None, audio=sound))
        else:
            refs.append(ref_refs.MiniMaxH3AudioReference(audio=torch.zeros(2, 1)))
        if b.kind != "audio":
            video.append(torch.zeros(1, 24, b.latent_frames, b.latent_height, b.latent_width))
        if b.audio_latents:
            audio.append(torch.zeros(2 * b.audio_latents, 32))
    return refs, video, audio


@pytest.mark.parametrize("aspect", [(16, 9), (9, 16), (1, 1)], ids=["16:9", "9:16", "1:1"])
@pytest.mark.parametrize("mix", list(REF_MIXES))
def test_ref2va_layout_equals_diffusers(aspect, mix):
    height, width = L.canvas_for_aspect(*aspect)
    T, h, w, Ta = L.latent_frames(124), height // 16, width // 16, L.audio_latents(124)
    tags = torch.full((13,), TEXT_TAG)
    tags[2:9] = VIDEO_TAG
    blocks = REF_MIXES[mix]
    ours = L.build_ref2va_layout(tags, blocks, T, h, w, Ta)
    assert_equals_diffusers(ours, REF2VA_LAYOUT(tags, *_diffusers_refs(blocks), T, h, w, Ta, (1, 2, 2), 2, AUDIO_TAG,
                                                VIDEO_TAG))


def test_ref2va_mixes_exercise_the_sequential_span():
    # 22 latent frames: diffusers' builtin-sum span is an ulp off numpy's pairwise sum, so the mixes above pin it.
    spans = np.array([L.FRAME_RESCALE * L.FRAMES_PER_LATENT[i % 5] for i in range(22)])
    assert _video((4, 3), 22).clock_advance() != float(spans.sum())


def test_ref2va_text_vision_tags_kept():
    tags = torch.tensor([TEXT_TAG, VIDEO_TAG, VIDEO_TAG, TEXT_TAG])
    assert torch.equal(L.build_ref2va_layout(tags, [_image((1, 1))], 2, 4, 4, 3).token_tags[:4], tags)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="music", audio_latents=4), "'image', 'video' or 'audio'"),
    (dict(kind="image", latent_frames=2, latent_height=4, latent_width=4), "one latent frame"),
    (dict(kind="image", latent_frames=1, latent_height=4, latent_width=4, audio_latents=3), "one latent frame"),
    (dict(kind="image", latent_frames=1), "positive latent grid"),
    (dict(kind="video", latent_frames=10, latent_height=4, latent_width=4), "5n \\+ 2"),
    (dict(kind="video", latent_frames=0, latent_height=4, latent_width=4), "5n \\+ 2"),
    (dict(kind="audio"), "needs audio latents"),
    (dict(kind="audio", latent_frames=1, audio_latents=5), "no video frames"),
])
def test_ref2va_block_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.ReferenceBlock(**kwargs)
