"""Pruning a full H3 DiT to the "curve" AdaLN form of the Comfy-Org pruned files (notes/h3_quantized_files.md §4.3).

S(t) = silu(time_embedder(t)) sampled on t_j = j / (G - 1) is centred over t and truncated to rank r by SVD:
adaln_t_table = U_r·Σ_r, and every AdaLN projection keeps W·V_r with the mean folded into its bias,
b + W·mean(S). The model keeps `adaln_basis` (V_rᵀ [r, D]) and `adaln_mean` [D] as plain attributes so that
full-width AdaLN LoRAs can be projected onto it; the Comfy files carry neither.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.models.h3.dit import H3DiT

GRID, RANK = 1025, 8


def curve_samples(model: H3DiT, grid: int = GRID) -> torch.Tensor:
    """silu(time_embedder(t_j)) [G, time_embed_dim] in float64 on the grid t_j = j / (G - 1)."""
    t = torch.arange(grid, dtype=torch.float64) / (grid - 1)
    with torch.no_grad():
        return F.silu(model.time_embedder(t.float().to(model.condition_proj.weight.device)).double())


@torch.no_grad()
def prune_adaln(model: H3DiT, grid: int = GRID, rank: int = RANK) -> H3DiT:
    """A pruned copy of a full model (same weights elsewhere, same dtypes)."""
    if model.config.curve:
        raise ValueError("the model is already pruned")
    samples = curve_samples(model, grid)
    mean = samples.mean(dim=0)
    u, sigma, vh = torch.linalg.svd(samples - mean, full_matrices=False)
    table, basis = u[:, :rank] * sigma[:rank], vh[:rank]

    device = model.condition_proj.weight.device
    pruned = H3DiT(replace(model.config, adaln_curve_grid=grid, time_embed_dim=rank)).to(device)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("time_embedder.")}
    for name in [k for k in state if k.endswith("adaln_proj.linear.weight")]:
        w = state[name].double()
        bias_name = name[:-len("weight")] + "bias"
        state[name] = w @ basis.T.to(device)
        state[bias_name] = state[bias_name].double() + w @ mean.to(device)
    state["adaln_t_table"] = table
    pruned.load_state_dict({k: v.float() for k, v in state.items()})
    pruned.set_dtype(model.dtype).eval().requires_grad_(False)
    pruned.adaln_basis, pruned.adaln_mean = basis.float(), mean.float()
    return pruned
