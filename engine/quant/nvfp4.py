"""NVFP4 weights (notes/h3_quantized_files.md §3), dequantized: FP4 E2M1 codes in 16-wide blocks along K, one
F8_E4M3 scale per block stored in cuBLAS's swizzled 128 x 4 tile layout, one fp32 scale per tensor.

W[r, c] = e2m1(code[r, c]) · block_scale[r, c // 16] · weight_scale_2; two codes per byte, the high nibble first;
rows and columns are padded to multiples of 16 (the scale grid further to 128 rows and 4 block columns).
"""

from __future__ import annotations

import torch

BLOCK = 16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pad16(n: int) -> int:
    return -(-n // 16) * 16


def stored_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed weight, block scales) shapes of an [out, in] weight."""
    n, k = pad16(out_features), pad16(in_features)
    return (n, k // 2), (-(-n // 128) * 128, -(-(k // BLOCK) // 4) * 4)


def unswizzle_scales(stored: torch.Tensor) -> torch.Tensor:
    """[R, C] in the tiled layout (each 128 x 4 tile stored as 32 rows of (4 row groups x 4 columns)) -> row-major."""
    rows, cols = stored.shape
    return stored.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols)


def dequantize_weight(packed: torch.Tensor, block_scales: torch.Tensor, scale_2: torch.Tensor, out_features: int,
                      in_features: int, dtype: torch.dtype) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(n, k).long()
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), device=packed.device)
    scales = unswizzle_scales(block_scales.float())[:n, :k // BLOCK] * scale_2.float()
    w = table[codes].view(n, k // BLOCK, BLOCK) * scales[..., None]
    return w.reshape(n, k)[:out_features, :in_features].to(dtype)
