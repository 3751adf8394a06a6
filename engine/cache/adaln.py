"""Exact AdaLN projection cache (ARCHITECTURE.md §6, notes/peers.md §7).

The 50 per-block AdaLN projections and the final layer's (about 13B parameters at full size) depend only on the
timestep embedding, so one schedule's tables serve every request on that schedule. A table is reused only under
an exact key: the timestep embedding's bytes; the model instance and its `weights_version` (bumped by loads and
LoRA merges); the projection dtypes; the device and every numeric setting that can change a matmul's result. The
result is bit-identical to computing the tables in the forward.

Each step looks up its tables, and all ranks agree on hit or miss in one MIN all-reduce before any rank uses an
entry: if any rank misses, every rank recomputes. Entries are evicted least recently used beyond `max_bytes`.
With `offload`, the projection weights move to (pinned) host memory once a request's whole schedule is cached,
and come back on the next miss (a new schedule, or changed weights).

    schedule = cache.schedule(dit)
    for each step: dit(..., modulations=schedule(timestep))
    schedule.finish()
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.parallel.collectives import all_agree

# Per step: the per-block tables, then the final layer's (shift, scale); what `H3DiT.modulations` returns.
Modulations = tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]]

_serials: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_next_serial = itertools.count()


def model_serial(model: nn.Module) -> int:
    """A number no other model instance gets, unlike id(), which a later model may reuse."""
    if model not in _serials:
        _serials[model] = next(_next_serial)
    return _serials[model]


def numeric_settings(device: torch.device) -> tuple:
    """Every global setting that can change the bits of a matmul on `device`."""
    b = torch.backends
    settings = (
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, torch.get_float32_matmul_precision(), b.fp32_precision,
        b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision,
        b.cuda.matmul.allow_fp16_reduced_precision_reduction, b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        str(b.cuda.preferred_blas_library()), torch.are_deterministic_algorithms_enabled(), b.cudnn.deterministic,
        torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type),
    )
    # CPU GEMMs split their reductions by thread count.
    return settings + ((torch.get_num_threads(),) if device.type == "cpu" else ())


def embedding_key(temb: torch.Tensor) -> tuple:
    data = temb.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return str(temb.device), numeric_settings(temb.device), temb.dtype, tuple(temb.shape), data


def projections(model: nn.Module) -> list[nn.Linear]:
    return [block.adaln_proj.linear for block in model.blocks] + [model.final_layer.adaln_proj.linear]


def nbytes(tables: Modulations) -> int:
    blocks, final = tables
    return sum(t.numel() * t.element_size() for t in itertools.chain(*blocks, final))


class AdaLNCache:
    def __init__(self, max_bytes: int = 4 << 30, offload: bool = False, group: dist.ProcessGroup | None = None):
        self.max_bytes, self.offload, self.group = max_bytes, offload, group
        self.hits = self.misses = self.bytes = 0
        self._entries: OrderedDict[tuple, tuple[Modulations, int]] = OrderedDict()  # LRU order, oldest first
        self._homes: list[tuple[nn.Parameter, torch.device]] = []  # offloaded parameters and their devices
        # Host copies outlive a reload: page-locking the 24 GiB took 26 s on the H200 host, a later offload 0.5 s.
        self._host: dict[nn.Parameter, torch.Tensor] = {}

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._entries), "bytes": self.bytes,
                "offloaded": bool(self._homes)}

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def schedule(self, model: nn.Module) -> "Schedule":
        """One request's per-step lookups on `model`; call `finish()` after its last step."""
        return Schedule(self, model)

    def _lookup(self, model: nn.Module, timestep: torch.Tensor) -> tuple[tuple, Modulations]:
        linears = projections(model)
        serial, version = model_serial(model), getattr(model, "weights_version", 0)
        self._drop_stale(serial, version)
        temb = model.time_embedding(timestep)
        key = (serial, version, tuple(p.dtype for linear in linears for p in linear.parameters()),
               *embedding_key(temb))
        hit = key in self._entries
        if self.group is not None and dist.get_world_size(self.group) > 1:
            [hit] = all_agree([hit], self.group)
        if hit:
            self.hits += 1
            self._entries.move_to_end(key)
            return key, self._entries[key][0]
        self.misses += 1
        self._reload()
        tables = model.modulations(temb)
        self._store(key, tables)
        return key, tables

    def _drop_stale(self, serial: int, version: int) -> None:
        # weights_version only grows, so entries of this model's older versions can never hit again.
        for old in [k for k in self._entries if k[0] == serial and k[1] != version]:
            self.bytes -= self._entries.pop(old)[1]

    def _store(self, key: tuple, tables: Modulations) -> None:
        size = nbytes(tables)
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        while self._entries and self.bytes + size > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1][1]
        if size <= self.max_bytes:
            self._entries[key] = (tables, size)
            self.bytes += size

    def _offload(self, linears: list[nn.Linear]) -> None:
        if self._homes:
            return
        for linear in linears:
            for p in linear.parameters():
                host = self._host.get(p)
                if host is None or host.shape != p.shape or host.dtype != p.dtype:
                    host = self._host[p] = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
                self._homes.append((p, p.device))
                p.data = host.copy_(p.data)

    def _reload(self) -> None:
        for p, device in self._homes:
            p.data = p.data.to(device, non_blocking=True)
        self._homes = []


class Schedule:
    """`schedule(timestep)` gives one step's tables (what `H3DiT.forward(modulations=)` takes). With `offload`,
    `finish()` moves the projection weights off the device when every step of the schedule is cached, so the
    next request on it runs without them."""

    def __init__(self, cache: AdaLNCache, model: nn.Module):
        self.cache, self.model, self.keys = cache, model, []

    def __call__(self, timestep: torch.Tensor) -> Modulations:
        key, tables = self.cache._lookup(self.model, timestep)
        self.keys.append(key)
        return tables

    def finish(self) -> None:
        cache = self.cache
        if cache.offload and self.keys and all(key in cache._entries for key in self.keys):
            cache._offload(projections(self.model))
