"""How the trained embedded default does on the toy world, scored from decoded frames and sound alone
(training/scoring.py): t2va over captions of held-out scenes (colour, motion, background, pitch, clicks, rain; the
share of clips passing each check, all of them, and the issue's four named ones; for each bouncer, how closely its
height follows the render's; where the render clicks, whether the contacts drawn agree with its clicks: the clicks
check's pictures half; the issue's clicks number over the bouncing captions alone, and the share of the others where
knocks are heard) and fl2va (PSNR of generated frame 0 against the rendered first frame, and of the last frame when
both keyframes are given), the video VAE's reconstruction and the t2va checks on each clip round-tripped through both
VAEs (the most a DiT can reach), how steady the t2va movers are (the extension's velocity check at every frame of the
one window, away from contacts: what bounds an extension's later joins), masked edits of two-object clips (removal,
replacement, sky repaint) and 5 s -> 15 s extensions (training/task_checks.py; each window prompted with what the
scene shows from its start; with each scene's 15 s render round-tripped and judged at the same boundaries; the joins
kept by kind: a mover's first, after a wall hit, before one, a still object's; with `--extension-past render` each
join also given a true past; with `--guide-speeds F ...` whether the DiT reads a mover's speed from the guide: the
scenes' movers at F times their speed, extended from GUIDE_JOIN), and the trained SeedVR2 on degraded 2x clips against
their bicubic upscale, and VSA's frames against dense attention's for the same seed.
Prints a table and writes JSON.

    python benchmarks/toy_eval.py --weights engine/weights/toy --captions 20 --out benchmarks/results/toy_eval.json
    python benchmarks/toy_eval.py --steps 16 --video-shift 3 ...   # another sampler than the DiT file's
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.h3.extend import plan_windows  # noqa: E402
from engine.models.h3.pipeline import EditRequest, ExtendRequest, GenerateRequest, H3Pipeline  # noqa: E402
from engine.models.h3.request import Source  # noqa: E402
from engine.models.seedvr2.pipeline import SeedVR2Pipeline  # noqa: E402
from training.captions import caption, caption_at  # noqa: E402
from training.quality import delta_e76, mean_colour_lab, psnr, ssim  # noqa: E402
from training.scoring import NAMED_CHECKS, clicks_agree, score_clip  # noqa: E402
from training.task_checks import (JOIN_KINDS, box_masks, extension_checks, height_correlation,  # noqa: E402
                                  removal_checks, repaint_checks, replacement_checks, speed_kept, steady_frames)
from training.toy_scene import COLOURS, FPS, HORIZON, SAMPLE_RATE, sample_scene, visible_on  # noqa: E402
from training.toy_world import MAX_FRAMES, render  # noqa: E402
from training.train import EVAL_SEED, FILES  # noqa: E402
from training.train_seedvr2 import degrade, to_model  # noqa: E402


# The whole sky regenerated, as the shipped h3_repaint workflow does: at the repaint preset's 0.75 every step's
# estimate keeps a quarter of the source, and the toy DiT reads the rest of a uniform sky through the noise (the
# source comes back, ΔE 0.4-0.9 from it).
REPAINT_STRENGTH = 1.0
EXTENSION_SEED = EVAL_SEED + 3000  # the extension rows' scenes: the first held-out ones from here
# The guide-speed rows' join: a whole number of VAE chunks (17n + 5 frames: none of the source regenerated), early
# enough that a mover at twice its speed has not reached a wall.
GUIDE_JOIN = 56


def load(weights: Path, device: str) -> H3Pipeline:
    pipe = H3Pipeline.from_files(*(weights / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                 device=device, dtype=torch.float32)
    pipe.encode_mp4 = False
    return pipe


def round_trip(pipe: H3Pipeline, truth) -> tuple[np.ndarray, np.ndarray]:
    """A rendered clip's frames and sound encoded and decoded by the VAEs: what they let through to a DiT."""
    frames = pipe.video_vae.decode(pipe.video_vae.encode_frames(torch.from_numpy(truth.frames))).numpy()
    sound = pipe.audio_vae.decode(pipe.audio_vae.encode(torch.from_numpy(truth.audio), 32000)).cpu().numpy()
    return frames, sound


def scenes_where(condition, first_seed: int, count: int, width: int, height: int) -> list:
    """The first `count` held-out scenes (from `first_seed` on) that meet the condition."""
    found, seed = [], first_seed
    while len(found) < count:
        scene = sample_scene(seed, width, height)
        if condition(scene):
            found.append(scene)
        seed += 1
    return found


def sky_mask(scene, width: int, height: int) -> np.ndarray:
    """bool [H, W]: the sky of a blue-sky scene (all of it, or above the grass's horizon)."""
    rows = np.arange(height)[:, None] + 0.5 < HORIZON * height if scene.background != "blue sky" else True
    return np.broadcast_to(rows, (height, width))


def edit_rows(pipe: H3Pipeline, args, width: int, height: int) -> list[dict]:
    """Masked edits of two-object clips: remove object 0 (a padded box track of it, as Mask Track Box draws),
    replace it by a box of an unused colour with a new soundtrack (the new box hums at its own pitch; the same with
    the source's sound kept is the `replace_kept_sound` row), and repaint the sky of a blue-sky clip at night."""
    rows = []
    for i, scene in enumerate(scenes_where(lambda s: len(s.objects) == 2, EVAL_SEED + 1000, args.edits,
                                           width, height)):
        truth, (gone, kept) = render(scene, width, height), scene.objects
        mask = box_masks(truth.masks[0])
        source = Source(truth.frames, audio=truth.audio)
        removed = pipe.edit(EditRequest(source, mask, caption(replace(scene, objects=(kept,))), "remove", seed=i,
                                        steps=args.steps))
        colour = next(c for c in COLOURS if c not in (gone.colour, kept.colour) and visible_on(c, scene.background))
        new = replace(scene, objects=(replace(gone, shape="box", colour=colour), kept))
        replaced = pipe.edit(EditRequest(source, mask, caption(new), "replace", audio_mask=1.0, seed=i,
                                         steps=args.steps))
        kept_sound = pipe.edit(EditRequest(source, mask, caption(new), "replace", seed=i, steps=args.steps))
        row = {"caption": caption(scene), "replacement": caption(new),
               "removal": removal_checks(removed.frames.numpy(), truth, 0, mask),
               "replace": replacement_checks(replaced.frames.numpy(), truth, 0, colour),
               "replace_kept_sound": replacement_checks(kept_sound.frames.numpy(), truth, 0, colour)}
        rows.append(row)
        print(f"edit {i}: remove {row['removal']['checks']} replace {row['replace']['checks']} with the source's "
              f"sound {row['replace_kept_sound']['checks']}", flush=True)
    for i, scene in enumerate(scenes_where(lambda s: "blue sky" in s.background, EVAL_SEED + 2000, args.edits,
                                           width, height)):
        truth, sky = render(scene, width, height), sky_mask(scene, width, height)
        night = replace(scene, background="night")
        out = pipe.edit(EditRequest(Source(truth.frames, audio=truth.audio), sky.astype(np.float32), caption(night),
                                    "repaint", strength=REPAINT_STRENGTH, seed=i, steps=args.steps))
        row = {"caption": caption(scene), "repaint": repaint_checks(out.frames.numpy(), truth, sky, "night")}
        rows.append(row)
        print(f"repaint {i}: {row['repaint']['checks']}", flush=True)
    return rows


def extension_rows(pipe: H3Pipeline, args, width: int, height: int) -> list[dict]:
    """5 s sources extended by 10 s in 5 s windows (`--extension-overlap` latents, the engine's 7 unless told), scored
    at the window boundaries. Each window's prompt says what the scene shows from its first new frame on (`caption_at`:
    after a wall hit a mover goes the other way), or with `--extension-prompts scene` every window gets the scene's own
    caption."""
    rows = []
    for i, scene in enumerate(scenes_where(lambda s: True, EXTENSION_SEED, args.extensions, width, height)):
        source = render(scene, width, height)
        req = ExtendRequest(Source(source.frames, audio=source.audio), 10.0, [caption(scene)], window_seconds=5.0,
                            seed=args.extension_seed + i, steps=args.steps,
                            overlap_latents=args.extension_overlap)
        F0 = len(source.frames)
        windows = plan_windows(F0, int(round(req.seconds * 24)), req.overlap_latents, 5 * 24 + 5)
        boundaries = [F0] + [w.start + w.frames for w in windows[:-1]]
        if args.extension_prompts == "window":
            req = replace(req, prompts=[caption_at(scene, b / 24, width, height) for b in boundaries])
        out = pipe.extend(req)
        frames = out.frames.numpy()[:MAX_FRAMES]  # windows of 5 s overshoot 15 s; the toy world renders to 15 s
        truth = render(scene, width, height, num_frames=len(frames))
        boundaries = [b for b in boundaries if b + 24 <= len(frames)]
        samples = round(len(frames) / 24 * 32000)
        recon, sound = round_trip(pipe, truth)
        row = {"caption": caption(scene), "prompts": req.prompts, "boundaries": boundaries,
               "extension": extension_checks(frames, np.asarray(out.audio)[:, :samples], truth, boundaries),
               # the whole scene rendered and round-tripped through both VAEs, judged at the same boundaries
               "vae_roundtrip_extension": extension_checks(recon[:len(frames)], sound[:, :samples], truth,
                                                           boundaries)}
        if args.extension_past == "render":
            row["extension_from_render"] = joins_from_render(pipe, req, truth, boundaries)
        rows.append(row)
        print(f"extend {i}: {row['extension']['checks']} (round trip: {row['vae_roundtrip_extension']['checks']})",
              flush=True)
    return rows


def guide_speed_rows(pipe: H3Pipeline, args, width: int, height: int) -> dict:
    """Does the DiT read a mover's speed from the guide? Each extension scene with its movers at `--guide-speeds`
    times their speed, rendered to GUIDE_JOIN and extended by one window (prompted with what it shows from there):
    the median over movers of their speed after the join over the guide's (`speed_kept`: 1 for a DiT that keeps the
    guide's speed, 1 / F for one that draws its own speed for the prompt whatever the guide shows); beside it the
    same of the render round-tripped through the VAEs (what they let through)."""
    ratios = {(task, f): [] for task in ("extension", "vae_roundtrip") for f in args.guide_speeds}
    for i, base in enumerate(scenes_where(lambda s: True, EXTENSION_SEED, args.extensions, width, height)):
        for f in args.guide_speeds:
            scene = replace(base, objects=tuple(replace(o, speed=o.speed * f) for o in base.objects))
            truth = render(scene, width, height, num_frames=GUIDE_JOIN + 2 * 17)  # 17n + 5: the VAEs take it whole
            source = Source(truth.frames[:GUIDE_JOIN], audio=truth.audio[:, :round(GUIDE_JOIN / FPS * SAMPLE_RATE)])
            out = pipe.extend(ExtendRequest(source, 5.0, [caption_at(scene, GUIDE_JOIN / FPS, width, height)],
                                            window_seconds=5.0, seed=i, steps=args.steps,
                                            overlap_latents=args.extension_overlap))
            kept = speed_kept(out.frames.numpy()[:len(truth.frames)], truth, GUIDE_JOIN)
            ratios["extension", f] += kept
            ratios["vae_roundtrip", f] += speed_kept(round_trip(pipe, truth)[0], truth, GUIDE_JOIN)
            print(f"guide speed x{f:g} {i}: after / guide {' '.join(f'{r:.2f}' for r in kept) or '-'}", flush=True)
    return {f"{task}_speed_after_over_guide_x{f:g}_median": float(np.median(r)) if r else float("nan")
            for (task, f), r in ratios.items()}


def joins_from_render(pipe: H3Pipeline, req: ExtendRequest, truth, boundaries: list[int]) -> dict:
    """Each join of an extension given a true past: the render up to the join extended by one window with that
    window's prompt, the join judged alone (what the DiT continues from a true guide, without the errors its own
    earlier windows leave in the next one's)."""
    joins = []
    for i, b in enumerate(boundaries):
        prompt = req.prompts[min(i, len(req.prompts) - 1)]  # as the engine's windows: the last one repeats
        samples = round(b / FPS * SAMPLE_RATE)
        out = pipe.extend(replace(req, source=Source(truth.frames[:b], audio=truth.audio[:, :samples]),
                                  seconds=req.window_seconds, prompts=[prompt]))
        frames = out.frames.numpy()[:len(truth.frames)]
        audio = np.asarray(out.audio)[:, :round(len(frames) / FPS * SAMPLE_RATE)]
        joins += extension_checks(frames, audio, truth, [b], source_frames=boundaries[0])["joins"]
    return {"checks": {"velocity": all(j["kept"] for j in joins)}, "joins": joins}


def shares(rows: list[dict], task: str) -> dict:
    """The share of rows passing each check of a task, and all of them."""
    scored = [r[task]["checks"] for r in rows if task in r]
    if not scored:
        return {}
    names = sorted({k for c in scored for k in c})
    return {f"{task}_all_checks": float(np.mean([all(c.values()) for c in scored])),
            **{f"{task}_{k}": float(np.mean([c[k] for c in scored if k in c])) for k in names}}


def counts(kept: list[bool]) -> list[int]:
    return [int(sum(kept)), len(kept)]


def joins_kept(rows: list[dict], task: str) -> dict:
    """[kept, judged] of the rows' extension joins, by kind (task_checks.JOIN_KINDS)."""
    joins = [j for r in rows if task in r for j in r[task]["joins"]]
    return {f"{task}_joins_{kind}": counts([j["kept"] for j in joins if j["kind"] == kind])
            for kind in JOIN_KINDS} if joins else {}


def pooled(rows: list[dict], key: str) -> float:
    """The share of frames kept over all rows' [kept, judged] counts under `key`."""
    kept, judged = np.sum([r[key] for r in rows], axis=0) if rows else (0, 0)
    return float(kept / judged) if judged else float("nan")


def click_fields(scene, scored: dict) -> dict:
    """What a t2va row keeps of the clicks: whether the caption names a bouncer, the knocks heard and the contacts
    drawn (frames)."""
    return {"bounces": any(o.motion == "bounces" for o in scene.objects), "knocks": scored["detected"]["clicks"],
            "contacts": scored["detected"]["contacts"]}


def click_shares(rows: list[dict]) -> dict:
    """Issue 18's clicks number: the share of captions with a bouncer whose clicks agree with the contacts drawn;
    and the share of the captions without one where knocks are heard (a knock drawn whatever the prompt says)."""
    bouncing = [r for r in rows if r["bounces"]]
    others = [r for r in rows if not r["bounces"]]
    return {"t2va_clicks_of_bouncing": float(np.mean([r["checks"]["clicks"] for r in bouncing] or [np.nan])),
            "t2va_knocks_without_bounce": float(np.mean([bool(r["knocks"]) for r in others] or [np.nan]))}


def upscale_rows(args, width: int, height: int) -> dict:
    """SeedVR2 ("toy") on degraded half-size clips (train_seedvr2.degrade) up to the full canvas, vs bicubic."""
    if not args.upscales:
        return {}
    sr = SeedVR2Pipeline.from_preset("toy", device=args.device)
    rng, ours, bicubic, drift = np.random.default_rng(1), [], [], []
    for i in range(args.upscales):
        hr = render(sample_scene(EVAL_SEED + 500 + i, width, height), width, height, 1.0).frames
        lq = degrade(hr, rng)
        out = sr.upscale(lq, target_height=height, target_width=width).numpy()
        up = ((to_model(lq, (height, width), "cpu").permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255)
        ours.append(psnr(out, hr))
        bicubic.append(psnr(up.byte().numpy(), hr))
        drift.append(float(delta_e76(mean_colour_lab(out), mean_colour_lab(hr))))  # the colour fix's criterion
    return {"seedvr2_psnr": float(np.mean(ours)), "bicubic_psnr": float(np.mean(bicubic)),
            "seedvr2_gain_db": float(np.mean(ours) - np.mean(bicubic)),
            "seedvr2_mean_colour_delta_e_max": float(np.max(drift))}


def vsa_rows(pipe: H3Pipeline, args, width: int, height: int) -> dict:
    """The lossy speed option's price on the trained model: t2va with VSA at `--vsa-sparsity` against dense attention
    for the same caption and seed (PSNR / SSIM of the frames), and whether the clip's checks still agree."""
    if not args.vsa:
        return {}
    rows = []
    for i in range(args.vsa):
        scene = sample_scene(EVAL_SEED + i, width, height)
        req = GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width, height=height)
        pipe.vsa_sparsity = 0.0
        dense = pipe.generate(req)
        pipe.vsa_sparsity = args.vsa_sparsity
        try:
            sparse = pipe.generate(req)
        finally:
            pipe.vsa_sparsity = 0.0
        a, b = dense.frames.numpy(), sparse.frames.numpy()
        spread = np.unique(np.linspace(0, len(a) - 1, 8).round().astype(int))
        agree = (score_clip(a, np.asarray(dense.audio), scene)["checks"]
                 == score_clip(b, np.asarray(sparse.audio), scene)["checks"])
        rows.append((psnr(b, a), ssim(b[spread], a[spread]), agree))
        print(f"vsa {i}: {rows[-1][0]:.1f} dB SSIM {rows[-1][1]:.3f} checks agree {agree}", flush=True)
    psnrs, ssims, agree = zip(*rows)
    return {"vsa_sparsity": args.vsa_sparsity, "vsa_vs_dense_psnr_median": float(np.median(psnrs)),
            "vsa_vs_dense_ssim_median": float(np.median(ssims)), "vsa_checks_agree": float(np.mean(agree))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", type=Path, default=Path("engine/weights/toy"))
    p.add_argument("--captions", type=int, default=20)
    p.add_argument("--steps", type=int, default=None,
                   help="sigma grid points of every task's sampling (default: the canvas's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--upscales", type=int, default=4, help="degraded clips for the SeedVR2 rows (1 s each)")
    p.add_argument("--edits", type=int, default=4, help="two-object clips for removal / replacement, and sky clips "
                                                       "for the repaint")
    p.add_argument("--extensions", type=int, default=3, help="5 s clips extended to 15 s")
    p.add_argument("--extension-overlap", type=int, choices=(2, 7, 12), default=7,
                   help="latent frames each extension window regenerates of the one before (Extend's overlap)")
    p.add_argument("--extension-prompts", choices=("window", "scene"), default="window",
                   help="each extension window prompted with what the scene shows from its start (after a wall hit "
                        "a mover goes the other way), or every window with the scene's caption")
    p.add_argument("--extension-seed", type=int, default=0,
                   help="the sampling seed of the first extension scene (scene i samples with this + i): another "
                        "draw of the same scenes")
    p.add_argument("--extension-past", choices=("own", "render"), default="own",
                   help="with render, each extension join is also judged given a true past: the render up to it "
                        "extended by one window (extension_from_render)")
    p.add_argument("--guide-speeds", type=float, nargs="+", default=[], metavar="F",
                   help="the extension scenes' movers at these multiples of their speed, each extended from frame "
                        "GUIDE_JOIN: their speed after the join over the guide's")
    p.add_argument("--out", default="benchmarks/results/toy_eval.json")
    p.add_argument("--vsa", type=int, default=4, help="captions generated dense and with VSA (quality rows)")
    p.add_argument("--vsa-sparsity", type=float, default=0.875)
    p.add_argument("--guidance", type=float, default=None,
                   help="the classifier-free guidance scale of text-to-video, edits and extensions (two DiT "
                        "forwards a step unless 1; default: the one the DiT file records)")
    p.add_argument("--video-shift", type=float, default=None,
                   help="sample at this video schedule shift (default: the one the DiT file records)")
    args = p.parse_args()
    pipe = load(args.weights, args.device)
    if args.video_shift is not None:
        pipe.video_shift = args.video_shift
    if args.guidance is not None:
        pipe.guidance = args.guidance
    width, height = pipe.canvas.max_pixels // pipe.canvas.short_edge, pipe.canvas.short_edge
    rows, checks, t0 = [], {}, time.perf_counter()
    for i in range(args.captions):
        scene = sample_scene(EVAL_SEED + i, width, height)
        truth = render(scene, width, height)
        t2va = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                             height=height))
        scored = score_clip(t2va.frames.numpy(), np.asarray(t2va.audio), scene)
        verdict = scored["checks"]
        fl2va = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                              height=height, first_frame=truth.frames[0]))
        both = pipe.generate(GenerateRequest(prompt=caption(scene), seed=i, steps=args.steps, width=width,
                                             height=height, first_frame=truth.frames[0],
                                             last_frame=truth.frames[-1]))
        recon, sound = round_trip(pipe, truth)
        # What the VAEs let through: the same checks on the clip itself, encoded and decoded (a DiT can do no better)
        roundtrip = score_clip(recon[:len(truth.frames)], sound[:, :truth.audio.shape[1]], scene)["checks"]
        row = {"caption": caption(scene), "checks": verdict, "passed": all(verdict.values()),
               "named_passed": all(verdict[k] for k in NAMED_CHECKS if k in verdict),
               **click_fields(scene, scored),
               "vae_roundtrip_named_passed": all(roundtrip[k] for k in NAMED_CHECKS if k in roundtrip),
               "fl2va_first_frame_psnr": round(psnr(fl2va.frames[0].numpy(), truth.frames[0]), 2),
               "fl2va_both_first_psnr": round(psnr(both.frames[0].numpy(), truth.frames[0]), 2),
               "fl2va_both_last_psnr": round(psnr(both.frames[-1].numpy(), truth.frames[-1]), 2),
               "vae_reconstruction_psnr": round(psnr(recon[:len(truth.frames)], truth.frames), 2),
               "bounce_height_correlation": [round(height_correlation(t2va.frames.numpy(), truth, k), 3)
                                             for k, o in enumerate(scene.objects) if o.motion == "bounces"],
               # the extension's velocity check inside one window, where no join is: [frames kept, judged]
               "t2va_steady_frames": counts(steady_frames(t2va.frames.numpy(), truth)),
               "vae_roundtrip_steady_frames": counts(steady_frames(recon[:len(truth.frames)], truth)),
               # the clicks check's pictures half: would the render's own knocks agree with the contacts drawn?
               "t2va_contacts_agree_with_render_clicks": clicks_agree(
                   scored["detected"]["contacts"], list(truth.click_frames), len(truth.frames))
               if truth.click_frames else None}
        rows.append(row)
        for name, ok in verdict.items():
            checks.setdefault(name, []).append(bool(ok))
        for name, ok in roundtrip.items():
            checks.setdefault(f"vae_roundtrip_{name}", []).append(bool(ok))
        print(f"{i:3d} {'pass' if row['passed'] else 'fail'} fl2va {row['fl2va_first_frame_psnr']:5.1f} dB "
              f"{' '.join(k for k, ok in verdict.items() if not ok) or '-'} "
              f"(round trip: {' '.join(k for k, ok in roundtrip.items() if not ok) or '-'}) | {row['caption']}",
              flush=True)
    edits, extensions = edit_rows(pipe, args, width, height), extension_rows(pipe, args, width, height)
    summary = {"captions": len(rows), "t2va_all_checks": float(np.mean([r["passed"] for r in rows])),
               "t2va_named_checks": float(np.mean([r["named_passed"] for r in rows])),
               "vae_roundtrip_named_checks": float(np.mean([r["vae_roundtrip_named_passed"] for r in rows])),
               **{k if k.startswith("vae_") else f"t2va_{k}": float(np.mean(v)) for k, v in checks.items()},
               **{f"{k}_median": float(np.median([r[k] for r in rows])) for k in (
                   "fl2va_first_frame_psnr", "fl2va_both_first_psnr", "fl2va_both_last_psnr",
                   "vae_reconstruction_psnr")},
               "t2va_contacts_agree_with_render_clicks": float(np.mean(
                   [r["t2va_contacts_agree_with_render_clicks"] for r in rows
                    if r["t2va_contacts_agree_with_render_clicks"] is not None] or [np.nan])),
               **click_shares(rows),
               **{k: pooled(rows, k) for k in ("t2va_steady_frames", "vae_roundtrip_steady_frames")},
               "t2va_bounce_height_correlation_median": float(np.median(
                   [c for r in rows for c in r["bounce_height_correlation"]] or [np.nan])),
               **shares(edits, "removal"), **shares(edits, "replace"), **shares(edits, "replace_kept_sound"),
               **shares(edits, "repaint"),
               **shares(extensions, "extension"), **shares(extensions, "vae_roundtrip_extension"),
               **joins_kept(extensions, "extension"), **joins_kept(extensions, "vae_roundtrip_extension"),
               **shares(extensions, "extension_from_render"), **joins_kept(extensions, "extension_from_render"),
               **guide_speed_rows(pipe, args, width, height),
               **upscale_rows(args, width, height), **vsa_rows(pipe, args, width, height),
               "wall_s": round(time.perf_counter() - t0, 1), "device": args.device, "weights": str(args.weights),
               "guidance": pipe.guidance, "steps": args.steps, "video_shift": pipe.video_shift,
               "extension_prompts": args.extension_prompts, "extension_overlap": args.extension_overlap,
               "extension_seed": args.extension_seed,
               "extension_past": args.extension_past}
    print("\n== toy eval (share of clips passing; PSNR in dB) ==")
    for k, v in summary.items():
        print(f"{k:38s} {v:.3f}" if isinstance(v, float) else f"{k:38s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "clips": rows, "edits": edits,
                                                "extensions": extensions}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
