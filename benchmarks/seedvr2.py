"""SeedVR2 3B on one GPU (full-size random weights, bf16): the VAE's reference and fast paths, the DiT, end-to-end
upscales, a 15 s clip, and what window-aligned SP needs per rank for 15 s of 1080p. The reference is measured in the
same run as what replaces it.

  1. conv: the VAE's big 3x3x3 convolutions at 1088x1920 (128 channels at full resolution, 256 at full and half, 512
     at a quarter), contiguous (the reference) vs channels-last (the fast path): ms per call, TFLOP/s.
  2. VAE encode + decode of 21 frames at 1088x1920, reference and fast path, tiled (the pipeline's default) and
     untiled: seconds per frame, TFLOP/s of the untiled work (FLOPs counted on the meta device), activation peak.
  3. DiT through the pipeline's `predict` at 21 frames (6 latent frames, 48 960 tokens, 2-frame windows) and 121
     frames (31 latent frames, 252 960 tokens, full 8x15x27 windows): seconds per output frame, TFLOP/s, activation
     peak and bytes per token (slope between the two runs).
  4. `upscale` end to end of 21 frames 544x960 -> 1088x1920: the reference VAE tiled (the previous default), the fast
     VAE tiled and untiled: seconds per frame and peak; then 9 and 21 frames with the DiT stubbed: what grows with the
     clip outside the DiT (the latents; pixels stay uint8 in host memory).
  5. A 15 s clip, 360 frames 540x960 -> 1080x1920, on one GPU: one DiT batch, fast VAE untiled: seconds, seconds per
     frame, peak allocated and reserved (with the weights).
  6. 15 s at 1080p (361 frames, 742 560 tokens) on --ranks ranks: the planner's tokens per rank and all-to-all
     traffic, the predicted memory per rank (measured bytes per token x the busiest rank's tokens + what grows with
     the clip), and a compute-only time estimate.

    python benchmarks/seedvr2.py [--ranks 8] [--out benchmarks/results/seedvr2.json]
    python benchmarks/seedvr2.py --tiny     # the same code on the CPU, tiny configs and sizes (a logic check; the
                                            # peaks count float tensors op by op, which also slows the timings)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import measure  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.models.seedvr2.config import NADIT_3B, TINY_3B, TINY_VAE, VAE  # noqa: E402
from engine.models.seedvr2.nadit import build_nadit  # noqa: E402
from engine.models.seedvr2.pipeline import SeedVR2Pipeline  # noqa: E402
from engine.models.seedvr2.vae import VideoVAE, build_vae  # noqa: E402
from engine.parallel import window_sp  # noqa: E402

TEXT_LEN = 58  # rows of the released pos_emb.pt
GiB = 2**30
TARGETS = {"vae_s_per_frame": 0.2, "upscale_s_per_frame": 0.25, "clip_15s_s": 100.0}  # one H200


class FloatMemory(TorchDispatchMode):
    """Bytes of the floating-point tensors made inside the mode and still alive, `now` and at the `peak`: memory
    accounting for the CPU, which keeps no allocator statistics. A storage counts from the op that allocated it until
    the last tensor seen on it dies."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[int, int] = {}
        self.refs = collections.Counter()
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.bytes:
                if key in inputs or not t.untyped_storage().nbytes():  # a view of something made outside
                    continue
                self.bytes[key] = t.untyped_storage().nbytes()
                self.now += self.bytes[key]
                self.peak = max(self.peak, self.now)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= self.bytes.pop(key)


def gib(n):
    return None if n is None else round(n / GiB, 2)


def tflops(flops, seconds):
    return round(flops / seconds / 1e12, 1)


# ---- 1. convolutions --------------------------------------------------------------------------------------------

def run_convs(config, device, dtype, height, width):
    """The VAE's big causal convs as the VAE runs them (time already prefixed with its two carried frames)."""
    rows = []
    ch = config.block_out_channels
    for channels, scale, frames in ((ch[0], 1, 4), (ch[1], 1, 1), (ch[1], 2, 4), (ch[2], 4, 4)):
        h, w = height // scale, width // scale
        x = torch.randn(1, channels, frames + 2, h, w, device=device, dtype=dtype)
        weight = torch.randn(channels, channels, 3, 3, 3, device=device, dtype=dtype) / (27 * channels) ** 0.5
        flops = 2 * 27 * channels * channels * frames * h * w
        row = {"channels": channels, "size": f"{w}x{h}", "frames": frames}
        for name, inp in (("reference", x), ("fast", x.contiguous(memory_format=torch.channels_last_3d))):
            with torch.no_grad():
                F.conv3d(inp, weight, None, 1, (0, 1, 1))  # warm-up (cuDNN's choice)
                seconds = measure(lambda: F.conv3d(inp, weight, None, 1, (0, 1, 1)), device, iters=3).seconds
            row[f"{name}_ms"], row[f"{name}_tflops"] = round(seconds * 1e3, 2), tflops(flops, seconds)
        rows.append(row)
        del x
    return rows


# ---- 2. VAE -------------------------------------------------------------------------------------------------------

def vae_flops(config, frames, height, width):
    """(encode, decode) FLOPs of one untiled pass, counted on the meta device."""
    with torch.device("meta"):
        vae = VideoVAE(config)
    with torch.no_grad():
        with FlopCounterMode(display=False) as counter:
            moments = vae.encode(torch.empty(1, 3, frames, height, width, device="meta"))
        encode = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            vae.decode(moments[:, :16])
    return encode, counter.get_total_flops()


def run_vae(pipe, frames, height, width, device, fast, tiling, flops):
    vae = pipe.vae
    vae.channels_last = fast
    video = torch.rand(1, 3, frames, height, width, device=device) * 2 - 1
    try:
        with torch.no_grad():
            vae.decode(vae.encode(video, tiling=tiling)[:, :16], tiling=tiling)  # warm-up: every chunk's shapes
            enc = measure(lambda: vae.encode(video, tiling=tiling), device, cpu_memory=FloatMemory())
            dec = measure(lambda: vae.decode(enc.result[:, :16], tiling=tiling), device, cpu_memory=FloatMemory())
    finally:
        vae.channels_last = None
    enc_s, dec_s = enc.seconds, dec.seconds
    return {"path": "fast" if fast else "reference", "tiling": tiling, "frames": frames,
            "encode_s_per_frame": round(enc_s / frames, 4), "decode_s_per_frame": round(dec_s / frames, 4),
            "s_per_frame": round((enc_s + dec_s) / frames, 4), "encode_tflops": tflops(flops[0], enc_s),
            "decode_tflops": tflops(flops[1], dec_s), "tflops": tflops(sum(flops), enc_s + dec_s),
            "encode_act_peak_GiB": gib(enc.above_start), "decode_act_peak_GiB": gib(dec.above_start)}


# ---- 3. DiT -------------------------------------------------------------------------------------------------------

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
        run = measure(lambda: pipe.predict(cond), device, iters=2, cpu_memory=FloatMemory())
    seconds, peak = run.seconds, run.above_start
    tokens = math.prod(grid)
    return {"frames": frames, "grid": list(grid), "tokens": tokens, "window": list(dit.window_size(grid)),
            "s": round(seconds, 3), "s_per_frame": round(seconds / frames, 4),
            "tflops": tflops(dit_flops(dit, grid), seconds), "act_peak_GiB": gib(peak),
            "act_bytes_per_token": None if peak is None else round(peak / tokens)}


# ---- 4, 5. upscale ------------------------------------------------------------------------------------------------

def run_upscale(pipe, frames, height, width, device, dit=True, fast=True, tiling=True, batch_frames=None):
    """`upscale` of a clip at half the size (uint8 in host memory); without `dit` the DiT is replaced by zeros, so
    what grows with the clip is only the pipeline's own whole-clip tensors."""
    clip = torch.randint(0, 256, (frames, height // 2, width // 2, 3), dtype=torch.uint8)
    if not dit:
        pipe.predict = lambda cond: torch.zeros_like(cond[..., :16])
    pipe.vae.channels_last = fast
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with torch.no_grad():
            run = measure(lambda: pipe.upscale(clip, target_height=height, target_width=width, tiling=tiling,
                                               batch_frames=batch_frames), device, cpu_memory=FloatMemory())
    finally:
        vars(pipe).pop("predict", None)
        pipe.vae.channels_last = None
    out, seconds = run.result, run.seconds
    row = {"frames": frames, "size": f"{width // 2}x{height // 2} -> {out.shape[2]}x{out.shape[1]}", "dit": dit,
           "vae": "fast" if fast else "reference", "tiling": tiling, "s": round(seconds, 2),
           "s_per_frame": round(seconds / frames, 3), "peak_GiB": gib(run.above_start)}
    if device.type == "cuda":  # with the weights: what has to fit
        row["peak_allocated_GiB"] = gib(torch.cuda.max_memory_allocated())
        row["peak_reserved_GiB"] = gib(torch.cuda.max_memory_reserved())
    return row


# ---- 6. 15 s over ranks -------------------------------------------------------------------------------------------

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


def predict_memory(plan, dit_runs, vae_run, clip_runs, weights) -> dict:
    """Per-rank memory for the planned clip: weights + the DiT's local activations (bytes per token from the two
    DiT runs x the busiest rank's tokens) + what every rank holds for the whole clip: the patchified input and the
    gathered output (about 2 kB per token, from window_sp.predict) and what grows with the clip in the pipeline (bytes
    per frame between two untiled upscales: the 21-frame DiT-stubbed one and the 15 s one, whose peak is the VAE
    chunk's, so the difference is the whole-clip tensors or more; 9 and 21 frames differ by their VAE chunk)."""
    a, b = dit_runs
    per_token = (b["act_peak_GiB"] - a["act_peak_GiB"]) * GiB / (b["tokens"] - a["tokens"])
    replicated_per_token = 2 * 132 * 4 + 64 * (2 + 2 + 2 + 8)
    dit_local = per_token * plan["busiest_rank_tokens"]
    dit_replicated = replicated_per_token * plan["tokens"]
    u0, u1 = clip_runs
    clip_per_frame = max(u1["peak_GiB"] - u0["peak_GiB"], 0) * GiB / (u1["frames"] - u0["frames"])
    clip = clip_per_frame * plan["frames"]
    vae_chunk = max(vae_run["encode_act_peak_GiB"], vae_run["decode_act_peak_GiB"]) * GiB
    total = weights + max(dit_local + dit_replicated, vae_chunk) + clip
    return {"dit_bytes_per_token": round(per_token), "dit_local_GiB": gib(dit_local),
            "dit_replicated_GiB": gib(dit_replicated), "vae_chunk_peak_GiB": gib(vae_chunk),
            "clip_bytes_per_frame": round(clip_per_frame), "clip_tensors_GiB": gib(clip),
            "weights_GiB": gib(weights), "per_rank_GiB": gib(total),
            "single_gpu_dit_activations_GiB": gib(per_token * plan["tokens"])}


# ---- table --------------------------------------------------------------------------------------------------------

def print_table():
    log(f"\n{'':<34}{'frames':>7}{'s/frame':>9}{'TFLOP/s':>9}{'peak GiB':>10}  target")
    for r in RESULTS.get("conv", []):
        log(f"{'conv ' + str(r['channels']) + ' ch ' + r['size']:<34}{r['frames']:>7}{'':>9}"
            f"{r['reference_tflops']:>9} reference, {r['fast_tflops']} fast ({r['reference_ms']} / {r['fast_ms']} ms)")
    for r in RESULTS.get("vae", []):
        name = f"VAE enc+dec {r['path']}, {'tiled' if r['tiling'] else 'untiled'}"
        peak = max(r["encode_act_peak_GiB"] or 0, r["decode_act_peak_GiB"] or 0)
        target = f"<= {TARGETS['vae_s_per_frame']}" if r["path"] == "fast" else ""
        log(f"{name:<34}{r['frames']:>7}{r['s_per_frame']:>9}{r['tflops']:>9}{peak:>10}  {target}")
        log(f"{'  encode / decode':<34}{'':>7}{r['encode_s_per_frame']:>9} / {r['decode_s_per_frame']} s/frame, "
            f"{r['encode_tflops']} / {r['decode_tflops']} TFLOP/s")
    for r in RESULTS.get("dit", []):
        log(f"{'DiT predict, ' + str(r['tokens']) + ' tokens':<34}{r['frames']:>7}{r['s_per_frame']:>9}"
            f"{r['tflops']:>9}{str(r['act_peak_GiB']):>10}")
    for r in RESULTS.get("upscale", []):
        name = (f"upscale, {r['vae']} VAE, {'tiled' if r['tiling'] else 'untiled'}" if r["dit"]
                else "upscale, DiT stubbed")
        target = f"<= {TARGETS['upscale_s_per_frame']}" if r["dit"] and r["vae"] == "fast" else ""
        log(f"{name:<34}{r['frames']:>7}{r['s_per_frame']:>9}{'':>9}{str(r['peak_GiB']):>10}  {target}")
    if "clip_15s" in RESULTS:
        r = RESULTS["clip_15s"]
        log(f"{'15 s clip ' + r['size']:<34}{r['frames']:>7}{r['s_per_frame']:>9}{'':>9}{str(r['peak_GiB']):>10}  "
            f"{r['s']} s (<= {TARGETS['clip_15s_s']}); with weights {r.get('peak_allocated_GiB')} GiB allocated, "
            f"{r.get('peak_reserved_GiB')} reserved")
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


def predict(results: dict, weights: float) -> dict:
    """The per-rank prediction from a run's measured rows."""
    plan = results["plan_15s"]
    fast_untiled = next(r for r in results["vae"] if r["path"] == "fast" and not r["tiling"])
    stubbed = next(r for r in results["upscale"] if not r["dit"] and r["frames"] == 21)
    memory = predict_memory(plan, results["dit"], fast_untiled, (stubbed, results["clip_15s"]), weights)
    long_run = results["dit"][1]
    memory["compute_only_s"] = {
        "dit": round(long_run["s"] / long_run["tokens"] * plan["busiest_rank_tokens"], 2),
        "vae_fast_untiled": round(fast_untiled["s_per_frame"] * plan["frames"] / plan["ranks"], 2)}
    return memory


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU: checks the code path only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--predict", type=Path, metavar="JSON",
                        help="recompute a saved run's per-rank prediction from its measured rows (no GPU) and print it")
    args = parser.parse_args()
    if args.predict:
        RESULTS.update(json.loads(args.predict.read_text()))
        RESULTS["predicted_15s_1080p"] = predict(RESULTS, RESULTS["weights_GiB"] * GiB)
        save(args.predict)
        print_table()
        return 0
    out = Path(args.out or ("benchmarks/results/seedvr2_tiny.json" if args.tiny else "benchmarks/results/seedvr2.json"))
    device = torch.device("cpu" if args.tiny else "cuda")
    height, width = (32, 48) if args.tiny else (1088, 1920)
    long_clip = (41, 16, 32) if args.tiny else (360, 1080, 1920)  # frames, output size
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    dtype = torch.float32 if args.tiny else torch.bfloat16
    RESULTS.update(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   attention_backend=attn.choose(device), size=f"{width}x{height}", dtype=str(dtype)[6:],
                   targets=TARGETS)

    dit = build_nadit(TINY_3B if args.tiny else NADIT_3B, seed=0, dtype=dtype, device=device)
    config = TINY_VAE if args.tiny else VAE
    vae = build_vae(config, seed=0, dtype=dtype, device=device)
    weights = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    text = torch.randn(TEXT_LEN, dit.config.text_dim)
    pipe = SeedVR2Pipeline(dit, vae, text, device, "3b (random weights)")
    RESULTS["weights_GiB"] = gib(weights)
    log(f"SeedVR2 3B, random weights, {RESULTS['dtype']}, {RESULTS['gpu']}, attention {RESULTS['attention_backend']}")

    stage("conv", lambda: RESULTS.__setitem__("conv", run_convs(config, device, dtype, height, width)), out)
    flops = vae_flops(config, 21, height, width)
    RESULTS["vae_TFLOP_per_frame"] = {"encode": round(flops[0] / 21e12, 3), "decode": round(flops[1] / 21e12, 3)}
    stage("vae", lambda: RESULTS.__setitem__("vae", [
        run_vae(pipe, 21, height, width, device, fast, tiling, flops)
        for fast, tiling in ((False, True), (False, False), (True, False), (True, True))]), out)
    stage("dit", lambda: RESULTS.__setitem__("dit", [run_dit(pipe, f, height, width, device) for f in (21, 121)]),
          out)
    stage("upscale", lambda: RESULTS.__setitem__("upscale", [
        run_upscale(pipe, 21, height, width, device, fast=False),
        run_upscale(pipe, 21, height, width, device),
        run_upscale(pipe, 21, height, width, device, tiling=False),
        run_upscale(pipe, 9, height, width, device, dit=False, tiling=False),
        run_upscale(pipe, 21, height, width, device, dit=False, tiling=False)]), out)
    frames, h, w = long_clip
    stage("clip_15s", lambda: RESULTS.__setitem__("clip_15s", run_upscale(pipe, frames, h, w, device, tiling=False)),
          out)
    stage("plan", lambda: RESULTS.__setitem__("plan_15s", plan_15s(dit, args.ranks, height, width)), out)
    if all(k in RESULTS for k in ("dit", "vae", "upscale", "clip_15s", "plan_15s")):
        RESULTS["predicted_15s_1080p"] = predict(RESULTS, weights)
        save(out)
    print_table()
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
