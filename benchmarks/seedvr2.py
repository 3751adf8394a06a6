"""SeedVR2 3B on one GPU (full-size random weights, bf16) and what window-aligned SP needs per rank for 15 s of 1080p.

  1. DiT through the pipeline's `predict` at 1088x1920 for 21 frames (6 latent frames, 48 960 tokens, 2-frame
     windows) and 121 frames (31 latent frames, 252 960 tokens, full 8x15x27 windows): seconds per output frame,
     TFLOP/s, activation peak and bytes per token (slope between the two runs).
  2. VAE encode and decode of 21 frames at 1088x1920, tiled (the pipeline's default) and untiled: seconds per frame
     and activation peak (temporal chunks: the peak does not grow with the clip, also over ranks: vae_parallel).
  3. End to end `upscale` of 21 frames 544x960 -> 1088x1920: seconds per frame and peak; then 9 and 21 frames with
     the DiT stubbed: the memory that grows with the clip outside the DiT (whole-clip pixel tensors, which every
     rank holds).
  4. 15 s at 1080p (361 frames, 742 560 tokens) on --ranks ranks: the planner's tokens per rank and all-to-all
     traffic, and the predicted memory per rank (measured bytes per token x the busiest rank's tokens + the
     whole-clip tensors every rank holds), plus a compute-only time estimate.

    python benchmarks/seedvr2.py [--ranks 8] [--out benchmarks/results/seedvr2.json]
    python benchmarks/seedvr2.py --tiny     # the same code path on CPU with tiny configs (a smoke check)
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.models.seedvr2.config import NADIT_3B, TINY_3B, TINY_VAE, VAE  # noqa: E402
from engine.models.seedvr2.nadit import build_nadit  # noqa: E402
from engine.models.seedvr2.pipeline import SeedVR2Pipeline  # noqa: E402
from engine.models.seedvr2.vae import build_vae  # noqa: E402
from engine.parallel import window_sp  # noqa: E402

TEXT_LEN = 58  # rows of the released pos_emb.pt
GiB = 2**30
def measure(fn, device, iters=1):
    """(seconds per call, activation peak in bytes above what was allocated before, result of the last call)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(iters):
        result = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return seconds, peak, result


def gib(n):
    return None if n is None else round(n / GiB, 2)


def dit_flops(dit, grid) -> float:
    """Video-stream FLOPs of one forward: linear layers plus windowed attention (text rows joined to each window)."""
    c = dit.config
    tokens = math.prod(grid)
    linear = 2 * tokens * c.num_layers * (c.dim * 3 * c.inner_dim + c.inner_dim * c.dim + 3 * c.dim * c.mlp_dim)
    attention = sum(4 * n * (n + TEXT_LEN) * c.inner_dim for layout in dit.layouts(grid) for n in layout.token_counts)
    return linear + attention


def run_dit(pipe, frames, height, width, device):
    dit = pipe.dit
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)
    grid = dit.grid(latent)
    cond = torch.randn(*latent, 33, device=device)
    with torch.no_grad():
        pipe.predict(cond)  # warm-up: kernels, plan
        seconds, peak, _ = measure(lambda: pipe.predict(cond), device, iters=2)
    tokens = math.prod(grid)
    return {"frames": frames, "grid": list(grid), "tokens": tokens, "window": list(dit.window_size(grid)),
            "s": round(seconds, 3), "s_per_frame": round(seconds / frames, 4),
            "tflops": round(dit_flops(dit, grid) / seconds / 1e12, 1), "act_peak_GiB": gib(peak),
            "act_bytes_per_token": None if peak is None else round(peak / tokens)}


def run_vae(pipe, frames, height, width, device, tiling):
    vae = pipe.vae
    video = torch.rand(1, 3, frames, height, width, device=device) * 2 - 1
    with torch.no_grad():
        vae.decode(vae.encode(video[:, :, :5], tiling=tiling)[:, :16], tiling=tiling)  # warm-up (cuDNN picks)
        enc_s, enc_peak, moments = measure(lambda: vae.encode(video, tiling=tiling), device)
        dec_s, dec_peak, _ = measure(lambda: vae.decode(moments[:, :16], tiling=tiling), device)
    return {"tiling": tiling, "frames": frames, "encode_s_per_frame": round(enc_s / frames, 4),
            "decode_s_per_frame": round(dec_s / frames, 4), "s_per_frame": round((enc_s + dec_s) / frames, 4),
            "encode_act_peak_GiB": gib(enc_peak), "decode_act_peak_GiB": gib(dec_peak)}


def run_upscale(pipe, frames, height, width, device, dit=True):
    """`upscale` of a clip at half the size; without `dit` the DiT is replaced by zeros, so what grows with the
    clip is only the pipeline's whole-clip tensors."""
    clip = torch.randint(0, 256, (frames, height // 2, width // 2, 3), dtype=torch.uint8)
    if not dit:
        pipe.predict = lambda cond: torch.zeros_like(cond[..., :16])
    try:
        with torch.no_grad():
            seconds, peak, _ = measure(lambda: pipe.upscale(clip, target_height=height, target_width=width), device)
    finally:
        vars(pipe).pop("predict", None)
    return {"frames": frames, "dit": dit, "s": round(seconds, 2), "s_per_frame": round(seconds / frames, 3),
            "peak_GiB": gib(peak)}


def plan_15s(dit, ranks, height, width, frames=361) -> dict:
    """Window-aligned SP plan of a 15 s clip: tokens per rank (both layouts) and all-to-all rows per switch."""
    grid = dit.grid(((frames - 1) // 4 + 1, height // 8, width // 8))
    plans = [window_sp.plan(grid, dit.window_size(grid), dit.config.num_layers, ranks, r) for r in range(ranks)]
    layouts = {("shifted" if layout.shifted else "regular"): a for layout, a in plans[0].assignments.items()}
    loads = {name: a.loads for name, a in layouts.items()}
    switches = sum(1 for a, b in zip(plans[0].batches, plans[0].batches[1:]) if a is not b)
    moved = [sum(ex.moved for ex in p.exchanges.values()) / len(p.exchanges) for p in plans]
    tokens = math.prod(grid)
    busiest = max(max(v) for v in loads.values())
    return {"frames": frames, "grid": list(grid), "tokens": tokens, "ranks": ranks,
            "windows": {name: len(a.layout) for name, a in layouts.items()},
            "tokens_per_rank": loads, "busiest_rank_tokens": busiest,
            "imbalance": round(busiest / (tokens / ranks), 4), "layout_switches": switches,
            "rows_moved_per_switch": round(sum(moved)), "moved_fraction": round(sum(moved) / tokens, 3),
            # bf16 rows of width dim per switch, and one fp32 all-reduce of [L, dim] text sums per layer
            "all_to_all_GB_per_forward": round(sum(moved) * switches * dit.config.dim * 2 / 1e9, 2),
            "text_all_reduce_MB_per_forward": round(TEXT_LEN * dit.config.dim * 4 * dit.config.num_layers / 1e6, 1),
            "ulysses_GB_per_forward": round(4 * tokens * dit.config.dim * 2 * (ranks - 1) / ranks
                                            * dit.config.num_layers / 1e9, 2)}


def predict_memory(plan, dit_runs, vae_runs, upscale_runs, weights) -> dict:
    """Per-rank memory for the planned clip: weights + the DiT's local activations (bytes per token from the two
    DiT runs x the busiest rank's tokens) + what every rank holds for the whole clip: the patchified input, the
    gathered output (about 2 kB per token, from window_sp.predict) and the pipeline's pixel tensors (bytes per
    frame from the two upscale runs); the VAE's chunk peak does not grow with the clip."""
    a, b = dit_runs
    per_token = (b["act_peak_GiB"] - a["act_peak_GiB"]) * GiB / (b["tokens"] - a["tokens"])
    replicated_per_token = 2 * 132 * 4 + 64 * (2 + 2 + 2 + 8)
    dit_local = per_token * plan["busiest_rank_tokens"]
    dit_replicated = replicated_per_token * plan["tokens"]
    u0, u1 = (r for r in upscale_runs if not r["dit"])
    clip_per_frame = (u1["peak_GiB"] - u0["peak_GiB"]) * GiB / (u1["frames"] - u0["frames"])
    clip = clip_per_frame * plan["frames"]
    vae_chunk = max(r[k] for r in vae_runs for k in ("encode_act_peak_GiB", "decode_act_peak_GiB")) * GiB
    total = weights + max(dit_local + dit_replicated, vae_chunk) + clip
    return {"dit_bytes_per_token": round(per_token), "dit_local_GiB": gib(dit_local),
            "dit_replicated_GiB": gib(dit_replicated), "vae_chunk_peak_GiB": gib(vae_chunk),
            "clip_bytes_per_frame": round(clip_per_frame), "clip_tensors_GiB": gib(clip),
            "weights_GiB": gib(weights), "per_rank_GiB": gib(total),
            "single_gpu_dit_activations_GiB": gib(per_token * plan["tokens"])}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU: checks the code path only")
    parser.add_argument("--out", default="benchmarks/results/seedvr2.json")
    args = parser.parse_args()
    out = Path(args.out if not args.tiny else "benchmarks/results/seedvr2_tiny.json")
    device = torch.device("cpu" if args.tiny else "cuda")
    height, width = (64, 96) if args.tiny else (1088, 1920)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    dtype = torch.float32 if args.tiny else torch.bfloat16
    RESULTS.update(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   attention_backend=attn.choose(device), size=f"{width}x{height}", dtype=str(dtype)[6:])

    dit = build_nadit(TINY_3B if args.tiny else NADIT_3B, seed=0, dtype=dtype, device=device)
    vae = build_vae(TINY_VAE if args.tiny else VAE, seed=0, dtype=dtype, device=device)
    weights = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    text = torch.randn(TEXT_LEN, dit.config.text_dim)
    pipe = SeedVR2Pipeline(dit, vae, text, device, "3b (random weights)")
    RESULTS["weights_GiB"] = gib(weights)
    log(f"SeedVR2 3B, random weights, {RESULTS['dtype']}, {RESULTS['gpu']}, attention {RESULTS['attention_backend']}")

    stage("dit", lambda: RESULTS.__setitem__("dit", [run_dit(pipe, f, height, width, device) for f in (21, 121)]),
          out)
    stage("vae", lambda: RESULTS.__setitem__("vae", [run_vae(pipe, 21, height, width, device, t)
                                                     for t in (True, False)]), out)
    stage("upscale", lambda: RESULTS.__setitem__("upscale", [run_upscale(pipe, f, height, width, device, dit)
                                                             for f, dit in ((21, True), (9, False), (21, False))]),
          out)
    stage("plan", lambda: RESULTS.__setitem__("plan_15s", plan_15s(dit, args.ranks, height, width)), out)
    if device.type == "cuda" and all(k in RESULTS for k in ("dit", "vae", "upscale", "plan_15s")):
        plan = RESULTS["plan_15s"]
        memory = predict_memory(plan, RESULTS["dit"], RESULTS["vae"], RESULTS["upscale"], weights)
        long_run = RESULTS["dit"][1]
        vae_tiled = RESULTS["vae"][0]
        memory["compute_only_s"] = {
            "dit": round(long_run["s"] / long_run["tokens"] * plan["busiest_rank_tokens"], 2),
            "vae_tiled": round(vae_tiled["s_per_frame"] * plan["frames"] / plan["ranks"], 2)}
        RESULTS["predicted_15s_1080p"] = memory
        save(out)

    log(f"\n{'':<28}{'frames':>8}{'tokens':>10}{'s/frame':>10}{'TFLOP/s':>9}{'peak GiB':>10}")
    for r in RESULTS.get("dit", []):
        log(f"{'DiT predict':<28}{r['frames']:>8}{r['tokens']:>10}{r['s_per_frame']:>10}{r['tflops']:>9}"
            f"{str(r['act_peak_GiB']):>10}")
    for r in RESULTS.get("vae", []):
        name = f"VAE enc+dec {'tiled' if r['tiling'] else 'untiled'}"
        peak = max(r["encode_act_peak_GiB"] or 0, r["decode_act_peak_GiB"] or 0)
        log(f"{name:<28}{r['frames']:>8}{'':>10}{r['s_per_frame']:>10}{'':>9}{peak:>10}")
        log(f"{'  encode / decode':<28}{'':>18}{r['encode_s_per_frame']:>10} / {r['decode_s_per_frame']}")
    for r in RESULTS.get("upscale", []):
        name = "upscale end to end" if r["dit"] else "upscale, DiT stubbed"
        log(f"{name:<28}{r['frames']:>8}{'':>10}{r['s_per_frame']:>10}{'':>9}{str(r['peak_GiB']):>10}")
    if "plan_15s" in RESULTS:
        p = RESULTS["plan_15s"]
        log(f"\n15 s 1080p on {p['ranks']} ranks: {p['tokens']} tokens, windows {p['windows']}, busiest rank "
            f"{p['busiest_rank_tokens']} tokens (imbalance {p['imbalance']}), {p['moved_fraction']:.0%} of rows move "
            f"per layout switch ({p['all_to_all_GB_per_forward']} GB per forward over {p['layout_switches']} "
            f"switches; Ulysses would move {p['ulysses_GB_per_forward']} GB)")
    if "predicted_15s_1080p" in RESULTS:
        m = RESULTS["predicted_15s_1080p"]
        log(f"predicted per rank: {m['per_rank_GiB']} GiB = weights {m['weights_GiB']} + max(DiT {m['dit_local_GiB']}"
            f" local + {m['dit_replicated_GiB']} replicated, VAE chunk {m['vae_chunk_peak_GiB']}) + whole-clip "
            f"tensors {m['clip_tensors_GiB']}; one GPU would need {m['single_gpu_dit_activations_GiB']} GiB of DiT "
            f"activations; compute-only {m['compute_only_s']}")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
