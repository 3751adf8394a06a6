"""The memory planner's plans for smaller GPUs, and what they cost a DiT step on this one (issue: fit the GPUs
people have). For each cap (24, 32, 48, 80 GiB, and this GPU uncapped) the planner plans a 5 s 1344x768 t2va on
the released model's sizes (engine/runtime/placement.config_sizes): precision, units on the GPU, text encoder,
bytes streamed per step, estimated peak. Then one step of a full-width DiT cut to `--blocks` blocks runs at the
plan's precision, dense and with VSA at 87.5 %, with the plan's share of its units on the GPU (streamed from pinned
host memory as the engine does) under `torch.cuda.set_per_process_memory_fraction(cap)`, against the same cut fully
resident: the ratio says whether the streaming hides behind compute. The cap stands in for a smaller card; the cut
model keeps every per-block number (bytes, FLOPs) of the full one, so the step and the PCIe traffic scale by
50 / blocks.

    python benchmarks/memory_plan.py [--blocks 8] [--caps 24 32 48 80] [--out benchmarks/results/memory_plan.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.h3_dit import make_layout  # noqa: E402
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.streaming import step_inputs  # noqa: E402
from benchmarks.timing import cuda_ms  # noqa: E402
from engine.kernels import vsa  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL  # noqa: E402
from engine.models.h3.dit import build_dit  # noqa: E402
from engine.models.h3.precision import set_precision  # noqa: E402
from engine.runtime.placement import config_sizes, hardware  # noqa: E402
from engine.runtime.planner import GiB, DoesNotFit, plan_memory, request  # noqa: E402
from engine.runtime.streaming import BlockStreamer, dit_units  # noqa: E402

FRAMES = 124  # 5 s
HEIGHT, WIDTH = 768, 1344
VSA_SPARSITY = 0.875


def step_flops(blocks: int, rows: int) -> float:
    """Dense GEMM + attention FLOPs of one DiT step over `rows` packed rows (2 per multiply-add)."""
    c = FULL
    gemm = 2 * rows * (c.hidden_size * 3 * c.inner_dim + c.inner_dim * c.hidden_size + 3 * c.hidden_size * c.ffn_dim)
    attention = 4 * rows * rows * c.inner_dim
    return blocks * (gemm + attention)


def run(args, cap_gib: float | None, device) -> None:
    torch.cuda.empty_cache()  # the last cap's cut DiT
    total = torch.cuda.get_device_properties(device).total_memory
    hw = hardware(device, 1, cap_gib, None)
    req = request(FRAMES, HEIGHT, WIDTH)
    try:
        plan = plan_memory(config_sizes(FULL), hw, req)
    except DoesNotFit as exc:
        RESULTS.setdefault("caps", []).append({"cap_gib": cap_gib, "refused": str(exc)})
        log(f"cap {cap_gib}: refused: {exc}")
        return
    row = {"cap_gib": cap_gib or round(total / GiB, 1), "plan": plan.as_dict(),
           "host_gib": round(plan.host_bytes / GiB, 1)}
    torch.cuda.set_per_process_memory_fraction(min(1.0, (cap_gib or total / GiB) * GiB / total), device)
    dit = build_dit(replace(FULL, num_layers=args.blocks), seed=0, dtype=torch.bfloat16, device=device)
    if plan.precision in ("fp8", "int8"):
        set_precision(dit, plan.precision)
    inputs = step_inputs(FRAMES, device)
    flops = step_flops(args.blocks, inputs[4].numel())
    sparse = vsa.build_plan(make_layout(FRAMES).to(device))
    topk = vsa.topk_for_sparsity(VSA_SPARSITY, sparse.num_cubes)
    for attention in ("dense", "vsa"):
        with torch.no_grad(), vsa.active(sparse, topk) if attention == "vsa" else contextlib.nullcontext():
            row[attention] = step(args, dit, inputs, plan, flops, device)
    RESULTS.setdefault("caps", []).append(row)
    log(f"cap {row['cap_gib']} GiB: {plan.describe()}")
    for attention in ("dense", "vsa"):
        r = row[attention]
        streamed = (f"streamed {r['streamed_ms']:.0f} ms ({r['ratio']:.2f}x, {r['pcie_gb_s']:.1f} GB/s over PCIe)"
                    if plan.streaming else "no streaming")
        log(f"  {args.blocks}-block cut, {attention}: resident {r['resident_ms']:.0f} ms ({r['resident_tflops']:.0f} "
            f"TFLOP/s dense-equivalent), {streamed}, peak {r['peak_gib']:.1f} GiB")


def step(args, dit, inputs, plan, flops: float, device) -> dict:
    """One step resident, then with the plan's share of units on the GPU (the rest streamed)."""
    torch.cuda.reset_peak_memory_stats()
    reference = dit(*inputs)[0]
    resident_ms = cuda_ms(lambda: dit(*inputs), warmup=1, iters=3)
    units = len(dit_units(dit))
    r = {"resident_ms": resident_ms, "resident_tflops": flops / resident_ms / 1e9, "units_cut": units}
    if plan.streaming:
        k = max(2, round(units * plan.resident_units / plan.units))
        streamer = BlockStreamer(dit_units(dit), device, k)
        torch.cuda.reset_peak_memory_stats()
        identical = bool(torch.equal(dit(*inputs)[0], reference))
        streamer.release()
        before = streamer.bytes_copied
        ms = cuda_ms(lambda: dit(*inputs), warmup=1, iters=3)
        per_step = (streamer.bytes_copied - before) / 4
        r.update(resident_units_cut=k, streamed_ms=ms, ratio=ms / resident_ms, bytes_per_step_gb=per_step / 1e9,
                 pcie_gb_s=per_step / ms / 1e6, identical=identical)
        streamer.close()
    r["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
    return r


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--caps", type=float, nargs="+", default=[24, 32, 48, 80])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_plan.json"))
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    RESULTS.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, request=f"{FRAMES} frames "
                   f"{WIDTH}x{HEIGHT}", rows=request(FRAMES, HEIGHT, WIDTH).rows,
                   latent_frames=L.latent_frames(FRAMES))
    for cap in [*args.caps, None]:
        stage(f"cap_{cap or 'none'}", lambda: run(args, cap, device), args.out)
    log(f"{'cap GiB':>8} {'precision':>9} {'units':>7} {'dense ms':>9} {'ratio':>6} {'VSA ms':>7} {'ratio':>6} "
        f"{'GB/step':>8} {'peak GiB':>9} {'host GiB':>9}")
    for row in RESULTS.get("caps", []):
        if "plan" in row:
            d, v, plan = row["dense"], row["vsa"], row["plan"]
            log(f"{row['cap_gib']:>8} {plan['precision']:>9} {plan['resident_units']:>3}/{plan['units']:<3} "
                f"{d.get('streamed_ms', d['resident_ms']):>9.0f} {d.get('ratio', 1.0):>6.2f} "
                f"{v.get('streamed_ms', v['resident_ms']):>7.0f} {v.get('ratio', 1.0):>6.2f} "
                f"{d.get('bytes_per_step_gb', 0):>8.1f} {max(d['peak_gib'], v['peak_gib']):>9.1f} {row['host_gib']:>9.1f}")
    save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
