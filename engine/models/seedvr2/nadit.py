"""SeedVR2 NaDiT, 3B (dit_v2) and 7B (dit v1) (specs/seedvr2.md §1-2), one file, top to bottom.

Video tokens (2x2 latent patches) and text tokens are two streams with their own residual paths through every
block. In block i the streams use separate weights (`.vid` / `.txt`) when i < mm_layers, else one shared set
(`.all`); module names follow the official checkpoints, so they load by name. Attention is window attention: each
window's video tokens attend jointly with the whole text sequence, and the text output of a layer is the mean over
all windows of its per-window text outputs. Layers alternate the regular and the shifted window layout.

Rows are kept window-major in the packed order of the current layer's `WindowBatch` (windows.py); between layers
with different layouts `relayout` moves them (a local permutation here; an all-to-all under window-aligned
sequence parallelism, which also passes `text_reduce` to sum the per-window text outputs over ranks).

Precision: linear layers run in the model dtype; RMSNorm, RoPE, the time embedding and the modulation vectors are
computed in fp32. Attention runs in the stream dtype (the reference forces bf16; fp32 here in tests).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels.attention import attention
from engine.models.seedvr2.config import TIMESTEP, NaDiTConfig
from engine.models.seedvr2.windows import Grid, WindowBatch, WindowLayout, layer_layouts, window_size

FP32_PARAMS = ("emb_in.", "ada.", "norm_q.", "norm_k.", "vid_out_norm.")
# Rows per attention call: windows of one shape are batched, in slices of at most this many query rows.
MAX_ROWS_PER_CALL = 1 << 17

TextReduce = Callable[[torch.Tensor], torch.Tensor]
Relayout = Callable[[torch.Tensor, WindowBatch, WindowBatch], torch.Tensor]


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[sin | cos] of t * 10000^(-k / (dim/2)) (diffusers `get_timestep_embedding`, no flip, no shift)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 RMSNorm; returns fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * weight.float() if weight is not None else x


def rope_freqs(c: NaDiTConfig) -> torch.Tensor:
    """Per-axis frequencies: 3B lang mode theta^(-2i/d) with d = head_dim // 3; 7B pixel mode
    linspace(1, 128, n) * pi (rotary-embedding-torch, max_freq 256)."""
    n = c.rope_freqs
    if c.rope == "mmrope3d":
        d = c.head_dim // 3
        return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32)[:n] / d))
    return torch.linspace(1.0, 256 / 2, n, dtype=torch.float32) * math.pi


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (2i, 2i+1) of x [..., S, H, D] by angle i ([S, P] tables) in fp32;
    channels >= 2P pass through."""
    p = cos.shape[-1]
    x0, x1 = x[..., : 2 * p].float().unflatten(-1, (p, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * p:]], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, affine: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps).to(x.dtype)


class Streams(nn.Module):
    """One module per stream (`vid`, `txt`) or one shared by both (`all`): the checkpoint's key layout.
    `vid_only` modules have no text copy."""

    def __init__(self, make: Callable[[], nn.Module], shared: bool, vid_only: bool = False):
        super().__init__()
        if shared:
            self.all = make()
        else:
            self.vid = make()
            if not vid_only:
                self.txt = make()
        self.vid_only = vid_only

    def get(self, stream: str) -> nn.Module | None:
        if self.vid_only and stream == "txt":
            return None
        return self.all if "all" in self._modules else getattr(self, stream)


class AdaSingle(nn.Module):
    """Learned shift/scale/gate vectors per layer, added to the shared timestep embedding (no implicit +1)."""

    def __init__(self, dim: int, layers: tuple[str, ...] = ("attn", "mlp"), gates: bool = True):
        super().__init__()
        for layer in layers:
            self.register_parameter(f"{layer}_shift", nn.Parameter(torch.randn(dim) / dim**0.5))
            self.register_parameter(f"{layer}_scale", nn.Parameter(torch.randn(dim) / dim**0.5 + 1))
            if gates:
                self.register_parameter(f"{layer}_gate", nn.Parameter(torch.randn(dim) / dim**0.5))

    def modulate(self, x: torch.Tensor, layer: str, emb: torch.Tensor) -> torch.Tensor:
        """x (fp32, normed) * (scaleE + scale) + (shiftE + shift); emb [d, 3] = (shift, scale, gate) slots."""
        return x * (emb[:, 1] + getattr(self, f"{layer}_scale")) + (emb[:, 0] + getattr(self, f"{layer}_shift"))

    def gate(self, x: torch.Tensor, layer: str, emb: torch.Tensor) -> torch.Tensor:
        return x * (emb[:, 2] + getattr(self, f"{layer}_gate")).to(x.dtype)


class Rope(nn.Module):
    """Window-local 3-D RoPE. The frequencies are recomputed in fp32 from the config; `rope.freqs` exists so the
    official key loads (the loader checks its values)."""

    def __init__(self, c: NaDiTConfig):
        super().__init__()
        self.config, self.mode = c, c.rope
        self.rope = nn.Module()
        self.rope.register_buffer("freqs", rope_freqs(c))

    def video(self, shape: Grid, text_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t*h*w, 3P] for a window of `shape`: 3B positions (L_txt + dt, dh, dw) in the window,
        7B positions linspace(-1, 1, n) over the window's extent on each axis."""
        freqs = rope_freqs(self.config).to(device)
        if self.mode == "mmrope3d":
            axes = [torch.arange(n, dtype=torch.float32, device=device) for n in shape]
            axes[0] = axes[0] + text_len
        else:
            axes = [torch.linspace(-1.0, 1.0, n, dtype=torch.float32, device=device) for n in shape]
        t, h, w = (a[:, None] * freqs for a in axes)
        n_t, n_h, n_w = shape
        angles = torch.cat([
            t[:, None, None].expand(n_t, n_h, n_w, -1),
            h[None, :, None].expand(n_t, n_h, n_w, -1),
            w[None, None, :].expand(n_t, n_h, n_w, -1),
        ], dim=-1).flatten(0, 2)
        return angles.cos(), angles.sin()

    def text(self, text_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """3B: text token p at position p on all three axes; 7B: text is not rotated."""
        if self.mode != "mmrope3d":
            return None
        p = torch.arange(text_len, dtype=torch.float32, device=device)
        angles = (p[:, None] * rope_freqs(self.config).to(device)).repeat(1, 3)
        return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, c: NaDiTConfig, shared: bool):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.head_dim
        self.proj_qkv = Streams(lambda: nn.Linear(c.dim, 3 * c.inner_dim, bias=False), shared)
        self.proj_out = Streams(lambda: nn.Linear(c.inner_dim, c.dim), shared)
        self.norm_q = Streams(lambda: RMSNorm(c.head_dim, c.norm_eps, affine=True), shared)
        self.norm_k = Streams(lambda: RMSNorm(c.head_dim, c.norm_eps, affine=True), shared)
        self.rope = Rope(c)

    def _qkv(self, x: torch.Tensor, stream: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.proj_qkv.get(stream)(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)
        return self.norm_q.get(stream)(q), self.norm_k.get(stream)(k), v

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, batch: WindowBatch, need_text: bool,
                text_reduce: TextReduce | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vid [N, d] packed as `batch`, txt [L, d] -> (vid out [N, d], text out [L, d] or None)."""
        q_v, k_v, v_v = self._qkv(vid, "vid")
        q_t, k_t, v_t = self._qkv(txt, "txt")
        n_txt, device = txt.shape[0], vid.device
        if (table := self.rope.text(n_txt, device)) is not None:
            q_t, k_t = apply_rope(q_t, *table), apply_rope(k_t, *table)

        out = vid.new_empty(vid.shape[0], self.heads * self.head_dim)
        txt_sum = torch.zeros(n_txt, self.heads, self.head_dim, dtype=torch.float32, device=device)
        for shape, rows in batch.groups:
            n_tok = math.prod(shape)
            cos, sin = self.rope.video(shape, n_txt, device)
            per_call = max(1, MAX_ROWS_PER_CALL // (n_tok + n_txt))
            for chunk in rows.view(-1, n_tok).split(per_call):
                n, idx = chunk.shape[0], chunk.flatten()
                q = apply_rope(q_v[idx].unflatten(0, (n, n_tok)), cos, sin)
                k = apply_rope(k_v[idx].unflatten(0, (n, n_tok)), cos, sin)
                v = v_v[idx].unflatten(0, (n, n_tok))
                # Every window attends jointly with the whole text; text queries only where the text goes on.
                k = torch.cat([k, k_t.expand(n, -1, -1, -1)], dim=1)
                v = torch.cat([v, v_t.expand(n, -1, -1, -1)], dim=1)
                if need_text:
                    q = torch.cat([q, q_t.expand(n, -1, -1, -1)], dim=1)
                o = attention(q, k, v)
                out[idx] = o[:, :n_tok].flatten(0, 1).flatten(1).to(out.dtype)
                if need_text:
                    txt_sum += o[:, n_tok:].float().sum(0)

        vid_out = self.proj_out.get("vid")(out)
        if not need_text:
            return vid_out, None
        if text_reduce is not None:
            txt_sum = text_reduce(txt_sum)
        txt_mean = (txt_sum / batch.num_windows).flatten(1).to(txt.dtype)
        return vid_out, self.proj_out.get("txt")(txt_mean)


class SwiGLU(nn.Module):
    def __init__(self, c: NaDiTConfig):
        super().__init__()
        self.proj_in_gate = nn.Linear(c.dim, c.mlp_dim, bias=False)
        self.proj_out = nn.Linear(c.mlp_dim, c.dim, bias=False)
        self.proj_in = nn.Linear(c.dim, c.mlp_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    def __init__(self, c: NaDiTConfig):
        super().__init__()
        self.proj_in = nn.Linear(c.dim, c.mlp_dim)
        self.proj_out = nn.Linear(c.mlp_dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: NaDiTConfig, index: int):
        super().__init__()
        shared, last = c.shared(index), index == c.num_layers - 1
        vid_only = last and c.last_block_vid_only
        mlp = SwiGLU if c.mlp == "swiglu" else GeluMLP
        self.eps = c.norm_eps
        self.attn = Attention(c, shared)
        self.mlp = Streams(lambda: mlp(c), shared, vid_only)
        self.ada = Streams(lambda: AdaSingle(c.dim), shared, vid_only)
        # Only the video stream is read after the last block: its text queries, text MLP and gate are skipped.
        self.text_out = not last

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, emb: torch.Tensor, batch: WindowBatch,
                text_reduce: TextReduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn_e, mlp_e = emb.view(-1, 2, 3).unbind(1)  # emb read as (d, l, g): interleaved, not chunk(6)
        ada_v, ada_t = self.ada.get("vid"), self.ada.get("txt")
        dtype = vid.dtype
        h_v = ada_v.modulate(rms_norm(vid, None, self.eps), "attn", attn_e).to(dtype)
        h_t = rms_norm(txt, None, self.eps)
        # 3B last block: its ada is video-only, so text enters attention normed but not modulated.
        h_t = (ada_t.modulate(h_t, "attn", attn_e) if ada_t is not None else h_t).to(dtype)
        a_v, a_t = self.attn(h_v, h_t, batch, self.text_out, text_reduce)
        vid = vid + ada_v.gate(a_v, "attn", attn_e)
        m = ada_v.modulate(rms_norm(vid, None, self.eps), "mlp", mlp_e).to(dtype)
        vid = vid + ada_v.gate(self.mlp.get("vid")(m), "mlp", mlp_e)
        if not self.text_out:
            return vid, txt
        txt = txt + ada_t.gate(a_t, "attn", attn_e)
        m = ada_t.modulate(rms_norm(txt, None, self.eps), "mlp", mlp_e).to(dtype)
        return vid, txt + ada_t.gate(self.mlp.get("txt")(m), "mlp", mlp_e)


class TimeEmbedding(nn.Module):
    def __init__(self, c: NaDiTConfig):
        super().__init__()
        self.freq_dim = c.freq_dim
        self.proj_in = nn.Linear(c.freq_dim, c.dim)
        self.proj_hid = nn.Linear(c.dim, c.dim)
        self.proj_out = nn.Linear(c.dim, c.emb_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.proj_in(timestep_sinusoid(t, self.freq_dim)))
        return self.proj_out(F.silu(self.proj_hid(x)))


class PatchProjection(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.proj = nn.Linear(n_in, n_out)


def patchify(x: torch.Tensor, patch: Grid) -> torch.Tensor:
    """[T, H, W, C] -> rows [T/pt * H/ph * W/pw, pt*ph*pw*C], token features ordered (t, h, w, c)."""
    pt, ph, pw = patch
    T, H, W, C = x.shape
    x = x.view(T // pt, pt, H // ph, ph, W // pw, pw, C).permute(0, 2, 4, 1, 3, 5, 6)
    return x.reshape(-1, pt * ph * pw * C)


def unpatchify(rows: torch.Tensor, grid: Grid, patch: Grid) -> torch.Tensor:
    pt, ph, pw = patch
    t, h, w = grid
    x = rows.view(t, h, w, pt, ph, pw, -1).permute(0, 3, 1, 4, 2, 5, 6)
    return x.reshape(t * pt, h * ph, w * pw, -1)


def local_relayout(x: torch.Tensor, src: WindowBatch, dst: WindowBatch) -> torch.Tensor:
    """Rows packed as `src` -> packed as `dst`, both holding the same tokens (one device)."""
    if src is dst:
        return x
    position = torch.empty_like(src.index)
    position[src.index] = torch.arange(src.index.numel(), device=src.index.device)
    return x.index_select(0, position[dst.index])


class NaDiT(nn.Module):
    def __init__(self, config: NaDiTConfig):
        super().__init__()
        self.config = c = config
        self.vid_in = PatchProjection(c.patch_dim, c.dim)
        self.txt_in = nn.Linear(c.text_dim, c.dim)
        self.emb_in = TimeEmbedding(c)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        if c.output_norm:
            self.vid_out_norm = RMSNorm(c.dim, c.norm_eps, affine=True)
            self.vid_out_ada = AdaSingle(c.dim, layers=("out",), gates=False)
        self.vid_out = PatchProjection(c.dim, c.out_channels * math.prod(c.patch_size))

    @property
    def dtype(self) -> torch.dtype:
        return self.txt_in.weight.dtype

    def set_dtype(self, dtype: torch.dtype) -> "NaDiT":
        """`dtype` for the linear layers; fp32 for the modulation vectors, norms and the time embedding."""
        for name, param in self.named_parameters():
            keep = any(p in name for p in FP32_PARAMS)
            param.data = param.data.to(torch.float32 if keep else dtype)
        return self

    def grid(self, latent_shape: tuple[int, int, int]) -> Grid:
        """Latent (T, H, W) -> token grid."""
        return tuple(n // p for n, p in zip(latent_shape, self.config.patch_size))

    def window_size(self, grid: Grid) -> Grid:
        c = self.config
        return window_size(grid, c.num_windows, c.window_area, c.window_max_t)

    def layouts(self, grid: Grid) -> list[WindowLayout]:
        """The window layout of every layer (regular for even layers, shifted for odd)."""
        return layer_layouts(grid, self.window_size(grid), self.config.num_layers)

    def time_embedding(self, timestep: float | torch.Tensor) -> torch.Tensor:
        """The shared modulation embedding [6d] (fp32) of one timestep."""
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.txt_in.weight.device).reshape(1)
        return self.emb_in(t)[0]

    def head(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.config.output_norm:
            # vid_out_ada has no embedding slot of its own: the reference reuses block 0's attn shift/scale.
            attn_e = emb.view(-1, 2, 3)[:, 0]
            x = self.vid_out_ada.modulate(rms_norm(x, self.vid_out_norm.weight, self.config.norm_eps), "out", attn_e)
        return self.vid_out.proj(x.to(self.dtype))

    def forward_rows(self, rows: torch.Tensor, txt: torch.Tensor, emb: torch.Tensor, batches: list[WindowBatch],
                     relayout: Relayout = local_relayout, text_reduce: TextReduce | None = None) -> torch.Tensor:
        """Patch rows [N, patch_dim] packed as `batches[0]` -> output rows [N, out * patch] packed as
        `batches[-1]`. `batches[i]` is what this device attends over in layer i."""
        vid = self.vid_in.proj(rows.to(self.dtype))
        txt = self.txt_in(txt.to(self.dtype))
        for i, (block, batch) in enumerate(zip(self.blocks, batches)):
            if i:
                vid = relayout(vid, batches[i - 1], batch)
            vid, txt = block(vid, txt, emb, batch, text_reduce)
        return self.head(vid, emb)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, timestep: float | torch.Tensor = TIMESTEP
                ) -> torch.Tensor:
        """vid [T, H, W, 33] latent (channels last), txt [L, text_dim] -> prediction [T, H, W, 16] (fp32)."""
        c = self.config
        grid = self.grid(vid.shape[:3])
        layouts = self.layouts(grid)
        distinct = {id(layout): layout.batch(device=vid.device) for layout in layouts}
        batches = [distinct[id(layout)] for layout in layouts]
        rows = patchify(vid, c.patch_size).index_select(0, batches[0].index)
        out = self.forward_rows(rows, txt, self.time_embedding(timestep), batches)
        canonical = torch.empty_like(out).index_copy_(0, batches[-1].index, out)
        return unpatchify(canonical.float(), grid, c.patch_size)


def build_nadit(config: NaDiTConfig, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> NaDiT:
    """A NaDiT with weights drawn from `seed` (tiny presets, random-weight benchmarks)."""
    with torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = NaDiT(config)
    return model.set_dtype(dtype).eval().requires_grad_(False)
