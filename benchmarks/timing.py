"""GPU timing shared by the benchmarks: CUDA events around `iters` calls after `warmup` calls."""

import time

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
