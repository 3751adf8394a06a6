"""benchmarks/toy_eval.py's clicks numbers: issue 18's share over the bouncing captions alone, and the knocks heard
where nothing bounces, judged on the generator's own clips; its steadiness share, pooled over frames; the extension
joins kept, pooled by kind."""

import numpy as np

from benchmarks.toy_eval import click_fields, click_shares, counts, joins_kept, pooled
from training.scoring import score_clip
from training.toy_scene import sample_scene
from training.toy_world import render


def row(scene, frames, audio):
    scored = score_clip(frames, audio, scene)
    return {"checks": scored["checks"], **click_fields(scene, scored)}


def test_the_clicks_number_is_over_bouncing_captions_and_knocks_without_a_bounce_are_counted_apart():
    scenes = [sample_scene(seed) for seed in range(40)]
    bouncing = next(s for s in scenes if all(o.motion == "bounces" for o in s.objects))
    still = next(s for s in scenes if all(o.motion == "stays still" for o in s.objects))
    bounce, calm = render(bouncing), render(still)
    assert bounce.click_frames and not calm.click_frames
    rows = [row(bouncing, bounce.frames, bounce.audio), row(bouncing, bounce.frames, calm.audio),
            row(still, calm.frames, calm.audio)]
    assert rows[0]["bounces"] and rows[0]["knocks"] and rows[0]["contacts"]
    assert click_shares(rows) == {"t2va_clicks_of_bouncing": 0.5, "t2va_knocks_without_bounce": 0.0}
    rows.append(row(still, calm.frames, bounce.audio))  # a knock drawn though the prompt names no bounce
    shares = click_shares(rows)
    assert shares["t2va_clicks_of_bouncing"] == 0.5 and shares["t2va_knocks_without_bounce"] == 0.5
    assert np.isnan(click_shares(rows[2:])["t2va_clicks_of_bouncing"])


def test_steady_frames_pool_over_the_frames_judged_not_the_clips():
    rows = [{"k": counts([True, True, True, False])}, {"k": counts([])}, {"k": counts([True] + [False] * 3)}]
    assert rows[0]["k"] == [3, 4] and rows[1]["k"] == [0, 0]
    assert pooled(rows, "k") == 0.5  # 4 of 8 frames; a clip without a mover in a line counts for nothing
    assert np.isnan(pooled(rows[1:2], "k")) and np.isnan(pooled([], "k"))


def test_extension_joins_pool_by_kind_over_the_rows():
    def join(kind, kept):
        return {"frame": 124, "object": 0, "kind": kind, "kept": kept}

    rows = [{"extension": {"joins": [join("first", True), join("after_wall", False)]}},
            {"extension": {"joins": [join("after_wall", True), join("still", True)]}}, {"caption": "no extension"}]
    assert joins_kept(rows, "extension") == {"extension_joins_first": [1, 1], "extension_joins_after_wall": [1, 2],
                                             "extension_joins_moving": [0, 0], "extension_joins_still": [1, 1]}
    assert joins_kept(rows[2:], "extension") == {}
