"""The engine's process group: which rank this is, its device, and the groups jobs run over.

One rank needs no process group. With N ranks (started by `engine.runtime.launch` through torchrun) the
default group uses NCCL on GPUs and gloo on CPU; it is the group sequence-parallel code shards over. A second,
gloo-only `control` group carries job dispatch and the per-step cancel agreement: small host-side objects that
must not queue behind GPU work, and idle ranks may wait on it for the next job without a deadline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Idle ranks block in the dispatch broadcast until the next job arrives, which may be days away.
IDLE_WAIT = timedelta(days=365)
# Streamed DiT units of different sizes come and go every step and fragment fixed-size segments: a 24 GiB plan
# on an H200 ran out of memory with 20.0 GiB allocated and 3.6 GiB reserved but free
# (benchmarks/results/memory_plan_e2e_h200_run2.json). Segments that grow in place do not; an operator's
# PYTORCH_CUDA_ALLOC_CONF stands.
ALLOCATOR = "expandable_segments:True"


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    group: "dist.ProcessGroup | None" = None  # compute group for sharded work (NCCL on GPUs, gloo on CPU)
    control: "dist.ProcessGroup | None" = None  # gloo: job dispatch and step agreement
    host_ranks: int = 1  # ranks on this host (they share its memory)

    @property
    def backend(self) -> str | None:
        return dist.get_backend(self.group) if self.group is not None else None


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but PyTorch sees no CUDA GPU here. Use --device cpu.")
    return name


def init_ranks(device_name: str) -> RankContext:
    """Joins the process group torchrun set up (env RANK/WORLD_SIZE/LOCAL_RANK), or a single rank."""
    device_type = resolve_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)  # read when CUDA starts, just below
        torch.cuda.set_device(device)
    if world_size == 1:
        # The VAEs' 3-D convolutions repeat one shape per canvas: cuDNN times its algorithms once per shape and keeps
        # the fastest (as benchmarks/h3_vae.py and seedvr2.py measure them). Not across ranks: each rank encodes the
        # same source and could time a different algorithm into slightly different latents.
        torch.backends.cudnn.benchmark = device.type == "cuda"
        return RankContext(0, 1, device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP (multicast) off: not every host allows it
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    return RankContext(dist.get_rank(), world_size, device, dist.group.WORLD, control,
                       int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def close_ranks(ctx: RankContext) -> None:
    if ctx.group is not None and dist.is_initialized():
        dist.destroy_process_group()
