"""SeedVR2 window geometry (specs/seedvr2.md §2.1-2.3): pure functions of the token grid, no model state.

A token grid (t, h, w) is flattened row-major, so token id = (it * h + ih) * w + iw. A layout is an exact
partition of the grid into windows:

* regular: windows of `window_size` from the origin, edge windows clipped;
* shifted: every axis that holds more than one window is offset by half a window (`int()` truncation), the first
  and last windows clipped (not a cyclic roll).

Windows are enumerated w outermost, then h, then t (the reference order); inside a window tokens are row-major.

`WindowLayout` is one layout of one grid; `WindowBatch` is the part of it one device attends over: a list of
whole windows packed window-major (rows of window i are contiguous, in window order), with the canonical token id
of every packed row. A single device holds all windows; window-aligned sequence parallelism gives each rank a
subset of whole windows, and moving rows between two batches only needs their `index` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

Grid = tuple[int, int, int]
Span = tuple[int, int]  # [start, stop) on one axis
Window = tuple[Span, Span, Span]


def window_size(grid: Grid, num_windows: tuple[int, int, int] = (4, 3, 3), area: tuple[int, int] = (45, 80),
                max_t: int = 30) -> Grid:
    """Window size in tokens: the size that gives `num_windows` windows on a grid rescaled to `area` (720p)."""
    t, h, w = grid
    nt, nh, nw = num_windows
    scale = math.sqrt(area[0] * area[1] / (h * w))
    rh, rw = round(h * scale), round(w * scale)
    return math.ceil(min(t, max_t) / nt), math.ceil(rh / nh), math.ceil(rw / nw)


def _regular_spans(size: int, ws: int) -> list[Span]:
    return [(i * ws, min((i + 1) * ws, size)) for i in range(math.ceil(size / ws))]


def _shifted_spans(size: int, ws: int) -> list[Span]:
    shift = 0.5 if ws < size else 0.0
    count = math.ceil((size - shift) / ws) + 1 if shift else 1
    spans = [(max(int((i - shift) * ws), 0), min(int((i - shift + 1) * ws), size)) for i in range(count)]
    return [(a, b) for a, b in spans if b > a]


def window_spans(grid: Grid, size: Grid, shifted: bool) -> list[Window]:
    """The windows of one layout as (t, h, w) spans, in the reference enumeration order."""
    spans = _shifted_spans if shifted else _regular_spans
    ts, hs, ws = (spans(n, s) for n, s in zip(grid, size))
    return [(st, sh, sw) for sw in ws for sh in hs for st in ts]


def window_partition(t: int, h: int, w: int, window_size: Grid, shifted: bool) -> list[torch.Tensor]:
    """One int64 tensor per window: the ids of its tokens in the flattened t*h*w grid, row-major inside."""
    ids = torch.arange(t * h * w).view(t, h, w)
    return [ids[a:b, c:d, e:f].flatten() for (a, b), (c, d), (e, f) in window_spans((t, h, w), window_size, shifted)]


@dataclass(frozen=True, eq=False)
class WindowBatch:
    """Whole windows of one layout packed window-major: the rows one device attends over in one layer."""

    ids: tuple[int, ...]  # window ids in the layout, in packed order
    shapes: tuple[Grid, ...]  # (t, h, w) extent of each window
    index: torch.Tensor  # canonical token id of every packed row
    num_windows: int  # windows in the whole layout: the text output is the mean over all of them

    @property
    def lengths(self) -> list[int]:
        return [a * b * c for a, b, c in self.shapes]

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0] + self.lengths, dtype=torch.int64).cumsum(0)

    @cached_property
    def groups(self) -> list[tuple[Grid, torch.Tensor]]:
        """Windows of equal shape batched together: (shape, packed rows [n * len]) with rows window-major."""
        starts = self.cu_seqlens.tolist()
        by_shape: dict[Grid, list[int]] = {}
        for i, shape in enumerate(self.shapes):
            by_shape.setdefault(shape, []).append(i)
        groups = []
        for shape, members in by_shape.items():
            n = math.prod(shape)
            rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in members])
            groups.append((shape, rows.to(self.index.device)))
        return groups


@dataclass(frozen=True, eq=False)
class WindowLayout:
    """One window layout (regular or shifted) of one token grid."""

    grid: Grid
    size: Grid
    shifted: bool
    windows: tuple[Window, ...]

    @classmethod
    def build(cls, grid: Grid, size: Grid, shifted: bool) -> "WindowLayout":
        return cls(tuple(grid), tuple(size), shifted, tuple(window_spans(grid, size, shifted)))

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def shapes(self) -> list[Grid]:
        return [tuple(b - a for a, b in spans) for spans in self.windows]

    @property
    def token_counts(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def tokens(self, ids: list[int] | None = None) -> torch.Tensor:
        """Canonical token ids of windows `ids` (default: all, in order), packed window-major."""
        t, h, w = self.grid
        grid = torch.arange(t * h * w).view(t, h, w)
        ids = range(len(self.windows)) if ids is None else ids
        parts = [grid[a:b, c:d, e:f].flatten() for (a, b), (c, d), (e, f) in (self.windows[i] for i in ids)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def batch(self, ids: list[int] | None = None, device: torch.device | str = "cpu") -> WindowBatch:
        ids = list(range(len(self.windows))) if ids is None else list(ids)
        shapes = self.shapes
        return WindowBatch(tuple(ids), tuple(shapes[i] for i in ids), self.tokens(ids).to(device), len(self))


def layer_layouts(grid: Grid, size: Grid, num_layers: int) -> list[WindowLayout]:
    """The layout of every layer: regular, shifted, regular, ... (layer 0 regular); two distinct objects."""
    regular, shifted = WindowLayout.build(grid, size, False), WindowLayout.build(grid, size, True)
    return [shifted if i % 2 else regular for i in range(num_layers)]
