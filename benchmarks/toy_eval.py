"""How the trained embedded default does on the toy world, scored from decoded frames and sound alone
(training/scoring.py): t2va over captions of held-out scenes (colour, motion, background, pitch, clicks, rain; the
share of clips passing each check and all of them) and fl2va (PSNR of generated frame 0 against the rendered first
frame). Prints a table and writes JSON.

    python benchmarks/toy_eval.py --weights engine/weights/toy --captions 20 --out benchmarks/results/toy_eval.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from engine.models.h3.pipeline import GenerateRequest, H3Pipeline
from training.captions import caption
from training.quality import psnr
from training.scoring import score_clip
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train import EVAL_SEED, FILES


def load(weights: Path, device: str) -> H3Pipeline:
    pipe = H3Pipeline.from_files(*(weights / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                 device=device, dtype=torch.float32)
    pipe.encode_mp4 = False
    return pipe


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--captions", type=int, default=20)
    p.add_argument("--steps", type=int, default=None, help="sigma grid points (default: the canvas's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results/toy_eval.json")
    args = p.parse_args()
    pipe = load(args.weights, args.device)
    width, height = pipe.canvas.max_pixels // pipe.canvas.short_edge, pipe.canvas.short_edge
    rows, checks, t0 = [], {}, time.perf_counter()
    for i in range(args.captions):
        scene = sample_scene(EVAL_SEED + i, width, height)
        truth = render(scene, width, height)
        t2va = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                             height=height))
        verdict = score_clip(t2va.frames.numpy(), np.asarray(t2va.audio), scene)["checks"]
        fl2va = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                              height=height, first_frame=truth.frames[0]))
        row = {"caption": caption(scene), "checks": verdict, "passed": all(verdict.values()),
               "fl2va_first_frame_psnr": round(psnr(fl2va.frames[0].numpy(), truth.frames[0]), 2)}
        rows.append(row)
        for name, ok in verdict.items():
            checks.setdefault(name, []).append(bool(ok))
        print(f"{i:3d} {'pass' if row['passed'] else 'fail'} fl2va {row['fl2va_first_frame_psnr']:5.1f} dB "
              f"{' '.join(k for k, ok in verdict.items() if not ok) or '-'} | {row['caption']}", flush=True)
    summary = {"captions": len(rows), "t2va_all_checks": float(np.mean([r["passed"] for r in rows])),
               **{f"t2va_{k}": float(np.mean(v)) for k, v in checks.items()},
               "fl2va_first_frame_psnr_median": float(np.median([r["fl2va_first_frame_psnr"] for r in rows])),
               "wall_s": round(time.perf_counter() - t0, 1), "device": args.device, "weights": str(args.weights)}
    print("\n== toy eval (share of clips passing; PSNR in dB) ==")
    for k, v in summary.items():
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "clips": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
