"""SeedVR2 window geometry: exact partitions, the spec's worked examples (specs/seedvr2.md §2.2), packed batches."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models.seedvr2.windows import (
    WindowLayout,
    layer_layouts,
    window_partition,
    window_size,
    window_spans,
)


@settings(max_examples=300, deadline=None)
@given(t=st.integers(1, 12), h=st.integers(1, 40), w=st.integers(1, 40), data=st.data(), shifted=st.booleans())
def test_partition_covers_every_token_once(t, h, w, data, shifted):
    size = tuple(data.draw(st.integers(1, n + 2)) for n in (t, h, w))
    windows = window_partition(t, h, w, size, shifted)
    ids = torch.cat(windows)
    assert torch.equal(ids.sort().values, torch.arange(t * h * w))
    grid = torch.arange(t * h * w).view(t, h, w)
    for ix, spans in zip(windows, window_spans((t, h, w), size, shifted)):
        (a, b), (c, d), (e, f) = spans
        assert ix.numel() == (b - a) * (d - c) * (f - e) > 0
        assert all(stop - start <= s for (start, stop), s in zip(spans, size))
        assert torch.equal(ix, grid[a:b, c:d, e:f].flatten())  # a box, row-major inside


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 36), h=st.integers(1, 96), w=st.integers(1, 96))
def test_adaptive_layouts_are_partitions(t, h, w):
    size = window_size((t, h, w))
    for shifted in (False, True):
        layout = WindowLayout.build((t, h, w), size, shifted)
        assert sum(layout.token_counts) == t * h * w
        assert torch.equal(layout.tokens().sort().values, torch.arange(t * h * w))


# (frames, H, W) -> grid, window size, (regular #win, max, min), (shifted #win, max, min)
WORKED = [
    ((1, 720, 1280), (1, 45, 80), (1, 15, 27), (9, 405, 390), (16, 405, 91)),
    ((5, 720, 1280), (2, 45, 80), (1, 15, 27), (18, 405, 390), (32, 405, 91)),
    ((21, 720, 1280), (6, 45, 80), (2, 15, 27), (27, 810, 780), (64, 810, 91)),
    ((81, 720, 1280), (21, 45, 80), (6, 15, 27), (36, 2430, 1170), (64, 2430, 273)),
    ((121, 1088, 1920), (31, 68, 120), (8, 15, 27), (100, 3240, 672), (150, 3240, 39)),
    ((361, 1088, 1920), (91, 68, 120), (8, 15, 27), (300, 3240, 288), (360, 3240, 52)),
    ((453, 2160, 3840), (114, 135, 240), (8, 15, 27), (1215, 3240, 720), (1500, 3240, 308)),
    ((1, 2048, 2048), (1, 128, 128), (1, 20, 20), (49, 400, 64), (49, 400, 100)),
]


def test_worked_examples():
    for (frames, height, width), grid, size, regular, shifted in WORKED:
        assert ((frames - 1) // 4 + 1, height // 16, width // 16) == grid
        assert window_size(grid) == size
        for is_shifted, (count, largest, smallest) in ((False, regular), (True, shifted)):
            counts = WindowLayout.build(grid, size, is_shifted).token_counts
            assert (len(counts), max(counts), min(counts)) == (count, largest, smallest), (grid, is_shifted)


def test_shift_is_clipped_half_window_with_truncation():
    # ws = 15 over 45: shift int(0.5 * 15) = 7 -> spans 0-7, 7-22, 22-37, 37-45; an axis fitting one window is
    # not shifted.
    spans = window_spans((1, 45, 80), (1, 15, 27), shifted=True)
    assert sorted({s[1] for s in spans}) == [(0, 7), (7, 22), (22, 37), (37, 45)]
    assert sorted({s[2] for s in spans}) == [(0, 13), (13, 40), (40, 67), (67, 80)]
    assert {s[0] for s in spans} == {(0, 1)}


def test_enumeration_order_w_then_h_then_t():
    spans = window_spans((4, 4, 4), (2, 2, 2), shifted=False)
    assert spans[:3] == [((0, 2), (0, 2), (0, 2)), ((2, 4), (0, 2), (0, 2)), ((0, 2), (2, 4), (0, 2))]
    assert spans[4] == ((0, 2), (0, 2), (2, 4))


def test_batches_pack_whole_windows():
    grid, size = (3, 7, 9), (2, 3, 4)
    for layout in layer_layouts(grid, size, 2):
        full = layout.batch()
        assert torch.equal(full.index, torch.cat(window_partition(*grid, size, layout.shifted)))
        assert full.cu_seqlens[-1] == full.index.numel() and full.num_windows == len(layout)
        rows = torch.cat([r for _, r in full.groups]).sort().values
        assert torch.equal(rows, torch.arange(full.index.numel()))  # every packed row in exactly one group
        for shape, r in full.groups:
            assert r.numel() % (shape[0] * shape[1] * shape[2]) == 0
        part = layout.batch([4, 1])  # a subset, as a sequence-parallel rank would hold
        assert part.num_windows == len(layout) and part.shapes == (layout.shapes[4], layout.shapes[1])
        assert torch.equal(part.index, torch.cat([window_partition(*grid, size, layout.shifted)[i] for i in (4, 1)]))
    layouts = layer_layouts(grid, size, 4)
    assert [layout.shifted for layout in layouts] == [False, True, False, True]
    assert layouts[2] is layouts[0] and layouts[3] is layouts[1]
