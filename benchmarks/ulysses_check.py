"""Ulysses sequence parallelism over NCCL on 2 GPUs against one GPU: a full-width H3 DiT cut to --layers blocks
(1 refiner block), 1344x768, dense and with VSA at 87.5 %; each rank times the forward alone (one GPU) and then
split over both ranks, and compares the two outputs. Needs 2 GPUs; --cpu runs the same code on 2 gloo ranks with a
4-head tiny DiT (a smoke check).

    python benchmarks/ulysses_check.py [--frames 124] [--layers 2] [--out benchmarks/results/ulysses_check.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import vsa  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL, TEXT_TAG, TINY  # noqa: E402
from engine.models.h3.dit import build_dit  # noqa: E402
from engine.parallel import ulysses  # noqa: E402


def timed(fn, sync, iters=3):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    sync()
    return out, (time.perf_counter() - t0) / iters * 1e3


def rank_main(rank, args, store):
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    if args.cpu:
        config, dtype, frames, hw = dataclasses.replace(TINY, num_attention_heads=4), torch.float32, 22, (8, 14)
    else:
        config = dataclasses.replace(FULL, num_layers=args.layers, num_refiner_layers=1)
        dtype, frames, hw = torch.bfloat16, args.frames, (48, 84)
    dit = build_dit(config, seed=0, dtype=dtype, device=device)
    lay = L.build_layout(torch.full((64,), TEXT_TAG), L.latent_frames(frames), *hw, L.audio_latents(frames))
    timestep, idx = L.row_timesteps(lay, 0.4, 0.6)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, lay.video_indices.numel(), config.video_patch_dim, generator=g)
    audio = torch.randn(1, lay.audio_indices.numel(), config.audio_in_channels, generator=g)
    text = torch.randn(1, lay.num_text, config.text_dim, generator=g)
    inputs = [x.to(device) for x in (video, audio, text, timestep, idx, lay.token_tags, lay.position_ids,
                                     lay.video_indices, lay.audio_indices, lay.text_indices)]
    plan = vsa.build_plan(lay.to(device))
    topk = vsa.topk_for_sparsity(0.875, plan.num_cubes)
    results = {}
    with torch.no_grad():
        for mode in ("dense", "vsa"):
            def forward():
                if mode == "vsa":
                    with vsa.active(plan, topk):
                        return dit(*inputs)
                return dit(*inputs)

            one, one_ms = timed(forward, sync)
            dist.barrier()
            with ulysses.parallel(dist.group.WORLD):
                two, two_ms = timed(forward, sync)
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(two, one))
            results[mode] = {"one_gpu_ms": round(one_ms, 1), "ulysses2_ms": round(two_ms, 1),
                             "speedup": round(one_ms / two_ms, 3), "rel_err_vs_one_gpu": err}
    if rank == 0:
        print(json.dumps(results), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], args.out.name).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ulysses_check.json"))
    args = parser.parse_args()
    if not args.cpu and torch.cuda.device_count() < 2:
        print("ulysses_check needs 2 GPUs (or --cpu for the gloo smoke check)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "store")), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
