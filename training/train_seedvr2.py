"""Train the embedded SeedVR2 (the 3B architecture at toy width) to restore degraded toy-world clips in its one step.

    python -m training.train_seedvr2 --minutes 9 --seed 0 --out engine/weights/toy/seedvr2    # GPU machine
    python -m training.train_seedvr2 --smoke --out /tmp/seedvr2                                # CPU: a few steps

The ground truth is a rendered clip at the embedded H3 canvas (224x128); its degraded copy is half the size,
blurred, noised and JPEG-compressed. The pipeline's own preprocessing (bicubic back to the output size, [-1, 1],
VAE encode) turns the copy into the condition latent; the NaDiT learns the official one-step recipe on it: at
t = 1000 on [noise | LQ latent | 1] it predicts v with x0 = noise - v, x0 the ground truth's latent. The VAE is
trained first on reconstruction, each pixel's loss weighted 1 + OBJECT_WEIGHT near the objects (the generator's
masks, dilated): unweighted, the ~3 % of pixels that hold objects hardly count and a small VAE learns the
backgrounds and draws the objects as grey blobs. Both learning rates fall to LR_FLOOR of their start over their
stage. --minutes is the stages' training time: rendering the clips (~12 s), encoding the DiT's pairs (TOY_VAE: ~150
s for 512 on an H200, ~940 s for 128 on 2 CPU cores) and the closing eval (~30 s; ~210 s on the CPU) come on top.
Files come out in the official layout (DiT and VAE fp16 safetensors, pos_emb.pt), their headers recording the
architecture (`TOY_3B` / `TOY_VAE` unless --resume'd files say otherwise, or the --vae-* / --dit-* options), which
`SeedVR2Pipeline.from_preset("toy")` loads with the strict loaders.
"""

from __future__ import annotations

import argparse
import io
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

from engine.models.seedvr2.checkpoint import DIT_FILES, TEXT_FILE, VAE_FILES, save_checkpoint
from engine.models.seedvr2.config import (LATENT_SCALE, TIMESTEP, TINY_TEXT_LEN, TOY_3B, TOY_VAE, VAEConfig,
                                          swiglu_dim)
from engine.models.seedvr2.nadit import build_nadit
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.models.seedvr2.vae import build_vae, posterior_sample
from training.quality import psnr
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train import EVAL_SEED, Log, object_weight, timed_steps

WINDOW = 17  # pixel frames per VAE training sample (4n + 1)
DIT_WINDOWS = (17, 41, 121)  # pixel frames of the DiT's pairs, in turn: the temporal windows of 1 s and 5 s clips
STAGES = {"vae": 0.4, "dit": 0.6}
LR_FLOOR = 0.1  # each stage's learning rate falls linearly (in time) to this share of its start
LOGVAR_INIT = -10.0  # a fresh VAE's posterior log-variance: its noise starts ~0.007, not 1 (see fresh_vae)
UPSCALE_SEED = EVAL_SEED + 500  # the held-out clips (degradations from rng seed 1) of benchmarks/toy_eval.py


def render_clip(args: tuple[int, int, int, float]) -> tuple[np.ndarray, np.ndarray]:
    """(frames uint8 [F, H, W, 3], where any object is: bool [F, H, W]) of one toy scene."""
    seed, width, height, seconds = args
    clip = render(sample_scene(seed, width, height), width, height, seconds)
    return clip.frames, clip.masks.any(0)


def toy_clips(seeds, width: int, height: int, seconds: float, workers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    jobs = [(s, width, height, seconds) for s in seeds]
    if workers <= 1:
        return [render_clip(j) for j in jobs]
    with Pool(workers) as pool:
        return pool.map(render_clip, jobs, chunksize=4)


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


def window(clip: np.ndarray, rng, smoke: bool, length: int = WINDOW) -> slice:
    """A random `length`-frame span of the clip (4n + 1 frames; the first when smoke-testing)."""
    length = min(length, (clip.shape[0] - 1) // 4 * 4 + 1)
    start = 0 if smoke else int(rng.integers(0, clip.shape[0] - length + 1))
    return slice(start, start + length)


def decayed_lr(opt: torch.optim.Optimizer, base: float, start: float, budget_s: float) -> None:
    """The learning rate at this point of a stage that began at `start` (time.monotonic()) and lasts budget_s."""
    done = min(max((time.monotonic() - start) / max(budget_s, 1e-9), 0.0), 1.0)
    for group in opt.param_groups:
        group["lr"] = base * (1 - (1 - LR_FLOOR) * done)


def fresh_vae(config: VAEConfig, seed: int, device) -> torch.nn.Module:
    """A new VAE whose posterior starts nearly deterministic. At the default init its log-variance is ~0, so the
    training sample carries noise of std 1 against means of std ~0.3: the decoder learns to hedge (colours pulled
    towards the data's mean, stop 32's 17.9 dB) long before the encoder has outgrown the noise."""
    vae = build_vae(config, seed=seed, device=device)
    with torch.no_grad():
        vae.encoder.conv_out.bias[config.latent_channels:] = LOGVAR_INIT
    return vae


def train_vae(vae, clips, budget_s, batch, log, rng, max_steps=None, lr=3e-4) -> None:
    """Reconstruction (MSE + L1, weighted near the objects) of random 17-frame windows."""
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, fused=next(vae.parameters()).is_cuda)
    size, device, start = clips[0][0].shape[1:3], x_device(vae), time.monotonic()
    for step in timed_steps(budget_s, max_steps):
        decayed_lr(opt, lr, start, budget_s)
        picks = range(batch) if max_steps else rng.integers(len(clips), size=batch)
        spans = [(clips[i], window(clips[i][0], rng, bool(max_steps))) for i in picks]
        x = torch.stack([to_model(clip[0][span], size, device) for clip, span in spans])
        weight = object_weight(np.stack([clip[1][span] for clip, span in spans]), device)
        # bf16 on the GPU: a step of fp32 (TF32) convolutions took 0.12 s at 4 clips, and the stage is short of steps
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
            moments = vae.encoder(x)
            mean, logvar = moments.float().chunk(2, dim=1)
            z = mean + torch.exp(0.5 * logvar.clamp(-30, 20)) * torch.randn_like(mean)
            y = vae.decoder(z)
        error = y.float() - x
        recon = error.square().mean()
        loss = ((error.square() + error.abs()) * weight).mean() / weight.mean() \
            + 1e-6 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or max_steps:
            log("sr_vae", step, max_steps, recon=recon.item(), loss=loss.item())
    vae.eval().requires_grad_(False)


def x_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def pair_latents(vae, hr: np.ndarray, lq: np.ndarray, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ground-truth latent, LQ latent: a posterior sample), both [T, h, w, 16] at the DiT's scale."""
    device, size = x_device(vae), hr.shape[1:3]
    gt, lq = (vae.encode(to_model(frames, size, device)[None]) for frames in (hr, lq))
    return tuple(posterior_sample(m, g)[0].permute(1, 2, 3, 0) * LATENT_SCALE for m, g in ((gt, None), (lq, generator)))


def degraded(spans: list[np.ndarray], rng, workers: int) -> list[np.ndarray]:
    """Each span degraded with its own seed, on `workers` threads (PIL resizes, blurs and compresses without the
    GIL)."""
    seeds = rng.integers(1 << 30, size=len(spans))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda hr, seed: degrade(hr, np.random.default_rng(seed)), spans, seeds))


def train_dit(dit, vae, text, clips, budget_s, batch, log, rng, max_steps=None, lr=3e-4) -> None:
    """One-step restoration on pairs encoded once (two windows of every clip, DIT_WINDOWS long in turn, each with its
    own degradation); the encoding counts against `budget_s`."""
    end = time.monotonic() + budget_s
    dit.float().train().requires_grad_(True)
    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01, fused=x_device(dit).type == "cuda")
    lengths = (WINDOW,) if max_steps else DIT_WINDOWS
    windows = [clip[0] for clip in clips for _ in range(1 if max_steps else 2)]
    spans = [frames[window(frames, rng, bool(max_steps), lengths[k % len(lengths)])]
             for k, frames in enumerate(windows)]
    seeds = rng.integers(1 << 30, size=len(spans))
    pairs = [pair_latents(vae, hr, lq, torch.Generator().manual_seed(int(seed)))
             for hr, lq, seed in zip(spans, degraded(spans, rng, 1 if max_steps else 8), seeds)]
    log("sr_pairs", len(pairs))
    total, every, start = 0.0, 1 if max_steps else 100, time.monotonic()
    budget_s = max(1.0, end - start)
    for step in timed_steps(budget_s, max_steps):
        decayed_lr(opt, lr, start, budget_s)
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


@torch.no_grad()
def evaluate(pipe: SeedVR2Pipeline, scenes, size: tuple[int, int], seconds: float, seed: int = 1) -> dict:
    """PSNR against the rendered ground truth (by default benchmarks/toy_eval.py's upscale rows: its clips, its
    degradations): SeedVR2 on the degraded clip, its bicubic upscale, and what bounds SeedVR2: the VAE's
    reconstruction of the ground truth (encode -> decode; no DiT, no colour fix) and the pipeline with its DiT
    skipped (x0 = the LQ latent, colour-fixed)."""
    rng, rows = np.random.default_rng(seed), {"psnr": [], "bicubic_psnr": [], "vae_psnr": [], "no_dit_psnr": []}
    for scene in scenes:
        hr = render(scene, size[1], size[0], seconds).frames
        lq = degrade(hr, rng)
        out = pipe.upscale(lq, target_height=size[0], target_width=size[1]).numpy()
        up = ((to_model(lq, size, "cpu").permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy()
        n = (len(hr) - 1) // 4 * 4 + 1
        recon = pipe.vae.decode(posterior_sample(pipe.vae.encode(to_model(hr[:n], size, pipe.device)[None]), None))
        recon = ((recon[0].float().clamp(-1, 1).permute(1, 2, 3, 0).cpu() + 1) * 127.5).round().byte().numpy()
        pipe.predict = lambda vid: vid[..., :16] - vid[..., 16:32]  # v = noise - LQ latent: x0 is the LQ latent
        try:
            skipped = pipe.upscale(lq, target_height=size[0], target_width=size[1]).numpy()
        finally:
            del pipe.predict
        for key, frames in (("psnr", out), ("bicubic_psnr", up), ("no_dit_psnr", skipped), ("vae_psnr", recon)):
            rows[key].append(psnr(frames, hr[:len(frames)]))
    result = {k: float(np.mean(v)) for k, v in rows.items()}
    return {**result, "gain_db": result["psnr"] - result["bicubic_psnr"]}


def save(dit, vae, text, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(dit, out / DIT_FILES["3b"][0], torch.float16, config=dit.config)
    save_checkpoint(vae, out / VAE_FILES[0], torch.float16, config=vae.config)
    torch.save(text.cpu().clone(), out / TEXT_FILE)


def architectures(args) -> tuple:
    """The DiT and VAE configs of fresh models: TOY_3B / TOY_VAE, changed where an option says so."""
    dit, vae = TOY_3B, TOY_VAE
    if args.dit_dim:
        dit = replace(dit, dim=args.dit_dim, heads=args.dit_dim // dit.head_dim,
                      mlp_dim=swiglu_dim(args.dit_dim, multiple_of=16))
    if args.dit_layers:
        dit = replace(dit, num_layers=args.dit_layers, mm_layers=min(dit.mm_layers, args.dit_layers))
    if args.vae_widths:
        vae = VAEConfig(block_out_channels=tuple(args.vae_widths), layers_per_block=args.vae_layers or 1,
                        norm_groups=args.vae_groups or TOY_VAE.norm_groups)
    return dit, vae


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Train the embedded SeedVR2 on degraded toy clips.")
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("engine/weights/toy/seedvr2"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resume", action="store_true", help="start from the files in --out")
    p.add_argument("--fresh-vae", action="store_true", help="with --resume: a new VAE all the same")
    p.add_argument("--fresh-dit", action="store_true", help="with --resume: a new DiT all the same")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    p.add_argument("--batch", type=int, default=4, help="clips a step, both stages")
    p.add_argument("--vae-lr", type=float, default=3e-4, help="1e-3 learned slower (README: stop 32's and 33's runs)")
    p.add_argument("--dit-lr", type=float, default=3e-4)
    p.add_argument("--vae-widths", type=int, nargs="+",
                   help=f"a fresh VAE's block widths (TOY_VAE: {' '.join(map(str, TOY_VAE.block_out_channels))})")
    p.add_argument("--vae-layers", type=int, help="a fresh VAE's resnets per down block")
    p.add_argument("--vae-groups", type=int, help="a fresh VAE's GroupNorm groups")
    p.add_argument("--dit-dim", type=int, help=f"a fresh DiT's width (TOY_3B: {TOY_3B.dim})")
    p.add_argument("--dit-layers", type=int, help=f"a fresh DiT's blocks (TOY_3B: {TOY_3B.num_layers})")
    p.add_argument("--eval-clips", type=int, default=4, help="toy_eval's upscale clips scored at the end")
    p.add_argument("--smoke", action="store_true", help="CPU check: small clips, a few steps of each stage")
    args = p.parse_args(argv)
    rng, device = np.random.default_rng(args.seed), torch.device(args.device)
    torch.backends.cudnn.benchmark = True  # the VAE's 3-D convolutions, at one shape all through its stage
    width, height = (64, 32) if args.smoke else (224, 128)
    steps_cap = 4 if args.smoke else None
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / ("smoke_log.jsonl" if args.smoke else "train_log.jsonl"))
    seeds = range(args.seed * 1_000_000 + 500_000, args.seed * 1_000_000 + 500_000 + (1 if args.smoke else args.clips))
    clips = toy_clips(seeds, width, height, 0.75 if args.smoke else 5.0, 1 if args.smoke else 8)
    log("data", len(clips), canvas=f"{width}x{height}")
    dit_config, vae_config = architectures(args)
    if args.resume:
        pipe = SeedVR2Pipeline.from_preset("toy", device=device, root=args.out, dtype=torch.float32)
        dit, vae, text = pipe.dit, pipe.vae, pipe.text
    if not args.resume or args.fresh_dit:
        dit = build_nadit(dit_config, seed=args.seed, device=device)
    if not args.resume or args.fresh_vae:
        vae = fresh_vae(vae_config, args.seed, device)
    if not args.resume:
        text = torch.randn(TINY_TEXT_LEN, dit.config.text_dim, generator=torch.Generator().manual_seed(0)).to(device)
    log("models", 0, dit=str(dit.config), vae=str(vae.config))
    budget = args.minutes * 60
    share = {k: v / sum(STAGES[s] for s in args.stages) for k, v in STAGES.items()}
    batch = 1 if args.smoke else args.batch
    if "vae" in args.stages:
        train_vae(vae, clips, budget * share["vae"], batch, log, rng, steps_cap, lr=args.vae_lr)
        save(dit, vae, text, args.out)  # a call cut short in the DiT stage keeps the VAE (--resume --stages dit)
    if "dit" in args.stages:
        train_dit(dit, vae, text, clips, budget * share["dit"], batch, log, rng, steps_cap, lr=args.dit_lr)
        save(dit, vae, text, args.out)
    pipe = SeedVR2Pipeline.from_preset("toy", device=device, root=args.out, dtype=torch.float32)
    scenes = [sample_scene((EVAL_SEED if args.smoke else UPSCALE_SEED) + i, width, height)
              for i in range(1 if args.smoke else args.eval_clips)]
    log("sr_eval", 0, None, **evaluate(pipe, scenes, (height, width), 0.75 if args.smoke else 1.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
