"""The MiniMax-H3 video VAE's fast path: diffusers' `AutoencoderKLMiniMaxH3` weights repacked once, and every tile of
every temporal clip batched through one network call.

The released recipe decodes and encodes 256-px tiles one at a time inside a loop over temporal clips. A decoder tile
is ~1800 tokens, so its GEMMs are small and the GPU idles. All tiles of a canvas have one shape (`_split_tiles` lays
equal tiles) and every tile of every clip is independent (a decoder clip reads only its 7-latent window, an encoder
clip starts from zero causal padding), so they go through the network together, as many per call as a budget allows
(`DECODE_TOKENS`, `ENCODE_VOXELS`). Tile layout, blending and stitching are diffusers' own (`_split_tiles`,
`_stitch_tiles`): the output is the released one.

`ViTDecoder`: fused [q; k; v] and [gate; up] weights in half precision on CUDA over an fp32 residual stream with fp32
norms (as diffusers keeps them), the engine's attention and fused norm / RoPE / SwiGLU kernels; optionally fp8 GEMMs.
`CausalEncoder`: convolutions in bf16 and channels-last on CUDA, each per-frame GroupNorm + SiLU written straight
into the next convolution's padded input. On the CPU both compute in fp32 and equal diffusers to rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKLMiniMaxH3

from engine.kernels import capability, fused
from engine.kernels.attention import dense
from engine.kernels.group_norm import frame_group_norm_silu
from engine.quant import transform
from engine.quant.fp8 import Fp8Linear

# One decoder call: ~64 KiB of activations per token at width 2048 (fp32 residual, half GEMM outputs, the 2 x 8192
# SwiGLU input), so ~4 GiB; 36 released 256-px tiles (1797 tokens each) make GEMMs of 65 k rows.
DECODE_TOKENS = 1 << 16
# One encoder call: 8 released 17-frame 256-px tiles. Level 0 then holds 128 x 8.9 M values per activation (2.3 GiB
# in bf16) and its padded buffers stay under 2^31 elements.
ENCODE_VOXELS = 8 * 17 * 256 * 256


# --- tiles and batches -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileGrid:
    """diffusers' tile layout of a pixel canvas: (start, size) of the tile rows and columns, and their overlaps."""

    rows: list[tuple[int, int]]
    cols: list[tuple[int, int]]
    row_overlaps: list[int]
    col_overlaps: list[int]

    @classmethod
    def of(cls, model: AutoencoderKLMiniMaxH3, height: int, width: int) -> "TileGrid":
        if not model.use_tiling:
            return cls([(0, height)], [(0, width)], [], [])
        ys, heights, y_overlaps = model._split_tiles(height, model.tile_sample_min_height,
                                                     model.tile_sample_min_overlap_height)
        xs, widths, x_overlaps = model._split_tiles(width, model.tile_sample_min_width,
                                                    model.tile_sample_min_overlap_width)
        return cls(list(zip(ys, heights)), list(zip(xs, widths)), y_overlaps, x_overlaps)

    def __len__(self) -> int:
        return len(self.rows) * len(self.cols)

    def crops(self, x: torch.Tensor, scale: int = 1) -> list[torch.Tensor]:
        """x's tiles in row-major order, x being `scale` times smaller than the pixel canvas (latents: 16)."""
        return [x[..., y // scale:(y + h) // scale, c // scale:(c + w) // scale]
                for y, h in self.rows for c, w in self.cols]

    def stitch(self, model: AutoencoderKLMiniMaxH3, tiles: list[torch.Tensor], scale: int = 1) -> torch.Tensor:
        """The tiles (row-major, `scale` times smaller than the pixels) blended into one canvas, as diffusers does."""
        n = len(self.cols)
        grid = [tiles[i:i + n] for i in range(0, len(tiles), n)]
        return model._stitch_tiles(grid, [o // scale for o in self.row_overlaps],
                                   [o // scale for o in self.col_overlaps])


def _batched(fn: Callable[[torch.Tensor], torch.Tensor], items: list[torch.Tensor],
             per_call: Callable[[torch.Size], int]) -> Iterator[torch.Tensor]:
    """fn over runs of consecutive same-shape items [1, ...] joined along the batch, at most per_call(shape) (and
    at least one) per run; each item's output [1, ...] in order, computed when it is asked for."""
    start = 0
    while start < len(items):
        shape = items[start].shape
        end = start + 1
        while end < len(items) and items[end].shape == shape and end - start < per_call(shape):
            end += 1
        yield from fn(torch.cat(items[start:end])).split(1)
        start = end


def decode_clips(decoder: "ViTDecoder", model: AutoencoderKLMiniMaxH3, windows: list[torch.Tensor],
                 max_tokens: int = DECODE_TOKENS) -> Iterator[torch.Tensor]:
    """Denormalised latent windows [1, C, t, h, w] of one shape -> each one's clip [1, 3, 4t, 16h, 16w] (fp32) as
    diffusers' `_decode_clip` tiles and stitches it, every tile of every window through `decoder` at most
    `max_tokens` tokens per call. Lazy: the next call runs when the next clip is asked for."""
    ratio = model.spatial_compression_ratio
    grid = TileGrid.of(model, windows[0].shape[-2] * ratio, windows[0].shape[-1] * ratio)
    tiles = [tile for window in windows for tile in grid.crops(window, ratio)]
    decoded = _batched(decoder, tiles, lambda shape: max_tokens // decoder.tokens(shape))
    for _ in windows:
        yield grid.stitch(model, [next(decoded) for _ in range(len(grid))])


def encode_video(encoder: "CausalEncoder", model: AutoencoderKLMiniMaxH3, x: torch.Tensor,
                 on_clip: Callable[[], None], max_voxels: int = ENCODE_VOXELS) -> torch.Tensor:
    """ImageNet-normalised pixels [B, 3, F, H, W] -> moments [B, 2C, T, H/16, W/16] (fp32) as diffusers' `_encode`:
    clips of `clip_length` frames, the last padded by repeating the last frame, `token_drop` trailing latents
    dropped; one frame alone is one clip. Every tile of every clip and video goes through `encoder`, at most
    `max_voxels` pixels x frames per call; `on_clip()` once each clip is encoded."""
    clip_length, drop = model.config.clip_length, model.config.token_drop
    clips = list(x.split(clip_length, dim=2))
    if x.shape[2] > 1:
        # The encoder is causal in time (latent j sees frames <= 4j, norms are per frame): the latents the last clip
        # keeps come from its first frames alone, and the frames behind them only feed the dropped latents.
        needed = (model.tokens_chunk_size - drop - 1) * model.temporal_compression_ratio + 1
        last = clips[-1][:, :, :needed]
        clips[-1] = torch.cat([last, last[:, :, -1:].expand(-1, -1, needed - last.shape[2], -1, -1)], dim=2)
    grid = TileGrid.of(model, x.shape[-2], x.shape[-1])
    tiles = [tile for clip in clips for video in clip.split(1) for tile in grid.crops(video)]
    encoded = _batched(encoder, tiles, lambda shape: max_voxels // math.prod(shape[2:]))
    ratio = model.spatial_compression_ratio
    moments = []
    for _ in clips:
        moments.append(torch.cat([grid.stitch(model, [next(encoded) for _ in range(len(grid))], ratio)
                                  for _ in range(x.shape[0])]))
        on_clip()
    return torch.cat(moments, dim=2)


# --- decoder -----------------------------------------------------------------------------------------------------

class SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * inner)  # [gate; up] (diffusers' proj holds [up; gate])
        self.fc2 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(fused.swiglu(self.fc1(x)))


class DecoderBlock(nn.Module):
    """x += scale1 * attn(rms(x)); x += scale2 * ff(rms(x)): the residual x in fp32, GEMMs in the compute dtype."""

    def __init__(self, dim: int, heads: int, head_dim: int, inner: int, eps: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)  # [q; k; v]
        self.qk_norm = nn.RMSNorm(head_dim, eps=eps)  # all ones: diffusers' norm_q / norm_k have no weight
        self.out = nn.Linear(heads * head_dim, dim)
        self.scale1 = nn.Parameter(torch.empty(dim))
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ff = SwiGLU(dim, inner)
        self.scale2 = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                fp8_rows: bool = False) -> torch.Tensor:
        """`fp8_rows`: both norms hand their fp8 GEMMs (qkv, ff.fc1) the rows quantized."""
        h = fused.rms_norm(x, self.norm1, dtype, fp8_rows)
        q, k, v = fused.qk_norm_rope(self.qkv(h), self.heads, self.qk_norm, self.qk_norm, rope, head_major=True)
        x, h = fused.scaled_residual_norm(x, self.out(dense(q, k, v).flatten(2)), self.scale1, self.norm2, dtype,
                                          fp8_rows)
        return fused.scaled_residual(x, self.ff(h), self.scale2)


class ViTDecoder(nn.Module):
    """diffusers' `post_quant_conv` + `MiniMaxH3VideoViTDecoder3d`, one call for a batch of equal tiles."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        c = config
        dim = c.decoder_num_attention_heads * c.decoder_attention_head_dim
        self.dtype = dtype
        self.fp8_rows = False  # the block GEMMs are fp8 ones that take their inputs quantized by the norms
        self.patch = math.prod(c.spatial_downsample_factors)
        self.patch_t = math.prod(c.temporal_downsample_factors)
        self.num_registers = c.decoder_num_register_tokens
        rope_dim = int(c.decoder_attention_head_dim * c.decoder_rope_dim_ratio)
        # On the CPU as diffusers computes it (this module is built on the meta device); `from_diffusers` moves it.
        self.rope_inv_freq = 1.0 / c.decoder_rope_theta ** torch.arange(0, 1, 6 / rope_dim, dtype=torch.float32,
                                                                         device="cpu")
        self.post_quant = nn.Linear(c.latent_channels, c.latent_channels)  # the 1x1x1 conv
        self.proj_in = nn.Linear(c.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.empty(1, self.num_registers, dim))
        self.blocks = nn.ModuleList(
            DecoderBlock(dim, c.decoder_num_attention_heads, c.decoder_attention_head_dim, dim * c.decoder_ffn_mult,
                         c.decoder_norm_eps) for _ in range(c.decoder_num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=c.decoder_norm_eps)
        self.proj_out = nn.Linear(dim, c.out_channels * self.patch_t * self.patch ** 2)

    @classmethod
    def from_diffusers(cls, model: AutoencoderKLMiniMaxH3, dtype: torch.dtype, device: torch.device,
                       fp8: bool = False) -> "ViTDecoder":
        """The decoder's weights packed once: GEMM weights and biases in `dtype`, norms, layer scales, registers and
        the two small input projections in fp32; with `fp8` the block GEMMs in float8 e4m3 (engine.quant.fp8), fed
        by the norms' quantized rows and accumulating fast where the device has fp8 GEMMs."""
        with torch.device("meta"):
            decoder = cls(model.config, dtype)
        decoder.load_state_dict(_packed_decoder_weights(model, dtype, device), assign=True)
        decoder.rope_inv_freq = decoder.rope_inv_freq.to(device)
        decoder.requires_grad_(False).eval()
        if fp8:
            transform.quantize_linears(decoder, {f"blocks.{i}.{name}": transform.QuantSpec("float8_e4m3fn")
                                                 for i in range(len(decoder.blocks))
                                                 for name in ("qkv", "out", "ff.fc1", "ff.fc2")})
            transform.fuse_swiglu(decoder, SwiGLU)  # fc2 quantizes silu(gate) * up on the way in
            decoder.fp8_rows = capability.fp8_gemm(device.type, capability.capability(device))
            for layer in decoder.modules():
                if isinstance(layer, Fp8Linear):
                    layer.fast_accum = True
        return decoder

    def tokens(self, shape: torch.Size) -> int:
        """Sequence length of one latent tile [1, C, t, h, w]."""
        return math.prod(shape[2:]) + self.num_registers + 1

    def _rope(self, t: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Coordinates in [-1, 1) per axis, the registers and the zero token at 0; diffusers' arithmetic exactly.
        grids = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (t, h, w)]
        positions = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)
        positions = torch.cat([positions, positions.new_zeros(self.num_registers + 1, 3)])
        angles = 2.0 * math.pi * positions[:, :, None] * self.rope_inv_freq[None, None, :]
        angles = angles.flatten(1).tile(2)
        return angles.cos(), angles.sin()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Denormalised latents [N, C, t, h, w] -> ImageNet-normalised pixels [N, 3, 4t, 16h, 16w] in fp32."""
        n, _, t, h, w = z.shape
        tokens = t * h * w
        x = self.proj_in(self.post_quant(z.permute(0, 2, 3, 4, 1).reshape(n, tokens, -1).float()))
        x = torch.cat([x, self.register_tokens.expand(n, -1, -1), x.new_zeros(n, 1, x.shape[-1])], dim=1)
        rope = self._rope(t, h, w, x.device)
        for block in self.blocks:
            x = block(x, rope, self.dtype, self.fp8_rows)
        x = self.proj_out(self.norm_out(x[:, :tokens]).to(self.dtype))
        p, pt = self.patch, self.patch_t
        x = x.view(n, t, h, w, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(n, -1, t * pt, h * p, w * p).float()


def _packed_decoder_weights(model: AutoencoderKLMiniMaxH3, dtype: torch.dtype,
                            device: torch.device) -> dict[str, torch.Tensor]:
    source = model.decoder

    def put(t: torch.Tensor, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return t.detach().to(device, dt).contiguous()

    weights = {
        "post_quant.weight": put(model.post_quant_conv.weight.flatten(1)),
        "post_quant.bias": put(model.post_quant_conv.bias),
        "proj_in.weight": put(source.proj_in.weight), "proj_in.bias": put(source.proj_in.bias),
        "register_tokens": put(source.register_tokens),
        "norm_out.weight": put(source.norm_out.weight), "norm_out.bias": put(source.norm_out.bias),
        "proj_out.weight": put(source.proj_out.weight, dtype), "proj_out.bias": put(source.proj_out.bias, dtype),
    }
    for i, block in enumerate(source.transformer_blocks):
        attn, ff = block.attn, block.ff
        up, gate = ff.net[0].proj.weight.chunk(2)
        up_bias, gate_bias = ff.net[0].proj.bias.chunk(2)
        weights.update({
            f"blocks.{i}.norm1.weight": put(block.norm1.weight),
            f"blocks.{i}.qkv.weight": put(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]), dtype),
            f"blocks.{i}.qkv.bias": put(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]), dtype),
            f"blocks.{i}.qk_norm.weight": torch.ones(model.config.decoder_attention_head_dim, device=device),
            f"blocks.{i}.out.weight": put(attn.to_out[0].weight, dtype),
            f"blocks.{i}.out.bias": put(attn.to_out[0].bias, dtype),
            f"blocks.{i}.scale1": put(block.scale1),
            f"blocks.{i}.norm2.weight": put(block.norm2.weight),
            f"blocks.{i}.ff.fc1.weight": put(torch.cat([gate, up]), dtype),
            f"blocks.{i}.ff.fc1.bias": put(torch.cat([gate_bias, up_bias]), dtype),
            f"blocks.{i}.ff.fc2.weight": put(ff.net[2].weight, dtype),
            f"blocks.{i}.ff.fc2.bias": put(ff.net[2].bias, dtype),
            f"blocks.{i}.scale2": put(block.scale2),
        })
    return weights


# --- encoder -----------------------------------------------------------------------------------------------------

def _padded(x: torch.Tensor, front: int, top: int, bottom: int, left: int, right: int, dtype: torch.dtype,
            memory_format: torch.memory_format) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty buffer for x [N, C, T, H, W] with `front` frames and the given rows / columns around it, and the view
    of its interior."""
    n, c, t, h, w = x.shape
    buffer = torch.empty(n, c, front + t, top + h + bottom, left + w + right, dtype=dtype, device=x.device,
                         memory_format=memory_format)
    return buffer, buffer[:, :, front:, top:top + h, left:left + w]


def _fill_padding(buffer: torch.Tensor, front: int, top: int, bottom: int, left: int, right: int) -> torch.Tensor:
    """Causal zero frames in front; the reflect padding of one row / column (the model's only width), rows first so
    that the corners reflect both ways, as F.pad's."""
    buffer[:, :, :front].zero_()
    if top:
        buffer[..., 0, :] = buffer[..., 2, :]
    if bottom:
        buffer[..., -1, :] = buffer[..., -3, :]
    if left:
        buffer[..., 0] = buffer[..., 2]
    if right:
        buffer[..., -1] = buffer[..., -3]
    return buffer


class CausalEncoder(nn.Module):
    """diffusers' `MiniMaxH3VideoEncoder3d` + `quant_conv`, one call for a batch of equal tiles: convolutions in the
    compute dtype (channels-last on CUDA), GroupNorm weights and the 1x1x1 `quant_conv` in fp32."""

    def __init__(self, model: AutoencoderKLMiniMaxH3, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype = dtype
        self.memory_format = torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format
        # cuDNN adds a convolution's bias in a pass of its own: inside each ResNet block the biases go where a pass is
        # made anyway (conv1's into norm2, conv2's and the shortcut's into the residual sum). The CPU keeps diffusers'
        # order of additions, so its latents stay diffusers' to the bit.
        self.fold_biases = device.type == "cuda"
        self.encoder = copy.deepcopy(model.encoder).to(device).requires_grad_(False).eval()
        for module in self.encoder.modules():
            if isinstance(module, nn.Conv3d):
                module.to(dtype=dtype, memory_format=self.memory_format)
        self.quant_conv = copy.deepcopy(model.quant_conv).to(device, torch.float32).requires_grad_(False)

    def _pad(self, x: torch.Tensor, front: int, top: int, bottom: int, left: int, right: int) -> torch.Tensor:
        buffer, interior = _padded(x, front, top, bottom, left, right, self.dtype, self.memory_format)
        interior.copy_(x)
        return _fill_padding(buffer, front, top, bottom, left, right)

    def _norm_silu_padded(self, x: torch.Tensor, norm: nn.GroupNorm, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The input of a k3 convolution after a per-frame GroupNorm + SiLU of x + bias (2 causal frames, reflect 1)."""
        buffer, interior = _padded(x, 2, 1, 1, 1, 1, self.dtype, self.memory_format)
        frame_group_norm_silu(x, norm, interior, bias)
        return _fill_padding(buffer, 2, 1, 1, 1, 1)

    @staticmethod
    def _conv(conv: nn.Conv3d, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        return F.conv3d(x, conv.weight, conv.bias if bias else None, stride=conv.stride)

    def _resnet(self, block, x: torch.Tensor) -> torch.Tensor:
        fold = self.fold_biases
        h = self._conv(block.conv1, self._norm_silu_padded(x, block.norm1), bias=not fold)
        h = self._conv(block.conv2, self._norm_silu_padded(h, block.norm2, block.conv1.bias if fold else None),
                       bias=not fold)
        skip = x if block.conv_shortcut is None else self._conv(block.conv_shortcut, x, bias=not fold)
        if not fold:
            return h.add_(skip)
        bias = block.conv2.bias.float() + (0 if block.conv_shortcut is None else block.conv_shortcut.bias.float())
        return fused.residual_bias(h, skip, bias)

    def _downsample(self, down, x: torch.Tensor) -> torch.Tensor:
        # Strided conv: 2 causal frames, and at spatial stride 2 one reflected row and column at the bottom / right.
        s = int(down.spatial_stride == 2)
        return self._conv(down.conv, self._pad(x, 2, 0, s, 0, s))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet-normalised pixels [N, 3, T, H, W] -> moments [N, 2C, ceil(T/4), H/16, W/16] in fp32."""
        e = self.encoder
        x = self._conv(e.conv_in, self._pad(x, 2, 1, 1, 1, 1))
        for level in e.down_blocks:
            for block in level.resnets:
                x = self._resnet(block, x)
            if level.downsamplers is not None:
                x = self._downsample(level.downsamplers[0], x)
        x = self._conv(e.conv_out, self._norm_silu_padded(x, e.norm_out)).float()
        return self._conv(self.quant_conv, x).contiguous()
