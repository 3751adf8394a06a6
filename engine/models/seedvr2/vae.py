"""SeedVR2 causal 3-D VAE ("video_vae_v3", s8 / c16 / t4; specs/seedvr2.md §3), one file, top to bottom.

diffusers 0.42.1 has no class for this VAE, so it is written here with the official module names (strict loading
by name). Causality: a conv never pads time with zeros; the first chunk replicates its first frame 2*pad_t times
at the head, and every later chunk is prefixed with the last k - s input frames the conv saw in the previous chunk
(`Causal.memory`). Chunking in time is therefore exact. GroupNorm statistics are per frame, never across time.

Two layouts run the same modules. The reference keeps activations contiguous (NCDHW). The fast path
(`VideoVAE.channels_last`, on by default on CUDA) keeps them channels-last (`torch.channels_last_3d`): cuDNN's NDHWC
convolutions with the spatial zero padding inside the call, GroupNorm + SiLU in one pass
(engine/kernels/group_norm.py), and views where the reference transposes. Both compute the same thing.

Memory: time is processed in chunks (`encode_chunk` frames, `decode_chunk` latents). A conv too large for one call
runs in bands with exact halos: row bands in the reference (over `CONV_MAX_ELEMENTS` input elements), time bands in
the fast path (contiguous slices there; each call stays below cuDNN's 32-bit indexing). Optional spatial tiling
(tiles blended with linear ramps; one causal state per tile) bounds the activations of large frames, at the price of
per-tile GroupNorm statistics (not exact). `encode_stream` reads its input a chunk at a time and `decode_stream` hands
every decoded chunk on, so a clip's pixels never need to exist whole; `on_chunk()` is called after every chunk
(`encode_boundaries` / `decode_boundaries` say how often), so a job can report progress and stop between chunks.

Frames: T = 4n + 1 pixel frames <-> n + 1 latent frames; latent 0 is pixel frame 0 alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernels.attention import attention, use_backend
from engine.kernels.group_norm import frame_group_norm_silu
from engine.models.seedvr2.config import VAEConfig

CONV_MAX_ELEMENTS = 1 << 28
CHANNELS_LAST_CONV_MAX_ELEMENTS = 3 << 29  # input or output elements of one fast-path call (cuDNN: below 2**31)

Read = Callable[[int, int], torch.Tensor]  # (start, stop) -> those frames of the input
Finish = Callable[[int, torch.Tensor], torch.Tensor]  # (first frame, chunk output) -> its result, frames first
Deliver = Callable[[int, torch.Tensor], None]  # (first frame, finished frames)


def channels_last(x: torch.Tensor) -> bool:
    """Whether x [B, C, T, H, W] is laid out channels-last: the fast path's activations."""
    return x.permute(0, 2, 3, 4, 1).is_contiguous() and not x.is_contiguous()


def layout(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last_3d if channels_last(x) else torch.contiguous_format


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


def norm_silu(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """silu(frame_group_norm(norm, x)); on a channels-last x one fused pass, the result channels-last too."""
    if channels_last(x):
        return frame_group_norm_silu(x, norm, torch.empty_like(x))
    return F.silu(frame_group_norm(norm, x), inplace=True)


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
            x = torch.cat([x[:, :, :1]] * (2 * self.time_pad) + [x], dim=2)
        if state is not None and keep > 0:
            state.memory[self] = x[:, :, x.shape[2] - keep:].clone()
        return self._conv_channels_last(x) if channels_last(x) else self._conv(x)

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

    def _conv_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        """The fast path: bands of output frames (contiguous slices of a channels-last input) small enough for one
        cuDNN call each, the result channels-last (cuDNN keeps the layout, the CPU does not); where even one output
        frame is too large, the reference's row bands."""
        (kt, kh, kw), (st, sh, sw) = self.kernel_size, self.stride
        left, right, top, bottom = self.space_pad
        b, c, t, h, w = x.shape
        h, w = h + top + bottom, w + left + right
        frame = b * max(c * h * w, self.out_channels * ((h - kh) // sh + 1) * ((w - kw) // sw + 1))  # in or out
        frames = (t - kt) // st + 1
        band = (CHANNELS_LAST_CONV_MAX_ELEMENTS // frame - kt) // st + 1  # output frames per call
        conv = self._conv_padded
        if band < 1:
            conv, band = self._conv, 1
        outs = [conv(x[:, :, f * st:(min(f + band, frames) - 1) * st + kt]) for f in range(0, frames, band)]
        return torch.cat(outs, dim=2).contiguous(memory_format=torch.channels_last_3d)

    def _conv_padded(self, x: torch.Tensor) -> torch.Tensor:
        """One call, the zero padding inside it where it is symmetric."""
        left, right, top, bottom = self.space_pad
        if (left, top) != (right, bottom):
            return F.conv3d(F.pad(x, self.space_pad), self.weight, self.bias, self.stride)
        return F.conv3d(x, self.weight, self.bias, self.stride, (0, top, left))


class ResnetBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, c: VAEConfig):
        super().__init__()
        self.norm1 = nn.GroupNorm(c.norm_groups, cin, eps=c.norm_eps)
        self.conv1 = CausalConv3d(cin, cout)
        self.norm2 = nn.GroupNorm(c.norm_groups, cout, eps=c.norm_eps)
        self.conv2 = CausalConv3d(cout, cout)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        h = self.conv1(norm_silu(self.norm1, x), state)
        h = self.conv2(norm_silu(self.norm2, h), state)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, state)
        return h.add_(x)


class Downsample3D(nn.Module):
    """Stride-2 conv in space (and in time for temporal blocks); pads right and bottom by one."""

    def __init__(self, channels: int, temporal: bool):
        super().__init__()
        kernel, stride = ((3, 3, 3), (2, 2, 2)) if temporal else ((1, 3, 3), (1, 2, 2))
        self.conv = CausalConv3d(channels, channels, kernel, stride, space_pad=(0, 1, 0, 1))

    def forward(self, x: torch.Tensor, state: Causal | None) -> torch.Tensor:
        return self.conv(x, state)


def depth_to_space(x: torch.Tensor, rt: int, memory_format: torch.memory_format = torch.contiguous_format
                   ) -> torch.Tensor:
    """[B, (2 * 2 * rt * C), F, H, W] -> [B, C, F * rt, 2H, 2W] (in `memory_format`): channel ((x * 2 + y) * rt + z)
    * C + c goes to frame f * rt + z, row h * 2 + x, column w * 2 + y."""
    b, n, f, h, w = x.shape
    c = n // (4 * rt)
    out = torch.empty(b, c, f * rt, 2 * h, 2 * w, dtype=x.dtype, device=x.device, memory_format=memory_format)
    out.unflatten(2, (f, rt)).unflatten(4, (h, 2)).unflatten(6, (w, 2)).copy_(
        x.unflatten(1, (2, 2, rt, c)).permute(0, 4, 5, 3, 6, 1, 7, 2))
    return out


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
        x = depth_to_space(self.upscale_conv(x), self.rt, layout(x))
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
        return self.conv_out(norm_silu(self.conv_norm_out, x), state)


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
        return self.conv_out(norm_silu(self.conv_norm_out, x), state)


def temporal_chunks(frames: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of every temporal chunk of a `frames`-long input: the first 1 + chunk, then chunk at a time."""
    return [(0, min(1 + chunk, frames))] + [(s, min(s + chunk, frames)) for s in range(1 + chunk, frames, chunk)]


def _tiles(size: int, tile: int, overlap: int, align: int) -> tuple[list[int], int]:
    """(starts, length) of the fewest tiles of at most `tile` covering `size` with at least `overlap` between
    neighbours, spread evenly; starts and length are multiples of `align`."""
    if size <= tile:
        return [0], size
    n = -(-(size - overlap) // (tile - overlap))
    length = min(tile, -(-(size + (n - 1) * overlap) // (n * align)) * align)
    return [round(i * (size - length) / (n - 1) / align) * align for i in range(n)], length


def _ramp(n: int, head: int, tail: int, device: torch.device) -> torch.Tensor:
    """1 in the middle, rising over `head` and falling over `tail` entries; never 0."""
    r = torch.ones(n, device=device)
    if head:
        r[:head] = torch.arange(1, head + 1, device=device) / (head + 1)
    if tail:
        r[n - tail:] = torch.minimum(r[n - tail:], torch.arange(tail, 0, -1, device=device) / (tail + 1))
    return r


def tiled(fn: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, tile: int, overlap: int,
          scale: float) -> torch.Tensor:
    """fn(tile of x, tile index) over overlapping spatial tiles of x [..., H, W] of at most `tile` (outputs scale x
    the tile size; the fewest tiles, spread evenly), blended with linear ramps over the overlaps. Equals fn(x, 0) for
    any fn that treats pixels independently."""
    height, width = x.shape[-2:]
    if height <= tile and width <= tile:
        return fn(x, 0)
    align, ov = max(1, round(1 / scale)), round(overlap * scale)  # tiles start on the output's grid
    (rows, th), (cols, tw) = _tiles(height, tile, overlap, align), _tiles(width, tile, overlap, align)
    out = weight = None
    for index, (h0, w0) in enumerate([(h0, w0) for h0 in rows for w0 in cols]):
        part = fn(x[..., h0:h0 + th, w0:w0 + tw], index).float()
        ph, pw = part.shape[-2:]
        if out is None:
            out = part.new_zeros(*part.shape[:-2], round(height * scale), round(width * scale))
            weight = part.new_zeros(out.shape[-2:])
        mask = (_ramp(ph, ov if h0 else 0, ov if h0 + th < height else 0, part.device)[:, None]
                * _ramp(pw, ov if w0 else 0, ov if w0 + tw < width else 0, part.device)[None])
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


def _frames_first(start: int, x: torch.Tensor) -> torch.Tensor:
    return x.movedim(2, 0)


class ClipStreams:
    """Encoding and decoding a clip in temporal chunks, whole (`encode`, `decode`) or streamed (`encode_stream`,
    `decode_stream`), over `_stream`: one rank's (`VideoVAE`) or spread over ranks (`vae_parallel.ParallelVAE`).
    Subclasses give `model` (the VideoVAE), `encode_chunk`, `decode_chunk`, `_stream` and `_boundaries`."""

    def encode_stream(self, read: Read, frames: int, tiling: bool = False,
                      on_chunk: Callable[[], None] | None = None) -> torch.Tensor:
        """Moments [B, 32, n+1, H/8, W/8] (mean, logvar) of a clip of `frames` = 4n+1 frames read a chunk at a time:
        read(start, stop) -> frames [B, 3, stop - start, H, W] in [-1, 1], H and W multiples of 8."""
        m = self.model
        tf, s = m.config.temporal_factor, m.config.spatial_factor
        if (frames - 1) % tf:
            raise ValueError(f"the VAE takes {tf}n+1 frames, got {frames}")
        parts = []
        self._stream(self._coder(m.encoder, tiling, m.tile_size, m.tile_overlap, 1 / s), read,
                     temporal_chunks(frames, self.encode_chunk), lambda start: -(-start // tf), _frames_first,
                     lambda start, part: parts.append(part), on_chunk)
        return torch.cat(parts).movedim(0, 2)

    def encode(self, x: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        """x [B, 3, 4n+1, H, W] in [-1, 1], H and W multiples of 8 -> moments [B, 32, n+1, H/8, W/8]."""
        return self.encode_stream(lambda start, stop: x[:, :, start:stop], x.shape[2], tiling, on_chunk)

    def decode_stream(self, z: torch.Tensor, deliver: Deliver, finish: Finish = _frames_first, tiling: bool = False,
                      on_chunk: Callable[[], None] | None = None) -> None:
        """Decodes z [B, 16, n+1, h, w] (VAE scale, not the DiT's) a chunk at a time: the pixels [B, 3, f, 8h, 8w] of
        frames [start, start + f) become finish(start, pixels) (frames first; runs where the chunk was decoded),
        then deliver(start, finished), chunk after chunk in order (on every rank)."""
        m = self.model
        tf, s = m.config.temporal_factor, m.config.spatial_factor
        self._stream(self._coder(m.decoder, tiling, m.tile_size // s, m.tile_overlap // s, s),
                     lambda start, stop: z[:, :, start:stop], temporal_chunks(z.shape[2], self.decode_chunk),
                     lambda start: max(tf * start - tf + 1, 0), finish, deliver, on_chunk)

    def decode(self, z: torch.Tensor, tiling: bool = False, on_chunk: Callable[[], None] | None = None
               ) -> torch.Tensor:
        """z [B, 16, n+1, h, w] (VAE scale) -> video [B, 3, 4n+1, 8h, 8w]."""
        parts = []
        self.decode_stream(z, lambda start, part: parts.append(part), tiling=tiling, on_chunk=on_chunk)
        return torch.cat(parts).movedim(0, 2)

    def encode_boundaries(self, frames: int) -> int:
        """How often encoding `frames` frames calls `on_chunk`."""
        return self._boundaries(len(temporal_chunks(frames, self.encode_chunk)))

    def decode_boundaries(self, latents: int) -> int:
        """How often decoding `latents` latent frames calls `on_chunk`."""
        return self._boundaries(len(temporal_chunks(latents, self.decode_chunk)))

    def _coder(self, coder: nn.Module, tiling: bool, tile: int, overlap: int, scale: float):
        """code(x, state_of): `coder` over one temporal chunk x (in spatial tiles if `tiling`; tile i carries the
        causal state state_of(i)), in the model's dtype and layout."""
        m = self.model

        def code(x: torch.Tensor, state_of: Callable[[int], Causal]) -> torch.Tensor:
            x = m.prepare(x)
            if not tiling:
                return coder(x, state_of(0))
            return tiled(lambda part, i: coder(part, state_of(i)), x, tile, overlap, scale).to(m.dtype)

        return code


class VideoVAE(ClipStreams, nn.Module):
    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder3D(config)
        self.decoder = Decoder3D(config)
        self.encode_chunk = 2 * config.temporal_factor  # pixel frames per chunk after the first frame
        self.decode_chunk = 2  # latent frames per chunk after the first latent
        self.tile_size = 1024  # pixels
        self.tile_overlap = 128
        self.channels_last: bool | None = None  # the fast path; None: on CUDA

    @property
    def model(self) -> "VideoVAE":
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.weight.device

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """x in the model's dtype, channels-last on the fast path, else contiguous."""
        fast = self.channels_last if self.channels_last is not None else x.is_cuda
        return x.to(self.dtype, memory_format=torch.channels_last_3d if fast else torch.contiguous_format)

    def _boundaries(self, chunks: int) -> int:
        return chunks

    def _stream(self, code, read: Read, chunks: list[tuple[int, int]], out_start: Callable[[int], int],
                finish: Finish, deliver: Deliver, on_chunk: Callable[[], None] | None) -> None:
        states = defaultdict(Causal)  # one per spatial tile
        for start, stop in chunks:
            out = code(read(start, stop), states.__getitem__)
            for state in states.values():
                state.first = False
            first = out_start(start)
            deliver(first, finish(first, out))
            if on_chunk is not None:
                on_chunk()


def build_vae(config: VAEConfig, seed: int | None = 0, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> VideoVAE:
    with torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = VideoVAE(config)
    return model.to(dtype).eval().requires_grad_(False)
