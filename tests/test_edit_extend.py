"""Masked edit, extension and latent refine on the `tiny` preset."""

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.io.video import read_video
from engine.models.h3 import layout as L
from engine.models.h3.extend import SEAM_FRAMES, TAIL_FRAMES, carry_seam, plan_windows, window_layout
from engine.models.h3.mask import MaskError
from engine.models.h3.pipeline import H3Pipeline
from engine.models.h3.request import EditRequest, ExtendRequest, GenerateRequest, RefineRequest, Source, StepEvent

STEPS = 4


@pytest.fixture(scope="module")
def pipe():
    return H3Pipeline.from_preset("tiny")


@pytest.fixture(scope="module")
def clip(pipe):
    """A generated 5 s clip (124 frames, 128x224) with sound; its latents as the store keeps them."""
    return pipe.generate(GenerateRequest(prompt="a red ball on grass", steps=STEPS, seed=1))


def stored(result):
    return Source(result.frames, 24.0, result.audio, result.sample_rate, result.video_latents, result.audio_latents)


def box_mask(frames=124):
    m = torch.zeros(frames, 128, 224)
    m[:, 40:90, 70:150] = 1.0
    return m


def test_edit_keeps_unmasked_latents_bit_identical_to_the_source_encoding(pipe, clip):
    source = Source(clip.frames, 24.0, clip.audio, clip.sample_rate)  # pixels: the engine encodes them
    result = pipe.edit(EditRequest(source, box_mask(), prompt="a blue cube", steps=STEPS))
    encoded = pipe.video_vae.encode_frames(clip.frames)  # the source encoding, computed independently
    keep = torch.zeros(37, 8, 14, dtype=torch.bool)
    keep[:, :, :] = True
    keep[:, 40 // 16:(90 + 15) // 16, 70 // 16:(150 + 15) // 16] = False
    cells = result.video_latents[0].permute(1, 2, 3, 0)  # [T, h, w, C]
    assert torch.equal(cells[keep], encoded[0].permute(1, 2, 3, 0)[keep])
    assert not torch.equal(cells[~keep], encoded[0].permute(1, 2, 3, 0)[~keep])
    assert result.frames.shape == clip.frames.shape
    # The source's sound is kept (audio mask 0 by default): its latents come back unchanged.
    assert torch.equal(result.audio_latents, pipe.audio_vae.encode(clip.audio, clip.sample_rate).cpu())


def test_edit_returns_the_source_pixels_outside_the_mask_in_frames_and_mp4(pipe, clip):
    """The decoder only approximates the source (random weights here: not at all), so the engine pastes the
    source's own pixels wherever the mask is 0; the MP4 is encoded from that composite."""
    mask = box_mask()
    result = pipe.edit(EditRequest(stored(clip), mask, prompt="a blue cube", steps=STEPS))
    outside = mask == 0
    assert torch.equal(result.frames[outside], clip.frames[outside])
    assert not torch.equal(result.frames[~outside], clip.frames[~outside])
    video = torch.from_numpy(read_video(result.mp4)[0]).float()
    to_source = [(video[area] - clip.frames[area].float()).abs().mean() for area in (outside, ~outside)]
    # Outside, the MP4 differs from the source by H.264's loss on these noisy frames only (~22 levels); inside it
    # shows the regenerated pixels, as far from the source as any other noise (~32).
    assert to_source[0] < 0.8 * to_source[1]


def test_all_ones_mask_equals_plain_generation(pipe, clip):
    silent = Source(clip.frames, 24.0, None, 32000, clip.video_latents)
    edited = pipe.edit(EditRequest(silent, torch.ones(128, 224), prompt="a forest", steps=STEPS, seed=9))
    plain = pipe.generate(GenerateRequest(prompt="a forest", width=224, height=128, steps=STEPS, seed=9))
    assert torch.equal(edited.video_latents, plain.video_latents)
    assert torch.equal(edited.audio_latents, plain.audio_latents)


def test_fractional_mask_and_presets(pipe, clip):
    half = pipe.edit(EditRequest(stored(clip), box_mask() * 0.5, preset="repaint", prompt="oil painting",
                                 steps=STEPS))
    full = pipe.edit(EditRequest(stored(clip), box_mask(), preset="repaint", prompt="oil painting", steps=STEPS))
    d_half = (half.video_latents - clip.video_latents).abs().sum()
    d_full = (full.video_latents - clip.video_latents).abs().sum()
    assert 0 < d_half < d_full
    removed = pipe.edit(EditRequest(stored(clip), box_mask(), preset="remove", steps=STEPS))  # prompt optional
    assert removed.frames.shape == clip.frames.shape


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(mask=torch.zeros(128, 224)), MaskError, "mask is empty"),
    (dict(mask=torch.full((128, 224), float("nan"))), MaskError, "NaN"),
    (dict(mask=torch.ones(200, 128, 224)), MaskError, "200 frames but the video has 124"),
    (dict(mask=torch.ones(128, 224), preset="erase"), L.LayoutError, "Unknown edit preset"),
    (dict(mask=torch.ones(128, 224), prompt=""), L.LayoutError, "needs a prompt"),
    (dict(mask=torch.ones(128, 224), strength=1.5), L.LayoutError, "strength"),
])
def test_bad_edit_requests(pipe, clip, kwargs, error, message):
    req = EditRequest(stored(clip), **{"prompt": "x", "steps": STEPS, **kwargs})
    with pytest.raises(error, match=message):
        pipe.edit(req)


def test_edit_result_and_its_mp4_are_cut_back_to_the_source_frames(pipe, clip):
    result = pipe.edit(EditRequest(Source(clip.frames[:120]), torch.ones(128, 224), prompt="a forest", steps=STEPS))
    assert result.frames.shape[0] == 120 and read_video(result.mp4)[0].shape[0] == 120  # decoded 124, kept 120


def test_bad_edit_sources(pipe, clip):
    with pytest.raises(L.LayoutError, match="5 to 15 s"):
        pipe.edit(EditRequest(Source(clip.frames[:48]), torch.ones(128, 224), prompt="x", steps=STEPS))
    with pytest.raises(L.LayoutError, match="uint8 frames"):
        pipe.edit(EditRequest(Source(clip.frames.float()), torch.ones(128, 224), prompt="x", steps=STEPS))


def test_extension_keeps_the_source_frames_and_grows_the_timeline(pipe, clip):
    events = []
    result = pipe.extend(ExtendRequest(stored(clip), seconds=8, prompts=["the ball rolls away"],
                                       window_seconds=6, steps=STEPS), on_step=events.append)
    windows = plan_windows(124, 8 * 24, 7, L.align_num_frames(6 * 24))
    assert len(windows) == 2 and {e.stage for e in events if isinstance(e, StepEvent)} == {"window 1/2", "window 2/2"}
    assert torch.equal(result.frames[:124], clip.frames)
    F_total = result.frames.shape[0]
    assert F_total == windows[-1].start + windows[-1].frames and (F_total - 5) % 17 == 0
    assert result.video_latents.shape[2] == L.latent_frames(F_total)
    assert torch.equal(result.video_latents[:, :, :37], clip.video_latents)
    assert result.audio_latents.shape[-1] == round(F_total * 40 / 24)
    assert result.audio.shape[-1] == round(F_total / 24 * 32000)
    assert torch.equal(result.audio[:, :clip.audio.shape[1]], clip.audio)  # the source's own sound, untouched


def test_a_window_before_another_hands_its_last_frames_to_the_next_decode(pipe, clip):
    """The first window's last TAIL_FRAMES are decoded again with the second window's first chunk after them (the
    decode of the result's latents from a chunk before them, not of the first window's alone); every frame streams
    once, in order, as it is in the result."""
    streamed = []

    def on_step(event):
        if getattr(event, "frames", None) is not None:
            streamed.append((event.detail, event.frames.start, event.frames.pixels.clone()))

    result = pipe.extend(ExtendRequest(stored(clip), seconds=8, prompts=["the ball rolls away"], window_seconds=5,
                                       steps=STEPS), on_step=on_step)
    first = plan_windows(124, 8 * 24, 7, L.align_num_frames(5 * 24))[0]
    end = first.start + first.frames
    n = (end - 5) // 17
    latents = result.video_latents
    with_next = torch.cat(list(pipe.video_vae.decode_chunks(latents[:, :, 5 * (n - 1):5 * (n + 1) + 2])))
    alone = torch.cat(list(pipe.video_vae.decode_chunks(latents[:, :, 5 * (n - 1):5 * n + 2])))
    assert torch.equal(result.frames[end - TAIL_FRAMES:end], with_next[17:17 + TAIL_FRAMES])
    assert not torch.equal(with_next[17:17 + TAIL_FRAMES], alone[17:17 + TAIL_FRAMES])
    assert [start for _, start, _ in streamed] == sorted(start for _, start, _ in streamed)
    assert torch.equal(torch.cat([pixels for _, _, pixels in streamed]), result.frames)
    assert max(start + len(pixels) for detail, start, pixels in streamed if detail.startswith("window 1/")) \
        == end - TAIL_FRAMES


def test_a_window_takes_over_the_frame_before_it_and_fades_into_its_own_decode():
    """The seam (the frame before the window as it stands minus as decoded) is added in full weight minus one step
    to the first new frame, a step less each frame, none from frame SEAM_FRAMES on; chunk by chunk as in one go;
    clamped to uint8."""
    frames = torch.full((SEAM_FRAMES + 4, 2, 2, 3), 100, dtype=torch.uint8)
    seam = torch.full((2, 2, 3), 26, dtype=torch.int16)
    seam[0, 0] = 200
    whole = frames.clone()
    carry_seam(whole, seam, 0)
    step = 26 / (SEAM_FRAMES + 1)
    expected = [100 + round(26 - (i + 1) * step) for i in range(SEAM_FRAMES)] + [100] * 4
    assert whole[:, 1, 1, 0].tolist() == expected
    assert whole[0, 0, 0, 0] == 255 and whole[SEAM_FRAMES:, 0, 0].eq(100).all()
    parts = [frames[:5].clone(), frames[5:].clone()]
    carry_seam(parts[0], seam, 0)
    carry_seam(parts[1], seam, 5)
    assert torch.equal(torch.cat(parts), whole)


def test_audio_length_matches_the_frames_after_every_window(pipe, clip):
    for seconds in (1, 4, 9):
        r = pipe.extend(ExtendRequest(stored(clip), seconds=seconds, prompts=["on"], window_seconds=5,
                                      steps=STEPS))
        assert r.audio_latents.shape[-1] == round(r.frames.shape[0] * 40 / 24)
    for w in plan_windows(124, 40 * 24, 7, 362):
        assert w.audio_start + w.audio_latents == round((w.start + w.frames) * 5 / 3)


def test_window_rope_times_are_window_zero_shifted_by_s_40_24():
    tags = torch.ones(9, dtype=torch.long)
    windows = plan_windows(124, 30 * 24, 7, L.align_num_frames(6 * 24))
    first = window_layout(tags, windows[0], 7, 37, 8, 14, media_origin=12)
    for window in windows[1:]:
        lay = window_layout(tags, window, 7, 37, 8, 14, media_origin=12)
        shift = window.time_shift - windows[0].time_shift
        assert window.time_shift == window.start * 40 / 24
        streams = [(lay.video_indices, first.video_indices)] + [  # audio: each channel on its own
            (lay.audio_indices[lay.num_condition_audio_rows:].view(2, -1)[c],
             first.audio_indices[first.num_condition_audio_rows:].view(2, -1)[c]) for c in range(2)]
        for rows_k, rows_0 in streams:
            t_k, t_0 = lay.position_ids[rows_k, 0], first.position_ids[rows_0, 0]
            n = min(len(t_k), len(t_0))
            assert torch.allclose(t_k[:n], t_0[:n] + shift, rtol=0, atol=1e-9)
        assert torch.equal(lay.position_ids[:9], first.position_ids[:9])  # text stays put
    assert any(w.time_shift != int(w.time_shift) for w in windows)  # fractional shifts are kept
    # Guides sit exactly at the times of the target's first latents.
    nv = first.num_condition_video_rows
    guide_t = first.position_ids[first.video_indices[:nv], 0]
    target_t = first.position_ids[first.video_indices[nv:2 * nv], 0]
    assert torch.equal(guide_t, target_t)


def test_reference_rows_never_change_during_denoising(pipe, clip):
    seen = []

    def capture(module, args, kwargs):
        video_rows, audio_rows = args[0], args[1]
        seen.append((video_rows[:, :7 * 28].clone(), audio_rows[:, :2 * 37].clone()))

    handle = pipe.dit.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        pipe.extend(ExtendRequest(stored(clip), seconds=3, prompts=["on"], steps=6))
    finally:
        handle.remove()
    assert len(seen) == 5
    assert all(torch.equal(v, seen[0][0]) and torch.equal(a, seen[0][1]) for v, a in seen)
    tail = clip.audio_latents[:, :, round(102 * 5 / 3):]
    assert torch.equal(seen[0][1][0], L.pack_audio(tail[None])[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "needs a prompt"),
    (dict(overlap_latents=6), "5k \\+ 2"),
    (dict(seconds=0), "above 0"),
])
def test_bad_extend_requests(pipe, clip, kwargs, message):
    with pytest.raises(L.LayoutError, match=message):
        pipe.extend(ExtendRequest(stored(clip), **{"seconds": 3, "prompts": ["x"], "steps": STEPS, **kwargs}))


MEMORY_SCRIPT = r"""
import json, resource, sys, threading, time, torch
torch.set_num_threads(1)
from engine.models.h3.pipeline import H3Pipeline
from engine.models.h3.request import ExtendRequest, GenerateRequest, Source

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

pipe = H3Pipeline.from_preset("tiny")
clip = pipe.generate(GenerateRequest(prompt="x", steps=3))
src = Source(clip.frames, 24.0, clip.audio, 32000, clip.video_latents, clip.audio_latents)
pipe.extend(ExtendRequest(src, seconds=4, prompts=["y"], window_seconds=5, steps=2))  # warm every code path
base, peak, stop = rss(), [0], False
def sample():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
thread = threading.Thread(target=sample); thread.start()
out = pipe.extend(ExtendRequest(src, seconds=float(sys.argv[1]), prompts=["y"], window_seconds=5, steps=2))
stop = True; thread.join()
result = out.frames.numel() + 4 * (out.audio.numel() + out.video_latents.numel() + out.audio_latents.numel())
print(json.dumps({"delta": peak[0] - base, "result_bytes": result + len(out.mp4 or b""), "frames": out.frames.shape[0]}))
"""


def test_memory_of_a_4_window_extension_is_within_10_percent_of_2_windows():
    def start(seconds):
        # glibc keeps freed heap blocks mapped; with a low mmap threshold RSS follows what is really alive.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        return subprocess.Popen([sys.executable, "-c", MEMORY_SCRIPT, str(seconds)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def result(proc):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    runs = [start(2 * 4.25), start(4 * 4.25)]  # one thread each: side by side on two cores
    two, four = map(result, runs)
    assert (two["frames"], four["frames"]) == (124 + 2 * 102, 124 + 4 * 102)  # windows of 124 frames
    # Working memory (peak growth minus the result itself: frames, sound, latents, MP4) must not grow with windows.
    # Measured on 2 CPU cores: 1 window 47.9 MB, 2 windows 59.8, 3 windows 60.3 (the first window after the source
    # works on less), 4 windows 61-65.
    work_two = two["delta"] - two["result_bytes"]
    work_four = four["delta"] - four["result_bytes"]
    print("extension working memory (bytes): 2 windows", work_two, "4 windows", work_four)
    assert work_four <= 1.1 * max(work_two, 0) + 8 * 2**20, (two, four)


def test_latent_refine_upscales_and_keeps_the_sound(pipe, clip):
    result = pipe.refine(RefineRequest(stored(clip), prompt="a red ball on grass", scale=2, strength=0.4,
                                       steps=3))
    assert result.frames.shape == (124, 256, 448, 3)
    assert result.video_latents.shape == (1, 24, 37, 16, 28)
    assert torch.equal(result.audio_latents, clip.audio_latents)
    assert any("refine steps" in n for n in result.notes)
    assert read_video(result.mp4)[0].shape == (124, 256, 448, 3)
    with pytest.raises(L.LayoutError, match="x1.5 or x2"):
        pipe.refine(RefineRequest(stored(clip), prompt="x", scale=3))
