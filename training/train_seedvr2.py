"""Train the embedded SeedVR2 (tiny 3B architecture) to restore degraded toy-world clips in its one step.

    python -m training.train_seedvr2 --minutes 8 --seed 0 --out engine/weights/toy/seedvr2    # GPU machine
    python -m training.train_seedvr2 --smoke --out /tmp/seedvr2                                # CPU: a few steps

The ground truth is a rendered clip at the embedded H3 canvas (224x128); its degraded copy is half the size,
blurred, noised and JPEG-compressed. The pipeline's own preprocessing (bicubic back to the output size, [-1, 1],
VAE encode) turns the copy into the condition latent; the NaDiT learns the official one-step recipe on it: at
t = 1000 on [noise | LQ latent | 1] it predicts v with x0 = noise - v, x0 the ground truth's latent. The VAE (the
tiny preset's widths) is trained first on reconstruction. Files come out in the official layout (DiT and VAE
fp16 safetensors, pos_emb.pt), which `SeedVR2Pipeline.from_preset("toy")` loads with the strict loaders.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

from engine.models.seedvr2.checkpoint import DIT_FILES, TEXT_FILE, VAE_FILES, save_checkpoint
from engine.models.seedvr2.config import LATENT_SCALE, TIMESTEP, TINY_3B, TINY_TEXT_LEN, TINY_VAE
from engine.models.seedvr2.nadit import build_nadit
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.models.seedvr2.vae import build_vae, posterior_sample
from training.quality import psnr
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train import EVAL_SEED, Log, timed_steps, toy_clips

WINDOW = 17  # pixel frames per training sample (4n + 1)
STAGES = {"vae": 0.35, "dit": 0.65}


def degrade(frames: np.ndarray, rng) -> np.ndarray:
    """uint8 [F, H, W, 3] -> uint8 [F, H/2, W/2, 3]: downscaled 2x, blurred, noised and JPEG-compressed (one
    setting for the whole clip, as a real low-quality source has)."""
    blur, sigma, quality = float(rng.uniform(0, 1.2)), float(rng.uniform(0, 8)), int(rng.integers(30, 90))
    height, width = frames.shape[1] // 2, frames.shape[2] // 2
    out = []
    for frame in frames:
        image = Image.fromarray(frame).resize((width, height), Image.BICUBIC)
        if blur > 0.1:
            image = image.filter(ImageFilter.GaussianBlur(blur))
        noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, sigma, (height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
        out.append(np.asarray(Image.open(buffer).convert("RGB")))
    return np.stack(out)


def to_model(frames: np.ndarray, size: tuple[int, int], device) -> torch.Tensor:
    """uint8 [F, h, w, 3] -> [3, F, H, W] in [-1, 1] at `size` (the pipeline's bicubic resize, antialiased)."""
    x = torch.from_numpy(frames).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if tuple(x.shape[-2:]) != size:
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(-1, 1)
    return x.permute(1, 0, 2, 3)


def window(clip: np.ndarray, rng, smoke: bool) -> np.ndarray:
    start = 0 if smoke else int(rng.integers(0, clip.shape[0] - WINDOW + 1))
    return clip[start:start + WINDOW]


def train_vae(vae, clips, budget_s, batch, log, rng, max_steps=None) -> None:
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, fused=next(vae.parameters()).is_cuda)
    size = clips[0].shape[1:3]
    for step in timed_steps(budget_s, max_steps):
        picks = range(batch) if max_steps else rng.integers(len(clips), size=batch)
        x = torch.stack([to_model(window(clips[i], rng, bool(max_steps)), size, x_device(vae))
                         for i in picks])
        moments = vae.encoder(x)
        mean, logvar = moments.float().chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar.clamp(-30, 20)) * torch.randn_like(mean)
        y = vae.decoder(z)
        recon = F.mse_loss(y, x)
        loss = recon + F.l1_loss(y, x) + 1e-6 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or max_steps:
            log("sr_vae", step, max_steps, recon=recon.item())
    vae.eval().requires_grad_(False)


def x_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def pair_latents(vae, hr: np.ndarray, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(ground-truth latent, LQ latent), both [T, h, w, 16] at the DiT's scale."""
    device, size = x_device(vae), hr.shape[1:3]
    gt = vae.encode(to_model(hr, size, device)[None])
    lq = vae.encode(to_model(degrade(hr, rng), size, device)[None])
    return tuple(posterior_sample(m, g)[0].permute(1, 2, 3, 0) * LATENT_SCALE
                 for m, g in ((gt, None), (lq, torch.Generator().manual_seed(int(rng.integers(1 << 30))))))


def train_dit(dit, vae, text, clips, budget_s, batch, log, rng, max_steps=None) -> None:
    """One-step restoration on pairs encoded once (two windows of every clip, each with its own degradation)."""
    dit.float().train().requires_grad_(True)
    opt = torch.optim.AdamW(dit.parameters(), lr=3e-4, weight_decay=0.01, fused=x_device(dit).type == "cuda")
    pairs = [pair_latents(vae, window(clip, rng, bool(max_steps)), rng)
             for clip in clips for _ in range(1 if max_steps else 2)]
    log("sr_pairs", len(pairs))
    total, every = 0.0, 1 if max_steps else 100
    for step in timed_steps(budget_s, max_steps):
        opt.zero_grad(set_to_none=True)
        picks = range(min(batch, len(pairs))) if max_steps else rng.integers(len(pairs), size=batch)
        gen = torch.Generator().manual_seed(0 if max_steps else int(rng.integers(1 << 30)))
        step_loss = 0.0
        for i in picks:
            gt, lq = pairs[int(i)]
            noise = torch.randn(gt.shape, generator=gen).to(gt.device)
            v = dit(torch.cat([noise, lq, torch.ones_like(lq[..., :1])], dim=-1), text, TIMESTEP)
            loss = F.mse_loss(v, noise - gt) / len(picks)
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        total += step_loss
        if (step + 1) % every == 0:
            log("sr_dit", step + 1, max_steps, loss=total / every)
            total = 0.0
    dit.eval().requires_grad_(False)


def evaluate(pipe: SeedVR2Pipeline, scenes, size: tuple[int, int], seconds: float) -> dict:
    """PSNR against the rendered ground truth: SeedVR2 on the degraded clip vs its bicubic upscale."""
    rng, ours, bicubic = np.random.default_rng(0), [], []
    for scene in scenes:
        hr = render(scene, size[1], size[0], seconds).frames
        lq = degrade(hr, rng)
        out = pipe.upscale(lq, target_height=size[0], target_width=size[1]).numpy()
        up = ((to_model(lq, size, "cpu").permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy()
        ours.append(psnr(out, hr))
        bicubic.append(psnr(up, hr))
    return {"psnr": float(np.mean(ours)), "bicubic_psnr": float(np.mean(bicubic)),
            "gain_db": float(np.mean(ours) - np.mean(bicubic))}


def save(dit, vae, text, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(dit, out / DIT_FILES["3b"][0], torch.float16)
    save_checkpoint(vae, out / VAE_FILES[0], torch.float16)
    torch.save(text.cpu().clone(), out / TEXT_FILE)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Train the embedded SeedVR2 on degraded toy clips.")
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("engine/weights/toy/seedvr2"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resume", action="store_true", help="start from the files in --out")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    p.add_argument("--smoke", action="store_true", help="CPU check: small clips, a few steps of each stage")
    args = p.parse_args(argv)
    rng, device = np.random.default_rng(args.seed), torch.device(args.device)
    width, height = (64, 32) if args.smoke else (224, 128)
    steps_cap = 4 if args.smoke else None
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / ("smoke_log.jsonl" if args.smoke else "train_log.jsonl"))
    seeds = range(args.seed * 1_000_000 + 500_000, args.seed * 1_000_000 + 500_000 + (1 if args.smoke else args.clips))
    clips = [c[0] for c in toy_clips(seeds, width, height, 0.75 if args.smoke else 5.0, 1 if args.smoke else 8)]
    log("data", len(clips), canvas=f"{width}x{height}")
    if args.resume:
        pipe = SeedVR2Pipeline.from_preset("toy", device=device, root=args.out, dtype=torch.float32)
        dit, vae, text = pipe.dit, pipe.vae, pipe.text
    else:
        dit = build_nadit(TINY_3B, seed=args.seed, device=device)
        vae = build_vae(TINY_VAE, seed=args.seed, device=device)
        text = torch.randn(TINY_TEXT_LEN, TINY_3B.text_dim, generator=torch.Generator().manual_seed(0)).to(device)
    budget = args.minutes * 60
    share = {k: v / sum(STAGES[s] for s in args.stages) for k, v in STAGES.items()}
    if "vae" in args.stages:
        train_vae(vae, clips, budget * share["vae"], 1 if args.smoke else 4, log, rng, steps_cap)
    if "dit" in args.stages:
        train_dit(dit, vae, text, clips, budget * share["dit"], 1 if args.smoke else 4, log, rng, steps_cap)
    save(dit, vae, text, args.out)
    pipe = SeedVR2Pipeline.from_preset("toy", device=device, root=args.out, dtype=torch.float32)
    scenes = [sample_scene(EVAL_SEED + i, width, height) for i in range(1 if args.smoke else 4)]
    log("sr_eval", 0, None, **evaluate(pipe, scenes, (height, width), 0.75 if args.smoke else 1.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
