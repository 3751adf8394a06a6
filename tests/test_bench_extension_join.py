"""benchmarks/extension_join.py: the speed shares of its three spans around a join, and one scene's first window on
the committed toy default."""

from pathlib import Path

import numpy as np
import pytest

from benchmarks.extension_join import DECODES, SPAN, SPANS, scene_rows, speed_shares
from benchmarks.toy_eval import EXTENSION_SEED, load, scenes_where


def test_a_stall_after_the_join_shows_in_the_completion_span_alone():
    join = 22
    rendered = 2.0 * np.arange(join + 2 * SPAN, dtype=float)
    stalled = rendered.copy()
    stalled[join:join + SPAN] = rendered[join - 1]
    stalled[join + SPAN:] = rendered[join + SPAN:] - rendered[join + SPAN] + rendered[join - 1]
    stalled[join - 3] = np.nan  # a frame where the tracker lost the object
    shares = speed_shares(stalled, rendered, join)
    assert shares == pytest.approx({"guide": 1.0, "completion": 0.0, "next": 1.0}, abs=1e-9)


def test_the_first_window_of_a_toy_extension_scene_is_measured_in_every_decode():
    pipe = load(Path("engine/weights/toy"), "cpu")
    scene = scenes_where(lambda s: True, EXTENSION_SEED, 1, 224, 128)[0]
    rows = scene_rows(pipe, scene, 0, 7, 2)
    assert [r["motion"] for r in rows] == ["moves right"]
    assert all(set(rows[0][d]) == set(SPANS) for d in DECODES)
    # the scene's own frames through the VAE keep the rendered speed before the join
    assert 0.7 < rows[0]["round_trip"]["guide"] < 1.3, rows[0]
