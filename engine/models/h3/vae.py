"""MiniMax-H3 video and audio VAEs (specs/h3.md §3) over diffusers' `AutoencoderKLMiniMaxH3{,Audio}`.

The wrappers own what the pipeline does around the autoencoders: per-channel latent normalisation, the
ImageNet pixel convention, the keyframe/reference encode recipe, tiled decode streamed chunk by chunk, the uint8
conversion on the device, and stereo-as-batch audio. The video VAE runs its fast path (`video_vae_fast`: weights
repacked, every tile of every clip batched; bf16 decoder and encoder on CUDA) unless `reference` asks for
diffusers' own loops (fp16 autocast over the decoder's weights cast once on CUDA, the encoder in fp32). Loading:
the diffusers layout (`vae/`, `audio_vae/`), the original MiniMax layout (`video_vae/` + `source/`, `audio_vae/` +
`metadata.json`), and the `tiny` preset (same architectures at tiny width, weights from a fixed seed, no files).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.modeling_utils import no_init_weights
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.io.convert import to_uint8_frames
from engine.models.h3.checkpoint import deinterleave_qkv, interleave_qkv, swap_halves
from engine.models.h3.layout import CLIP_LENGTH, LATENTS_PER_CHUNK, latent_frames
from engine.models.h3.video_vae_fast import (DECODE_TOKENS, ENCODE_VOXELS, CausalEncoder, ViTDecoder, decode_clips,
                                             encode_video)

# Spec §3.1, exactly as published.
VIDEO_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075, -0.2727581858634949,
    -1.3675414323806763, -0.2553254961967468, -0.26907554268836975, -0.5376840829849243, -0.0464097298681736,
    0.6657370328903198, 0.19690127670764923, -0.5460608005523682, -0.4035342037677765, -0.23683024942874908,
    0.25928452610969543, -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)
VIDEO_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037, 1.5636216402053833,
    2.194143533706665, 0.96531379222869875, 1.05698859691619875, 0.841948926448822, 0.7729952931404114,
    1.8955937623977661, 0.946841835975647, 0.7996809482574463, 0.44988900423049925, 0.7197399735450745,
    0.69362932443618775, 2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525,
)
# Spec §3.2.
AUDIO_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373,
    0.08179686214561671, -0.35782641352446604, 0.040623809960919084, -0.01552534501956604, -0.223362481667332,
    0.1821006842509091, 0.2941778783780663, -0.07901167601970885, -0.056815072777201, -0.3699028221860095,
    -0.31616315591624855, 0.5905951377425391, -0.052139568068853864, 0.013673160263486295, -0.03691647864630577,
    0.09732660653298163, -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344,
    0.02868032184767538, -0.21217779266454084, -0.1678263169941987, 0.3221287889040614, -0.1223055851554907,
    0.4356604928128464, -0.0502599202236253, 0.3979258376211797,
)
AUDIO_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828,
    1.6390226546605453, 2.7788298348882177, 1.7659090095747236, 1.6199757612137327, 2.6336525640336896,
    1.8539356672817833, 2.5056497896915633, 1.811019237886178, 1.9579657790720237, 1.6685498243529284,
    1.4922469314453364, 3.298670198067373, 1.9491804496832168, 1.8720003270431442, 1.8334080103291832,
    1.6488070416529093, 1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912,
    1.8318420762504692, 1.5540637421583379, 1.9344930328968526, 1.599198216109855, 1.718045989838149,
    1.6307219190837705, 1.8661226051202384, 1.5613768203168363,
)
# The released VAE's preview projection (ComfyUI's MiniMaxH3Video latent format): normalised latent [24] -> RGB
# in [-1, 1] = latent @ factors + bias. A file may carry its own fitted pair (LATENT_RGB: the embedded default's).
VIDEO_LATENT_RGB_FACTORS = (
    (-0.018555, 0.024344, -0.017536), (0.150164, 0.137244, 0.129221), (0.027367, -0.050369, -0.208606),
    (-0.000793, -0.164622, -0.323161), (-0.048556, 0.013970, -0.074286), (0.011740, 0.014172, -0.006906),
    (0.061517, 0.061212, 0.110025), (0.035321, 0.086879, 0.110059), (-0.017426, 0.002997, 0.035356),
    (0.531539, 0.548819, 0.624404), (-0.024968, -0.040234, -0.034302), (-0.032549, -0.029096, -0.017221),
    (0.022609, 0.020286, 0.050661), (-0.084001, -0.038131, -0.020805), (-0.018830, 0.010412, 0.061120),
    (0.020777, 0.011196, -0.030994), (-0.008390, -0.012201, -0.025687), (-0.013281, -0.002924, 0.006331),
    (0.000260, 0.001833, -0.011038), (0.105471, 0.100482, 0.132106), (0.016529, 0.015213, 0.009999),
    (-0.014015, -0.017438, -0.019134), (-0.033787, -0.009984, -0.019725), (0.004224, 0.017284, 0.027196),
)
VIDEO_LATENT_RGB_BIAS = (0.057426, -0.022078, -0.071449)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TILE_SIZE, TILE_OVERLAP = 256, 64
ENCODE_SEED = 42

# Tiny presets: the real compression (16x spatial, 4x temporal, 24 channels, clip 17 / drop 3; hop 800,
# 32 channels) so every layout rule holds, at widths that run in seconds on a laptop CPU.
TINY_VIDEO_VAE = dict(
    block_out_channels=(4, 8, 8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
    decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
    decoder_num_register_tokens=2,
)
# The embedded default's video VAE: the tiny encoder (its latents are what the toy DiT learned) and a decoder wide
# enough to draw a 16x16 patch: the tiny one maps each token to its 3072 pixel values through 32 channels, which blurs
# the toy objects' edges and colours. The file header records it (`save_video_vae_file`).
TOY_VIDEO_VAE = dict(TINY_VIDEO_VAE, decoder_num_layers=4, decoder_num_attention_heads=6, decoder_attention_head_dim=32)
VIDEO_ARCHITECTURE = ("latent_channels", "block_out_channels", "layers_per_block", "norm_num_groups",
                      "decoder_num_layers", "decoder_num_attention_heads", "decoder_attention_head_dim",
                      "decoder_num_register_tokens", "decoder_ffn_mult")
# Half the real 256/64 px: canvases past 128 px (the tiny default 224x128 included) decode as blended tiles,
# while small encodes stay one tile (CPU conv3d pays for every overlap).
TINY_TILE_SIZE, TINY_TILE_OVERLAP = 128, 32
# decoder_dim 128 halves through the 7 upsamplers down to 1 channel, the narrowest BigVGAN stack possible; one
# AMP block per stage instead of three (the per-sample activations at 32 kHz dominate CPU time).
TINY_AUDIO_VAE = dict(encoder_dim=4, latent_dim=64, num_attention_heads=2, decoder_dim=128,
                      resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3, 5),))
# The embedded default's audio VAE. A one-channel last stage cannot be trained to make a tone (the tiny preset
# trained decodes every input to the same near-silence, RMS 3e-4); the same hop 800 in four upsamplers ends at 16
# channels (the release ends at 8). The file header records it (`save_audio_vae_file`).
TOY_AUDIO_VAE = dict(encoder_dim=8, latent_dim=64, num_attention_heads=2, decoder_dim=256, decoder_rates=(8, 5, 5, 4),
                     decoder_kernel_sizes=(16, 9, 9, 8), resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3, 5),))
AUDIO_ARCHITECTURE = ("encoder_dim", "encoder_rates", "latent_dim", "latent_channels", "num_attention_heads",
                      "decoder_dim", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes",
                      "resblock_dilation_sizes", "sampling_rate")


def _channel_stats(values, ndim: int) -> torch.Tensor:
    shape = [1, -1] + [1] * (ndim - 2)
    return torch.tensor(values, dtype=torch.float32).view(shape)


def _check_stats(mean, std, channels: int, what: str) -> None:
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"{what}: latents_mean/std need {channels} entries, got {len(mean)}/{len(std)}")


def _randomize_constant_params(model: nn.Module, generator: torch.Generator) -> None:
    # Zero-initialised layer scales, registers and constant norm weights would make whole sub-networks
    # no-ops (and hide conversion bugs), so every constant parameter gets a small random perturbation.
    with torch.no_grad():
        for p in model.parameters():
            if bool((p == p.flatten()[0]).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=generator))


def _seeded(cls, config: dict, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
    _randomize_constant_params(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


@torch.no_grad()
def _load_strict(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (key, tensor) pairs into the model one at a time (peak memory: model + one tensor); every
    parameter and buffer of the state dict must come exactly once with its shape, or ValueError."""
    expected = model.state_dict()
    seen = set()
    for key, tensor in items:
        if key not in expected:
            raise ValueError(f"unexpected key {key!r} in {source}")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"{key!r} in {source} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected[key].shape)}")
        expected[key].copy_(tensor)
        seen.add(key)
    missing = [key for key in expected if key not in seen]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} in {source}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def _safetensors_items(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():
            yield key, f.get_tensor(key)


def _diffusers_items(folder: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], str]:
    """(key, tensor) pairs of a diffusers component folder, single file or sharded, and a name for errors."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        items = (item for shard in shards for item in _safetensors_items(folder / shard))
        return items, str(index)
    weights = folder / "diffusion_pytorch_model.safetensors"
    return _safetensors_items(weights), str(weights)


def _from_diffusers_folder(cls, folder: Path, config: dict) -> nn.Module:
    # Built and filled here rather than by `from_pretrained`, which needs `accelerate` for these classes.
    with no_init_weights():
        model = cls.from_config(config)
    items, source = _diffusers_items(folder)
    _load_strict(model, items, source)
    return model.eval()


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def _component_dir(path: str | Path, names: tuple[str, ...]) -> Path:
    path = Path(path)
    for name in names:
        if (path / name / "config.json").is_file():
            return path / name
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"no {' or '.join(n + '/' for n in names)}config.json under {path}")


# --- video ---------------------------------------------------------------------------------------------------

_ORIGINAL_MASK_TOKEN = "decoder.mask_token"


def original_video_vae_key(key: str) -> str:
    """Diffusers `AutoencoderKLMiniMaxH3` key -> the original (MiniMax) key it comes from (spec §7.4)."""
    m = re.match(r"^encoder\.down_blocks\.(\d+)\.(resnets|downsamplers)\.(\d+)\.(.+)$", key)
    if m:
        level, kind, index, rest = m.groups()
        if kind == "downsamplers":
            return f"encoder.down.{level}.downsample.{rest}"
        return f"encoder.down.{level}.block.{index}.{rest.replace('conv_shortcut.', 'nin_shortcut.')}"
    key = key.replace("decoder.proj_in.", "decoder.x_embedder.")
    key = re.sub(r"\.attn\.to_[qkv]\.", ".attn.to_qkv.", key)
    key = key.replace(".attn.to_out.0.", ".attn.to_out.")
    key = key.replace(".ff.net.0.proj.", ".ff.w1.").replace(".ff.net.2.", ".ff.w2.")
    return key


def original_video_vae_plan(model: AutoencoderKLMiniMaxH3) -> dict[str, list[str]]:
    """Every original key the model needs -> the diffusers key(s) it becomes (q, k, v for a fused `to_qkv`)."""
    plan: dict[str, list[str]] = {}
    for key in model.state_dict():
        plan.setdefault(original_video_vae_key(key), []).append(key)
    for targets in plan.values():
        targets.sort(key=lambda k: ("to_q." not in k, "to_k." not in k))  # q, k, v order
    return plan


def convert_original_video_vae(original: Iterable[tuple[str, torch.Tensor]], model: AutoencoderKLMiniMaxH3,
                               source: str = "state dict") -> Iterator[tuple[str, torch.Tensor]]:
    """Original video-VAE (key, tensor) pairs -> diffusers pairs, lazily. Strict: an unknown key, or (once the
    input is exhausted) a key the model needs that never came, raises ValueError naming it and `source`."""
    plan = original_video_vae_plan(model)
    heads = model.config.decoder_num_attention_heads
    seen = set()
    for key, tensor in original:
        if key == _ORIGINAL_MASK_TOKEN:  # MAE training leftover, unused by the decoder
            continue
        if key not in plan:
            raise ValueError(f"unexpected key {key!r} in {source}")
        seen.add(key)
        targets = plan[key]
        if ".attn.to_qkv." in key:
            if tensor.shape[0] % (3 * heads):
                raise ValueError(f"{key!r} in {source} has {tensor.shape[0]} rows, not 3 x {heads} heads")
            yield from zip(targets, deinterleave_qkv(tensor, heads).chunk(3, dim=0))
        elif ".ff.w1." in key:  # original [gate; up], diffusers SwiGLU reads [up; gate]
            yield targets[0], swap_halves(tensor)
        else:
            yield targets[0], tensor
    missing = [key for key in plan if key not in seen]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} in {source}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def video_vae_config_from_original(wrapper: dict, source: dict) -> dict:
    """`video_vae/config.json` + `video_vae/source/config.json` (original names) -> diffusers constructor kwargs."""
    vit = source.get("vit_decoder_kwargs", {})
    ch = source.get("ch", 128)
    config = dict(
        in_channels=source.get("in_channels", 3),
        out_channels=source.get("out_ch", 3),
        latent_channels=source.get("z_channels", 24),
        block_out_channels=tuple(ch * m for m in source.get("ch_mult", (1, 2, 2, 4, 4, 8))),
        layers_per_block=source.get("num_res_blocks", 2),
        spatial_downsample_factors=tuple(source.get("space_down", (2, 2, 2, 2, 1, 1))),
        temporal_downsample_factors=tuple(source.get("time_down", (1, 2, 2, 1, 1, 1))),
        norm_num_groups=source.get("norm_num_groups", 32),
        spatial_padding_mode=source.get("padding_mode", "reflect"),
        decoder_num_layers=vit.get("num_layers", 36),
        decoder_num_attention_heads=vit.get("heads", 32),
        decoder_attention_head_dim=vit.get("dim_head", 64),
        decoder_num_register_tokens=vit.get("num_register_tokens", 4),
        decoder_rope_theta=vit.get("rope_theta", 100.0),
        decoder_rope_dim_ratio=vit.get("rope_dim_ratio", 0.75),
        clip_length=wrapper.get("vae_clip_length", 17),
        token_drop=wrapper.get("vae_token_drop", 3),
    )
    if source.get("embed_dim", config["latent_channels"]) != config["latent_channels"]:
        raise ValueError("video VAE source config: embed_dim != z_channels is not supported")
    return config


class VideoVAE(nn.Module):
    """`AutoencoderKLMiniMaxH3` plus the 24-channel latent statistics; see the module docstring.

    `reference`: run diffusers' loops (the oracle) instead of the fast path. The fast path's networks are packed
    from `model` on first use, and again when the device, a precision below or `model`'s weights (trained in place)
    change: `decode_dtype` and `encode_dtype` are their CUDA compute dtypes (the CPU computes in fp32),
    `decode_fp8` turns the decoder blocks' GEMMs to float8 (with bf16 activations), `encode_fp8` the encoder
    blocks' convolutions (with fp8 activations; engine.kernels.conv_fp8). `decode_tokens` and
    `encode_voxels` bound the fast path's batches (decoder tokens, encoder pixels x frames per call): the memory plan
    sets them (engine/runtime/planner.py); they do not change the output.
    """

    def __init__(self, model: AutoencoderKLMiniMaxH3, latents_mean=VIDEO_LATENTS_MEAN,
                 latents_std=VIDEO_LATENTS_STD, tile_size: int = TILE_SIZE, tile_overlap: int = TILE_OVERLAP,
                 latent_rgb=(VIDEO_LATENT_RGB_FACTORS, VIDEO_LATENT_RGB_BIAS), reference: bool = False):
        super().__init__()
        self.reference = reference
        # bf16: 3.4 s and 69 dB against diffusers fp32 for 124 frames 1344x768 on an H200, fp16 3.7 s and 85 dB
        # (benchmarks/results/h3_vae_h200_run1.json)
        self.decode_dtype, self.encode_dtype = torch.bfloat16, torch.bfloat16
        self.decode_fp8 = self.encode_fp8 = False
        self.decode_tokens, self.encode_voxels = DECODE_TOKENS, ENCODE_VOXELS
        self._fast: dict[str, tuple[tuple, nn.Module]] = {}  # kind -> (key, network); not submodules
        _check_stats(latents_mean, latents_std, model.config.latent_channels, "video VAE")
        self.model = model.eval()
        # (factors [24, 3], bias [3]) of the live previews' linear latent -> RGB projection, on the CPU
        self.latent_rgb = tuple(torch.as_tensor(v, dtype=torch.float32) for v in latent_rgb)
        self.latents_mean_values = tuple(float(v) for v in latents_mean)
        self.latents_std_values = tuple(float(v) for v in latents_std)
        self.register_buffer("latents_mean", _channel_stats(self.latents_mean_values, 5), persistent=False)
        self.register_buffer("latents_std", _channel_stats(self.latents_std_values, 5), persistent=False)
        self.register_buffer("pixel_mean", _channel_stats(IMAGENET_MEAN, 5), persistent=False)
        self.register_buffer("pixel_std", _channel_stats(IMAGENET_STD, 5), persistent=False)
        model.enable_tiling(tile_size, tile_size, tile_overlap, tile_overlap)

    @property
    def device(self) -> torch.device:
        return self.latents_mean.device

    @property
    def spatial_compression(self) -> int:
        return self.model.spatial_compression_ratio

    def place(self, device: torch.device) -> None:
        """Serve on `device`. On a GPU only the fast networks go there (packed now, not at the first request):
        diffusers' fp32 model, the oracle (10.4 GB at full size), stays in host memory."""
        device = torch.device(device)
        if device.type != "cuda" or self.reference:
            self.to(device)
            return
        self.model.cpu()
        for name, buffer in self._buffers.items():
            self._buffers[name] = buffer.to(device)
        self.fast_decoder()
        self.fast_encoder()

    def served_bytes(self) -> int:
        """What `place` puts on a GPU: the decoder's GEMM weights in its compute dtype (fp8: 1 byte), the
        encoder's convolutions in theirs (its blocks' k3 ones 1 byte with `encode_fp8`), and their fp32 norms, scales
        and small projections."""
        gemm = 1 if self.decode_fp8 else torch.finfo(self.decode_dtype).bits // 8
        conv = torch.finfo(self.encode_dtype).bits // 8
        total = 0
        for module in (self.model.decoder, self.model.post_quant_conv, self.model.encoder, self.model.quant_conv):
            for name, p in module.named_parameters():
                half = p.dim() > 1 and module is not self.model.quant_conv and "proj_in" not in name
                block_conv = self.encode_fp8 and ".resnets." in name and name.endswith(("conv1.weight", "conv2.weight"))
                total += p.numel() * ((gemm if module is self.model.decoder else 1 if block_conv else conv)
                                      if half else 4)
        return total

    def _fast_network(self, kind: str, build: Callable[[torch.dtype], nn.Module], dtype: torch.dtype,
                      *options) -> nn.Module:
        dtype = dtype if self.device.type == "cuda" else torch.float32
        key = (self.device, dtype, *options, sum(p._version for p in self.model.parameters()))
        if kind not in self._fast or self._fast[kind][0] != key:
            self._fast.pop(kind, None)  # the old copy goes before the new one is packed
            self._fast[kind] = key, build(dtype)
        return self._fast[kind][1]

    def fast_decoder(self) -> ViTDecoder:
        fp8 = self.decode_fp8
        dtype = torch.bfloat16 if fp8 else self.decode_dtype  # fp8 GEMMs scale rows into bf16 outputs
        return self._fast_network("decoder", lambda dt: ViTDecoder.from_diffusers(self.model, dt, self.device, fp8),
                                  dtype, fp8)

    def fast_encoder(self) -> CausalEncoder:
        fp8 = self.encode_fp8
        return self._fast_network("encoder", lambda dt: CausalEncoder(self.model, dt, self.device, fp8),
                                  self.encode_dtype, fp8)

    def encode_chunks(self, num_frames: int) -> int:
        """How often `encode_frames` of `num_frames` frames calls `on_chunk`: once per clip of 17 frames."""
        return -(-num_frames // self.model.config.clip_length) if num_frames > 1 else 1

    @torch.no_grad()
    def encode_frames(self, frames_uint8: torch.Tensor, generator_seed: int = ENCODE_SEED,
                      on_chunk: Callable[[], None] | None = None, any_length: bool = False) -> torch.Tensor:
        """uint8 [F, H, W, 3] (F = 1 or 17n + 5; H, W multiples of 16) -> normalised latents [1, 24, T, H/16, W/16].

        The keyframe/reference recipe (spec §3.1): ImageNet-normalise, encode, sample the posterior under an
        independent CPU generator seeded `generator_seed`, round to fp16, normalise. `on_chunk()` after every
        17-frame clip. `any_length`: other frame counts too, the last clip padded by repeating its last frame (a
        ref2va video reference shorter than 22 frames, as the reference implementation encodes it).
        """
        frames = torch.as_tensor(frames_uint8)
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
        num_frames, height, width = frames.shape[:3]
        if num_frames > 1 and not any_length:
            latent_frames(num_frames)  # raises LayoutError unless 17n + 5
        s = self.spatial_compression
        if height % s or width % s:
            raise ValueError(f"frame size {width}x{height} must be a multiple of {s}")
        x = frames.to(self.device).permute(3, 0, 1, 2).unsqueeze(0).float().div_(255.0)
        x.sub_(self.pixel_mean).div_(self.pixel_std)  # in place: a 5 s 1344x768 source is 1.4 GiB in fp32
        posterior = DiagonalGaussianDistribution(self._encoded_clips(x, on_chunk or (lambda: None)))
        z = posterior.sample(generator=torch.Generator().manual_seed(generator_seed))
        z = z.to(torch.float16).float()
        return (z - self.latents_mean) / self.latents_std

    def _encoded_clips(self, x: torch.Tensor, on_chunk: Callable[[], None]) -> torch.Tensor:
        """diffusers' `_encode` (clips of 17 frames, the last padded by repetition, `token_drop` trailing latents
        dropped) of pixels [B, 3, F, H, W], with `on_chunk()` after every clip: the fast path, or diffusers' loop."""
        if not self.reference:
            return encode_video(self.fast_encoder(), self.model, x, on_chunk, self.encode_voxels)
        model, clip = self.model, self.model.config.clip_length
        if x.shape[2] == 1:
            moments = model._encode_clip(x)
            on_chunk()
            return moments
        if x.shape[2] % clip:
            x = torch.cat([x, x[:, :, -1:].repeat(1, 1, -x.shape[2] % clip, 1, 1)], dim=2)
        moments = []
        for i in range(x.shape[2] // clip):
            moments.append(model._encode_clip(x[:, :, i * clip:(i + 1) * clip]))
            on_chunk()
        moments = torch.cat(moments, dim=2)
        return moments[:, :, :-model.config.token_drop] if model.config.token_drop > 0 else moments

    def encode_image(self, image_uint8: torch.Tensor, generator_seed: int = ENCODE_SEED) -> torch.Tensor:
        """uint8 [H, W, 3] -> normalised latents [1, 24, 1, H/16, W/16] (spatial encoder only)."""
        return self.encode_frames(torch.as_tensor(image_uint8)[None], generator_seed)

    def decode(self, latents: torch.Tensor, on_chunk: Callable[[], None] | None = None) -> torch.Tensor:
        """Normalised latents [1, 24, T, h, w] -> uint8 frames [F, H, W, 3] on the CPU: `decode_chunks`, joined;
        `on_chunk()` after every chunk."""
        chunks = []
        for chunk in self.decode_chunks(latents):
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk()
        return torch.cat(chunks)

    @staticmethod
    def decode_chunk_count(num_latents: int, num_frames: int | None = None) -> int:
        """How many chunks `decode_chunks` yields for 5n + 2 latents (n of 17 frames, then 5), or until
        `num_frames` frames are out."""
        n = (num_latents - 2) // LATENTS_PER_CHUNK
        return n + 1 if num_frames is None else min(n + 1, -(-num_frames // CLIP_LENGTH))

    @torch.no_grad()
    def decode_chunks(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Normalised latents [1, 24, T, h, w] -> uint8 frames [n, H, W, 3] on the CPU, one VAE chunk at a time.

        diffusers' `_decode` loop, yielding each chunk once it is final (cross-faded with the next clip's head) so
        a consumer (the MP4 encoder) works while the next one decodes; joined, they are diffusers' `decode` (to
        rounding on the fast path, exactly with `reference`). Tiled as diffusers tiles. T = 5n + 2 gives
        F = 17n + 5: n chunks of 17 frames, then 5.
        """
        if latents.dim() != 5 or latents.shape[0] != 1:
            raise ValueError(f"expected latents [1, C, T, h, w], got {tuple(latents.shape)}")
        if latents.shape[2] % LATENTS_PER_CHUNK != 2:
            raise ValueError(f"the video VAE decodes 5n + 2 latent frames, got {latents.shape[2]}")
        z = latents.to(self.device, torch.float32) * self.latents_std + self.latents_mean
        left = (z.shape[2] - 2) // LATENTS_PER_CHUNK * CLIP_LENGTH + LATENTS_PER_CHUNK
        if z.shape[2] == 2:
            # diffusers' chunk loop decodes nothing for n = 0 (5 frames): repeat the last latent up to one full
            # window (7 latents -> 22 frames) and keep the 5 frames of the first two latents.
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, 5, -1, -1)], dim=2)
        for chunk in self._decoded_chunks(z):
            frames = self._host_frames(chunk[:, :, :left])
            left -= frames.shape[0]
            yield frames
            if not left:
                return

    def cast_decoder_weights(self, dtype: torch.dtype) -> None:
        """Cast the decoder's convolution and projection weights to the autocast dtype once, as autocast would on
        every call (it caches no cast of a weight that needs no grad): the same rounding, so the same output (bit
        for bit on the H200), without ~160 000 cast kernels per 5 s 1344x768 decode (7.7 -> 7.4 s) and with half
        of the decoder's 9.7 GB. Norms and the encoder keep their float32 weights. The reference path on CUDA
        casts them (the model is no fp32 oracle after that)."""
        if self.model.post_quant_conv.weight.dtype == dtype:  # cast already (every reference decode on CUDA asks)
            return
        for module in (self.model.post_quant_conv, *self.model.decoder.modules()):
            if isinstance(module, (nn.Conv2d, nn.Conv3d, nn.Linear)):
                module.to(dtype)

    def _decoded_chunks(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        """diffusers' `_decode` loop over denormalised latents, one final chunk [1, 3, n, H, W] at a time (5n + 2
        latents are n whole chunks once the dropped tokens are counted: no tail padding to cut)."""
        model = self.model
        size, pre = model.tokens_chunk_size, model.frame_pre_padding
        span = size * model.temporal_compression_ratio
        windows = [z[:, :, i * size:(i + 1) * size + model.token_overlap]
                   for i in range((z.shape[2] + model.config.token_drop) // size - 1)]
        overlap = None
        for clip in self._decoded_clips(windows):
            chunk = clip[:, :, pre:span]
            if overlap is not None:
                chunk = model._blend(overlap, chunk, model.frame_overlap, dim=-3)
            # Past its chunk the clip decodes the head of the next one, cross-faded into the next clip's.
            overlap = clip[:, :, span + pre:2 * span]
            yield chunk
        yield overlap

    def _decoded_clips(self, windows: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Each latent window's tiled decode [1, 3, 4t, H, W]: the fast path, or diffusers' `_decode_clip` (fp16
        autocast over the cast weights on CUDA, the released recipe)."""
        if not self.reference:
            yield from decode_clips(self.fast_decoder(), self.model, windows, self.decode_tokens)
            return
        cuda = self.device.type == "cuda"
        if cuda:
            self.cast_decoder_weights(torch.float16)
        for window in windows:
            with torch.autocast("cuda", dtype=torch.float16, enabled=cuda):
                clip = self.model._decode_clip(window)
            yield clip

    def _host_frames(self, video: torch.Tensor) -> torch.Tensor:
        """Decoder output [1, 3, n, H, W] -> uint8 [n, H, W, 3] on the CPU (via pinned memory from CUDA)."""
        frames = to_uint8_frames(video.float() * self.pixel_std + self.pixel_mean)
        if not frames.is_cuda:
            return frames
        host = torch.empty(frames.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(frames, non_blocking=True)
        torch.cuda.current_stream(frames.device).synchronize()  # the consumer reads it at once
        return host

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "VideoVAE":
        """Load from a models folder (or the component folder): diffusers `vae/` or original `video_vae/`."""
        folder = _component_dir(path, ("vae", "video_vae"))
        config = _read_json(folder / "config.json")
        if "source_path" in config or "source_safetensors_path" in config:
            return cls._from_original(folder, config)
        model = _from_diffusers_folder(AutoencoderKLMiniMaxH3, folder, config)
        return cls(model, config.get("latents_mean") or VIDEO_LATENTS_MEAN,
                   config.get("latents_std") or VIDEO_LATENTS_STD)

    @classmethod
    def _from_original(cls, folder: Path, wrapper: dict) -> "VideoVAE":
        source_dir = folder / wrapper.get("source_path", "source")
        weights = source_dir / wrapper.get("source_safetensors_path", "model.safetensors")
        config = video_vae_config_from_original(wrapper, _read_json(source_dir / "config.json"))
        with no_init_weights():
            model = AutoencoderKLMiniMaxH3(**config)
        items = convert_original_video_vae(_safetensors_items(weights), model, str(weights))
        _load_strict(model, items, str(weights))
        return cls(model, wrapper.get("latents_mean") or VIDEO_LATENTS_MEAN,
                   wrapper.get("latents_std") or VIDEO_LATENTS_STD,
                   wrapper.get("vae_tile_size", TILE_SIZE), wrapper.get("vae_tile_overlap_min", TILE_OVERLAP))


def build_tiny_video_vae(seed: int = 0, config: dict = TINY_VIDEO_VAE) -> VideoVAE:
    model = _seeded(AutoencoderKLMiniMaxH3, dict(config, latents_mean=VIDEO_LATENTS_MEAN,
                                                 latents_std=VIDEO_LATENTS_STD), seed)
    return VideoVAE(model, tile_size=TINY_TILE_SIZE, tile_overlap=TINY_TILE_OVERLAP)


# --- audio ---------------------------------------------------------------------------------------------------

# Not in the released `metadata.json`: the reference hardcodes them (32 kHz BigVGAN table). Taken from the
# metadata when present (the tiny preset written in this layout).
_AUDIO_FIXED = dict(num_attention_heads=8, resblock_kernel_sizes=(3, 7, 11),
                    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)))


def audio_vae_config_from_original(metadata: dict, wrapper: dict) -> dict:
    """`audio_vae/metadata.json` + `config.json` (original) -> diffusers constructor kwargs (spec §7.4)."""
    kwargs = metadata["metadata"]["kwargs"]
    if kwargs.get("decoder_type", "bigvgan") != "bigvgan" or not kwargs.get("attn_proj", True):
        raise ValueError("audio VAE: only the BigVGAN decoder with the attention projection is supported")
    if "latent_channels" in wrapper and wrapper["latent_channels"] != kwargs["vae_latent_channels"]:
        raise ValueError("audio VAE: metadata.json and config.json disagree on the latent width")
    return dict(
        {key: kwargs.get(key, value) for key, value in _AUDIO_FIXED.items()},
        encoder_dim=kwargs["encoder_dim"], encoder_rates=tuple(kwargs["encoder_rates"]),
        latent_dim=kwargs["latent_dim"], latent_channels=kwargs["vae_latent_channels"],
        decoder_dim=kwargs["decoder_dim"], decoder_rates=tuple(kwargs["decoder_rates"]),
        decoder_kernel_sizes=tuple(2 * u - u % 2 for u in kwargs["decoder_rates"]),
        sampling_rate=kwargs["sample_rate"],
    )


def resample(waveform: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """[C, S] linear-interpolation resampling (no anti-alias filter: reference soundtracks only)."""
    if orig_rate == new_rate:
        return waveform
    length = max(1, round(waveform.shape[-1] * new_rate / orig_rate))
    return F.interpolate(waveform[None], size=length, mode="linear", align_corners=False)[0]


class AudioVAE(nn.Module):
    """`AutoencoderKLMiniMaxH3Audio` (mono, 32 kHz) plus the 32-channel latent statistics; stereo = batch of 2."""

    def __init__(self, model: AutoencoderKLMiniMaxH3Audio, latents_mean=AUDIO_LATENTS_MEAN,
                 latents_std=AUDIO_LATENTS_STD):
        super().__init__()
        _check_stats(latents_mean, latents_std, model.config.latent_channels, "audio VAE")
        self.model = model.eval()
        self.latents_mean_values = tuple(float(v) for v in latents_mean)
        self.latents_std_values = tuple(float(v) for v in latents_std)
        self.register_buffer("latents_mean", _channel_stats(self.latents_mean_values, 3), persistent=False)
        self.register_buffer("latents_std", _channel_stats(self.latents_std_values, 3), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.latents_mean.device

    @property
    def sample_rate(self) -> int:
        return self.model.config.sampling_rate

    @property
    def hop(self) -> int:
        return self.model.hop_length

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [2, 32, Ta] (one batch item per stereo channel) -> float32 waveform [2, Ta * hop]."""
        if latents.dim() != 3:
            raise ValueError(f"expected audio latents [channels, 32, Ta], got {tuple(latents.shape)}")
        z = latents.to(self.device, torch.float32) * self.latents_std + self.latents_mean
        audio = self.model.decode(z, return_dict=False)[0][:, 0]
        return audio.float().clamp_(-1.0, 1.0).to(latents.device)

    @torch.no_grad()
    def encode(self, waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """float [C, S] (C = 1 or 2) at `sample_rate` -> normalised posterior-mean latents [2, 32, ceil(S'/hop)].

        Resampled to 32 kHz, mono duplicated to stereo; diffusers right-pads to a multiple of the hop.
        """
        x = torch.as_tensor(waveform).to(self.device, torch.float32)
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2 or x.shape[0] not in (1, 2):
            raise ValueError(f"expected a mono or stereo waveform [C, S], got {tuple(x.shape)}")
        x = resample(x, int(sample_rate), self.sample_rate)
        if x.shape[0] == 1:
            x = x.expand(2, -1)
        mean = self.model.encode(x[:, None].contiguous(), return_dict=False)[0].mode()
        return (mean - self.latents_mean) / self.latents_std

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "AudioVAE":
        """Load `audio_vae/` in the diffusers layout or the original one (`model.safetensors` + `metadata.json`)."""
        folder = _component_dir(path, ("audio_vae",))
        config = _read_json(folder / "config.json")
        if (folder / "metadata.json").is_file():
            with no_init_weights():
                model = AutoencoderKLMiniMaxH3Audio(
                    **audio_vae_config_from_original(_read_json(folder / "metadata.json"), config))
            weights = folder / "model.safetensors"
            _load_strict(model, _safetensors_items(weights), str(weights))  # original names = diffusers names
        else:
            model = _from_diffusers_folder(AutoencoderKLMiniMaxH3Audio, folder, config)
        mean = config.get("latents_mean") or AUDIO_LATENTS_MEAN
        std = config.get("latents_std") or AUDIO_LATENTS_STD
        return cls(model, mean, std)


def build_tiny_audio_vae(seed: int = 0, config: dict = TINY_AUDIO_VAE) -> AudioVAE:
    model = _seeded(AutoencoderKLMiniMaxH3Audio, dict(config, latents_mean=list(AUDIO_LATENTS_MEAN),
                                                      latents_std=list(AUDIO_LATENTS_STD)), seed)
    return AudioVAE(model)


__all__ = [
    "VideoVAE", "AudioVAE", "build_tiny_video_vae", "build_tiny_audio_vae", "convert_original_video_vae",
    "original_video_vae_plan", "VIDEO_LATENTS_MEAN", "VIDEO_LATENTS_STD", "AUDIO_LATENTS_MEAN", "AUDIO_LATENTS_STD",
]


# --- Comfy-Org single files ------------------------------------------------------------------------------------
# `minimax_h3_video_vae_fp16.safetensors`: the original key names in F16 plus `latents_mean` / `latents_std`
# buffers; `minimax_h3_audio_vae_fp32.safetensors`: the original names with every weight norm folded into a plain
# `.weight`, plus the same two buffers. Both load into fp32 diffusers models.

COMFY_VAE_PREFIXES = ("first_stage_model.", "vae.")
LATENT_STATS = ("latents_mean", "latents_std")
LATENT_RGB = ("latent_rgb_factors", "latent_rgb_bias")  # optional in a video VAE file (VideoVAE.latent_rgb)
# audio_vae/metadata.json of the release (spec §7.4)
FULL_AUDIO_KWARGS = dict(encoder_dim=64, encoder_rates=[2, 4, 4, 5, 5], latent_dim=2048, vae_latent_channels=32,
                         decoder_dim=1024, decoder_rates=[5, 5, 2, 2, 2, 2, 2], decoder_type="bigvgan",
                         attn_proj=True, sample_rate=32000)


def _single_file_items(path: Path, stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, fp32 tensor) pairs of a Comfy VAE file without its common prefix; the latent statistics go to `stats`."""
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = list(f.keys())
        prefix = next((p for p in COMFY_VAE_PREFIXES if keys and all(k.startswith(p) for k in keys)), "")
        for key in keys:
            name = key[len(prefix):]
            if name in LATENT_STATS:
                stats[name] = f.get_tensor(key).float().flatten().tolist()
            elif name in LATENT_RGB:
                stats[name] = f.get_tensor(key).float()
            else:
                yield name, f.get_tensor(key).float()


def _latent_stats(stats: dict, path: Path) -> tuple[list, list]:
    for name in LATENT_STATS:
        if name not in stats:
            raise ValueError(f"missing key {name!r} in {path.name} (a Comfy VAE file carries its latent statistics)")
    return stats["latents_mean"], stats["latents_std"]


def load_video_vae_file(path: str | Path, config: dict | None = None) -> VideoVAE:
    """The Comfy video VAE single file (F16 weights upcast to fp32); `config` defaults to the one in the file's
    header, else the released one."""
    path = Path(path)
    config = config or video_vae_file_config(path)
    with no_init_weights():
        model = AutoencoderKLMiniMaxH3(**(config or video_vae_config_from_original({}, {})))
    stats: dict = {}
    _load_strict(model, convert_original_video_vae(_single_file_items(path, stats), model, path.name), path.name)
    vae = VideoVAE(model, *_latent_stats(stats, path))
    if all(name in stats for name in LATENT_RGB):
        factors, bias = (stats[name] for name in LATENT_RGB)
        if factors.shape != (model.config.latent_channels, 3) or bias.shape != (3,):
            raise ValueError(f"{path.name}: latent_rgb_factors / latent_rgb_bias must be "
                             f"[{model.config.latent_channels}, 3] / [3], got {list(factors.shape)} / "
                             f"{list(bias.shape)}")
        vae.latent_rgb = (factors, bias)
    return vae


def _header_config(path: str | Path, allowed: tuple[str, ...], what: str) -> dict | None:
    """The architecture a file's header records under 'config' (the embedded default's files carry one), else None."""
    with safe_open(Path(path), framework="pt", device="cpu") as f:
        text = (f.metadata() or {}).get("config")
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{Path(path).name}: the header's 'config' is not JSON ({error})") from None
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(f"{Path(path).name}: unknown {what} setting(s) {unknown} in the header's 'config'; "
                         f"allowed: {', '.join(allowed)}")
    return config


def audio_vae_file_config(path: str | Path) -> dict | None:
    """The architecture a Comfy audio VAE file's header records (`save_audio_vae_file` writes it), else None."""
    return _header_config(path, AUDIO_ARCHITECTURE, "audio VAE")


def video_vae_file_config(path: str | Path) -> dict | None:
    """The architecture a Comfy video VAE file's header records (`save_video_vae_file` writes it), else None."""
    return _header_config(path, VIDEO_ARCHITECTURE, "video VAE")


def load_audio_vae_file(path: str | Path, config: dict | None = None) -> AudioVAE:
    """The Comfy audio VAE single file: weight norms are removed from the model, which then takes the folded
    weights as they are; `config` defaults to the one in the file's header, else the released one."""
    path = Path(path)
    config = config or audio_vae_file_config(path)
    with no_init_weights():
        model = AutoencoderKLMiniMaxH3Audio(
            **(config or audio_vae_config_from_original({"metadata": {"kwargs": FULL_AUDIO_KWARGS}}, {})))
    for module in model.modules():
        if hasattr(module, "weight_g"):
            torch.nn.utils.remove_weight_norm(module)
    stats: dict = {}
    _load_strict(model, _single_file_items(path, stats), path.name)
    return AudioVAE(model, *_latent_stats(stats, path))


def save_video_vae_file(vae: VideoVAE, path: str | Path, prefix: str = "") -> Path:
    """A video VAE as the Comfy single file `load_video_vae_file` reads: original names in F16, the latent
    statistics as buffers (the trained embedded default is written this way)."""
    sd, out, config = vae.model.state_dict(), {}, vae.model.config
    heads = config.decoder_num_attention_heads
    for original, targets in original_video_vae_plan(vae.model).items():
        if ".attn.to_qkv." in original:
            tensor = interleave_qkv(torch.cat([sd[t] for t in targets]), heads)
        elif ".ff.w1." in original:
            tensor = swap_halves(sd[targets[0]])
        else:
            tensor = sd[targets[0]]
        out[prefix + original] = tensor.half()
    # unused at inference
    out[prefix + "decoder.mask_token"] = torch.zeros(1, 1, heads * config.decoder_attention_head_dim).half()
    out[prefix + "latents_mean"] = torch.tensor(vae.latents_mean_values)
    out[prefix + "latents_std"] = torch.tensor(vae.latents_std_values)
    out[prefix + "latent_rgb_factors"], out[prefix + "latent_rgb_bias"] = vae.latent_rgb
    architecture = {k: v for k, v in config.items() if k in VIDEO_ARCHITECTURE}
    save_file({k: v.detach().contiguous().cpu() for k, v in out.items()}, str(path),
              metadata={"config": json.dumps(architecture)})
    return Path(path)


def save_audio_vae_file(vae: AudioVAE, path: str | Path) -> Path:
    """An audio VAE as the Comfy single file `load_audio_vae_file` reads: weight norms folded, fp32, statistics."""
    out = {}
    for name, module in vae.model.named_modules():
        if hasattr(module, "weight_g"):
            out[f"{name}.weight"] = torch._weight_norm(module.weight_v, module.weight_g, 0)
    for key, value in vae.model.state_dict().items():
        if not key.endswith((".weight_g", ".weight_v")):
            out[key] = value
    out["latents_mean"] = torch.tensor(vae.latents_mean_values)
    out["latents_std"] = torch.tensor(vae.latents_std_values)
    config = {k: v for k, v in vae.model.config.items() if k in AUDIO_ARCHITECTURE}
    save_file({k: v.detach().float().contiguous().cpu() for k, v in out.items()}, str(path),
              metadata={"config": json.dumps(config)})
    return Path(path)
