"""Our DiT against diffusers' MiniMaxH3Transformer3DModel holding the same weights (fp32, rel. err <= 1e-5)."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from engine.models.h3 import checkpoint
from engine.models.h3.config import TEST_CONVERSION, TEST_DIFFUSERS, TEXT_TAG, VIDEO_TAG, TINY
from engine.models.h3.dit import build_dit
from engine.models.h3.layout import ReferenceBlock, build_layout, build_ref2va_layout, row_timesteps


def reference_model(ours):
    ref = MiniMaxH3Transformer3DModel(**ours.config.to_dict()).eval()
    missing, unexpected = ref.load_state_dict(checkpoint.to_diffusers(ours.state_dict()), strict=True)
    return ref


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# A Ref2VA layout: an image and a video (with its sound) at their own resolutions, and a standalone sound.
REF2VA = (ReferenceBlock("image", 1, 4, 8), ReferenceBlock("video", 2, 8, 6, audio_latents=5),
          ReferenceBlock("audio", audio_latents=3))


@pytest.mark.parametrize("config", [TEST_DIFFUSERS, TEST_CONVERSION, TINY], ids=["diffusers-test", "conversion", "tiny"])
@pytest.mark.parametrize("keyframes", [(), ("first",), ("first", "last"), REF2VA],
                         ids=["t2va", "fl2va-first", "fl2va-both", "ref2va"])
def test_dit_matches_diffusers(config, keyframes):
    torch.manual_seed(1)
    ours = build_dit(config, seed=3)
    # Random weights everywhere (default init leaves some zero-ish); perturb to exercise every path.
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref = reference_model(ours)
    text_tags = torch.full((7,), TEXT_TAG)
    text_tags[2:5] = VIDEO_TAG  # a vision block inside the text stream
    if keyframes is REF2VA:
        layout = build_ref2va_layout(text_tags, REF2VA, 7, 6, 10, 9)
    else:
        layout = build_layout(text_tags, num_latent_frames=7, latent_height=6, latent_width=10, num_audio_latents=9,
                              keyframes=keyframes)
    nv, na = layout.video_indices.numel(), layout.audio_indices.numel()
    video = torch.randn(1, nv, config.video_patch_dim)
    audio = torch.randn(1, na, config.audio_in_channels)
    text = torch.randn(1, layout.num_text, config.text_dim)
    for t_v, t_a in [(0.0, 0.0), (0.31, 0.62), (0.9, 0.97)]:
        timestep, idx = row_timesteps(layout, t_v, t_a)
        args = (video, audio, text, timestep, idx, layout.token_tags, layout.position_ids.float(),
                layout.video_indices, layout.audio_indices, layout.text_indices)
        with torch.no_grad():
            v_ours, a_ours = ours(*args)
            v_ref, a_ref = ref(*args, return_dict=False)
        assert rel_err(v_ours, v_ref) <= 1e-5
        assert rel_err(a_ours, a_ref) <= 1e-5


def test_per_sample_row_timesteps_equal_each_sample_alone():
    """Training's masked edits give each clip of a batch its own mask: timesteps per row and sample ([B, Nv] ->
    indices [B, S]) must give each sample the output it gets alone with its own rows."""
    torch.manual_seed(2)
    model = build_dit(TINY, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    layout = build_layout(torch.full((5,), TEXT_TAG), num_latent_frames=2, latent_height=4, latent_width=6,
                          num_audio_latents=3)
    nv, na = layout.video_indices.numel(), layout.audio_indices.numel()
    masks = (torch.rand(2, nv) < 0.5).float()
    t_video = torch.clamp(1 - masks * 0.6, max=0.999)
    video, audio = torch.randn(2, nv, TINY.video_patch_dim), torch.randn(2, na, TINY.audio_in_channels)
    text = torch.randn(2, layout.num_text, TINY.text_dim)
    rest = (layout.token_tags, layout.position_ids.float(), layout.video_indices, layout.audio_indices,
            layout.text_indices)
    timestep, idx = row_timesteps(layout, t_video, 0.4, t_text=0.4)
    assert idx.shape == (2, layout.seq_len)
    with torch.no_grad():
        together = model(video, audio, text, timestep, idx, *rest)
        for b in range(2):
            alone = model(video[b:b + 1], audio[b:b + 1], text[b:b + 1], *row_timesteps(layout, t_video[b], 0.4,
                                                                                         t_text=0.4), *rest)
            for got, want in zip(together, alone):
                assert rel_err(got[b:b + 1], want) <= 1e-5
    assert not torch.allclose(together[0][0], together[0][1])
