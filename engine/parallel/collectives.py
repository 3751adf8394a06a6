"""The few collectives sequence parallelism and the AdaLN cache need (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk i of x along dim 0 goes to rank i; chunk i of the result came from rank i."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's x concatenated along `dim`, in rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def all_agree(flags: list[bool], group: dist.ProcessGroup) -> list[bool]:
    """Each flag AND-ed over the ranks, in one MIN all-reduce."""
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(f) for f in t.tolist()]
