"""Timing shared by the benchmarks: CUDA events around `iters` calls after `warmup` calls; wall time and peak memory
of a whole call (`measure`)."""

import contextlib
import gc
import time
from typing import Any, NamedTuple

import torch


def cuda_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def timed(fn, sync, warmup=1, iters=3) -> float:
    """Mean ms of `fn` over `iters` calls after `warmup`, `sync` (e.g. torch.cuda.synchronize) around them."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


class Measured(NamedTuple):
    seconds: float  # per call
    peak: int | None  # bytes allocated at the peak of the timed calls (None: a CPU run without `cpu_memory`)
    start: int  # bytes allocated before them
    result: Any  # of the last call

    @property
    def above_start(self) -> int | None:
        return None if self.peak is None else self.peak - self.start


def measure(fn, device: torch.device, warmup: int = 0, iters: int = 1, cpu_memory=None) -> Measured:
    """Wall seconds per call of `fn` over `iters` calls after `warmup`, and the peak memory of those calls. On the
    CPU, which keeps no allocator statistics, the peak is `cpu_memory`'s (a context manager with a `.peak` in bytes,
    e.g. benchmarks/seedvr2.FloatMemory; it slows the calls) when one is given."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    start = 0
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    memory = cpu_memory if cpu_memory is not None and not cuda else contextlib.nullcontext()
    with memory:
        t0 = time.perf_counter()
        for _ in range(iters):
            result = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() if cuda else getattr(memory, "peak", None)
    return Measured(seconds, peak, start, result)
