"""Block streaming on the GPU (engine/runtime/streaming.py): a full-width H3 DiT cut to `--blocks` blocks, one
denoising step at 1344x768 with every block resident vs streamed from pinned host memory with K units resident,
in bf16 and fp8. Reports ms per step, the ratio to resident, bytes copied per step and the host -> device rate
they need (GB/s), peak GPU memory, and whether the output is bit-identical. Table + JSON.

    python benchmarks/streaming.py [--blocks 8] [--frames 124] [--resident 2 3] [--out benchmarks/results/streaming.json]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.h3_dit import TEXT_ROWS, make_layout  # noqa: E402
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import cuda_ms  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL  # noqa: E402
from engine.models.h3.dit import build_dit  # noqa: E402
from engine.models.h3.precision import set_precision  # noqa: E402
from engine.runtime.streaming import BlockStreamer, dit_units  # noqa: E402


def step_inputs(frames: int, device):
    lay = make_layout(frames).to(device)
    g = torch.Generator(device).manual_seed(0)
    video = torch.randn(1, lay.video_indices.numel(), FULL.video_patch_dim, device=device, generator=g)
    audio = torch.randn(1, lay.audio_indices.numel(), FULL.audio_in_channels, device=device, generator=g)
    text = torch.randn(1, TEXT_ROWS, FULL.text_dim, device=device, generator=g, dtype=torch.bfloat16)
    ts, idx = L.row_timesteps(lay, 0.4, 0.6)
    return (video, audio, text, ts.to(device), idx.to(device), lay.token_tags, lay.position_ids,
            lay.video_indices, lay.audio_indices, lay.text_indices)


def run(args, precision: str, device) -> None:
    dit = build_dit(replace(FULL, num_layers=args.blocks), seed=0, dtype=torch.bfloat16, device=device)
    set_precision(dit, precision)
    inputs = step_inputs(args.frames, device)
    with torch.no_grad():
        reference = dit(*inputs)[0]
        torch.cuda.reset_peak_memory_stats()
        resident_ms = cuda_ms(lambda: dit(*inputs), warmup=1, iters=3)
        row = {"precision": precision, "blocks": args.blocks, "frames": args.frames, "resident_ms": resident_ms,
               "resident_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        for k in args.resident:
            streamer = BlockStreamer(dit_units(dit), device, k)
            torch.cuda.reset_peak_memory_stats()
            out = dit(*inputs)[0]
            streamer.release()
            before = streamer.bytes_copied
            ms = cuda_ms(lambda: dit(*inputs), warmup=1, iters=3)  # steps follow each other as in a job
            per_step = (streamer.bytes_copied - before) / 4
            row[f"k{k}"] = {"ms": ms, "ratio": ms / resident_ms, "bytes_per_step_gb": per_step / 1e9,
                            "needed_gb_s": per_step / ms / 1e6, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                            "misses_per_step": streamer.misses / 5, "identical": bool(torch.equal(out, reference))}
            streamer.close()
    RESULTS.setdefault("runs", []).append(row)
    log(f"{precision}: resident {resident_ms:.1f} ms, peak {row['resident_peak_gib']:.1f} GiB")
    for k in args.resident:
        r = row[f"k{k}"]
        log(f"  K={k}: {r['ms']:.1f} ms ({r['ratio']:.2f}x), {r['bytes_per_step_gb']:.1f} GB/step = "
            f"{r['needed_gb_s']:.1f} GB/s, peak {r['peak_gib']:.1f} GiB, identical {r['identical']}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--frames", type=int, default=124)
    p.add_argument("--resident", type=int, nargs="+", default=[2, 3])
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/streaming.json"))
    args = p.parse_args()
    device = torch.device("cuda")
    RESULTS.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    for precision in args.precisions:
        stage(precision, lambda: run(args, precision, device), args.out)
    save(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
