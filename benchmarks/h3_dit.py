"""Full-size MiniMax-H3 DiT, random weights: our blocks vs diffusers' in the same run (GPU).

Times one DiT block at 1344x768 for each frame count (S = 37 774 rows at 124 frames, 109 126 at 362, text 64)
and reports ms per block and the 50-block step estimate, for each of our attention backends and for diffusers'
default. Also checks that a 2-block model of ours matches diffusers on the same weights (bf16 tolerance).

    python benchmarks/h3_dit.py [--frames 124 362] [--out benchmarks/results/h3_dit.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import cuda_ms  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.models.h3 import checkpoint  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL, NUM_MODALITIES, TEXT_TAG  # noqa: E402
from engine.models.h3.dit import build_dit, rope_table  # noqa: E402

TEXT_ROWS = 64


def make_layout(frames: int):
    T, Ta = L.latent_frames(frames), L.audio_latents(frames)
    return L.build_layout(torch.full((TEXT_ROWS,), TEXT_TAG), T, 48, 84, Ta)


def block_flops(S: int, c=FULL) -> float:
    linear = 2 * S * (c.hidden_size * 3 * c.inner_dim + c.inner_dim * c.hidden_size + 3 * c.hidden_size * c.ffn_dim)
    attention = 4 * S * S * c.inner_dim
    return linear + attention, attention / (linear + attention)


def diffusers_block(device):
    from diffusers import MiniMaxH3Transformer3DModel

    ref = MiniMaxH3Transformer3DModel(**replace(FULL, num_layers=2, num_refiner_layers=2).to_dict())
    ref = ref.to(device, torch.bfloat16)
    for name in ref._keep_in_fp32_modules:
        if hasattr(ref, name):
            getattr(ref, name).float()
    return ref.eval().requires_grad_(False)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 362])
    parser.add_argument("--out", default="benchmarks/results/h3_dit.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}

    ours = build_dit(replace(FULL, num_layers=2), seed=0, dtype=torch.bfloat16, device=device)
    ref = diffusers_block(device)
    ref.load_state_dict(checkpoint.to_diffusers(ours.state_dict()))
    our_backends = attn.backends(device)
    results["our_backends"] = our_backends
    results["auto_backend"] = attn.choose(device)

    # Fidelity at full width on a short layout: ours (each backend) vs diffusers on the same weights.
    lay = make_layout(22).to(device)
    nv, na = lay.video_indices.numel(), lay.audio_indices.numel()
    g = torch.Generator(device).manual_seed(0)
    inputs = (torch.randn(1, nv, 96, device=device, generator=g), torch.randn(1, na, 32, device=device, generator=g),
              torch.randn(1, TEXT_ROWS, 5120, device=device, generator=g, dtype=torch.bfloat16))
    ts, idx = L.row_timesteps(lay, 0.4, 0.6)
    common = (ts.to(device), idx.to(device), lay.token_tags, lay.position_ids, lay.video_indices,
              lay.audio_indices, lay.text_indices)
    with torch.no_grad():
        v_ref, a_ref = ref(*inputs, *common, return_dict=False)
        for name in our_backends:
            with attn.use_backend(name):
                v, a = ours(*inputs, *common)
            err = ((v.float() - v_ref.float()).abs().max() / v_ref.float().abs().max()).item()
            results[f"rel_err_vs_diffusers_{name}"] = round(err, 5)

    block, ref_block = ours.blocks[0], ref.transformer_blocks[0]
    for frames in args.frames:
        lay = make_layout(frames).to(device)
        S = lay.seq_len
        x = torch.randn(1, S, FULL.hidden_size, device=device, dtype=torch.bfloat16) * 0.5
        ts, idx = L.row_timesteps(lay, 0.4, 0.6)
        with torch.no_grad():
            temb = ours.time_embedding(ts.to(device))
            mods = block.adaln_proj(temb)
            rows = idx.to(device) * NUM_MODALITIES + lay.token_tags
            rope = rope_table(lay.position_ids, ours.rope_inv_freq)
            flops, attn_share = block_flops(S)
            row = {"frames": frames, "S": S, "attn_flop_share": round(attn_share, 3)}
            ms = cuda_ms(lambda: ref_block(x, temb, rows, rope))
            row["diffusers_ms_per_block"] = round(ms, 2)
            for name in our_backends:
                with attn.use_backend(name):
                    ms_ours = cuda_ms(lambda: block(x, mods, rows, rope))
                row[f"ours_{name}_ms_per_block"] = round(ms_ours, 2)
                row[f"ours_{name}_tflops"] = round(flops / ms_ours / 1e9, 1)
                row[f"ours_{name}_speedup_vs_diffusers"] = round(ms / ms_ours, 3)
            row["diffusers_tflops"] = round(flops / ms / 1e9, 1)
            row["diffusers_step_est_s"] = round(50 * ms / 1e3, 2)
            best = min(our_backends, key=lambda n: row[f"ours_{n}_ms_per_block"])
            row["ours_best_backend"] = best
            row["ours_step_est_s"] = round(50 * row[f"ours_{best}_ms_per_block"] / 1e3, 2)
        results["runs"].append(row)
        torch.cuda.empty_cache()
    results["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)

    print(f"\nMiniMax-H3 DiT, 1344x768, one block, bf16, {results['gpu']} (torch {results['torch']})")
    cols = ["frames", "S", "diffusers ms/blk"] + [f"{n} ms/blk" for n in our_backends] + ["best x", "step s (ours/diff)"]
    print(" | ".join(f"{c:>16}" for c in cols))
    for r in results["runs"]:
        vals = [r["frames"], r["S"], r["diffusers_ms_per_block"]] + [r[f"ours_{n}_ms_per_block"] for n in our_backends]
        vals += [r[f"ours_{r['ours_best_backend']}_speedup_vs_diffusers"],
                 f"{r['ours_step_est_s']}/{r['diffusers_step_est_s']}"]
        print(" | ".join(f"{v:>16}" for v in vals))
    print({k: v for k, v in results.items() if k.startswith("rel_err")}, f"peak {results['peak_mem_GiB']} GiB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
