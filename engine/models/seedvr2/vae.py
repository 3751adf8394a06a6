"""SeedVR2 causal 3-D VAE ("video_vae_v3", s8 / c16 / t4; specs/seedvr2.md §3), one file, top to bottom.

diffusers 0.42.1 has no class for this VAE, so it is written here with the official module names (strict loading
by name). Causality: a conv never pads time with zeros; the first chunk replicates its first frame 2*pad_t times
at the head, and every later chunk is prefixed with the last k - s input frames the conv saw in the previous chunk
(`Causal.memory`). Chunking in time is therefore exact. GroupNorm statistics are per frame, never across time.

Memory: time is processed in chunks (`encode_chunk` frames, `decode_chunk` latents); a conv whose input exceeds
`CONV_MAX_ELEMENTS` runs in row bands with exact halos; optional spatial tiling (tiles blended with linear ramps)
bounds the activations of large frames, at the price of per-tile GroupNorm statistics (not exact). `on_chunk()`
is called after every temporal chunk of every tile (`encode_boundaries` / `decode_boundaries` say how often), so
a job can report progress and stop between chunks.

Frames: T = 4n + 1 pixel frames <-> n + 1 latent frames; latent 0 is pixel frame 0 alone.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels.attention import attention, use_backend
from engine.models.seedvr2.config import VAEConfig

CONV_MAX_ELEMENTS = 1 << 28


class Causal:
    """What one temporal chunk leaves for the next: each causal conv's last k - s input frames."""

    def __init__(self):
        self.memory: dict[nn.Module, torch.Tensor] = {}
        self.first = True


def frame_group_norm(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """GroupNorm of every frame of x [B, C, T, H, W] on its own (the result is a frame-major view)."""
    b, c, t, h, w = x.shape
    y = F.group_norm(x.transpose(1, 2).reshape(b * t, c, h, w), norm.num_groups, norm.weight, norm.bias, norm.eps)
    return y.view(b, t, c, h, w).transpose(1, 2)


class CausalConv3d(nn.Conv3d):
    """Conv3d with causal time padding (head replication / chunk memory) and explicit zero padding in space
    (left, right, top, bottom)."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int] = 3,
                 stride: int | tuple[int, int, int] = 1, space_pad: tuple[int, int, int, int] | None = None):
        super().__init__(cin, cout, kernel, stride)
        kt, kh, kw = self.kernel_size
        self.time_pad = kt // 2
        self.space_pad = space_pad if space_pad is not None else (kw // 2, kw // 2, kh // 2, kh // 2)

    def forward(self, x: torch.Tensor, state: Causal | None = None) -> torch.Tensor:
        keep = self.kernel_size[0] - self.stride[0]
        if state is not None and self in state.memory:
            x = torch.cat([state.memory[self].to(x), x], dim=2)
        elif self.time_pad:
            x = torch.cat([x[:, :, :1].expand(-1, -1, 2 * self.time_pad, -1, -1), x], dim=2)
        if state is not None and keep > 0:
            state.memory[self] = x[:, :, x.shape[2] - keep:].clone()
        return self._conv(x)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        left, right, top, bottom = self.space_pad
        if x.numel() <= CONV_MAX_ELEMENTS:
            return F.conv3d(F.pad(x, (left, right, top, bottom)), self.weight, self.bias, self.stride)
        # Row bands with exact halos: output rows [o0, o1) need padded input rows [o0*s, (o1-1)*s + k).
        kh, sh, height = self.kernel_size[1], self.stride[1], x.shape[3]
        rows_out = (height + top + bottom - kh) // sh + 1
        band = max(1, math.ceil(rows_out / math.ceil(x.numel() / CONV_MAX_ELEMENTS)))
        outs = []
        for o0 in range(0, rows_out, band):
            o1 = min(o0 + band, rows_out)
            i0, i1 = o0 * sh - top, (o1 - 1) * sh + kh - top
            part = x[:, :, :, max(i0, 0):min(i1, height)]
            part = F.pad(part, (left, right, max(-i0, 0), max(i1 - height, 0)))
            outs.append(F.conv3d(part, self.weight, self.bias, self.stride))
        return torch.cat(outs, dim=3)


class ResnetBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, c: VAEConfig):
        super().__init__()
        self.norm1 = nn.GroupNorm(c.norm_groups, cin, eps=c.norm_eps)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = nn.GroupNorm(c.norm_groups, cout, eps=c.norm_eps)
        self.conv2 = CausalConv3d(cout, cout)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        h = self.conv1(F.silu(frame_group_norm(self.norm1, x), inplace=True), state)
        h = self.conv2(F.silu(frame_group_norm(self.norm2, h), inplace=True), state)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, state)
        return x + h


class Downsample3D(nn.Module):
    """Stride-2 conv in space (and in time for temporal blocks); pads right and bottom by one."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        kernel, stride = ((3, 3, 3), (2, 2, 2)) if temporal else ((1, 3, 3), (1, 2, 2))
        self.conv = CausalConv3d(channels, channels, kernel, stride, space_pad=(0, 1, 0, 1))

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        return self.conv(x, state)


def depth_to_space(x: torch.Tensor, rt: int) -> torch.Tensor:
    """[B, (2 * 2 * rt * C), F, H, W] -> [B, C, F * rt, 2H, 2W]: channel ((x * 2 + y) * rt + z) * C + c goes to
    frame f * rt + z, row h * 2 + x, column w * 2 + y."""
    b, n, f, h, w = x.shape
    x = x.view(b, 2, 2, rt, n // (4 * rt), f, h, w).permute(0, 4, 5, 3, 6, 1, 7, 2)
    return x.reshape(b, n // (4 * rt), f * rt, h * 2, w * 2)


class Upsample3D(nn.Module):
    """MAGViT-v2 upsampling: 1x1x1 conv to C * 4 * r_t channels, depth-to-space as "b (x y z c) f h w ->
    b c (f z) (h x) (w y)", drop the duplicated first frame (first chunk only), then a causal 3x3x3 conv."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        ratio = 4 * self.rt
        self.upscale_conv = nn.Conv3d(channels, channels * ratio, 1)
        with torch.no_grad():
            self.upscale_conv.weight.copy_(torch.eye(channels).repeat(ratio, 1).view_as(self.upscale_conv.weight))
            self.upscale_conv.bias.zero_()
        self.conv = CausalConv3d(channels, channels)

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        x = depth_to_space(self.upscale_conv(x), self.rt)
        if self.rt == 2 and (state is None or state.first):
            x = torch.cat([x[:, :, :1], x[:, :, 2:]], dim=2)
        return self.conv(x, state)


class FrameAttention(nn.Module):
    """Single-head self-attention over the pixels of each frame (diffusers `Attention` names), with residual."""

    def __init__(self, channels: int, c: VAEConfig):
        super().__init__()
        self.group_norm = nn.GroupNorm(c.norm_groups, channels, eps=c.norm_eps)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        tokens = frame_group_norm(self.group_norm, x).permute(0, 2, 3, 4, 1).reshape(b * f, h * w, c)
        q, k, v = (proj(tokens)[:, :, None] for proj in (self.to_q, self.to_k, self.to_v))
        with use_backend("sdpa"):  # one 512-wide head: beyond the FA3 / cuDNN head-dim limits
            out = attention(q, k, v)[:, :, 0]
        out = self.to_out[0](out).view(b, f, h, w, c).permute(0, 4, 1, 2, 3)
        return x + out


class MidBlock3D(nn.Module):
    def __init__(self, channels: int, c: VAEConfig):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock3D(channels, channels, c), ResnetBlock3D(channels, channels, c)])
        self.attentions = nn.ModuleList([FrameAttention(channels, c)])

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        x = self.resnets[0](x, state)
        return self.resnets[1](self.attentions[0](x), state)


class DownBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, c: VAEConfig, downsample: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3D(cin if i == 0 else cout, cout, c) for i in range(c.layers_per_block))
        if downsample is not None:
            self.downsamplers = nn.ModuleList([Downsample3D(cout, temporal=downsample == "time+space")])

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, state)
        return self.downsamplers[0](x, state) if hasattr(self, "downsamplers") else x


class UpBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, c: VAEConfig, upsample: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3D(cin if i == 0 else cout, cout, c) for i in range(c.layers_per_block + 1))
        if upsample is not None:
            self.upsamplers = nn.ModuleList([Upsample3D(cout, temporal=upsample == "time+space")])

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, state)
        return self.upsamplers[0](x, state) if hasattr(self, "upsamplers") else x


class Encoder3D(nn.Module):
    def __init__(self, c: VAEConfig):
        super().__init__()
        ch, n = c.block_out_channels, len(c.block_out_channels)
        self.conv_in = CausalConv3d(c.in_channels, ch[0])
        blocks = []
        for i in range(n):
            last = i == n - 1
            kind = None if last else ("time+space" if i >= n - 1 - c.temporal_blocks else "space")
            blocks.append(DownBlock3D(ch[max(i - 1, 0)], ch[i], c, kind))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock3D(ch[-1], c)
        self.conv_norm_out = nn.GroupNorm(c.norm_groups, ch[-1], eps=c.norm_eps)
        self.conv_out = CausalConv3d(ch[-1], 2 * c.latent_channels)

    def forward(self, x: torch.Tensor, state: Causal | None = None) -> torch.Tensor:
        x = self.conv_in(x, state)
        for block in self.down_blocks:
            x = block(x, state)
        x = self.mid_block(x, state)
        return self.conv_out(F.silu(frame_group_norm(self.conv_norm_out, x), inplace=True), state)


class Decoder3D(nn.Module):
    def __init__(self, c: VAEConfig):
        super().__init__()
        ch = list(reversed(c.block_out_channels))
        n = len(ch)
        self.conv_in = CausalConv3d(c.latent_channels, ch[0])
        self.mid_block = MidBlock3D(ch[0], c)
        blocks = []
        for i in range(n):
            kind = None if i == n - 1 else ("time+space" if i < c.temporal_blocks else "space")
            blocks.append(UpBlock3D(ch[max(i - 1, 0)], ch[i], c, kind))
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_norm_out = nn.GroupNorm(c.norm_groups, ch[-1], eps=c.norm_eps)
        self.conv_out = CausalConv3d(ch[-1], c.in_channels)

    def forward(self, z: torch.Tensor, state: Causal | None = None) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z, state), state)
        for block in self.up_blocks:
            x = block(x, state)
        return self.conv_out(F.silu(frame_group_norm(self.conv_norm_out, x), inplace=True), state)


def chunk_count(frames: int, chunk: int) -> int:
    """How many temporal chunks `VideoVAE._chunked` cuts `frames` into: the first 1 + chunk, then chunk at a time."""
    return 1 + -(-max(frames - 1 - chunk, 0) // chunk)


def tile_count(height: int, width: int, tile: int, overlap: int) -> int:
    """How many spatial tiles `tiled` runs over a [..., height, width] input."""
    if height <= tile and width <= tile:
        return 1
    return len(_tile_starts(height, tile, tile - overlap)) * len(_tile_starts(width, tile, tile - overlap))


def _tile_starts(size: int, tile: int, stride: int) -> list[int]:
    if size <= tile:
        return [0]
    return list(range(0, size - tile, stride)) + [size - tile]


def _ramp(n: int, head: int, tail: int, device: torch.device) -> torch.Tensor:
    """1 in the middle, rising over `head` and falling over `tail` entries; never 0."""
    r = torch.ones(n, device=device)
    if head:
        r[:head] = torch.arange(1, head + 1, device=device) / (head + 1)
    if tail:
        r[n - tail:] = torch.minimum(r[n - tail:], torch.arange(tail, 0, -1, device=device) / (tail + 1))
    return r


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, overlap: int,
          scale: float) -> torch.Tensor:
    """fn over overlapping spatial tiles of x [..., H, W] (outputs scale x the tile size), blended with linear
    ramps over the overlaps. Equals fn(x) for any fn that treats pixels independently."""
    height, width = x.shape[-2:]
    if height <= tile and width <= tile:
        return fn(x)
    stride, ov = tile - overlap, round(overlap * scale)
    out = weight = None
    for h0 in _tile_starts(height, tile, stride):
        for w0 in _tile_starts(width, tile, stride):
            part = fn(x[..., h0:h0 + tile, w0:w0 + tile]).float()
            ph, pw = part.shape[-2:]
            if out is None:
                out = part.new_zeros(*part.shape[:-2], round(height * scale), round(width * scale))
                weight = part.new_zeros(out.shape[-2:])
            mask = (_ramp(ph, ov if h0 else 0, ov if h0 + tile < height else 0, part.device)[:, None]
                    * _ramp(pw, ov if w0 else 0, ov if w0 + tile < width else 0, part.device)[None])
            oh, ow = round(h0 * scale), round(w0 * scale)
            out[..., oh:oh + ph, ow:ow + pw] += part * mask
            weight[oh:oh + ph, ow:ow + pw] += mask
    return out / weight


def posterior_sample(moments: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Diagonal Gaussian (logvar clamped to [-30, 20]): a sample with `generator`, the mean without one."""
    mean, logvar = moments.float().chunk(2, dim=1)
    if generator is None:
        return mean
    noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32).to(mean.device)
    return mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * noise


class VideoVAE(nn.Module):
    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder3D(config)
        self.decoder = Decoder3D(config)
        self.encode_chunk = 2 * config.temporal_factor  # pixel frames per chunk after the first frame
        self.decode_chunk = 2  # latent frames per chunk after the first latent
        self.tile_size = 1024  # pixels
        self.tile_overlap = 128

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    @staticmethod
    def _chunked(fn, x: torch.Tensor, chunk: int, on_chunk: Callable[[], None] | None = None) -> torch.Tensor:
        state, outs = Causal(), []
        pieces = [x[:, :, :1 + chunk]] + [p for p in x[:, :, 1 + chunk:].split(chunk, dim=2) if p.shape[2]]
        for piece in pieces:
            outs.append(fn(piece, state))
            state.first = False
            if on_chunk is not None:
                on_chunk()
        return torch.cat(outs, dim=2)

    def encode_boundaries(self, shape: tuple[int, ...], tiling: bool = False) -> int:
        """How often `encode` of an input of `shape` [B, 3, T, H, W] calls `on_chunk`."""
        tiles = tile_count(*shape[-2:], self.tile_size, self.tile_overlap) if tiling else 1
        return tiles * chunk_count(shape[2], self.encode_chunk)

    def decode_boundaries(self, shape: tuple[int, ...], tiling: bool = False) -> int:
        """How often `decode` of latents of `shape` [B, 16, t, h, w] calls `on_chunk`."""
        s = self.config.spatial_factor
        tiles = tile_count(*shape[-2:], self.tile_size // s, self.tile_overlap // s) if tiling else 1
        return tiles * chunk_count(shape[2], self.decode_chunk)

    def encode(self, x: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        """x [B, 3, 4n+1, H, W] in [-1, 1], H and W multiples of 8 -> moments [B, 32, n+1, H/8, W/8] (mean, logvar)."""
        tf, s = self.config.temporal_factor, self.config.spatial_factor
        if (x.shape[2] - 1) % tf:
            raise ValueError(f"the VAE takes {tf}n+1 frames, got {x.shape[2]}")
        x = x.to(self.dtype)

        def run(part):
            return self._chunked(self.encoder, part, self.encode_chunk, on_chunk)

        if not tiling:
            return run(x)
        return tiled(run, x, self.tile_size, self.tile_overlap, 1 / s).to(self.dtype)

    def decode(self, z: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        """z [B, 16, n+1, h, w] (VAE scale, not the DiT's) -> video [B, 3, 4n+1, 8h, 8w]."""
        s = self.config.spatial_factor
        z = z.to(self.dtype)

        def run(part):
            return self._chunked(self.decoder, part, self.decode_chunk, on_chunk)

        if not tiling:
            return run(z)
        return tiled(run, z, self.tile_size // s, self.tile_overlap // s, s).to(self.dtype)


def build_vae(config: VAEConfig, seed: int | None = 0, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> VideoVAE:
    with torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = VideoVAE(config)
    return model.to(dtype).eval().requires_grad_(False)
