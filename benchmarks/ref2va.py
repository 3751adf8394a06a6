"""Ref2VA at full size, random weights (GPU): what the references add to the sequence, the DiT step against t2va
at the same canvas, the partition swap host <-> GPU, peak memory.

The request: 5 s at 1344x768 with 3 image references (4:3, at the released 2048 short edge) and one 5 s video
reference with its sound (on its own 1344x768 canvas). Its text rows hold the vision tokens Qwen3-VL gives those
references (one per 32x32 pixels, the video read at 2 fps in pairs). One DiT block is timed on each layout and
scaled to the 50-block step; the swap moves a 16-layer slice of the DiT (a quarter) through engine/models/h3/
partitions.py (out to pinned host memory, the other in) and reports GB/s and the whole DiT's swap at that rate.

    python benchmarks/ref2va.py [--out benchmarks/results/ref2va_h200.json]
    python benchmarks/ref2va.py --tiny   # the same code on the tiny config, CPU (a smoke run)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import cuda_ms, timed  # noqa: E402
from engine.kernels import attention  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL, NUM_MODALITIES, TEXT_TAG, TINY, VIDEO_TAG  # noqa: E402
from engine.models.h3.dit import build_dit, rope_table  # noqa: E402
from engine.models.h3.partitions import Partitions, module_bytes  # noqa: E402
from engine.models.h3.references import reference_size  # noqa: E402

PROMPT_ROWS = 64
FRAMES = 124


def vision_tokens(height: int, width: int) -> int:
    return (height // 32) * (width // 32)


def layouts(canvas: tuple[int, int], image: tuple[int, int]) -> dict[str, L.PackedLayout]:
    """t2va and the ref2va request above at `canvas` (h, w), image references of size `image` before resizing."""
    height, width = canvas
    T, h, w, Ta = L.latent_frames(FRAMES), height // 16, width // 16, L.audio_latents(FRAMES)
    ih, iw = reference_size(*image, "diffusers", height * width, short_edge=2048 * height // 768)
    blocks = [L.ReferenceBlock("image", 1, ih // 16, iw // 16)] * 3 + [
        L.ReferenceBlock("video", T, h, w, audio_latents=Ta)]
    # Text rows: labels and vision blocks of 3 images and a 5 s video (2 fps: 10 frames, 5 blocks), the prompt.
    vision = 3 * (vision_tokens(ih, iw) + 2) + 5 * (vision_tokens(height, width) + 2)
    labels = 3 * 6 + 2 * 6 + 5 * 8
    tags = torch.full((vision + labels + PROMPT_ROWS,), TEXT_TAG)
    tags[:vision] = VIDEO_TAG
    return {"t2va": L.build_layout(torch.full((PROMPT_ROWS,), TEXT_TAG), T, h, w, Ta),
            "ref2va": L.build_ref2va_layout(tags, blocks, T, h, w, Ta)}


def block_flops(S: int, c) -> float:
    linear = 2 * S * (c.hidden_size * 3 * c.inner_dim + c.inner_dim * c.hidden_size + 3 * c.hidden_size * c.ffn_dim)
    return linear + 4 * S * S * c.inner_dim


def step_times(config, device, canvas, image) -> None:
    dit = build_dit(replace(config, num_layers=1), seed=0, dtype=torch.bfloat16, device=device)
    block = dit.blocks[0]
    for name, lay in layouts(canvas, image).items():
        lay = lay.to(device)
        S = lay.seq_len
        x = torch.randn(1, S, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.5
        ts, idx = L.row_timesteps(lay, 0.4, 0.6)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            mods = block.adaln_proj(dit.time_embedding(ts.to(device)))
            rows = idx.to(device) * NUM_MODALITIES + lay.token_tags
            rope = rope_table(lay.position_ids, dit.rope_inv_freq)
            run = lambda: block(x, mods, rows, rope)  # noqa: E731
            ms = cuda_ms(run) if device.type == "cuda" else timed(run, lambda: None, 1, 1)
        RESULTS[name] = {"rows": S, "text_rows": lay.num_text, "condition_video_rows": lay.num_condition_video_rows,
                         "condition_audio_rows": lay.num_condition_audio_rows, "ms_per_block": round(ms, 2),
                         "step_s": round(ms * FULL.num_layers / 1e3, 2),
                         "tflops": round(block_flops(S, config) / ms / 1e9, 1)}
        if device.type == "cuda":
            RESULTS[name]["block_peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        log(f"{name}: {RESULTS[name]}")
    t2va, ref = RESULTS["t2va"], RESULTS["ref2va"]
    RESULTS["ref2va_step_vs_t2va"] = round(ref["ms_per_block"] / t2va["ms_per_block"], 2)
    RESULTS["rows_vs_t2va"] = round(ref["rows"] / t2va["rows"], 2)
    RESULTS["flops_vs_t2va"] = round(block_flops(ref["rows"], config) / block_flops(t2va["rows"], config), 2)


def swap(config, device, layers: int) -> None:
    """fl2va -> ref2va -> fl2va with room for one partition on the device: each swap parks the other one in
    pinned host memory (the first one loads the Ref2VA slice from its loader)."""
    part = replace(config, num_layers=layers)
    fl2va = build_dit(part, seed=0, dtype=torch.bfloat16, device=device)
    size = module_bytes(fl2va)
    partitions = Partitions("fl2va", device, {"ref2va": lambda: build_dit(part, seed=1, dtype=torch.bfloat16,
                                                                          device=device)})
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    partitions.reserve_bytes = free - size // 2  # the device holds one slice and no more
    dit = partitions.activate("ref2va", fl2va)
    dit = partitions.activate("fl2va", dit)
    dit = partitions.activate("ref2va", dit)
    swaps = partitions.swaps
    # A swap from host memory moves the active slice out to pinned host memory and the other one in.
    back = [s for s in swaps if s["source"] == "host"]
    RESULTS["swap"] = {"layers": layers, "GB": round(size / 1e9, 2), "swaps": swaps}
    if back:
        seconds = min(s["seconds"] for s in back)
        RESULTS["swap"].update(swap_s=seconds, GB_per_s_both_ways=round(2 * size / 1e9 / seconds, 1),
                               full_dit_swap_s=round(seconds * config.num_layers / layers, 1))
    log(f"swap: {RESULTS['swap']}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/ref2va.json")
    p.add_argument("--tiny", action="store_true", help="the tiny config on the CPU: checks the script")
    args = p.parse_args()
    out = Path(args.out)
    device = torch.device("cpu" if args.tiny else "cuda")
    config, canvas, image = (TINY, (128, 224), (96, 128)) if args.tiny else (FULL, (768, 1344), (768, 1024))
    RESULTS.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   canvas=f"{canvas[1]}x{canvas[0]}", frames=FRAMES, attention=attention.choose(device))
    stage("step", lambda: step_times(config, device, canvas, image), out)
    if device.type == "cuda":
        stage("swap", lambda: swap(config, device, 16), out)
    t0 = time.perf_counter()
    print(f"\nRef2VA vs t2va, {RESULTS['canvas']}, {FRAMES} frames, one DiT block x {FULL.num_layers}, bf16")
    print(f"{'layout':>8} | {'rows':>7} | {'text':>6} | {'cond video':>10} | {'ms/block':>9} | {'step s':>7} | TFLOP/s")
    for name in ("t2va", "ref2va"):
        r = RESULTS.get(name)
        if r:
            print(f"{name:>8} | {r['rows']:>7} | {r['text_rows']:>6} | {r['condition_video_rows']:>10} | "
                  f"{r['ms_per_block']:>9} | {r['step_s']:>7} | {r['tflops']}")
    print({k: RESULTS.get(k) for k in ("ref2va_step_vs_t2va", "rows_vs_t2va", "flops_vs_t2va")})
    if "swap" in RESULTS:
        print({k: v for k, v in RESULTS["swap"].items() if k != "swaps"})
    RESULTS["report_s"] = round(time.perf_counter() - t0, 3)
    save(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
