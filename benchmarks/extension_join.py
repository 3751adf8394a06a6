"""Where an extension's motion slows after a join (issue 18's extension velocity check): toy_eval's extension scenes,
each 5 s render extended by one window at the engine's overlap, and for every mover in a line its speed along its
path over three 12-frame spans of the window, as a share of the render's:
  - guide: the last 12 frames before the join (the window's regenerated overlap);
  - completion: the first 12 new frames, the rest of the VAE chunk the source's last two latents began (a 17n + 5
    source ends 5 frames into a chunk, so every join falls there);
  - next: the 12 frames after, from the next chunk's one-frame latent on.
Each from three decodes of the window: the DiT's latents as they are (dit), the DiT's new latents after the
scene's own encoded overlap (truth_overlap: is the slowing in the new latents or in the overlap?), and the scene's
frames encoded and decoded (round_trip: what the VAE lets through). Prints a table and writes JSON.

    python benchmarks/extension_join.py --weights engine/weights/toy --scenes 8 --device cpu \
        --out benchmarks/results/extension_join.json
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

from benchmarks.toy_eval import EXTENSION_SEED, load, scenes_where  # noqa: E402
from engine.models.h3.extend import Window, plan_windows  # noqa: E402
from engine.models.h3.pipeline import ExtendRequest  # noqa: E402
from engine.models.h3.request import Source, StepEvent  # noqa: E402
from training.captions import caption, caption_at  # noqa: E402
from training.scoring import colour_labels, track_colour  # noqa: E402
from training.toy_scene import DIRECTIONS, FPS  # noqa: E402
from training.toy_world import render  # noqa: E402

WIDTH, HEIGHT = 224, 128
WINDOW_FRAMES = 124  # toy_eval's 5 s windows
SPAN = 12
SPANS = ("guide", "completion", "next")
DECODES = ("dit", "truth_overlap", "round_trip")


def first_window(pipe, scene, seed: int, overlap: int, steps: int | None) -> tuple[torch.Tensor, Window, int]:
    """The window that extends the scene's 5 s render: (its final latents, the window, the source's frames)."""
    source = render(scene, WIDTH, HEIGHT)
    F0 = len(source.frames)
    window = plan_windows(F0, WINDOW_FRAMES, overlap, WINDOW_FRAMES)[0]  # a whole one
    final = {}

    def keep(event):
        if isinstance(event, StepEvent):
            final["latents"] = event.video_x0.cpu()

    pipe.extend(ExtendRequest(Source(source.frames, audio=source.audio), (window.start + window.frames - F0) / FPS,
                              [caption_at(scene, F0 / FPS, WIDTH, HEIGHT)], window_seconds=WINDOW_FRAMES / FPS,
                              seed=seed, steps=steps, overlap_latents=overlap), on_step=keep)
    return final["latents"], window, F0


def speed_shares(position: np.ndarray, truth: np.ndarray, join: int) -> dict[str, float]:
    """Speed along the path over each span (fit of a line to the frames where the object is seen), over the
    render's."""
    out = {}
    for k, name in enumerate(SPANS):
        frames = np.arange(join + (k - 1) * SPAN, join + k * SPAN)
        seen = ~np.isnan(position[frames])
        fit = np.polyfit(frames[seen], position[frames][seen], 1)[0] if seen.sum() >= SPAN // 2 else np.nan
        out[name] = float(fit / np.polyfit(frames, truth[frames], 1)[0])
    return out


def scene_rows(pipe, scene, seed: int, overlap: int, steps: int | None) -> list[dict]:
    latents, window, F0 = first_window(pipe, scene, seed, overlap, steps)
    start, join = window.start, F0 - window.start
    truth = render(scene, WIDTH, HEIGHT, num_frames=start + window.frames)
    vae = pipe.video_vae
    fresh = vae.encode_frames(torch.from_numpy(truth.frames[start:]))
    spliced = fresh.clone()
    spliced[:, :, overlap:] = latents[:, :, overlap:].to(fresh)
    decoded = {"dit": vae.decode(latents.to(fresh)), "truth_overlap": vae.decode(spliced),
               "round_trip": vae.decode(fresh)}
    labels = {name: colour_labels(frames.numpy()) for name, frames in decoded.items()}
    rendered_labels = colour_labels(truth.frames[start:])
    rows = []
    for k, obj in enumerate(scene.objects):
        hits = [c for c in truth.contact_frames[k] if F0 - SPAN <= c < F0 + 2 * SPAN]
        if obj.motion not in DIRECTIONS or hits:  # a wall hit turns the rendered speed inside a span
            continue
        axis = DIRECTIONS[obj.motion][0]
        rendered = track_colour(rendered_labels, obj.colour)
        path = (rendered.x, rendered.y)[axis]
        row = {"caption": caption(scene), "object": k, "motion": obj.motion}
        for name in DECODES:
            track = track_colour(labels[name], obj.colour)
            row[name] = speed_shares((track.x, track.y)[axis], path, join)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--scenes", type=int, default=8, help="toy_eval's extension scenes (those with a mover in a line "
                                                         "are measured)")
    p.add_argument("--overlap", type=int, choices=(2, 7, 12), default=7)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results/extension_join.json")
    args = p.parse_args()
    pipe, t0 = load(args.weights, args.device), time.perf_counter()
    rows = []
    for i, scene in enumerate(scenes_where(lambda s: True, EXTENSION_SEED, args.scenes, WIDTH, HEIGHT)):
        rows += scene_rows(pipe, scene, i, args.overlap, args.steps)
    summary = {f"{d}_{s}_median": float(np.nanmedian([r[d][s] for r in rows])) for d in DECODES for s in SPANS}
    print(f"{'speed / rendered':16s}" + "".join(f"{s:>12s}" for s in SPANS))
    for d in DECODES:
        print(f"{d:16s}" + "".join(f"{summary[f'{d}_{s}_median']:12.2f}" for s in SPANS))
    for r in rows:
        print(f"  {r['object']} {r['motion']:11s} dit " + " ".join(f"{r['dit'][s]:5.2f}" for s in SPANS)
              + " | " + r["caption"])
    result = {"summary": {**summary, "movers": len(rows), "overlap": args.overlap, "device": args.device,
                          "weights": str(args.weights), "wall_s": round(time.perf_counter() - t0, 1)}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
