"""The toy world: deterministic scenes and clips, the frame/sample rules, captions that parse back, re-renders."""

import time
from dataclasses import replace

import numpy as np
import pytest

from engine.models.h3 import layout
from training.captions import (
    BACKGROUND_PHRASES, CaptionError, ObjectDescription, SceneDescription, caption, caption_at, describe,
    parse_caption)
from training.toy_scene import (
    BACKGROUNDS, COLOURS, DIRECTIONS, MOTIONS, PITCHES_HZ, SHAPES, SIZES, sample_scene, visible_on)
from training.toy_world import ToyClip, background_image, frames_for_seconds, render

SEEDS = range(300)


@pytest.fixture(scope="module")
def scenes():
    return [sample_scene(seed) for seed in SEEDS]


def first_scene(scenes, want):
    return next(s for s in scenes if want(s))


def test_same_seed_same_scene_and_clip():
    a, b = render(sample_scene(7)), render(sample_scene(7))
    assert a.scene == b.scene and a.caption == b.caption
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    assert np.array_equal(a.masks, b.masks) and a.contact_frames == b.contact_frames
    other = render(sample_scene(8))
    assert other.scene != a.scene and not np.array_equal(other.frames, a.frames)


def test_frame_and_sample_counts_follow_the_engine_rules():
    for seconds in (5.0, 6.5, 10.0, 15.0):
        assert frames_for_seconds(seconds) == layout.frames_for_seconds(seconds)[0]
    assert frames_for_seconds(5.0) == 124 and frames_for_seconds(15.0) == 362
    scene = sample_scene(1)
    for seconds, frames, samples in ((5.0, 124, 165_333), (15.0, 362, 482_667)):
        clip = render(scene, seconds=seconds)
        assert clip.frames.shape == (frames, 128, 224, 3) and clip.frames.dtype == np.uint8
        assert clip.audio.shape == (2, samples) and clip.audio.dtype == np.float32
        assert samples == round(frames / 24 * 32_000)
        k = len(scene.objects)
        assert clip.masks.shape == (k, frames, 128, 224) and clip.masks.dtype == bool
        assert clip.centroids.shape == (k, frames, 2)
    odd = render(scene, 96, 64, num_frames=1)
    assert odd.frames.shape == (1, 64, 96, 3) and odd.audio.shape == (2, 1333)


def test_captions_parse_back_to_their_scenes(scenes):
    for scene in scenes:
        text = caption(scene)
        assert parse_caption(text) == describe(scene), text
    assert parse_caption("A red ball bounces on green grass under a blue sky, humming; rain falls.") == \
        SceneDescription((ObjectDescription("red", "ball", "bounces"),), "green grass under a blue sky", True, True)
    two = parse_caption("a red ball moves right and a blue box stays still on a white background")
    assert [o.motion for o in two.objects] == ["moves right", "stays still"] and not two.humming


def test_every_attribute_value_is_reached(scenes):
    objects = [o for s in scenes for o in s.objects]
    assert {o.colour for o in objects} == set(COLOURS)
    assert {o.shape for o in objects} == set(SHAPES)
    assert {o.size for o in objects} == set(SIZES)
    assert {o.motion for o in objects} == set(MOTIONS)
    assert {s.background for s in scenes} == set(BACKGROUNDS)
    assert {len(s.objects) for s in scenes} == {1, 2}
    assert {s.humming for s in scenes} == {True, False} and {s.rain for s in scenes} == {True, False}
    for s in scenes:
        assert all(visible_on(o.colour, s.background) for o in s.objects)
        assert len({o.colour for o in s.objects}) == len(s.objects)


def test_pitches_rise_in_distinct_bands():
    pitches = sorted(PITCHES_HZ.values())
    assert len(set(pitches)) == len(COLOURS)
    assert all(hi / lo >= 1.45 for lo, hi in zip(pitches, pitches[1:]))


def test_ground_truth_matches_the_pictures():
    for seed in range(4):
        clip = render(sample_scene(seed))
        for k, obj in enumerate(clip.scene.objects):
            mask = clip.masks[k]
            assert mask.sum((1, 2)).min() > 50
            rgb = np.median(clip.frames[mask], 0)
            assert np.abs(rgb - COLOURS[obj.colour]).max() <= 2, (obj, rgb)
            ys, xs = np.nonzero(mask[0])
            assert np.allclose([xs.mean() + 0.5, ys.mean() + 0.5], clip.centroids[k, 0], atol=1.0)
        outside = ~clip.masks.any(0)
        painted = np.round(background_image(clip.background, 224, 128)).astype(np.uint8)
        assert (clip.frames == painted).all(-1)[outside].mean() > 0.97


def test_motions_do_what_they_say(scenes):
    for motion in MOTIONS:
        scene = first_scene(scenes, lambda s: len(s.objects) == 1 and s.objects[0].motion == motion)
        clip = render(scene)
        (x, y), area = clip.centroids[0].T, clip.masks[0].sum((1, 2))
        if motion in DIRECTIONS:
            axis, sign = DIRECTIONS[motion]
            moved = (x, y)[axis][-1] - (x, y)[axis][0]
            assert sign * moved > 10 and clip.contact_frames == ((),), (motion, moved)  # no wall hit in 5 s
        elif motion == "bounces":
            contacts = clip.contact_frames[0]
            assert len(contacts) >= 3 and all(y[f] >= y[max(f - 2, 0): f + 3].max() - 1e-3 for f in contacts)
        elif motion == "stays still":
            assert np.ptp(x) == 0 and np.ptp(y) == 0 and np.ptp(area) == 0
        else:
            assert (area[-1] / area[0] > 4) == (motion == "grows") and (area[0] / area[-1] > 4) == (motion == "shrinks")


def test_a_longer_render_continues_the_shorter_one_and_reaches_the_walls(scenes):
    scene = first_scene(scenes, lambda s: s.rain and s.humming and any(o.motion in DIRECTIONS for o in s.objects))
    short, long = render(scene), render(scene, seconds=15)
    assert np.array_equal(long.frames[:124], short.frames)
    assert np.array_equal(long.audio[:, : short.audio.shape[1]], short.audio)
    mover = next(k for k, o in enumerate(scene.objects) if o.motion in DIRECTIONS)
    assert long.contact_frames[mover], "a mover reaches a wall within 15 s"
    assert short.contact_frames[mover] == ()


def test_a_caption_at_a_later_time_names_the_way_each_mover_goes_then(scenes):
    """`caption_at` (an extension window's prompt in toy_eval): before a mover's first wall hit the scene's own
    caption; after it, for every frame a second away from a hit, the direction the render moves it in."""
    width, height = 224, 128
    checked, turned = 0, 0
    for scene in [s for s in scenes if any(o.motion in DIRECTIONS for o in s.objects)][:12]:
        clip = render(scene, width, height, seconds=15)
        assert caption_at(scene, 0.0, width, height) == caption(scene)
        for k, obj in enumerate(scene.objects):
            if obj.motion not in DIRECTIONS:
                continue
            axis, _ = DIRECTIONS[obj.motion]
            path = clip.centroids[k][:, axis]
            for f in range(0, len(path) - 1, 12):
                if any(abs(f - c) <= 24 for c in clip.contact_frames[k]):
                    continue
                said = parse_caption(caption_at(scene, f / 24, width, height)).objects[k].motion
                assert DIRECTIONS[said][1] == np.sign(path[f + 1] - path[f]), (scene, f, said)
                checked, turned = checked + 1, turned + (said != obj.motion)
    assert checked > 100 and turned > 20, (checked, turned)


def test_a_2x_canvas_is_the_same_picture():
    scene = sample_scene(5)
    small, large = render(scene, num_frames=39), render(scene, 448, 256, num_frames=39)
    assert np.allclose(large.centroids, 2 * small.centroids, atol=1e-3)
    pooled = large.frames.reshape(39, 128, 2, 224, 2, 3).mean((2, 4))
    mse = np.mean((pooled - small.frames.astype(float)) ** 2)
    assert 10 * np.log10(255**2 / mse) > 30


def test_edited_scenes_render_from_the_same_description():
    scene = first_scene([sample_scene(s) for s in SEEDS], lambda s: len(s.objects) == 2)
    removed = render(replace(scene, objects=scene.objects[:1]))
    both = render(scene)
    near = both.masks[1]
    near = near | np.roll(near, 1, 1) | np.roll(near, -1, 1)  # edge pixels the second object partly covers
    keep = ~(near | np.roll(near, 1, 2) | np.roll(near, -1, 2))
    assert np.array_equal(removed.frames[keep], both.frames[keep])
    assert caption(removed.scene) == caption(describe(removed.scene))


def test_bad_captions_and_requests_say_what_fits():
    with pytest.raises(CaptionError, match="colours red, green"):
        parse_caption("a dog runs on the beach")
    with pytest.raises(CaptionError, match="cannot be seen on a white background"):
        parse_caption("a white ball stays still on a white background")
    with pytest.raises(CaptionError, match="different colours"):
        parse_caption("a red ball grows and a red box shrinks at night")
    assert set(BACKGROUND_PHRASES) == set(BACKGROUNDS)
    scene = sample_scene(0)
    with pytest.raises(ValueError, match="at most 15 s"):
        render(scene, seconds=20)
    with pytest.raises(ValueError, match="at least 16x16"):
        render(scene, 8, 128)
    with pytest.raises(ValueError, match="1 to 362 frames"):
        render(scene, num_frames=0)


def test_a_5_s_clip_renders_fast():
    scene = sample_scene(1)  # two objects, one bouncing, rain
    best = min(_timed(lambda: render(scene)) for _ in range(3))
    assert best < 1.0, f"rendering a 5 s 224x128 clip took {best:.2f} s"
    assert isinstance(render(scene), ToyClip)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
