"""MiniMax-H3 video VAE on one GPU: our fast path (engine/models/h3/video_vae_fast.py) against diffusers in the same
run, on full-size random weights of the released config.

  1. Decode of 37 latents [1, 24, 37, 48, 84] = 124 frames at 1344x768 (7 clips x 28 tiles of 256 px):
     diffusers fp32 (the oracle), diffusers fp16 (the released recipe: fp16 autocast over the cast weights), ours
     fp16, bf16 and fp8 (bf16 activations; fast accumulation, and exact for comparison), ours fp16 to uint8 host
     frames (what the engine streams).
  2. Encode of 124 frames at 1344x768 (the keyframe recipe, `encode_frames`): diffusers fp32 (as released),
     diffusers fp16 autocast, ours bf16 (the default), fp16, and fp8 (`encode_fp8`: the ResNet blocks' k3
     convolutions with fp8 inputs and weights, engine/kernels/conv_fp8.py).

Each row: seconds, TFLOP/s (counted analytically: decoder GEMMs + attention per token, encoder convolutions; each
path's own work), peak GPU memory, and its error against the diffusers fp32 row: PSNR of the decoded frames (ImageNet
space mapped back to [0, 1], unclamped); for encodes the latents' max / mean abs error and the PSNR between the
decodes of both latents (ours fp16).

    python benchmarks/h3_vae.py [--out benchmarks/results/h3_vae.json]
    python benchmarks/h3_vae.py --small    # a small config and canvas on the CPU: checks the code path only
    python benchmarks/h3_vae.py --skip encode    # the decode rows alone
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import Measured, measure  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.models.h3 import vae as V  # noqa: E402
from engine.models.h3.video_vae_fast import TileGrid  # noqa: E402
from engine.quant.fp8 import Fp8Linear  # noqa: E402

GiB = 2**30


def random_vae(small: bool, device: torch.device) -> V.VideoVAE:
    """Random weights built on the device (a CPU init of 2.6 B parameters takes minutes); the zero-initialised layer
    scales and registers and the constant norm weights get a random perturbation, or every block would be a no-op."""
    config = dict(V.TINY_VIDEO_VAE) if small else V.video_vae_config_from_original({}, {})
    torch.manual_seed(0)
    with torch.device(device):
        model = V.AutoencoderKLMiniMaxH3(**config).eval().requires_grad_(False)
        for p in model.parameters():
            if bool((p == p.flatten()[0]).all()):
                p.add_(0.1 * torch.randn_like(p))
    tiles = (V.TINY_TILE_SIZE, V.TINY_TILE_OVERLAP) if small else (V.TILE_SIZE, V.TILE_OVERLAP)
    return V.VideoVAE(model, tile_size=tiles[0], tile_overlap=tiles[1]).to(device)


def smooth_frames(num_frames: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(1)
    base = torch.rand(num_frames, 3, height // 8, width // 8, generator=g, device=device)
    up = F.interpolate(base, size=(height, width), mode="bilinear", align_corners=False)
    return (up * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def decoder_flops(model, num_latents: int, height: int, width: int) -> float:
    """GEMMs and attention of every decoder call of a decode (all tiles of all clips, registers included)."""
    c = model.config
    dim = c.decoder_num_attention_heads * c.decoder_attention_head_dim
    ffn = dim * c.decoder_ffn_mult
    clips = (num_latents + c.token_drop) // model.tokens_chunk_size - 1
    grid = TileGrid.of(model, height, width)
    r = model.spatial_compression_ratio
    seq = ((model.tokens_chunk_size + model.token_overlap) * (grid.rows[0][1] // r) * (grid.cols[0][1] // r)
           + c.decoder_num_register_tokens + 1)
    per_token = c.decoder_num_layers * (2 * (4 * dim * dim + 3 * dim * ffn) + 4 * seq * dim) + 2 * dim * 3 * r * r * 4
    return clips * len(grid) * seq * per_token


def encoder_flops(model, clip_frames: list[int], height: int, width: int) -> float:
    """Convolutions of every encoder call: `clip_frames` frames per clip, every tile."""
    c = model.config
    grid = TileGrid.of(model, height, width)
    total = 0
    for frames in clip_frames:
        t, h, w = frames, grid.rows[0][1], grid.cols[0][1]
        flops = 2 * 27 * c.in_channels * c.block_out_channels[0] * t * h * w
        channels = c.block_out_channels[0]
        for out, ts, ss in zip(c.block_out_channels, c.temporal_downsample_factors, c.spatial_downsample_factors):
            for i in range(c.layers_per_block):
                cin = channels if i == 0 else out
                flops += 2 * 27 * (cin * out + out * out) * t * h * w + (2 * cin * out * t * h * w if cin != out else 0)
            channels = out
            if ts * ss > 1:
                t, h, w = (t - 1) // ts + 1, (h + (ss == 2) - 3) // ss + 1, (w + (ss == 2) - 3) // ss + 1
                flops += 2 * 27 * out * out * t * h * w
        flops += 2 * 27 * channels * 2 * c.latent_channels * t * h * w + 2 * (2 * c.latent_channels) ** 2 * t * h * w
        total += flops * len(grid)
    return total


def psnr(a: torch.Tensor, b: torch.Tensor, vae: V.VideoVAE) -> float:
    """Of ImageNet-normalised frames mapped back to [0, 1] (unclamped: random weights overshoot it), peak 1."""
    std = vae.pixel_std.to(a.device)
    mse = ((a.float() - b.float()) * std).square().mean().item()
    return round(10 * math.log10(1 / mse), 2) if mse > 0 else float("inf")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GiB, 1)


def add_row(kind: str, name: str, run: Measured, flops: float, **extra) -> None:
    row = dict(kind=kind, name=name, s=round(run.seconds, 3), tflops=float(f"{flops / run.seconds / 1e12:.3g}"),
               peak_GiB=gib(run.peak), above_start_GiB=gib(run.above_start), **extra)
    RESULTS.setdefault("rows", []).append(row)
    log(f"{row}")


@torch.no_grad()
def decode(args, vae, device) -> None:
    model = vae.model
    z = torch.randn(1, 24, args.latents, args.height // 16, args.width // 16, device=device,
                    generator=torch.Generator(device).manual_seed(0))
    zd = z * vae.latents_std + vae.latents_mean
    flops = decoder_flops(model, args.latents, args.height, args.width)
    floats = lambda: torch.cat(list(vae._decoded_chunks(zd)), dim=2)  # noqa: E731  (float frames, on the device)

    run = measure(lambda: model.decode(zd, return_dict=False)[0], device)
    oracle = run.result
    add_row("decode", "diffusers fp32 (oracle)", run, flops, psnr=float("inf"))
    fast_rows = [("ours fp16", torch.float16, False), ("ours bf16", torch.bfloat16, False),
                 ("ours fp8 (bf16 activations)", torch.bfloat16, True)]
    for name, dtype, fp8 in fast_rows:
        vae.decode_dtype, vae.decode_fp8 = dtype, fp8
        run = measure(floats, device, 1, args.iters)
        add_row("decode", name, run, flops, psnr=psnr(run.result, oracle, vae), compute=dtype_name(
            vae.fast_decoder().dtype))
        del run
    for layer in vae.fast_decoder().modules():  # the fp8 tier's GEMMs with fp32 promotion, for comparison
        if isinstance(layer, Fp8Linear):
            layer.fast_accum = False
    run = measure(floats, device, 1, args.iters)
    add_row("decode", "ours fp8, exact accumulation", run, flops, psnr=psnr(run.result, oracle, vae),
            compute=dtype_name(vae.fast_decoder().dtype))
    del run
    vae.decode_dtype, vae.decode_fp8 = torch.float16, False
    add_row("decode", "ours fp16 -> uint8 host frames", measure(lambda: vae.decode(z), device, 1, args.iters), flops)
    vae.reference = True  # casts diffusers' decoder weights to fp16 in place: the fp32 oracle ran first
    run = measure(floats, device, 1, 1)
    add_row("decode", "diffusers fp16 (released recipe)", run, flops, psnr=psnr(run.result, oracle, vae))
    vae.reference = False


@torch.no_grad()
def encode(args, vae, device) -> None:
    model = vae.model
    frames = smooth_frames(args.frames, args.height, args.width, device)
    clip = model.config.clip_length
    full = [clip] * -(-args.frames // clip)
    ours = full[:-1] + [(model.tokens_chunk_size - model.config.token_drop - 1) * model.temporal_compression_ratio + 1]
    diffusers_flops = encoder_flops(model, full, args.height, args.width)
    ours_flops = encoder_flops(model, ours, args.height, args.width)

    def decoded(latents):
        return torch.cat(list(vae._decoded_chunks(latents * vae.latents_std + vae.latents_mean)), dim=2)

    vae.reference = True
    run = measure(lambda: vae.encode_frames(frames), device, 1, 1)
    oracle = run.result
    add_row("encode", "diffusers fp32 (released)", run, diffusers_flops)

    def autocast():
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            return vae.encode_frames(frames)

    ours = lambda: vae.encode_frames(frames)  # noqa: E731
    rows = [("diffusers fp16 autocast", autocast, True, None, False, 1, diffusers_flops),
            ("ours bf16", ours, False, torch.bfloat16, False, args.iters, ours_flops),
            ("ours fp16", ours, False, torch.float16, False, args.iters, ours_flops),
            ("ours fp8 block convolutions", ours, False, torch.bfloat16, True, args.iters, ours_flops)]
    results = []
    for name, fn, reference, dtype, fp8, iters, flops in rows:
        vae.reference, vae.encode_dtype, vae.encode_fp8 = reference, dtype or vae.encode_dtype, fp8
        run = measure(fn, device, 1, iters)
        err = (run.result - oracle).abs()
        compute = "fp8" if fp8 else dtype_name(vae.fast_encoder().dtype)
        results.append((name, run, flops, dict(
            latents_max_abs_err=float(f"{err.max():.3g}"), latents_mean_abs_err=float(f"{err.mean():.3g}"),
            **({} if reference else {"compute": compute}))))
    vae.reference, vae.encode_dtype, vae.encode_fp8 = False, torch.bfloat16, False
    reference_frames = decoded(oracle)
    for name, run, flops, errors in results:
        add_row("encode", name, run, flops, **errors, decode_psnr=psnr(decoded(run.result), reference_frames, vae))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a small config and canvas on the CPU")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=("decode", "encode"), help="parts to skip")
    parser.add_argument("--out", help="default: benchmarks/results/h3_vae.json (--small: h3_vae_small.json)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    out = Path(args.out or f"benchmarks/results/h3_vae{'_small' if args.small else ''}.json")
    args.height, args.width, args.latents = (128, 224, 12) if args.small else (768, 1344, 37)
    args.frames = (args.latents - 2) // 5 * 17 + 5
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # the encoder's conv3d shapes repeat: tuned once, in the warm-up
    vae = random_vae(args.small, device)
    RESULTS.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   attention_backends=attn.backends(device), canvas=f"{args.width}x{args.height}",
                   frames=args.frames, latents=[1, 24, args.latents, args.height // 16, args.width // 16],
                   params=sum(p.numel() for p in vae.model.parameters()))
    log(f"{RESULTS}")
    for name, part in (("decode", decode), ("encode", encode)):
        if name not in args.skip:
            stage(name, lambda: part(args, vae, device), out)

    log(f"\n== MiniMax-H3 video VAE, {args.frames} frames {RESULTS['canvas']}, latents {RESULTS['latents']}, "
        f"{RESULTS['device']}, attention {attn.choose(device)} ==")
    log(f"{'':6} {'path':34} {'computes in':>11} {'s':>8} {'TFLOP/s':>8} {'peak GiB':>9} {'(above start)':>13}  "
        f"error vs diffusers fp32")
    for r in RESULTS.get("rows", []):
        if "psnr" in r:
            error = f"PSNR {r['psnr']} dB"
        elif "latents_max_abs_err" in r:
            error = (f"latents max {r['latents_max_abs_err']} mean {r['latents_mean_abs_err']}, decodes PSNR "
                     f"{r['decode_psnr']} dB")
        else:
            error = "-"
        log(f"{r['kind']:6} {r['name']:34} {r.get('compute', ''):>11} {r['s']:8.3f} {r['tflops']:8.3g} "
            f"{str(r['peak_GiB']):>9} {str(r['above_start_GiB']):>13}  {error}")
    save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
