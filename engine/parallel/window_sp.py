"""Window-aligned sequence parallelism for the SeedVR2 NaDiT (specs/seedvr2.md §6.2).

Attention never crosses a window, so a rank that owns whole windows keeps every head and needs no communication
inside a layer; any number of ranks works, and a rank may own no window at all.

* Planner: per layout (regular / shifted) windows are dealt largest first (by token count, ties by window id) to
  the least-loaded rank (ties by rank id); each rank packs its windows in ascending id order.
* Layout switch: one variable-split all-to-all moves every token from its owner under the previous layout to its
  owner under the next. A rank sends, per destination, the rows that destination needs, already in the
  destination's packed order; the receiver's rows arrive grouped by source, and one index_select puts them in its
  packed order (`Exchange`). The plan is a pure function of (grid, window size, layers, world, rank), so every
  rank builds the same global picture without talking, and it is cached per grid.
* Text: replicated on every rank; the per-window text output sums of a layer are added over the ranks with one
  all-reduce (the model divides by the global window count).
* Exit: the output rows are all-gathered and put back in canonical token order on every rank.

    v = window_sp.predict(dit, latent, text, timestep, group)   # = dit(latent, text, timestep) on one rank
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from engine.models.seedvr2.nadit import NaDiT, patchify, unpatchify
from engine.models.seedvr2.windows import Grid, WindowBatch, WindowLayout, layer_layouts


def assign_windows(token_counts: list[int], world: int) -> list[int]:
    """The owner rank of every window: longest-processing-time-first onto the least-loaded rank."""
    owner = [0] * len(token_counts)
    loads = [(0, rank) for rank in range(world)]
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        load, rank = heapq.heappop(loads)
        owner[i] = rank
        heapq.heappush(loads, (load + token_counts[i], rank))
    return owner


@dataclass(frozen=True, eq=False)
class Assignment:
    """One layout spread over `world` ranks: who owns each window, and where every token sits."""

    layout: WindowLayout
    windows: tuple[tuple[int, ...], ...]  # window ids of each rank, ascending
    index: tuple[torch.Tensor, ...]  # canonical token ids of each rank's packed rows
    owner: torch.Tensor  # [N] rank holding each token
    position: torch.Tensor  # [N] row of each token in its owner's packing

    @classmethod
    def build(cls, layout: WindowLayout, world: int) -> "Assignment":
        owner_of = assign_windows(layout.token_counts, world)
        windows = tuple(tuple(i for i, r in enumerate(owner_of) if r == rank) for rank in range(world))
        index = tuple(layout.tokens(list(ids)) for ids in windows)
        n = sum(layout.token_counts)
        owner, position = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        for rank, ids in enumerate(index):
            owner[ids] = rank
            position[ids] = torch.arange(ids.numel())
        return cls(layout, windows, index, owner, position)

    @property
    def loads(self) -> list[int]:
        """Tokens per rank."""
        return [ids.numel() for ids in self.index]


@dataclass(frozen=True)
class Exchange:
    """One rank's part of a layout switch."""

    rank: int
    send: torch.Tensor  # rows of the old packing to send, grouped by destination, each group in its packed order
    send_counts: list[int]  # rows to each rank
    recv_counts: list[int]  # rows from each rank
    order: torch.Tensor  # new packed row j = received row order[j]
    network: bool  # some token changes rank (the same answer on every rank)

    @classmethod
    def build(cls, src: Assignment, dst: Assignment, rank: int, device: torch.device | str = "cpu") -> "Exchange":
        world, n = len(src.index), src.owner.numel()
        mine = src.index[rank]
        to = dst.owner[mine]
        send = (to * n + dst.position[mine]).argsort()
        theirs = dst.index[rank]
        came = src.owner[theirs]
        arrival = (came * n + torch.arange(theirs.numel())).argsort()  # received row k is new row arrival[k]
        order = torch.empty_like(arrival)
        order[arrival] = torch.arange(arrival.numel())
        return cls(rank, send.to(device), torch.bincount(to, minlength=world).tolist(),
                   torch.bincount(came, minlength=world).tolist(), order.to(device),
                   bool((src.owner != dst.owner).any()))

    @property
    def moved(self) -> int:
        """Rows this rank sends to other ranks."""
        return sum(self.send_counts) - self.send_counts[self.rank]

    def __call__(self, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Rows packed as the old layout on this rank -> rows packed as the new one."""
        rows = x.index_select(0, self.send)
        if self.network:
            out = rows.new_empty(sum(self.recv_counts), *rows.shape[1:])
            dist.all_to_all_single(out, rows, self.recv_counts, self.send_counts, group=group)
            rows = out
        return rows.index_select(0, self.order)


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """Everything one rank needs for forwards over one token grid."""

    assignments: dict[WindowLayout, Assignment]  # per distinct layout
    batches: tuple[WindowBatch, ...]  # what this rank attends over in each layer
    exchanges: dict[tuple[WindowBatch, WindowBatch], Exchange]  # per layout switch that occurs
    out_counts: list[int]  # output rows of every rank (the last layer's packing)
    out_index: torch.Tensor  # canonical token id of every all-gathered output row (ranks in order)

    def relayout(self, group: dist.ProcessGroup | None):
        """`NaDiT.forward_rows`' relayout over `group`."""
        def relayout(x: torch.Tensor, src: WindowBatch, dst: WindowBatch) -> torch.Tensor:
            return x if src is dst else self.exchanges[src, dst](x, group)
        return relayout


@lru_cache(maxsize=16)
def plan(grid: Grid, size: Grid, num_layers: int, world: int, rank: int,
         device: torch.device = torch.device("cpu")) -> WindowPlan:
    """The plan of `rank` among `world` ranks for a token grid (cached: built once per grid)."""
    layouts = layer_layouts(grid, size, num_layers)
    assignments = {layout: Assignment.build(layout, world) for layout in dict.fromkeys(layouts)}
    batches = {layout: layout.batch(a.windows[rank], device) for layout, a in assignments.items()}
    exchanges = {}
    for prev, nxt in zip(layouts, layouts[1:]):
        if prev is not nxt and (batches[prev], batches[nxt]) not in exchanges:
            exchanges[batches[prev], batches[nxt]] = Exchange.build(assignments[prev], assignments[nxt], rank, device)
    last = assignments[layouts[-1]]
    return WindowPlan(assignments, tuple(batches[layout] for layout in layouts), exchanges, last.loads,
                      torch.cat(last.index).to(device))


def gather_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Every rank's x (counts[r] long along `dim`, any lengths) concatenated in rank order, on every rank."""
    if group is None or len(counts) == 1:
        return x
    most = max(counts)
    pad = list(x.shape)
    pad[dim] = most - x.shape[dim]
    x = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
    parts = [torch.empty_like(x) for _ in counts]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, counts)], dim)


def _sum_over(group: dist.ProcessGroup):
    def text_reduce(sums: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(sums, group=group)
        return sums
    return text_reduce


def predict(dit: NaDiT, vid: torch.Tensor, txt: torch.Tensor, timestep: float | torch.Tensor,
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """`dit(vid, txt, timestep)` with the windows spread over `group`: vid [T, H, W, 33] and txt, the same on every
    rank -> [T, H, W, 16] (fp32) on every rank."""
    c = dit.config
    world, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    grid = dit.grid(vid.shape[:3])
    p = plan(grid, dit.window_size(grid), c.num_layers, world, rank, vid.device)
    rows = patchify(vid, c.patch_size).index_select(0, p.batches[0].index)
    out = dit.forward_rows(rows, txt, dit.time_embedding(timestep), list(p.batches), p.relayout(group),
                           _sum_over(group) if world > 1 else None)
    out = gather_rows(out, p.out_counts, group)
    canonical = torch.empty_like(out).index_copy_(0, p.out_index, out)
    return unpatchify(canonical.float(), grid, c.patch_size)
