"""The memory planner's plans for smaller GPUs, and what they cost a DiT step on this one (issue: fit the GPUs
people have). For each cap (24, 32, 48, 80 GiB, and this GPU uncapped) the planner plans a 5 s 1344x768 t2va on
the released model's sizes (engine/runtime/placement.config_sizes): precision, units on the GPU, text encoder,
bytes streamed per step, estimated peak. Then one step of a full-width DiT cut to `--blocks` blocks runs at the
plan's precision, dense and with VSA at 87.5 %, with the plan's share of its units on the GPU (streamed from pinned
host memory as the engine does) under `torch.cuda.set_per_process_memory_fraction(cap)`, against the same cut fully
resident: the ratio says whether the streaming hides behind compute. The cap stands in for a smaller card; the cut
model keeps every per-block number (bytes, FLOPs) of the full one, so the step and the PCIe traffic scale by
50 / blocks.

`--e2e CAP`: instead, the whole released-size pipeline (random weights: Qwen3-VL text encoder at the conditioner's
width and depth, the 50-block DiT in the layout of the Comfy-Org pruned files that 24-32 GB cards load (curve AdaLN,
rank 8; `--full-adaln` for the unpruned one), both VAEs) is planned and run as the engine runs it under a real CAP
GiB: built on
the GPU (a CPU init of 40 B parameters takes long), quantized there at the plan's precision, moved to host memory
(where the engine loads files), then `plan_engine` + `apply_plan` with the cap set, and one 5 s 1344x768 t2va (5
grid points, VSA 87.5 %) after a 2-point warm-up: seconds per phase, bytes streamed, peak GPU memory against the
plan's estimate, peak host memory; the host-side quantization the engine would do is timed on one block. When the
plan streams, the same job then runs uncapped with every DiT unit on the GPU: the denoise ratio streamed / resident.

    python benchmarks/memory_plan.py [--blocks 8] [--caps 24 32 48 80] [--out benchmarks/results/memory_plan.json]
    python benchmarks/memory_plan.py --e2e 24 [--out benchmarks/results/memory_plan_e2e.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
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
from engine.models.h3 import prune  # noqa: E402
from engine.models.h3.config import FULL  # noqa: E402
from engine.models.h3.dit import build_dit  # noqa: E402
from engine.models.h3.precision import set_precision  # noqa: E402
from engine.runtime.placement import config_sizes, hardware  # noqa: E402
from engine.runtime.planner import GiB, DoesNotFit, plan_memory, request  # noqa: E402
from engine.runtime.ranks import ALLOCATOR  # noqa: E402
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
    hw = hardware(device, 1, cap_gib, args.host_gib)
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


def end_to_end(args, device) -> None:
    from types import SimpleNamespace

    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    from benchmarks.h3_speed import random_conditioner
    from engine.models.h3.pipeline import FULL_CANVAS, H3Pipeline
    from engine.models.h3.request import GenerateRequest
    from engine.models.h3.vae import AudioVAE, VideoVAE
    from engine.runtime.placement import apply_plan, check_job, held_on_host, plan_engine

    config = FULL if args.full_adaln else replace(FULL, adaln_curve_grid=prune.GRID, time_embed_dim=prune.RANK)
    cap, e2e = args.e2e, RESULTS.setdefault("e2e", {"cap_gib": args.e2e, "adaln": "full" if args.full_adaln else "curve"})
    precision = plan_memory(config_sizes(config), hardware(device, 1, cap, None), request(FRAMES, HEIGHT, WIDTH)).precision
    one_block = build_dit(replace(config, num_layers=1, num_refiner_layers=0), seed=0, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    set_precision(one_block, precision)
    e2e["host_quantize_s_per_block"] = round(time.perf_counter() - t0, 2)
    e2e["host_quantize_s_est"] = round(e2e["host_quantize_s_per_block"] * (FULL.num_layers + FULL.num_refiner_layers), 1)
    del one_block

    t0 = time.perf_counter()
    conditioner = random_conditioner(SimpleNamespace(tiny=False, dtype=torch.bfloat16), device)
    conditioner.model.cpu()
    dit = build_dit(config, seed=0, dtype=torch.bfloat16, device=device)
    set_precision(dit, precision)
    dit.cpu()
    with torch.device(device):
        video_vae = VideoVAE(AutoencoderKLMiniMaxH3().eval().requires_grad_(False))
        audio_vae = AudioVAE(AutoencoderKLMiniMaxH3Audio().eval().requires_grad_(False))
    video_vae.cpu(), audio_vae.cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    e2e["build_s"] = round(time.perf_counter() - t0, 1)
    log(f"e2e: built in host memory in {e2e['build_s']} s ({precision} DiT)")

    pipe = H3Pipeline(dit, video_vae, audio_vae, conditioner, FULL_CANVAS, torch.device("cpu"), "random")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * GiB / total, device)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    planned = plan_engine(pipe, hardware(device, 1, cap, None, held_on_host(pipe)), "auto", None)
    apply_plan(pipe, planned, device)
    e2e["place_s"] = round(time.perf_counter() - t0, 1)
    e2e["plan"] = planned.as_dict()
    e2e["placed_GiB"] = round(torch.cuda.memory_allocated(device) / GiB, 2)
    log(f"e2e: placed in {e2e['place_s']} s: {planned.describe()}; {e2e['placed_GiB']} GiB on the GPU")
    save(args.out)
    pipe.vsa_sparsity = VSA_SPARSITY
    pipe.encode_mp4 = False  # the MP4 runs on the CPU beside the decode (h3_speed measures it); PyAV stays out
    req = GenerateRequest(prompt="A red kite climbs over a windy beach while waves crash.", seconds=5, width=WIDTH,
                          height=HEIGHT, steps=5, seed=0)
    def job(label: str, steps: int) -> bool:
        check_job(pipe, replace(req, steps=steps))
        torch.cuda.reset_peak_memory_stats()
        before = pipe.streamer.bytes_copied if pipe.streamer else 0
        t0 = time.perf_counter()
        try:
            result = pipe.generate(replace(req, steps=steps))
        except torch.OutOfMemoryError as exc:
            e2e[f"{label}_oom"] = str(exc).splitlines()[0]
            log(f"e2e {label}: out of memory: {e2e[f'{label}_oom']}")
            return False
        torch.cuda.synchronize()
        e2e[label] = {"total_s": round(time.perf_counter() - t0, 2),
                      **{k: round(v, 2) for k, v in result.timings.items()},
                      "streamed_GB": round(((pipe.streamer.bytes_copied if pipe.streamer else 0) - before) / 1e9, 1),
                      "peak_GiB": round(torch.cuda.max_memory_allocated(device) / GiB, 2),
                      "reserved_peak_GiB": round(torch.cuda.max_memory_reserved(device) / GiB, 2)}
        log(f"e2e {label}: {e2e[label]}")
        save(args.out)
        return True

    if job("warmup", 2) and job("timed", 5) and planned.plan.streaming:
        # The reference the streamed steps are held to: the same pipeline, precision and job, uncapped, with every
        # DiT unit on the GPU for good.
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        pipe.streamer.close()
        pipe.streamer = pipe.memory_plan = None
        if job("resident_warmup", 2) and job("resident", 5):
            e2e["denoise_ratio"] = round(e2e["timed"]["denoise_s"] / e2e["resident"]["denoise_s"], 3)
            log(f"e2e: denoise streamed under {cap} GiB / resident uncapped = {e2e['denoise_ratio']}")
    e2e["plan_estimate_GiB"] = round(planned.plan.device_bytes / GiB, 2)
    e2e["host_peak_GiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--caps", type=float, nargs="+", default=[24, 32, 48, 80])
    p.add_argument("--e2e", type=float, help="the whole released-size pipeline under this cap (GiB) instead")
    p.add_argument("--full-adaln", action="store_true", help="--e2e: the unpruned DiT (full AdaLN projections)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_plan.json"))
    args = p.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)  # as the engine's ranks run, set before CUDA starts
    device = torch.device("cuda", torch.cuda.current_device())
    if args.e2e:
        stage("e2e", lambda: end_to_end(args, device), args.out)
        e2e = RESULTS.get("e2e", {})
        log(f"e2e under {args.e2e} GiB: {e2e.get('plan', {}).get('plan')}; timed run {e2e.get('timed')}; plan "
            f"estimate {e2e.get('plan_estimate_GiB')} GiB; host peak {e2e.get('host_peak_GiB')} GiB; host-side "
            f"quantization ~{e2e.get('host_quantize_s_est')} s")
        save(args.out)
        return 0
    # What the host has available before any cap's run pins memory (the CUDA host allocator keeps what it pinned):
    # every cap is planned against it.
    args.host_gib = hardware(device, 1, None, None).host_bytes / GiB
    RESULTS.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, request=f"{FRAMES} frames "
                   f"{WIDTH}x{HEIGHT}", rows=request(FRAMES, HEIGHT, WIDTH).rows,
                   latent_frames=L.latent_frames(FRAMES), host_available_gib=round(args.host_gib, 1))
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
