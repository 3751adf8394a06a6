"""How the trained embedded default does on the toy world, scored from decoded frames and sound alone
(training/scoring.py): t2va over captions of held-out scenes (colour, motion, background, pitch, clicks, rain; the
share of clips passing each check and all of them) and fl2va (PSNR of generated frame 0 against the rendered first
frame, and of the last frame when both keyframes are given), the video VAE's reconstruction, and the trained
SeedVR2 on degraded 2x clips against their bicubic upscale. Prints a table and writes JSON.

    python benchmarks/toy_eval.py --weights engine/weights/toy --captions 20 --out benchmarks/results/toy_eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.h3.pipeline import GenerateRequest, H3Pipeline  # noqa: E402
from engine.models.seedvr2.pipeline import SeedVR2Pipeline  # noqa: E402
from training.captions import caption  # noqa: E402
from training.quality import psnr  # noqa: E402
from training.scoring import score_clip  # noqa: E402
from training.toy_scene import sample_scene  # noqa: E402
from training.toy_world import render  # noqa: E402
from training.train import EVAL_SEED, FILES  # noqa: E402
from training.train_seedvr2 import degrade, to_model  # noqa: E402


def load(weights: Path, device: str) -> H3Pipeline:
    pipe = H3Pipeline.from_files(*(weights / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                 device=device, dtype=torch.float32)
    pipe.encode_mp4 = False
    return pipe


def upscale_rows(args, width: int, height: int) -> dict:
    """SeedVR2 ("toy") on degraded half-size clips (train_seedvr2.degrade) up to the full canvas, vs bicubic."""
    if not args.upscales:
        return {}
    sr = SeedVR2Pipeline.from_preset("toy", device=args.device)
    rng, ours, bicubic = np.random.default_rng(1), [], []
    for i in range(args.upscales):
        hr = render(sample_scene(EVAL_SEED + 500 + i, width, height), width, height, 1.0).frames
        lq = degrade(hr, rng)
        out = sr.upscale(lq, target_height=height, target_width=width).numpy()
        up = ((to_model(lq, (height, width), "cpu").permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255)
        ours.append(psnr(out, hr))
        bicubic.append(psnr(up.byte().numpy(), hr))
    return {"seedvr2_psnr": float(np.mean(ours)), "bicubic_psnr": float(np.mean(bicubic)),
            "seedvr2_gain_db": float(np.mean(ours) - np.mean(bicubic))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--captions", type=int, default=20)
    p.add_argument("--steps", type=int, default=None, help="sigma grid points (default: the canvas's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--upscales", type=int, default=4, help="degraded clips for the SeedVR2 rows (1 s each)")
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
        both = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                             height=height, first_frame=truth.frames[0],
                                             last_frame=truth.frames[-1]))
        recon = pipe.video_vae.decode(pipe.video_vae.encode_frames(torch.from_numpy(truth.frames))).numpy()
        row = {"caption": caption(scene), "checks": verdict, "passed": all(verdict.values()),
               "fl2va_first_frame_psnr": round(psnr(fl2va.frames[0].numpy(), truth.frames[0]), 2),
               "fl2va_both_first_psnr": round(psnr(both.frames[0].numpy(), truth.frames[0]), 2),
               "fl2va_both_last_psnr": round(psnr(both.frames[-1].numpy(), truth.frames[-1]), 2),
               "vae_reconstruction_psnr": round(psnr(recon[:len(truth.frames)], truth.frames), 2)}
        rows.append(row)
        for name, ok in verdict.items():
            checks.setdefault(name, []).append(bool(ok))
        print(f"{i:3d} {'pass' if row['passed'] else 'fail'} fl2va {row['fl2va_first_frame_psnr']:5.1f} dB "
              f"{' '.join(k for k, ok in verdict.items() if not ok) or '-'} | {row['caption']}", flush=True)
    summary = {"captions": len(rows), "t2va_all_checks": float(np.mean([r["passed"] for r in rows])),
               **{f"t2va_{k}": float(np.mean(v)) for k, v in checks.items()},
               **{f"{k}_median": float(np.median([r[k] for r in rows])) for k in (
                   "fl2va_first_frame_psnr", "fl2va_both_first_psnr", "fl2va_both_last_psnr",
                   "vae_reconstruction_psnr")},
               **upscale_rows(args, width, height),
               "wall_s": round(time.perf_counter() - t0, 1), "device": args.device, "weights": str(args.weights)}
    print("\n== toy eval (share of clips passing; PSNR in dB) ==")
    for k, v in summary.items():
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "clips": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
