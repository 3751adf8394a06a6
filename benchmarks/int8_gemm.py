"""The four H3 block GEMMs at full width (qkv, out, fc1, fc2) on one GPU: bf16 `F.linear`, fp8 `_scaled_mm`, cuBLAS
int8 `torch._int_mm` (int32 out, no epilogue) and our Triton `int8_linear` (scales and bias in the epilogue) for
each tile candidate, plus the int8 activation quantizer (ConvRot rotation + row quantize). Prints a table, writes
JSON. The engine's tile (quant_triton.LINEAR_TILE) should be the best candidate here.

    python benchmarks/int8_gemm.py --out benchmarks/results/int8_gemm_h200_run1.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import cuda_ms
from engine.models.h3.config import FULL
from engine.quant import fp8, int8_convrot, quant_triton

TILES = [
    dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BM=256, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BM=64, BN=256, BK=128, GROUP_M=8, num_warps=4, num_stages=4),
]


def gemms(config=FULL) -> dict[str, tuple[int, int]]:
    inner = config.num_attention_heads * config.attention_head_dim
    return {"qkv": (config.hidden_size, 3 * inner), "out": (inner, config.hidden_size),
            "fc1": (config.hidden_size, 2 * config.ffn_dim), "fc2": (config.ffn_dim, config.hidden_size)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[37774, 109126], help="block rows (124 / 362 frames)")
    parser.add_argument("--out", default="benchmarks/results/int8_gemm.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for m in args.rows:
        table = {}
        for name, (k, n) in gemms().items():
            torch.manual_seed(0)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
            wq, ws = int8_convrot.quantize_weight(w)
            xq, xs = int8_convrot.quantize_activation(x, int8_convrot.GROUP)
            w8, w8s = fp8.quantize_weight(w)
            x8, x8s = fp8.quantize_rows(x)
            flop = 2 * m * k * n
            row = {"k": k, "n": n,
                   "bf16_ms": cuda_ms(lambda: F.linear(x, w)),
                   "fp8_scaled_mm_ms": cuda_ms(lambda: torch._scaled_mm(
                       x8, w8.t(), scale_a=x8s, scale_b=w8s.reshape(1, 1).expand(1, n).contiguous(),
                       out_dtype=torch.bfloat16)),
                   "int_mm_ms": cuda_ms(lambda: torch._int_mm(xq, wq.t())),
                   "quantize_activation_ms": cuda_ms(lambda: int8_convrot.quantize_activation(x, int8_convrot.GROUP))}
            ref = (torch._int_mm(xq, wq.t()).float() * xs * ws.t()).to(torch.bfloat16)
            for i, tile in enumerate(TILES):
                out = quant_triton.int8_linear(xq, xs, wq, ws, None, torch.bfloat16, tile)
                assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2), (name, tile)
                row[f"triton_tile{i}_ms"] = cuda_ms(lambda tile=tile: quant_triton.int8_linear(
                    xq, xs, wq, ws, None, torch.bfloat16, tile))
            row["triton_best_ms"] = min(v for key, v in row.items() if key.startswith("triton_tile"))
            for key in [key for key in row if key.endswith("_ms")]:
                row[key.removesuffix("_ms") + "_TOPS"] = round(flop / row[key] / 1e9, 1)
            table[name] = {key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}
        totals = {key: round(sum(r[key] for r in table.values()), 2) for key in next(iter(table.values()))
                  if key.endswith("_ms")}
        results["rows"][str(m)] = {"gemms": table, "total_ms": totals}
        print(f"\n== {m} rows: the four block GEMMs (ms; TOPS beside) ==")
        for key, total in totals.items():
            print(f"{key:28s} {total:9.2f} ms")
    results["tiles"] = TILES
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
