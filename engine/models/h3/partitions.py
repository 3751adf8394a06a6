"""The DiT partitions of MiniMax-H3 (specs/h3.md §6): FL2VA (t2va, fl2va, edit, extend, refine) and Ref2VA.

One partition is active on the device. A partition is loaded on its first job; the one it replaces stays on the
device when both fit beside `reserve_bytes` of working memory, else waits in pinned host memory, else (host memory
short too) is dropped and read from disk again when next needed. On a streaming engine (`on_host`) both wait in host
memory and the pipeline streams the active one's blocks. Every swap is timed, logged and kept for the
engine's status.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.nn as nn

from engine.models.h3.layout import LayoutError
from engine.models.phases import Phase

PARTITIONS = {"fl2va": "FL2VA", "ref2va": "Ref2VA"}
RESERVE_BYTES = 8 << 30  # working memory a job needs beside the DiTs on the GPU (activations, VAE decode)
SWAPS_KEPT = 16

log = logging.getLogger("h3forge.partitions")


def partition_for(task: str) -> str | None:
    """The partition an H3 task runs on (None: SeedVR2's upscale needs neither)."""
    return None if task == "upscale" else "ref2va" if task == "ref2va" else "fl2va"


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def to_pinned_host(module: nn.Module) -> nn.Module:
    for t in (*module.parameters(), *module.buffers()):
        t.data = torch.empty_like(t.data, device="cpu", pin_memory=True).copy_(t.data)
    return module


class Partitions:
    def __init__(self, active: str, device: torch.device, loaders: dict[str, Callable[[], nn.Module]],
                 reserve_bytes: int = RESERVE_BYTES):
        self.active, self.device, self.loaders = active, torch.device(device), loaders
        self.reserve_bytes = reserve_bytes
        self.idle: dict[str, nn.Module] = {}  # loaded partitions not active: on the device or in host memory
        self.prepare: Callable[[nn.Module], nn.Module] = lambda dit: dit  # e.g. --dit-precision, on every load
        self.on_host = False  # a streaming engine's DiTs live in host memory; the pipeline streams the active one
        self.swaps: list[dict] = []

    def available(self, name: str) -> bool:
        return name == self.active or name in self.idle or name in self.loaders

    def activate(self, name: str, current: nn.Module, on_step=None) -> nn.Module:
        """The DiT of partition `name` on the device (`current` is the active one's); a "loading" boundary
        before and after a swap."""
        if name == self.active:
            return current
        if not self.available(name):
            raise LayoutError(f"This engine has no {PARTITIONS[name]} weights, which {name} jobs need. Start it with "
                              f"the {PARTITIONS[name]} DiT (a models folder holding {PARTITIONS[name]}/, or --ref-dit "
                              f"FILE for Comfy-Org single files).")
        t0 = time.perf_counter()
        done = Phase(on_step, "loading", 1, f"{PARTITIONS[name]} DiT")
        incoming = self.idle.pop(name, None)
        source = "disk" if incoming is None else self._where(incoming)
        if source != "device" and not self.on_host and not self._fits(module_bytes(current)):  # same size
            self._park(self.active, current)
            current = None
        else:
            self.idle[self.active] = current
        if incoming is None:
            incoming = self.prepare(self.loaders[name]())
        incoming = incoming.to("cpu" if self.on_host else self.device)
        swap = {"from": self.active, "to": name, "source": source, "seconds": round(time.perf_counter() - t0, 3),
                "previous_kept": "device" if current is not None else self._where_idle(self.active)}
        self.swaps = (self.swaps + [swap])[-SWAPS_KEPT:]
        log.info("partition swap %s", swap)
        self.active = name
        done()
        return incoming

    def describe(self) -> dict:
        idle = {name: self._where(dit) for name, dit in self.idle.items()}
        on_disk = {name: "disk" for name in self.loaders if name != self.active and name not in idle}
        return {"active": self.active, "idle": {**idle, **on_disk}, "swaps": len(self.swaps),
                "last_swap": self.swaps[-1] if self.swaps else None}

    def _where(self, dit: nn.Module) -> str:
        return "device" if not self.on_host and next(dit.parameters()).device == self.device else "host"

    def _where_idle(self, name: str) -> str:
        return self._where(self.idle[name]) if name in self.idle else "disk"

    def _fits(self, incoming_bytes: int) -> bool:
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free - incoming_bytes >= self.reserve_bytes

    def _park(self, name: str, dit: nn.Module) -> None:
        """Into pinned host memory when the host has room for it, else dropped (read from disk when next needed)."""
        available = host_available_bytes()
        if name in self.loaders and available is not None and available < 1.2 * module_bytes(dit):
            dit.to("meta")  # frees its device memory though the caller still holds the module
        else:
            self.idle[name] = to_pinned_host(dit)
        torch.cuda.empty_cache()
