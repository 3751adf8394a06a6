"""VSA on the GPU: the Triton fine kernel against the PyTorch reference, and VSA timed against dense attention.

Checks (bf16 inputs, q/k/v strided like the DiT's fused QKV, an odd 15x26 token grid with partial cubes):
  * Triton fine kernel vs `vsa.fine_reference` (fp32) on the same cube selection, at top-k = 7 and all cubes;
  * `vsa_attention` at top-k = all cubes vs dense attention (fp32 reference);
  * trained-gate mode at top-k = all cubes vs the CPU fp32 path.
Timing: one attention call at full H3 geometry (B = 1, 56 heads x 128) at 1344x768 for 124 and 362 frames
(S = 37 774 and 109 126): each dense backend, VSA at --sparsity (training-free and gated), and its stages.

    python benchmarks/vsa_check.py [--frames 124 362] [--sparsity 0.875] [--out benchmarks/results/vsa_check.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import cuda_ms  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.kernels import vsa  # noqa: E402
from engine.kernels.vsa_triton import block_sparse_attention  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import TEXT_TAG  # noqa: E402

TEXT_ROWS, HEADS, HEAD_DIM = 64, 56, 128
BF16_TOL = 2e-2  # max abs error / max abs reference


def make_layout(frames: int, latent_h: int, latent_w: int, keyframes=()):
    return L.build_layout(torch.full((TEXT_ROWS,), TEXT_TAG), L.latent_frames(frames), latent_h, latent_w,
                          L.audio_latents(frames), keyframes=keyframes)


def packed_qkv(S: int, heads: int, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    qkv = torch.randn(1, S, 3, heads, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
    return qkv.unbind(2)  # strided views, as Attention.forward hands them over


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def correctness(device) -> dict:
    lay = make_layout(22, 30, 52, keyframes=("first",))  # 480x832: token grid 7 x 15 x 26
    plan = vsa.build_plan(lay).to(device)
    heads = 8
    q, k, v = packed_qkv(plan.seq_len, heads, device)
    P, C = plan.num_dense, plan.num_cubes
    qv, kv, vv = (plan.tile_video(x) for x in (q, k, v))
    scores = vsa.pool_cubes(qv, plan.cube_sizes) @ vsa.pool_cubes(kv, plan.cube_sizes).transpose(-1, -2)
    res = {"grid": list(plan.grid), "S": plan.seq_len, "cubes": C}
    for topk in (vsa.topk_for_sparsity(0.875, C), C):
        selected = vsa.select_cubes(scores, topk)
        args = (qv, kv, vv, k[:, :P], v[:, :P], selected, plan.cube_sizes)
        ref = vsa.fine_reference(*(a.float() if a.is_floating_point() else a for a in args[:-1]), plan.cube_sizes)
        out = block_sparse_attention(*args, plan.video_order, torch.empty_like(q[:, P:]))
        res[f"fine_triton_vs_reference_topk{topk}"] = rel_err(out, plan.untile_video(ref))

    dense = attn.sdpa(q.float(), k.float(), v.float())
    res["vsa_all_cubes_vs_dense"] = rel_err(vsa.vsa_attention(q, k, v, plan, C), dense)
    gate = torch.randn_like(q) * 0.5
    cpu_plan = plan.to("cpu")
    ref = vsa.vsa_attention(*(x.float().cpu() for x in (q, k, v)), cpu_plan, C, gate.float().cpu())
    res["vsa_gated_all_cubes_vs_cpu_fp32"] = rel_err(vsa.vsa_attention(q, k, v, plan, C, gate).cpu(), ref)
    res["pass"] = all(val <= BF16_TOL for key, val in res.items() if key.startswith(("fine", "vsa")))
    return res


def timing(frames: int, sparsity: float, device) -> dict:
    plan = vsa.build_plan(make_layout(frames, 48, 84)).to(device)
    S, P, C = plan.seq_len, plan.num_dense, plan.num_cubes
    topk = vsa.topk_for_sparsity(sparsity, C)
    q, k, v = packed_qkv(S, HEADS, device)
    row = {"frames": frames, "S": S, "dense_rows": P, "cubes": C, "topk": topk,
           "sparsity": round(1 - topk / C, 4)}
    with torch.no_grad():
        dense_flops = 4 * S * S * HEADS * HEAD_DIM
        for name in attn.backends(device):
            if name in ("sdpa", "flex"):
                continue  # the FA2-based default and Triton-generated flex (~70% of FA3): not baselines here
            with attn.use_backend(name):
                ms = cuda_ms(lambda: attn.dense(q, k, v))
            row[f"dense_{name}_ms"] = round(ms, 2)
            row[f"dense_{name}_tflops"] = round(dense_flops / ms / 1e9, 1)

        row["vsa_ms"] = round(cuda_ms(lambda: vsa.vsa_attention(q, k, v, plan, topk)), 2)
        gate = torch.randn_like(q) * 0.1
        row["vsa_gated_ms"] = round(cuda_ms(lambda: vsa.vsa_attention(q, k, v, plan, topk, gate)), 2)
        for name in attn.backends(device):
            if f"dense_{name}_ms" in row:
                row[f"vsa_speedup_vs_{name}"] = round(row[f"dense_{name}_ms"] / row["vsa_ms"], 2)

        # Stages of the training-free path.
        def tile():
            return [vsa.tile_and_pool(x, plan, pool) for x, pool in ((q, True), (k, True), (v, False))]

        row["stage_tile_pool_qkv_ms"] = round(cuda_ms(tile), 2)
        (qv, q_pool), (kv, k_pool), (vv, _) = tile()
        def select():
            return vsa.select_cubes(q_pool @ k_pool.transpose(-1, -2), topk)

        row["stage_select_ms"] = round(cuda_ms(select), 2)
        selected = select()
        fine_args = (qv, kv, vv, k[:, :P], v[:, :P], selected, plan.cube_sizes, plan.video_order,
                     torch.empty_like(q[:, P:]))
        fine_ms = cuda_ms(lambda: block_sparse_attention(*fine_args))
        kept_keys = P * C + int(plan.cube_sizes[selected.long()].sum()) // HEADS  # per head, all query cubes
        fine_flops = 4 * 64 * kept_keys * HEADS * HEAD_DIM
        row["stage_fine_ms"] = round(fine_ms, 2)
        row["stage_fine_tflops"] = round(fine_flops / fine_ms / 1e9, 1)
        row["stage_dense_prefix_ms"] = round(cuda_ms(lambda: attn.dense(q[:, :P], k, v)), 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 362])
    parser.add_argument("--sparsity", type=float, default=0.875)
    parser.add_argument("--out", default="benchmarks/results/vsa_check.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "dense_backends": attn.backends(device), "auto_backend": attn.choose(device)}
    results["correctness"] = correctness(device)
    results["runs"] = [timing(f, args.sparsity, device) for f in args.frames]
    results["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)

    c = results["correctness"]
    print(f"\nVSA check on {results['gpu']} (torch {results['torch']}); correctness "
          f"{'PASS' if c['pass'] else 'FAIL'} (tolerance {BF16_TOL}):")
    for key, val in c.items():
        if key.startswith(("fine", "vsa")):
            print(f"  {key:44s} {val:.2e}")
    dense_names = [n for n in results["dense_backends"] if f"dense_{n}_ms" in results["runs"][0]]
    cols = ["frames", "S", "topk/cubes"] + [f"{n} dense ms" for n in dense_names]
    cols += ["VSA ms", "gated ms", "fine ms", "fine TF/s"] + [f"x vs {n}" for n in dense_names]
    print("\nOne attention call, B=1, 56 heads x 128, bf16, 1344x768, sparsity", args.sparsity)
    print(" | ".join(f"{col:>13}" for col in cols))
    for r in results["runs"]:
        vals = [r["frames"], r["S"], f"{r['topk']}/{r['cubes']}"] + [r[f"dense_{n}_ms"] for n in dense_names]
        vals += [r["vsa_ms"], r["vsa_gated_ms"], r["stage_fine_ms"], r["stage_fine_tflops"]]
        vals += [r[f"vsa_speedup_vs_{n}"] for n in dense_names]
        print(" | ".join(f"{val:>13}" for val in vals))
    for r in results["runs"]:
        print(f"  stages at {r['frames']} frames:", {k: v for k, v in r.items() if k.startswith("stage")})
    print(f"peak {results['peak_mem_GiB']} GiB")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(results, indent=1))
    return 0 if c["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
