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
into the next convolution's padded input (its reflected border too), every convolution bias on CUDA added inside a
pass made anyway; optionally the blocks' k3 convolutions in fp8 (engine.kernels.conv_fp8). On the CPU both compute
in fp32 and equal diffusers to rounding.
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

from engine.kernels import capability, conv_fp8, fused
from engine.kernels.attention import dense
from engine.kernels.fused import FP8
from engine.kernels.group_norm import frame_group_norm_silu, reflect_border, residual_bias
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


class CausalEncoder(nn.Module):
    """diffusers' `MiniMaxH3VideoEncoder3d` + `quant_conv`, one call for a batch of equal tiles: convolutions in the
    compute dtype (channels-last on CUDA), GroupNorm weights and the 1x1x1 `quant_conv` in fp32."""

    def __init__(self, model: AutoencoderKLMiniMaxH3, dtype: torch.dtype, device: torch.device, fp8: bool = False):
        super().__init__()
        self.dtype = dtype
        self.memory_format = torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format
        # cuDNN adds a convolution's bias in a pass of its own, so on CUDA every bias goes where a pass is made anyway:
        # conv1's into norm2; conv2's and the shortcut's into the residual sum; conv_in's and each downsampler's
        # into the next block's norm1 and (through the shortcut) its residual sum. The CPU keeps diffusers' order of
        # additions, so its latents stay diffusers' to the bit.
        self.fold_biases = device.type == "cuda"
        # cuDNN runs the 3-channel conv_in at ~25 TFLOP/s (~0.2 s of a 5 s 1344x768 encode): on CUDA it is a conv2d
        # over each frame with the two before it stacked in channels (9, padded to 16 for the tensor cores), ~5x faster.
        self.stack_conv_in = device.type == "cuda"
        self.encoder = copy.deepcopy(model.encoder).to(device).requires_grad_(False).eval()
        for module in self.encoder.modules():
            if isinstance(module, nn.Conv3d):
                module.to(dtype=dtype, memory_format=self.memory_format)
        weight = self.encoder.conv_in.weight  # [C, 3, 3, 3, 3] -> [C, 16, 3, 3]: channel 3k + c is frame tap k of c
        stacked = weight.permute(0, 2, 1, 3, 4).flatten(1, 2)
        self.conv_in_stacked = F.pad(stacked, (0, 0, 0, 0, 0, -stacked.shape[1] % 8)).contiguous(
            memory_format=torch.channels_last if device.type == "cuda" else torch.contiguous_format)
        self.quant_conv = copy.deepcopy(model.quant_conv).to(device, torch.float32).requires_grad_(False)
        # `fp8`: the ResNet blocks' k3 convolutions (~85 % of the FLOPs) in float8 (engine.kernels.conv_fp8), each
        # fed by a GroupNorm + SiLU that writes its padded input in fp8.
        self.fp8 = {conv: conv_fp8.quantize_weight(conv.weight) for level in self.encoder.down_blocks
                    for block in level.resnets for conv in (block.conv1, block.conv2)} if fp8 else {}
        for conv in self.fp8:
            conv.weight = None

    def _pad(self, x: torch.Tensor, front: int, top: int, bottom: int, left: int, right: int) -> torch.Tensor:
        buffer, interior = _padded(x, front, top, bottom, left, right, self.dtype, self.memory_format)
        interior.copy_(x)
        buffer[:, :, :front].zero_()
        return reflect_border(buffer, top, bottom, left, right)

    def _norm_silu_padded(self, x: torch.Tensor, norm: nn.GroupNorm, bias: torch.Tensor | None,
                          conv: nn.Conv3d) -> torch.Tensor:
        """conv's input after a per-frame GroupNorm + SiLU of x + bias (2 causal frames, reflect 1)."""
        dtype = FP8 if conv in self.fp8 else self.dtype
        buffer, _ = _padded(x, 2, 1, 1, 1, 1, dtype, self.memory_format)
        buffer[:, :, :2].zero_()
        frame_group_norm_silu(x, norm, buffer[:, :, 2:], bias, reflect=True)
        return buffer

    def _conv(self, conv: nn.Conv3d, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """conv(x), and the bias still to add to it (None when the convolution added it)."""
        if conv in self.fp8:
            y = conv_fp8.conv3d_k3(x, *self.fp8[conv], self.dtype)
            return (y, conv.bias.float()) if self.fold_biases else (y.add_(conv.bias.view(-1, 1, 1, 1)), None)
        if self.fold_biases:
            return F.conv3d(x, conv.weight, None, stride=conv.stride), conv.bias.float()
        return F.conv3d(x, conv.weight, conv.bias, stride=conv.stride), None

    def _conv_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        padded = self._pad(x, 2, 1, 1, 1, 1)
        if not self.stack_conv_in:
            return self._conv(self.encoder.conv_in, padded)
        n, c, t, h, w = x.shape
        stacked = padded.new_zeros(n, t, h + 2, w + 2, self.conv_in_stacked.shape[1])
        for k in range(3):
            stacked[..., c * k:c * (k + 1)] = padded[:, :, k:k + t].permute(0, 2, 3, 4, 1)
        y = F.conv2d(stacked.flatten(0, 1).permute(0, 3, 1, 2), self.conv_in_stacked)
        y = y.permute(0, 2, 3, 1).view(n, t, h, w, -1).permute(0, 4, 1, 2, 3)  # channels-last [N, C, T, H, W]
        bias = self.encoder.conv_in.bias
        return (y, bias.float()) if self.fold_biases else (y.add_(bias.view(-1, 1, 1, 1)), None)

    def _resnet(self, block, x: torch.Tensor, x_bias: torch.Tensor | None, pad: int | None = None) -> torch.Tensor:
        """The block's output for the input x + x_bias; with `pad` (0 or 1) as the input of a downsampler: after 2
        causal frames, with `pad` reflected rows and columns at the bottom / right."""
        h, h_bias = self._conv(block.conv1, self._norm_silu_padded(x, block.norm1, x_bias, block.conv1))
        h, bias = self._conv(block.conv2, self._norm_silu_padded(h, block.norm2, h_bias, block.conv2))
        skip, skip_bias = (x, x_bias) if block.conv_shortcut is None else self._conv(block.conv_shortcut, x)
        if block.conv_shortcut is not None and x_bias is not None:  # shortcut(x + b) = shortcut(x) + W b
            skip_bias = skip_bias + block.conv_shortcut.weight.float().flatten(1) @ x_bias
        if bias is None:  # diffusers' order of additions
            h.add_(skip)
            return h if pad is None else self._pad(h, 2, 0, pad, 0, pad)
        bias = bias if skip_bias is None else bias + skip_bias
        if pad is None:
            return residual_bias(h, skip, bias)
        buffer, _ = _padded(h, 2, 0, pad, 0, pad, self.dtype, self.memory_format)
        buffer[:, :, :2].zero_()
        residual_bias(h, skip, bias, buffer[:, :, 2:], pad, pad)
        return buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet-normalised pixels [N, 3, T, H, W] -> moments [N, 2C, ceil(T/4), H/16, W/16] in fp32."""
        e = self.encoder
        x, bias = self._conv_in(x)
        for level in e.down_blocks:
            down = None if level.downsamplers is None else level.downsamplers[0]
            for i, block in enumerate(level.resnets):
                # The strided conv's input: 2 causal frames, at spatial stride 2 one reflected row and column at the
                # bottom / right, written by the level's last block.
                pad = int(down.spatial_stride == 2) if down is not None and i == len(level.resnets) - 1 else None
                x, bias = self._resnet(block, x, bias, pad), None
            if down is not None:
                x, bias = self._conv(down.conv, x)
        x, out_bias = self._conv(e.conv_out, self._norm_silu_padded(x, e.norm_out, bias, e.conv_out))
        x = x.float() if out_bias is None else x.float() + out_bias.view(-1, 1, 1, 1)
        return F.conv3d(x, self.quant_conv.weight, self.quant_conv.bias).contiguous()
