"""The embedded default (`--preset toy`, the trained weights in engine/weights/toy) through a real engine process and
the real client, scored from the returned frames and sound alone (training/scoring.py) on held-out captions: the CI
subset of issue 18's tables (`benchmarks/toy_eval.py` runs 20 captions and every task).

The first seven held-out scenes (EVAL_SEED on, never trained on) with toy_eval's seeds. What the committed weights
reach on them is asserted as a floor, so a worse default fails, and the issue's own t2va criterion (85 % of captions
pass the named colour, motion, background and hum pitch) as it is: of seven captions one may miss (of six, as until
stop 66, none could); the clicks of the two that bounce as a floor.
Beside them: fl2va's first frame, a sky repainted at night and the join of an extension to its source.
"""

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.toy_eval import REPAINT_STRENGTH, click_fields, click_shares, scenes_where, sky_mask
from engine_fixture import start_engine
from training.captions import caption
from training.quality import psnr
from training.scoring import NAMED_CHECKS, score_clip
from training.task_checks import repaint_checks
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train import EVAL_SEED

WIDTH, HEIGHT = 224, 128  # the toy preset's canvas
CAPTIONS = 7


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("toy"), "--preset", "toy") as running:
        yield running


@pytest.fixture(scope="module")
def scenes():
    return [sample_scene(EVAL_SEED + i, WIDTH, HEIGHT) for i in range(CAPTIONS)]


def run(engine, task: str, params: dict, tensors=None):
    return asyncio.run(asyncio.wait_for(engine.client().run(task, params, tensors), 300))


@pytest.fixture(scope="module")
def t2va(engine, scenes) -> list[dict]:
    """Each held-out caption's checks, knocks and contacts, generated as toy_eval does (seed = its index, the
    canvas's steps)."""
    rows = []
    for i, scene in enumerate(scenes):
        result = run(engine, "t2va", {"prompt": caption(scene), "seed": i})
        scored = score_clip(result.frames, result.audio, scene)
        rows.append({"checks": scored["checks"], **click_fields(scene, scored)})
    return rows


def share(rows: list[dict], name: str) -> float:
    judged = [r["checks"][name] for r in rows if name in r["checks"]]
    return sum(judged) / len(judged)


def test_t2va_shows_the_named_background_and_hum(t2va):
    assert share(t2va, "background") == 1.0 and share(t2va, "pitch") == 1.0, t2va
    assert share(t2va, "pan") >= 0.75, t2va  # every humming clip (6 of the 7) follows its object


def test_t2va_shows_the_named_colour_and_motion_in_some_captions(t2va):
    """Colour in 7 of the 7 and motion in 6 (caption 1's box stays put), on this CPU as on an H100 (the same
    latents to fp16 rounding since the conditioner reads the same states under every transformers release; the
    H100's table has 0.90 and 0.90 over 40 captions, guided at 1.5 as the DiT file says); random weights pass
    neither."""
    assert share(t2va, "colour") >= 6 / 7, t2va
    assert share(t2va, "motion") >= 5 / 7, t2va


def test_t2va_passes_the_issues_named_checks_in_85_percent_of_captions(t2va):
    passed = [all(r["checks"][k] for k in NAMED_CHECKS if k in r["checks"]) for r in t2va]
    assert sum(passed) >= 0.85 * len(passed), t2va


def test_t2va_knocks_where_it_draws_a_bounce_and_nowhere_else(t2va):
    """Of the two bouncing captions (2 and 3) this CPU and the H100 knock at 20, 54, 88 and 122, the render's
    contacts, and draw them 0-2 frames early (18, 52, 86, 120-121); the five others are silent of knocks. Before
    stop 64 the DiT knocked nowhere. Issue 18's number (80 % of toy_eval's 10 bouncing captions of 40) is the
    benchmark's."""
    shares = click_shares(t2va)
    assert shares["t2va_clicks_of_bouncing"] >= 0.5 and shares["t2va_knocks_without_bounce"] == 0, t2va


def test_fl2va_starts_on_the_given_first_frame(engine, scenes):
    """Frame 0 near the rendered first frame it was given: issue 18's 28 dB on the median of the seven scenes (the
    committed default: 30.45 dB on this CPU, 28.59 over toy_eval's 40 on an H100; 30.61 before stop 79's decoder);
    three of them, with rain on white or sand, reach only 25-26."""
    values = []
    for i, scene in enumerate(scenes):
        truth = render(scene, WIDTH, HEIGHT)
        result = run(engine, "fl2va", {"prompt": caption(scene), "seed": i}, {"first_frame": truth.frames[0]})
        values.append(psnr(result.frames[0], truth.frames[0]))
    assert np.median(values) >= 28.0, values


def test_a_repainted_sky_turns_to_night(engine):
    """toy_eval's first repaint clip (its sky mask, its strength) sent as frames, sound and a mask over the wire."""
    scene = scenes_where(lambda s: "blue sky" in s.background, EVAL_SEED + 2000, 1, WIDTH, HEIGHT)[0]
    truth, sky = render(scene, WIDTH, HEIGHT), sky_mask(scene, WIDTH, HEIGHT)
    result = run(engine, "edit", {"prompt": caption(replace(scene, background="night")), "preset": "repaint",
                                  "strength": REPAINT_STRENGTH, "seed": 0, "source_sample_rate": 32000},
                 {"source_frames": truth.frames, "source_audio": truth.audio, "mask": (sky * 255).astype(np.uint8)})
    verdict = repaint_checks(result.frames, truth, sky, "night")
    assert verdict["checks"]["moved"], verdict["measurements"]


def test_an_extension_joins_its_source_no_rougher_than_the_vae_steps_inside_it(engine):
    """toy_eval's first extension source, extended 5 s over the wire: the frame difference across the join is no
    larger than the largest step the video VAE itself makes between latents inside the added frames (every fourth
    frame). Stepping straight from the source's own pixels to the decode of the new window, it was 3.4 against 1.8
    there; now 0.89 against 1.26 with stop 79's decoder (0.82 against 1.24 before it), guided since stop 68 (unguided
    0.80 against 1.32 before it; this CPU)."""
    scene = scenes_where(lambda s: True, EVAL_SEED + 3000, 1, WIDTH, HEIGHT)[0]
    source = render(scene, WIDTH, HEIGHT)
    result = run(engine, "extend", {"prompts": [caption(scene)], "seconds": 5.0, "window_seconds": 5.0, "seed": 0,
                                    "source_sample_rate": 32000},
                 {"source_frames": source.frames, "source_audio": source.audio})
    steps = np.abs(np.diff(result.frames.astype(np.int16), axis=0)).mean((1, 2, 3))  # steps[i]: frame i -> i + 1
    join = len(source.frames) - 1
    inside = [steps[i] for i in range(join + 1, len(steps)) if i % 17 % 4 == 0]  # latent boundaries of the decode
    assert np.array_equal(result.frames[:join + 1], source.frames)
    assert steps[join] <= max(inside), (steps[join], inside)
