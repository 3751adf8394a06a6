"""Where a bouncer is inside each of the toy video VAE's 4-frame latents: how much of that the latent holds, and how
much the decoder draws. Near a floor contact a bouncer falls ~8 px a frame and turns inside one latent; a decoder
that draws it frozen across the latent's frames shows no contact, and then no click can match one.

Over bouncing held-out scenes, every 4-frame latent in which the bouncer is seen in all four decoded and rendered
frames: the rendered height's deviation from its mean over those frames (the motion inside the latent) against
  - probe: a small MLP from the encoded latent's 3x3 cells around the object (fit on the first 3/4 of the scenes,
    scored on the rest): what a decoder could draw from the latent;
  - decoder: the round trip's tracked height, as a deviation from its own mean over the same frames (and the share
    of latents where the round trip loses the bouncer in one of the four frames).
Both as R^2 (1 - residual power / the deviation's power) and residual RMS in pixels, over all such latents and the
fast ones (a step of more than 4 px inside). And per scene, the video half of the clicks check: whether the round
trip's contacts (every object's, as the scorer finds them) agree with the rendered clicks (`scoring.clicks_agree`);
with the sound rendered, this is the share of scenes whose t2va clicks check a perfect DiT could pass (the toy
audio VAE returns every knock at its frame). And the round trip's frame difference (the extension check's) across
latent boundaries, over its clip's median: at 17m + 5, where every extension window joins (the end of the decoder's
cross-fade of two windows), and at the other boundaries. Prints a table and writes JSON.

    python benchmarks/vae_motion.py --weights engine/weights/toy --scenes 120 --device cpu \
        --out benchmarks/results/vae_motion.json
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

from engine.models.h3.mask import latent_frame_spans  # noqa: E402
from engine.models.h3.vae import load_video_vae_file  # noqa: E402
from training.scoring import clicks_agree, colour_labels, contact_frames, track_colour  # noqa: E402
from training.task_checks import JUMP_RATIO, frame_differences  # noqa: E402
from training.toy_scene import sample_scene  # noqa: E402
from training.toy_world import render  # noqa: E402
from training.train import EVAL_SEED, FILES  # noqa: E402

WIDTH, HEIGHT, CELL = 224, 128, 16
FAST_STEP_PX = 4.0


def scene_tracks(frames: np.ndarray, scene) -> list:
    """Each of the scene's objects tracked by its colour, as the scorer tracks it."""
    labels = colour_labels(frames)
    return [track_colour(labels, o.colour) for o in scene.objects]


def contacts(tracks: list) -> list[float]:
    """Every floor bounce and wall hit the scorer finds on these tracks."""
    return sorted(f for t in tracks for part in contact_frames(t, WIDTH, HEIGHT) for f in part)


def boundary_steps(frames: np.ndarray) -> tuple[list[float], list[float]]:
    """The frame difference across each latent boundary over the clip's median: (at the joins, 17m + 5; elsewhere)."""
    diffs = frame_differences(frames)
    ratios = {a: float(diffs[a - 1] / np.median(diffs)) for a, _ in latent_frame_spans(len(frames))[1:]}
    joins = [a for a in ratios if a % 17 == 5 and a > 5]  # frame 5 ends the first chunk's first latents only
    return [ratios[a] for a in joins], [r for a, r in ratios.items() if a not in joins]


def latent_rows(vae, scene) -> tuple[list, list, list, int, bool, tuple]:
    """For the scene's first bouncer: (probe features, rendered deviations [4], decoded deviations [4]) of each
    4-frame latent where it is seen in all four frames of the render and of the round trip, the number of
    4-frame latents where the render shows it in all four and the round trip loses it in one or more, whether
    the round trip's contacts agree with the rendered clicks, and its `boundary_steps`."""
    k = next(i for i, o in enumerate(scene.objects) if o.motion == "bounces")
    truth = render(scene, WIDTH, HEIGHT)
    with torch.no_grad():
        z = vae.encode_frames(torch.from_numpy(truth.frames))
        decoded = vae.decode(z).cpu().numpy()[:len(truth.frames)]
    z = z[0].cpu().numpy()
    tracks = scene_tracks(decoded, scene)
    agree = clicks_agree(contacts(tracks), list(truth.click_frames), len(decoded))
    rendered_y = truth.centroids[k, :, 1]
    decoded_y = tracks[k].y
    features, wanted, drawn, lost = [], [], [], 0
    for t, (a, b) in enumerate(latent_frame_spans(len(truth.frames))):
        if b - a != 4 or not np.isfinite(rendered_y[a:b]).all():
            continue
        if not np.isfinite(decoded_y[a:b]).all():
            lost += 1
            continue
        x, y = truth.centroids[k, a:b, 0].mean(), rendered_y[a:b].mean()
        r = int(np.clip(y // CELL, 1, z.shape[2] - 2))
        c = int(np.clip(x // CELL, 1, z.shape[3] - 2))
        features.append(z[:, t, r - 1:r + 2, c - 1:c + 2].ravel())
        wanted.append(rendered_y[a:b] - y)
        drawn.append(decoded_y[a:b] - decoded_y[a:b].mean())
    return features, wanted, drawn, lost, agree, boundary_steps(decoded)


def fit_probe(x: np.ndarray, y: np.ndarray, seed: int = 0, steps: int = 3000) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 256), torch.nn.GELU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, y.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), 1e-3, weight_decay=1e-2)
    xs, ys = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    for _ in range(steps):
        pick = torch.randint(0, len(xs), (256,))
        loss = (net(xs[pick]) - ys[pick]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def scores(predicted: np.ndarray, wanted: np.ndarray) -> dict:
    residual, power = ((predicted - wanted) ** 2).mean(), (wanted ** 2).mean()
    return {"r2": float(1 - residual / power), "residual_rms_px": float(np.sqrt(residual)),
            "deviation_rms_px": float(np.sqrt(power)), "latents": len(wanted)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--scenes", type=int, default=120,
                   help="bouncing held-out scenes (a few seconds each on 2 CPU cores)")
    p.add_argument("--device", default="cpu", help="where the VAE runs (the probe fits on the CPU)")
    p.add_argument("--out", default="benchmarks/results/vae_motion.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    vae = load_video_vae_file(args.weights / FILES["video_vae"]).to(args.device)
    rows, seed = [], EVAL_SEED
    while len(rows) < args.scenes:
        scene = sample_scene(seed, WIDTH, HEIGHT)
        seed += 1
        if any(o.motion == "bounces" for o in scene.objects):
            rows.append(latent_rows(vae, scene))
    fit, held = rows[:len(rows) * 3 // 4], rows[len(rows) * 3 // 4:]

    def stack(part, i):
        return np.array([v for row in part for v in row[i]], dtype=np.float64)

    x_fit, x_held = stack(fit, 0), stack(held, 0)
    mean, std = x_fit.mean(0), x_fit.std(0) + 1e-6
    probe = fit_probe((x_fit - mean) / std, stack(fit, 1))
    with torch.no_grad():
        probed = probe(torch.from_numpy((x_held - mean) / std).float()).numpy()
    wanted, drawn = stack(held, 1), stack(held, 2)
    fast = np.abs(np.diff(wanted, axis=1)).max(1) > FAST_STEP_PX
    summary = {f"{name}_{part}": scores(values[sel], wanted[sel])
               for name, values in (("probe", probed), ("decoder", drawn))
               for part, sel in (("all", np.ones(len(wanted), bool)), ("fast", fast))}
    lost = sum(row[3] for row in held)
    joins, others = (np.concatenate([row[5][i] for row in rows]) for i in (0, 1))
    summary["steps_over_median"] = {"joins": float(np.median(joins)), "other_boundaries": float(np.median(others)),
                                    "joins_within_limit": float(np.mean(joins <= JUMP_RATIO)),
                                    "other_boundaries_within_limit": float(np.mean(others <= JUMP_RATIO))}
    summary.update({"decoder_lost_share": lost / (lost + len(wanted)),
                    "contacts_agree_with_clicks": float(np.mean([row[4] for row in rows])), "scenes": len(rows),
                    "held_out_scenes": len(held), "weights": str(args.weights),
                    "wall_s": round(time.perf_counter() - t0, 1)})
    print("\n== the bouncer's height inside each 4-frame latent (held-out scenes) ==")
    print(f"{'':16s} {'R^2':>6s} {'residual px':>12s} {'motion px':>10s} {'latents':>8s}")
    for key, s in summary.items():
        if isinstance(s, dict) and "r2" in s:
            print(f"{key:16s} {s['r2']:6.2f} {s['residual_rms_px']:12.2f} {s['deviation_rms_px']:10.2f} "
                  f"{s['latents']:8d}")
    print(f"latents where the round trip loses the bouncer: {summary['decoder_lost_share']:.2f}")
    print(f"scenes whose round-trip contacts agree with the rendered clicks: "
          f"{summary['contacts_agree_with_clicks']:.2f} of {len(rows)}")
    steps = summary["steps_over_median"]
    print(f"round trip's frame difference over its median: at the joins {steps['joins']:.2f} (within "
          f"{JUMP_RATIO:g}x: {steps['joins_within_limit']:.2f}), at the other latent boundaries "
          f"{steps['other_boundaries']:.2f} ({steps['other_boundaries_within_limit']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
