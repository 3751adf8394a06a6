"""MiniMax-H3 diffusion transformer (specs/h3.md §1-2), one file, top to bottom.

One packed sequence of text, conditioning, audio and video rows runs through 50 identical blocks of full
self-attention. Each row picks its AdaLN modulation from a (timestep, modality) table: row address
`timestep_index * 3 + modality_tag`. Module names follow the original (sglang-native) checkpoint, so a raw
checkpoint loads by name once its fused QKV is de-interleaved (see checkpoint.py). Here `attn.qkv_proj` holds
[q_all; k_all; v_all] and `mlp.fc1` holds [gate; value].

Precision: patch projections, time embedder and output heads stay fp32; everything else runs in `dtype`.

Pruned "curve" models (config.adaln_curve_grid > 0, specs/h3.md §7.3) have no time embedder: the embedding is
interpolated from `adaln_t_table [G, r]`, which already holds the post-SiLU curve, so the rank-r AdaLN projections
run without SiLU, in fp32.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels import fused
from engine.kernels.attention import attention, sparse_active
from engine.models.h3.config import NUM_MODALITIES, H3Config
from engine.parallel import ulysses

FP32_MODULES = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out",
                "final_layer.audio_out")


CURVE_FP32 = re.compile(r"adaln_t_table|(blocks\.\d+|final_layer)\.adaln_proj(\..*)?")


def keeps_fp32(name: str, config: H3Config) -> bool:
    """Whether module, parameter or buffer `name` stays fp32 whatever the model dtype."""
    if any(name == p or name.startswith(p + ".") for p in FP32_MODULES):
        return True
    return config.curve and CURVE_FP32.fullmatch(name) is not None


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoid of the unscaled t in [0, 1]: cos first, then sin; freqs exp(-ln(1e4) k / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_inv_freq(config: H3Config) -> torch.Tensor:
    n = config.rope_freq_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


def rope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, h, w) positions [S, 3] -> cos, sin [S, 6 * rope_freq_dim] (three axes, then duplicated)."""
    freqs = position_ids.float()[:, :, None] * inv_freq.to(position_ids.device)[None, None]
    freqs = freqs.flatten(1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


class Attention(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.heads = c.num_attention_heads
        self.qkv_proj = nn.Linear(c.hidden_size, 3 * c.inner_dim, bias=False)
        self.q_norm = nn.RMSNorm(c.attention_head_dim, eps=c.qk_norm_eps)
        self.k_norm = nn.RMSNorm(c.attention_head_dim, eps=c.qk_norm_eps)
        self.out_proj = nn.Linear(c.inner_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                attend=attention) -> torch.Tensor:
        # Head-major q/k/v for dense FA3 (1.8 % faster on them); VSA's tiling reads the row-major ones faster.
        q, k, v = fused.qk_norm_rope(self.qkv_proj(x), self.heads, self.q_norm, self.k_norm, rope,
                                     head_major=not sparse_active())
        out = attend(q, k, v).flatten(2).type_as(q)
        return self.out_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, 2 * c.ffn_dim, bias=False)  # [gate; value]
        self.fc2 = nn.Linear(c.ffn_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(fused.swiglu(self.fc1(x)))


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows only: no RoPE, no AdaLN."""

    def __init__(self, c: H3Config):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = SwiGLU(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(c) for _ in range(c.num_refiner_layers))
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


class AdaLNProjection(nn.Module):
    """temb [M, time_embed_dim] -> 6 tables [M * 3, hidden]: shift/scale/gate for attention, then for the MLP."""

    def __init__(self, c: H3Config):
        super().__init__()
        self.hidden_size = c.hidden_size
        self.linear = nn.Linear(c.time_embed_dim, 6 * NUM_MODALITIES * c.hidden_size, bias=True)
        self.silu = not c.curve

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # SiLU at temb's fp32 precision, then cast to the projection dtype (the reference order); the bias has it
        # also when the weight is quantized.
        mods = self.linear((F.silu(temb) if self.silu else temb).to(self.linear.bias.dtype))
        return mods.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class Block(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = SwiGLU(c)
        self.adaln_proj = AdaLNProjection(c)

    def forward(self, x, mods, rows, rope, attend=attention):
        """`mods` are this block's six AdaLN tables; `rows` the per-row table address (fused.py reads the tables
        in place: h = norm(x) * (1 + scale[rows]) + shift[rows], x += gate[rows] * sublayer(h))."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        h = fused.modulated_rms_norm(x, self.norm1, shift_msa, scale_msa, rows)
        y = self.attn(h, rope, attend)
        x, h = fused.gated_residual_norm(x, y, gate_msa, rows, self.norm2, shift_mlp, scale_mlp)
        return fused.gated_residual(x, self.mlp(h), gate_mlp, rows)


class TimeEmbedder(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.freq_dim = c.freq_dim
        self.proj_in = nn.Linear(c.freq_dim, c.time_embed_hidden_dim)
        self.proj_out = nn.Linear(c.time_embed_hidden_dim, c.time_embed_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = timestep_sinusoid(t, self.freq_dim).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(x)))


def curve_embedding(table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t [M] in [0, 1] -> [M, r]: linear interpolation of the table rows on the grid t_j = j / (G - 1), fp32."""
    pos = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
    i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
    table = table.float()
    start, end = table[i0], table[i0 + 1]
    return start + (pos - i0)[:, None] * (end - start)


class FinalLayer(nn.Module):
    def __init__(self, c: H3Config):
        super().__init__()
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)
        self.adaln_proj = nn.Module()
        self.adaln_proj.linear = nn.Linear(c.time_embed_dim, 2 * c.hidden_size)
        self.silu = not c.curve
        self.video_out = nn.Linear(c.hidden_size, c.video_patch_dim)
        self.audio_out = nn.Linear(c.hidden_size, c.audio_in_channels)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        linear = self.adaln_proj.linear
        shift, scale = linear((F.silu(temb) if self.silu else temb).to(linear.bias.dtype)).chunk(2, dim=-1)
        return shift, scale

    def forward(self, x, shift, scale, timestep_indices, video_indices, audio_indices):
        x = self.norm(x) * (1.0 + scale[timestep_indices]) + shift[timestep_indices]
        x = x.to(self.video_out.weight.dtype)
        return self.video_out(x.index_select(1, video_indices)), self.audio_out(x.index_select(1, audio_indices))


class H3DiT(nn.Module):
    def __init__(self, config: H3Config):
        super().__init__()
        self.config = c = config
        self.video_patch_proj = nn.Linear(c.video_patch_dim, c.hidden_size)
        self.audio_patch_proj = nn.Linear(c.audio_in_channels, c.hidden_size)
        self.condition_proj = nn.Linear(c.text_dim, c.hidden_size)
        if c.curve:
            self.register_buffer("adaln_t_table", torch.zeros(c.adaln_curve_grid, c.time_embed_dim))
        else:
            self.time_embedder = TimeEmbedder(c)
        self.token_refiner = TokenRefiner(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.final_layer = FinalLayer(c)
        self.register_buffer("rope_inv_freq", rope_inv_freq(c), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].norm1.weight.dtype if len(self.blocks) else self.condition_proj.weight.dtype

    def set_dtype(self, dtype: torch.dtype) -> "H3DiT":
        """Cast to the released mixed precision: `dtype` everywhere except the fp32 modules."""
        for name, module in self.named_modules():
            target = torch.float32 if keeps_fp32(name, self.config) else dtype
            for param in module.parameters(recurse=False):
                param.data = param.data.to(target)
        return self

    def time_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        if self.config.curve:
            return curve_embedding(self.adaln_t_table, timestep)
        return self.time_embedder(timestep)

    def block_modulations(self, temb: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per-block AdaLN tables for these timesteps, in the blocks' dtype (curve projections compute in fp32)."""
        dtype = self.dtype
        return [tuple(m.to(dtype) for m in block.adaln_proj(temb)) for block in self.blocks]

    def modulations(self, temb: torch.Tensor):
        """Every AdaLN table for these timesteps: per block, then the final layer's (shift, scale); the AdaLN
        cache (engine/cache/adaln.py) stores exactly these."""
        return self.block_modulations(temb), self.final_layer.modulation(temb)

    def forward(
        self,
        video: torch.Tensor,  # [B, Nv, 96] rows ordered as video_indices
        audio: torch.Tensor,  # [B, Na, 32]
        text: torch.Tensor,  # [B, Nt, text_dim]
        timestep: torch.Tensor,  # [M] distinct t in [0, 1], t = 1 clean
        timestep_indices: torch.Tensor,  # [S], or [B, S] per sample (one rank, training's masked edits)
        token_tags: torch.Tensor,  # [S]
        position_ids: torch.Tensor,  # [S, 3]
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        modulations: tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the data-ward velocity (x0 - noise) of the video and audio rows, fp32. `modulations` are
        `self.modulations(temb)` when the caller has them. Inside `ulysses.parallel(group)` the blocks run on
        this rank's shard of the rows."""
        sp = ulysses.shards(position_ids.shape[0])
        rope = rope_table(sp.split(position_ids), self.rope_inv_freq)
        dtype = self.dtype

        text_h = self.token_refiner(self.condition_proj(text.to(self.condition_proj.weight.dtype)))
        video_h = self.video_patch_proj(video.to(self.video_patch_proj.weight.dtype)).to(text_h.dtype)
        audio_h = self.audio_patch_proj(audio.to(self.audio_patch_proj.weight.dtype)).to(text_h.dtype)
        x = text_h.new_zeros(text_h.shape[0], position_ids.shape[0], text_h.shape[-1])
        x = x.index_copy(1, text_indices, text_h).index_copy(1, video_indices, video_h)
        x = x.index_copy(1, audio_indices, audio_h).to(dtype)

        if modulations is None:
            modulations = self.modulations(self.time_embedding(timestep))
        block_mods, (shift, scale) = modulations
        x, rows = sp.split(x, 1), sp.split(timestep_indices * NUM_MODALITIES + token_tags, -1)
        for block, mods in zip(self.blocks, block_mods):
            x = block(x, mods, rows, rope, sp.attention)
        x = sp.gather(x, 1)
        return self.final_layer(x, shift, scale, timestep_indices, video_indices, audio_indices)


def build_dit(config: H3Config, seed: int | None = 0, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> H3DiT:
    """A DiT with weights drawn from `seed` (the `tiny` preset and random-weight benchmarks)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: the full model in fp32 would need 132 GB first
    try:
        with torch.device(device):
            if seed is not None:
                torch.manual_seed(seed)
            model = H3DiT(config)
    finally:
        torch.set_default_dtype(previous)
    return model.set_dtype(dtype).eval().requires_grad_(False)
