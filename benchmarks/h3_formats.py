"""H3 DiT formats on one GPU: the Comfy-Org single-file schemas against our bf16 and diffusers, same run.

Random weights at full width are written in each published schema (--layers blocks, default 2, so five files
fit the disk; load time and memory are also given per block and for 50 blocks), then loaded by our strict loader:

  bf16                 minimax_h3_fl2va_bf16 (full AdaLN, time embedder)
  pruned_bf16          curve AdaLN: adaln_t_table [1025, 8], F16 rank-8 projections, no time embedder
  pruned_fp8_scaled    + the 4 GEMMs per block in F8_E4M3 with a per-tensor scale (torch._scaled_mm on SM >= 8.9)
  pruned_int8_convrot  + the 4 GEMMs in I8 with ConvRot 256 and per-row scales (W8A8 through torch._int_mm)
  int8_convrot         unpruned: the GEMMs as above and the AdaLN at ConvRot group 64

Per format: file size, load time, GPU memory of the weights, one block at 1344x768 x 124 and x 362 frames dense
and with VSA at --sparsity (best of 3 rounds), the ratio to the diffusers block, the block's four GEMMs alone
(with their activation quantizers and SwiGLU; ratio to bf16), the GEMM path taken, and the block output's relative
error against our bf16 block (each format with its own AdaLN tables, so the pruned formats include the rank-8
curve error); the error is taken on the block's update (output - input), which the residual would hide.

    python benchmarks/h3_formats.py [--layers 2] [--sparsity 0.875] [--out benchmarks/results/h3_formats.json]
    python benchmarks/h3_formats.py --tiny     # the same code path on CPU at tiny width (a smoke check)
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import timed  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.kernels import vsa  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.checkpoint import load_dit, save_dit, to_diffusers  # noqa: E402
from engine.models.h3.config import FULL, NUM_MODALITIES, TEXT_TAG, H3Config  # noqa: E402
from engine.models.h3.dit import build_dit, rope_table  # noqa: E402
from engine.models.h3.prune import prune_adaln  # noqa: E402
from engine.quant.transform import QuantSpec, quantize_linears  # noqa: E402

ROUNDS = 3
FORMATS = ("bf16", "pruned_bf16", "pruned_fp8_scaled", "pruned_int8_convrot", "int8_convrot")
GEMMS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# GEMM widths divisible by ConvRot's 256, the unpruned AdaLN input (128) by 64: the published schema, tiny.
TINY = H3Config(num_attention_heads=2, attention_head_dim=128, hidden_size=256, num_layers=2, num_refiner_layers=1,
                ffn_dim=512, text_dim=64, freq_dim=32, time_embed_hidden_dim=256, time_embed_dim=128,
                rope_freq_dim=16)


def gib(n: float) -> float:
    return round(n / 2**30, 3)


def write_files(args, config, folder: Path, device) -> dict[str, Path]:
    """Each format's file, from one random full model (the quantized ones quantized from its bf16 weights)."""
    full = build_dit(config, seed=0, dtype=args.dtype, device=device)
    gemms = [f"blocks.{i}.{g}" for i in range(config.num_layers) for g in GEMMS]
    adaln = {f"blocks.{i}.adaln_proj.linear": QuantSpec("int8_convrot", group=64) for i in range(config.num_layers)}
    paths = {"bf16": save_dit(full, folder / "minimax_h3_fl2va_bf16.safetensors")}
    pruned = prune_adaln(full)
    paths["pruned_bf16"] = save_dit(pruned, folder / "minimax_h3_fl2va_pruned_bf16.safetensors")
    for name, spec in (("pruned_fp8_scaled", QuantSpec("float8_e4m3fn")), ("pruned_int8_convrot", QuantSpec("int8_convrot"))):
        paths[name] = save_dit(quantize_linears(copy.deepcopy(pruned), dict.fromkeys(gemms, spec)),
                               folder / f"minimax_h3_fl2va_{name}.safetensors")
    del pruned
    paths["int8_convrot"] = save_dit(quantize_linears(full, dict.fromkeys(gemms, QuantSpec("int8_convrot")) | adaln),
                                     folder / "minimax_h3_fl2va_int8_convrot.safetensors")
    del full
    gc.collect()
    return paths


def diffusers_block(model, device, dtype):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    c = model.config
    ref = MiniMaxH3TransformerBlock(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.ffn_dim,
                                    c.time_embed_dim, c.norm_eps, c.qk_norm_eps)
    sd = {k.removeprefix("transformer_blocks.0."): v for k, v in to_diffusers(
        {k: v for k, v in model.state_dict().items() if k.startswith("blocks.0.")}).items()}
    ref.load_state_dict(sd)
    return ref.to(device, dtype).eval().requires_grad_(False)


def workloads(args, device):
    """Per frame count: (layout, timesteps, row indices, the block input x), the same for every format."""
    out = {}
    for frames in ([22] if args.tiny else args.frames):
        h, w = (8, 14) if args.tiny else (48, 84)
        lay = L.build_layout(torch.full((64,), TEXT_TAG), L.latent_frames(frames), h, w, L.audio_latents(frames))
        lay = lay.to(device)
        ts, idx = L.row_timesteps(lay, 0.4, 0.6)
        gen = torch.Generator(device=device).manual_seed(frames)
        hidden = (TINY if args.tiny else FULL).hidden_size
        x = (torch.randn(1, lay.seq_len, hidden, device=device, generator=gen) * 0.5).to(args.dtype)
        out[frames] = (lay, ts.to(device), idx.to(device), x)
    return out


def measure(args, name, path, work, reference, device, sync):
    row = {"format": name, "file_GiB": gib(path.stat().st_size)}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    t0 = time.perf_counter()
    model = load_dit(path, dtype=args.dtype, device=device)
    sync()
    row["load_s"] = round(time.perf_counter() - t0, 2)
    layers = model.config.num_layers
    if device.type == "cuda":
        weights = torch.cuda.memory_allocated() - before
        row["weights_GiB"] = gib(weights)
        row["load_peak_GiB"] = gib(torch.cuda.max_memory_allocated() - before)
        per_block = sum(t.numel() * t.element_size() for t in model.blocks[0].state_dict().values())
        row["block_weights_GiB"] = gib(per_block)
        row["weights_GiB_at_50_blocks"] = gib(weights + (50 - layers) * per_block)
    row["load_s_at_50_blocks_est"] = round(row["load_s"] * 50 / layers, 1)
    block = model.blocks[0]
    ref_block = diffusers_block(model, device, args.dtype) if name == "bf16" else None
    with torch.no_grad():
        for frames, (lay, ts, idx, x) in work.items():
            temb = model.time_embedding(ts)
            mods = model.block_modulations(temb)[0]
            rows = idx * NUM_MODALITIES + lay.token_tags
            rope = rope_table(lay.position_ids, model.rope_inv_freq)
            plan = vsa.build_plan(lay)
            topk = vsa.topk_for_sparsity(args.sparsity, plan.num_cubes)

            def sparse():
                with vsa.active(plan, topk):
                    return block(x, mods, rows, rope)

            attn_out = torch.randn(*x.shape[:-1], block.attn.out_proj.in_features, device=device).to(args.dtype)

            def gemms():  # the block's four GEMMs (and, quantized, their activation quantizers), SwiGLU included
                block.attn.qkv_proj(x), block.attn.out_proj(attn_out), block.mlp(x)

            runs = {"dense": lambda: block(x, mods, rows, rope), "vsa": sparse, "gemms": gemms}
            if ref_block is not None:
                runs["diffusers"] = lambda: ref_block(x, temb, rows, rope)
            # The runs take turns, each keeps its best: GPU clocks drift as the card heats.
            rounds = [{k: timed(fn, sync, *args.timing) for k, fn in runs.items()} for _ in range(args.rounds)]
            for k in runs:
                row[f"{frames}_{k}_ms"] = round(min(r[k] for r in rounds), 2)
            outputs = {"dense": block(x, mods, rows, rope).float(), "vsa": sparse().float()}
            if ref_block is not None:
                reference[frames] = {"diffusers_ms": row[f"{frames}_diffusers_ms"], **outputs}
            base = reference[frames]
            for k in ("dense", "vsa"):
                row[f"{frames}_{k}_speedup_vs_diffusers"] = round(base["diffusers_ms"] / row[f"{frames}_{k}_ms"], 3)
                # error of the block's update (output - input): the residual would hide it
                row[f"{frames}_{k}_rel_err_vs_bf16"] = round(
                    ((outputs[k] - base[k]).norm() / (base[k] - x.float()).norm()).item(), 5)
            row[f"{frames}_S"] = lay.seq_len
            if ref_block is not None:
                reference[frames]["gemms_ms"] = row[f"{frames}_gemms_ms"]
            row[f"{frames}_gemms_speedup_vs_bf16"] = round(reference[frames]["gemms_ms"] / row[f"{frames}_gemms_ms"], 3)
    qkv = model.blocks[0].attn.qkv_proj
    int8_gemm = "Triton int8 W8A8" if qkv.weight.is_cuda else "_int_mm W8A8"
    row["gemm_path"] = ("_scaled_mm" if getattr(qkv, "scaled_mm", False) else int8_gemm
                        if getattr(qkv, "int_mm", False) else "dequantized" if hasattr(qkv, "requantize")
                        else str(args.dtype).removeprefix("torch."))
    log(f"{name}: {row}")
    RESULTS.setdefault("formats", []).append(row)
    del model, block, ref_block
    gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 362])
    parser.add_argument("--layers", type=int, default=2, help="DiT blocks written per file (full width)")
    parser.add_argument("--sparsity", type=float, default=0.875)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/h3_formats.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    args.rounds, args.timing = (1, (0, 1)) if args.tiny else (ROUNDS, (1, 3))  # (warmup, iters)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = replace(TINY if args.tiny else FULL, num_layers=args.layers, num_refiner_layers=1)
    RESULTS.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   capability=list(torch.cuda.get_device_capability()) if device.type == "cuda" else None,
                   attention_backends=attn.backends(device), sparsity=args.sparsity, layers=args.layers)
    out = Path(args.out)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        paths = {}
        stage("write", lambda: paths.update(write_files(args, config, Path(folder), device)), out)
        work = workloads(args, device)
        reference: dict = {}
        for name in ("bf16",) + tuple(f for f in args.formats if f != "bf16"):  # bf16 first: the reference
            if name in paths:
                stage(name, lambda name=name: measure(args, name, paths[name], work, reference, device, sync), out)

    log("\n== H3 DiT formats (one block; ours vs diffusers and vs our bf16, same run) ==")
    for r in RESULTS.get("formats", []):
        mem = f"{r['weights_GiB_at_50_blocks']} GiB at 50 blocks" if "weights_GiB_at_50_blocks" in r else "cpu"
        parts = [f"{r['format']:<20} ({r['gemm_path']}) file {r['file_GiB']} GiB, load {r['load_s']} s, {mem}"]
        for frames in work:
            parts.append(f"{frames} fr: dense {r[f'{frames}_dense_ms']} ms ({r[f'{frames}_dense_speedup_vs_diffusers']}x, "
                         f"err {r[f'{frames}_dense_rel_err_vs_bf16']}), VSA {r[f'{frames}_vsa_ms']} ms "
                         f"({r[f'{frames}_vsa_speedup_vs_diffusers']}x, err {r[f'{frames}_vsa_rel_err_vs_bf16']}), "
                         f"4 GEMMs {r[f'{frames}_gemms_ms']} ms ({r[f'{frames}_gemms_speedup_vs_bf16']}x bf16)")
        log(" | ".join(parts))
    save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
