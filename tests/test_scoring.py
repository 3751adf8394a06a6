"""Scoring from frames and audio alone: the generator's own clips pass every check; broken clips fail the right one."""

from dataclasses import replace

import numpy as np
import pytest

from engine.models.h3.mask import latent_frame_spans
from training.captions import CaptionError, caption, describe
from training.quality import delta_e76, mean_colour_lab, psnr, srgb_to_lab, ssim
from training.scoring import REVERSAL_FRAMES, ScoreInputError, detect_clicks, score_clip
from training.toy_scene import (
    BACKGROUNDS, COLOURS, DIRECTIONS, FPS, PITCHES_HZ, SAMPLE_RATE, Scene, ToyObject, sample_scene, visible_on)
from training.toy_sound import mix
from training.toy_world import render

OPPOSITE = {"moves left": "moves right", "moves right": "moves left", "moves up": "moves down",
            "moves down": "moves up", "grows": "shrinks", "shrinks": "grows"}


@pytest.fixture(scope="module")
def scenes():
    return [sample_scene(seed) for seed in range(200)]


def pick(scenes, want):
    return render(next(s for s in scenes if want(s)))


def failed(score):
    return {name for name, ok in score["checks"].items() if not ok}


def one(scene, motions=None):
    return len(scene.objects) == 1 and (motions is None or scene.objects[0].motion in motions)


def test_the_generators_clips_pass_every_check(scenes):
    checked = set()
    for scene in scenes[:50]:
        clip = render(scene)
        score = score_clip(clip.frames, clip.audio, clip.caption)
        assert not failed(score), (clip.caption, score)
        checked |= set(score["checks"])
        heard = score["detected"]["clicks"]
        assert all(min(abs(np.array(heard) - f)) <= 1 for f in clip.click_frames), (clip.click_frames, heard)
    assert checked == {"colour", "size", "motion", "background", "pitch", "pan", "clicks", "rain"}


def test_ground_truth_scores_perfectly_against_its_scene(scenes):
    scene = next(s for s in scenes if len(s.objects) == 2 and s.humming)
    for clip in (render(scene), render(scene, 448, 256)):
        score = score_clip(clip.frames, clip.audio, scene)
        assert not failed(score), score
        m = score["measurements"]
        assert m["psnr"] == float("inf") and m["ssim"] == pytest.approx(1.0) and m["delta_e"] == pytest.approx(0.0)
    long = render(pick(scenes, lambda s: any(o.motion in DIRECTIONS for o in s.objects)).scene, seconds=15)
    score = score_clip(long.frames, long.audio, long.scene)
    assert not failed(score) and score["detected"]["clicks"], score  # the 15 s clip hits a wall, with a click


def test_fast_bounces_and_a_bounce_on_the_last_frame_still_match_their_clicks():
    # A fast ball meets the floor between two frames, up to a whole step from either; a bounce on the last frame
    # (t = 123/24 s) shows no turn yet, so its click goes unjudged.
    fast = ToyObject("ball", "red", "small", "bounces", 0.5, 0.5, bounce_height=0.75, bounce_period=0.8,
                     bounce_phase=0.3)
    last = replace(fast, colour="blue", x=0.25, bounce_period=1.0, bounce_phase=6 - 123 / 24)
    for obj in (fast, last):
        clip = render(Scene((obj,), "grey", humming=True, rain=True, seed=3))
        assert not failed(score_clip(clip.frames, clip.audio, clip.caption)), clip.contact_frames
    assert render(Scene((last,), "grey", True, True, 3)).contact_frames[0][-1] == 123


def test_random_noise_frames_fail(scenes):
    clip = render(scenes[0])
    noise = np.random.default_rng(0).integers(0, 256, clip.frames.shape, dtype=np.uint8)
    score = score_clip(noise, clip.audio, clip.caption)
    assert {"colour", "motion", "background"} <= failed(score)
    assert score["measurements"]["0.presence"] < 0.1


def test_a_clip_of_another_caption_fails_that_attribute(scenes):
    clip = pick(scenes, lambda s: one(s, DIRECTIONS) and s.humming)
    scene, obj = clip.scene, clip.scene.objects[0]
    wrong_colour = next(c for c in COLOURS if c != obj.colour and visible_on(c, scene.background))
    wrong_background = next(b for b in BACKGROUNDS if b != scene.background and visible_on(obj.colour, b))
    for other, expected in (
            (replace(obj, colour=wrong_colour), {"colour", "motion", "pitch", "pan"}),
            (replace(obj, motion=OPPOSITE[obj.motion]), {"motion"}),
            (replace(obj, size="small" if obj.size == "large" else "large"), {"size"})):
        description = describe(replace(scene, objects=(other,)))
        assert failed(score_clip(clip.frames, clip.audio, caption(description))) == expected, caption(description)
    for other, expected in ((replace(scene, background=wrong_background), {"background"}),
                            (replace(scene, rain=not scene.rain), {"rain"})):
        assert failed(score_clip(clip.frames, clip.audio, caption(other))) == expected, caption(other)


def test_a_time_reversed_clip_fails_its_direction(scenes):
    for motions in (DIRECTIONS, ("grows", "shrinks")):
        clip = pick(scenes, lambda s: one(s, motions))
        score = score_clip(clip.frames[::-1], clip.audio, clip.caption)
        assert "motion" in failed(score) and score["detected"]["0.motion"] == OPPOSITE[clip.scene.objects[0].motion]


def test_a_bounce_held_over_a_latents_frames_is_one_contact_at_its_middle(scenes):
    """The toy video VAE decodes the pixel frames of one latent frame (4; 1 at a chunk's start) alike, so a bounce it
    draws turns over a run of equal frames: one contact, at the run's middle. Each latent's middle frame held over
    its span passes (the run's first and last frames as two contacts were up to 3 frames from a click), every
    contact found but one in the clip's last REVERSAL_FRAMES (122 of 124 frames), which has no frames to turn over;
    the same pictures a latent (4 frames) late do not."""
    clip = pick(scenes, lambda s: one(s, ("bounces",)))

    def held(late):
        frames = clip.frames[np.maximum(np.arange(len(clip.frames)) - late, 0)]
        for a, b in latent_frame_spans(len(frames)):
            frames[a:b] = frames[a + (b - a) // 2]
        return score_clip(frames, clip.audio, clip.caption)

    middle = held(0)
    judged = [f for f in clip.click_frames if f < len(clip.frames) - REVERSAL_FRAMES]
    assert not failed(middle) and len(middle["detected"]["0.contacts"]) == len(judged), middle
    assert "clicks" in failed(held(4))


def test_silent_audio_fails_pitch_and_clicks(scenes):
    clip = pick(scenes, lambda s: one(s, ("bounces",)) and s.humming and not s.rain)
    assert not failed(score_clip(clip.frames, clip.audio, clip.caption))
    score = score_clip(clip.frames, np.zeros_like(clip.audio), clip.caption)
    assert failed(score) == {"pitch", "pan", "clicks"}


def test_clicks_off_by_more_than_two_frames_fail(scenes):
    clip = pick(scenes, lambda s: one(s, ("bounces",)))
    late = np.roll(clip.audio, 4 * SAMPLE_RATE // FPS, axis=1)  # every click 4 frames after its bounce
    assert "clicks" in failed(score_clip(clip.frames, late, clip.caption))
    nearly = np.roll(clip.audio, SAMPLE_RATE // FPS, axis=1)
    assert "clicks" not in failed(score_clip(clip.frames, nearly, clip.caption))


def test_the_detector_hears_a_knock_at_a_quarter_of_its_level_and_no_hum_or_rain():
    """Every contact sounds the same knock (a decoder can learn its waveform); the scorer finds it hard left (the
    quietest mono mix) at a quarter of its level, and never finds the two highest hums or the rain."""
    n = 5 * SAMPLE_RATE
    hums = [(PITCHES_HZ["white"], np.full(n, 0.3)), (PITCHES_HZ["purple"], np.full(n, 0.8))]
    starts = [SAMPLE_RATE, 2 * SAMPLE_RATE + 777, 4 * SAMPLE_RATE]
    bed = mix(hums, [], True, 0, n, SAMPLE_RATE)
    knocks = mix(hums, [(s, 0.0) for s in starts], True, 0, n, SAMPLE_RATE) - bed
    assert np.allclose(knocks[:, starts[0]:starts[0] + 640], knocks[:, starts[1]:starts[1] + 640], atol=1e-6)
    assert detect_clicks(bed) == []
    assert detect_clicks(bed + knocks / 4) == [round(s / SAMPLE_RATE * FPS) for s in starts] == [24, 49, 96]


def test_swapped_stereo_channels_fail_pan(scenes):
    clip = pick(scenes, lambda s: one(s, ("moves left", "moves right")) and s.humming)
    score = score_clip(clip.frames, clip.audio[::-1], clip.caption)
    assert failed(score) == {"pan"} and score["measurements"]["0.pan_correlation"] < -0.9


def test_bad_inputs_get_clear_errors(scenes):
    clip = render(scenes[0], num_frames=22)
    with pytest.raises(ScoreInputError, match=r"uint8 \[F, H, W, 3\]"):
        score_clip(clip.frames.astype(np.float32), clip.audio, clip.caption)
    with pytest.raises(ScoreInputError, match=r"stereo \[2, S\]"):
        score_clip(clip.frames, clip.audio[0], clip.caption)
    with pytest.raises(CaptionError, match="Captions look like"):
        score_clip(clip.frames, clip.audio, "a cat sleeps")


def test_psnr_and_ssim():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 32, 40, 3)).astype(np.uint8)
    b = np.clip(a + 10.0, 0, 255)
    assert psnr(a, a) == float("inf")
    assert psnr(np.zeros((4, 4, 3)), np.full((4, 4, 3), 10.0)) == pytest.approx(10 * np.log10(255**2 / 100))
    assert ssim(a, a) == pytest.approx(1.0)
    noisy = [np.clip(a + rng.normal(0, sigma, a.shape), 0, 255) for sigma in (5, 20, 60)]
    scores = [ssim(a, n) for n in noisy]
    assert scores == sorted(scores, reverse=True) and scores[-1] < 0.9 and ssim(a, b) == pytest.approx(ssim(b, a), rel=1e-5)
    # Flat pictures: only the luminance term is left, (2 x y + C1) / (x^2 + y^2 + C1).
    c1 = (0.01 * 255) ** 2
    assert ssim(np.full((16, 16, 3), 100.0), np.full((16, 16, 3), 140.0)) == \
        pytest.approx((2 * 100 * 140 + c1) / (100**2 + 140**2 + c1), rel=1e-5)
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(a[:, :8, :8], a[:, :8, :8])


def test_lab_and_delta_e():
    # Reference values of the sRGB (D65) primaries and neutrals in CIE L*a*b*.
    assert np.allclose(srgb_to_lab([255, 255, 255]), [100, 0, 0], atol=1e-3)
    assert np.allclose(srgb_to_lab([0, 0, 0]), [0, 0, 0], atol=1e-6)
    assert np.allclose(srgb_to_lab([255, 0, 0]), [53.2408, 80.0925, 67.2032], atol=1e-3)
    assert np.allclose(srgb_to_lab([0, 0, 255]), [32.2970, 79.1875, -107.8602], atol=1e-3)
    assert np.allclose(srgb_to_lab([128, 128, 128]), [53.5850, 0, 0], atol=1e-3)
    assert delta_e76(srgb_to_lab([255, 0, 0]), srgb_to_lab([255, 0, 0])) == 0
    assert delta_e76([50, 0, 0], [53, 4, 0]) == pytest.approx(5.0)
    frames = np.zeros((2, 8, 8, 3), np.uint8)
    frames[:, :4] = (255, 0, 0)
    mask = np.zeros((2, 8, 8), bool)
    mask[:, :4] = True
    assert np.allclose(mean_colour_lab(frames, mask), srgb_to_lab([255, 0, 0]))
    assert np.allclose(mean_colour_lab(frames), mean_colour_lab(frames.astype(np.float64)))
    with pytest.raises(ValueError, match="no pixels"):
        mean_colour_lab(frames, np.zeros((2, 8, 8), bool))
