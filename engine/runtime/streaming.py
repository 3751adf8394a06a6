"""Block streaming: a model's big units (DiT blocks, their AdaLN projections, refiner blocks) live in host memory
and come to the device just before use, at most `resident` of them at a time.

Of the `resident` places, all but two hold units that stay for the whole job once copied (the largest units,
`kept`); the other units take turns in the last two places, one running while the next is copied in on a side
stream. A step then copies only the units that take turns: with K of N resident, N - (K - 2) units a step, not N
(plain LRU over a cyclic order would evict every unit before its next use). Each unit is a module whose call brings
its tensors in (a forward pre-hook): the streamer makes it resident (a miss when it was not prefetched), makes the
compute stream wait for its copy, and starts copying the next unit that takes turns. What follows a unit is what
followed it on the last pass (the AdaLN cache skips the projections on a hit), at first the order given. Units
evicted to make room drop their device copies; `record_stream` keeps the allocator from reusing that memory before
the compute stream is done with it.

The copies are exact, so the output is bit-identical to the resident model's. The host copies are the canonical
weights between jobs: `release()` evicts every unit, after which weight edits (LoRA merges) land on the host
copies and reach the device with the next fetch. On a CPU device the "device" copies are clones (the logic runs
as on a GPU, without streams), which is how the tests count residency.

    streamer = BlockStreamer(units, device, resident=4)
    ... forward passes ...
    streamer.release()
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Unit:
    module: nn.Module  # its call brings the tensors in
    slots: list[tuple[nn.Module, str, bool]]  # (owner, name, is a parameter) of every tensor the unit streams
    host: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    ready: torch.cuda.Event | None = None  # the copy to the device is done


def unit_tensors(module: nn.Module, exclude: tuple[nn.Module, ...] = ()) -> list[tuple[nn.Module, str, bool]]:
    """Every parameter and buffer under `module`, except those under the `exclude` submodules (their own units)."""
    skipped = {id(m) for e in exclude for m in e.modules()}
    slots = []
    for owner in module.modules():
        if id(owner) in skipped:
            continue
        slots += [(owner, name, True) for name, p in owner._parameters.items() if p is not None]
        slots += [(owner, name, False) for name, b in owner._buffers.items() if b is not None]
    return slots


def _get(owner: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    return owner._parameters[name] if is_param else owner._buffers[name]


def _set(owner: nn.Module, name: str, is_param: bool, tensor: torch.Tensor) -> None:
    if is_param:
        owner._parameters[name].data = tensor
    else:
        owner._buffers[name] = tensor


class BlockStreamer:
    def __init__(self, units: list[tuple[nn.Module, tuple[nn.Module, ...]]], device: torch.device | str,
                 resident: int):
        """`units`: (module, submodules it leaves to other units), in the order a forward pass calls them."""
        if resident < 1:
            raise ValueError(f"At least one unit must be resident, got {resident}.")
        self.device = torch.device(device)
        self.resident = resident
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.units = [Unit(module, unit_tensors(module, exclude)) for module, exclude in units]
        self.kept: set[int] = set()  # units that stay once copied (set below, when their sizes are known)
        self.order = {id(u.module): i for i, u in enumerate(self.units)}
        self.next = {i: (i + 1) % len(self.units) for i in range(len(self.units))}
        self.on_device: OrderedDict[int, None] = OrderedDict()  # resident units, least recently used first
        self.last: int | None = None
        self.hooks = []
        self.fetches = self.misses = self.bytes_copied = self.max_resident = 0
        for unit in self.units:
            for slot in unit.slots:
                tensor = _get(*slot)
                host = tensor.detach().to("cpu", copy=True)
                unit.host.append(host.pin_memory() if self.cuda else host)
                unit.nbytes += tensor.numel() * tensor.element_size()
                _set(*slot, unit.host[-1])
            self.hooks.append(unit.module.register_forward_pre_hook(self._before))
        turns = 2 if resident < len(self.units) else 0  # places the other units take turns in
        largest = sorted(range(len(self.units)), key=lambda i: -self.units[i].nbytes)
        self.kept = set(largest[:max(0, resident - turns)])
        if self.cuda:
            torch.cuda.empty_cache()

    @property
    def host_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def stats(self) -> dict:
        return {"units": len(self.units), "resident": self.resident, "kept": len(self.kept),
                "max_resident": self.max_resident,
                "fetches": self.fetches, "misses": self.misses, "bytes_copied": self.bytes_copied,
                "host_bytes": self.host_bytes}

    def _before(self, module: nn.Module, args) -> None:
        i = self.order[id(module)]
        if self.last is not None:
            self.next[self.last] = i  # what followed the previous unit this time
        self.last = i
        if i not in self.on_device:
            self.misses += 1
            self._fetch(i, keep=(i,))
        self.on_device.move_to_end(i)
        unit = self.units[i]
        if unit.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
        ahead, j, taking_turns = [i], i, 0
        while taking_turns < min(1, self.resident - 1):  # copy the next unit that takes turns (kept ones on the way)
            j = self.next[j]
            if j in ahead:
                break
            ahead.append(j)
            taking_turns += j not in self.kept
            if j not in self.on_device:
                self._fetch(j, keep=tuple(ahead))

    def _fetch(self, i: int, keep: tuple[int, ...]) -> None:
        while len(self.on_device) >= self.resident:
            victim = next((j for j in self.on_device if j not in keep and j not in self.kept), None)
            if victim is None:
                return  # every resident unit is needed sooner: fetch this one when it is called
            self._evict(victim)
        unit = self.units[i]
        unit.host = [_get(*slot).data for slot in unit.slots]  # an edit may have replaced a tensor (requantize)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                copies = [h.to(self.device, non_blocking=True) for h in unit.host]
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.copy_stream)
        else:
            copies = [h.clone() for h in unit.host]
        for slot, tensor in zip(unit.slots, copies):
            _set(*slot, tensor)
        self.on_device[i] = None
        self.fetches += 1
        self.bytes_copied += unit.nbytes
        self.max_resident = max(self.max_resident, len(self.on_device))

    def _evict(self, i: int) -> None:
        unit = self.units[i]
        for slot, host in zip(unit.slots, unit.host):
            if self.cuda:
                _get(*slot).record_stream(torch.cuda.current_stream(self.device))
            _set(*slot, host)
        unit.ready = None
        del self.on_device[i]

    def release(self) -> None:
        """Evict every unit (the host copies are the weights between jobs)."""
        for i in list(self.on_device):
            self._evict(i)
        self.last = None

    def detach(self) -> None:
        """Stop streaming, every unit's weights left in host memory (the hooks removed)."""
        self.release()
        for hook in self.hooks:
            hook.remove()

    def close(self) -> None:
        """Stop streaming: every unit back on the device for good, the hooks removed."""
        self.detach()
        for unit in self.units:
            for slot, host in zip(unit.slots, unit.host):
                _set(*slot, host.to(self.device))


def move_unstreamed(model: nn.Module, units: list[nn.Module], device: torch.device) -> None:
    """Every parameter and buffer of `model` outside the streamed `units` to `device`."""
    for slot in unit_tensors(model, tuple(units)):
        _set(*slot, _get(*slot).to(device))


def dit_units(dit: nn.Module) -> list[tuple[nn.Module, tuple[nn.Module, ...]]]:
    """The H3 DiT's streamed units in the order a step calls them: the refiner blocks, every block's AdaLN
    projection (the step's tables are computed up front), then every block without its projection."""
    refiner = [(block, ()) for block in dit.token_refiner.blocks]
    projections = [(block.adaln_proj, ()) for block in dit.blocks]
    return refiner + projections + [(block, (block.adaln_proj,)) for block in dit.blocks]
