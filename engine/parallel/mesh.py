"""How the engine's ranks share the H3 DiT: tensor parallelism (engine/parallel/tensor.py) inside, Ulysses sequence
parallelism (engine/parallel/ulysses.py) across (notes/h3_quantized_files.md §7.3).

N ranks run T-way TP and U = N/T-way Ulysses, TP-major: rank = u·T + t. A TP group is T consecutive ranks (one host,
where its two all-reduces per block have NVLink) holding one copy of the weights between them; rank t of every TP
group forms a Ulysses group, which splits the packed sequence and trades it for heads around attention. Both split
the heads: T must be one of `tensor.tp_degrees` and U must divide the H/T heads left per rank. With T = 1 and U not
dividing H, every rank runs the whole sequence (replicated), as before TP.

    mesh = plan(ranks, tp, dit.config)  # ValueError: what is possible instead
    parallel = Parallel.build(mesh, world)  # every rank, the same mesh: process groups are made by all ranks
    parallel.shard(dit)
    with parallel.sequence_parallel():
        video, audio = dit(...)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from engine.models.h3.config import H3Config
from engine.parallel import tensor, ulysses


@dataclass(frozen=True)
class Mesh:
    ranks: int
    tp: int = 1
    ulysses: int = 1  # 1 with ranks > tp: every rank runs the whole sequence (TP 1 only)

    def describe(self) -> str:
        parts = [f"{name} x{n}" for name, n in (("tensor parallel", self.tp), ("ulysses", self.ulysses)) if n > 1]
        return " · ".join(parts) or (f"replicated on {self.ranks} ranks" if self.ranks > 1 else "one rank")

    def choice(self) -> str:
        """This mesh as the serve option that gives it."""
        if self.ulysses > 1:
            return f"--tp {self.tp} (Ulysses {self.ulysses})"
        return f"--tp {self.tp}" + ("" if self.tp == self.ranks else " (the whole sequence on every GPU)")


def meshes(ranks: int, config: H3Config) -> list[Mesh]:
    """Every mesh of `ranks` ranks this DiT can run, by TP degree."""
    heads = config.num_attention_heads
    out = [Mesh(ranks, 1, ranks if heads % ranks == 0 else 1)]
    for tp in tensor.tp_degrees(config)[1:]:
        if ranks % tp == 0 and (heads // tp) % (ranks // tp) == 0:
            out.append(Mesh(ranks, tp, ranks // tp))
    return out


def plan(ranks: int, tp: int, config: H3Config) -> Mesh:
    """The mesh of `ranks` ranks with TP degree `tp`, or ValueError listing the ones that are possible."""
    possible = meshes(ranks, config)
    mesh = next((m for m in possible if m.tp == tp), None)
    if mesh is not None:
        return mesh
    choices = [m.choice() for m in possible]
    listed = choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]
    raise ValueError(f"--gpus {ranks} --tp {tp} is not possible: MiniMax-H3 has {config.num_attention_heads} "
                     f"attention heads; with {ranks} GPU{'s' if ranks > 1 else ''} use {listed}")


def _group(members: list[list[int]], world: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """This rank's group among `members` (one list per group); every rank makes every group, in the same order."""
    if len(members[0]) == 1:
        return None
    if len(members) == 1:
        return world
    rank, mine = dist.get_rank(), None
    for ranks in members:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class Parallel:
    """This rank's groups of a mesh: `tensor` (None: no TP) and `ulysses` (None: the whole sequence)."""

    mesh: Mesh
    tensor: dist.ProcessGroup | None = None
    ulysses: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, mesh: Mesh, world: dist.ProcessGroup | None) -> "Parallel":
        """The groups of `mesh` over `world` (the group of all ranks; None on one rank). Every rank calls this with
        the same mesh."""
        T, U = mesh.tp, mesh.ulysses
        return cls(mesh, _group([[u * T + t for t in range(T)] for u in range(U)], world),
                   _group([[u * T + t for u in range(U)] for t in range(T)], world))

    def shard(self, dit: nn.Module) -> nn.Module:
        """`dit` cut for this rank's TP group (unchanged without TP)."""
        return dit if self.tensor is None else tensor.shard(dit, self.tensor)

    def sequence_parallel(self) -> contextlib.AbstractContextManager:
        """DiT forwards inside run sequence-parallel over this rank's Ulysses group."""
        return ulysses.parallel(self.ulysses)
