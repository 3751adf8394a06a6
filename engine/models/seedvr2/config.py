"""SeedVR2 configurations (specs/seedvr2.md §1.2, §3.1) and the named presets.

`3b` and `7b` are the released models; `tiny-3b` / `tiny-7b` / `tiny` are the same architectures at tiny width
(weights drawn from a seed) for tests and the offline demo. The tiny DiTs use a smaller window reference area so
that tiny clips still get many windows.
"""

from __future__ import annotations

from dataclasses import dataclass

LATENT_SCALE = 0.9152  # z_model = z_vae * 0.9152 (spec §3.3)
TIMESTEP = 1000.0  # the single sampling step's timestep (spec §4.1)


@dataclass(frozen=True)
class NaDiTConfig:
    dim: int = 2560  # vid_dim = txt_dim
    heads: int = 20
    head_dim: int = 128
    num_layers: int = 32
    # Blocks [0, mm_layers) keep separate vid/txt weights; later blocks share one set (`.all`). 7B: num_layers.
    mm_layers: int = 10
    mlp: str = "swiglu"  # "swiglu" (3B: 3 linears, no bias) or "gelu" (7B: tanh GELU, with bias)
    mlp_dim: int = 6912
    rope: str = "mmrope3d"  # "mmrope3d" (3B: lang freqs, video + text) or "pixel3d" (7B: video only)
    # 3B quirks: the last block's ada/MLP are video-only, and the output head has an affine RMSNorm + modulation.
    last_block_vid_only: bool = True
    output_norm: bool = True
    in_channels: int = 33  # noisy latent 16 + condition latent 16 + mask 1
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    norm_eps: float = 1e-5
    num_windows: tuple[int, int, int] = (4, 3, 3)  # (nt, nh, nw) windows at the reference area
    window_area: tuple[int, int] = (45, 80)  # the 720p token grid the window count refers to
    window_max_t: int = 30

    @property
    def emb_dim(self) -> int:
        return 6 * self.dim

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def patch_dim(self) -> int:
        t, h, w = self.patch_size
        return self.in_channels * t * h * w

    @property
    def rope_freqs(self) -> int:
        """Frequencies per axis: 3B `RotaryEmbedding(head_dim // 3)`, 7B `RotaryEmbedding(head_dim // 2 // 3)`."""
        axis_dim = self.head_dim // 3 if self.rope == "mmrope3d" else self.head_dim // 2 // 3
        return axis_dim // 2

    def shared(self, block: int) -> bool:
        return block >= self.mm_layers


def swiglu_dim(dim: int, expand_ratio: int = 4, multiple_of: int = 256) -> int:
    hidden = int(2 * dim * expand_ratio / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


NADIT_3B = NaDiTConfig()
NADIT_7B = NaDiTConfig(
    dim=3072, heads=24, num_layers=36, mm_layers=36, mlp="gelu", mlp_dim=4 * 3072, rope="pixel3d",
    last_block_vid_only=False, output_norm=False,
)
TINY_3B = NaDiTConfig(
    dim=64, heads=2, head_dim=32, num_layers=4, mm_layers=2, mlp_dim=swiglu_dim(64, multiple_of=16),
    text_dim=48, freq_dim=32, window_area=(8, 12),
)
TINY_7B = NaDiTConfig(
    dim=48, heads=2, head_dim=32, num_layers=4, mm_layers=4, mlp="gelu", mlp_dim=4 * 48, rope="pixel3d",
    last_block_vid_only=False, output_norm=False, text_dim=40, freq_dim=32, window_area=(8, 12),
)


@dataclass(frozen=True)
class VAEConfig:
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 16
    norm_groups: int = 32
    temporal_blocks: int = 2  # down blocks [n-1-k, n-1) and up blocks [0, k) also scale time by 2
    in_channels: int = 3
    norm_eps: float = 1e-6

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** self.temporal_blocks


VAE = VAEConfig()
TINY_VAE = VAEConfig(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_groups=4)

# What the named resolutions mean on the tiny presets (the short edge in pixels, from the tiny H3 canvas's 128 up)
# and the largest output area they make (448x256, twice that canvas's sides): the tiny VAE's full-resolution
# convolutions dominate an upscale on a CPU, so the sizes stay near the canvas. Real weights keep the real sizes.
TINY_RESOLUTIONS = {"720p": 128, "1080p": 144, "1440p": 176, "2k": 176, "2160p": 224, "4k": 224}
TINY_MAX_PIXELS = 448 * 256

# The embedded default's files ("toy", engine/weights/toy/seedvr2) record their architecture in the safetensors header
# (`checkpoint.CONFIG_METADATA`); files without one are the tiny presets' (TINY_3B, TINY_VAE). The toy DiT must be wider
# than 64: at t = 1000 its residual stream carries the noise it is given (2x2 patches of 16 channels: 64 numbers a
# token) besides the restored latent, and v = noise - x0 needs both. The toy VAE's 16-wide one lost the objects'
# colours (~21 dB reconstruction of the toy clips, against bicubic's 29 dB from the degraded half-size copy).
TOY_3B = NaDiTConfig(
    dim=192, heads=6, head_dim=32, num_layers=4, mm_layers=2, mlp_dim=swiglu_dim(192, multiple_of=16),
    text_dim=48, freq_dim=32, window_area=(8, 12),
)
TOY_VAE = VAEConfig(block_out_channels=(32, 32, 64, 64), layers_per_block=1, norm_groups=8)

DIT_PRESETS = {"3b": NADIT_3B, "7b": NADIT_7B, "tiny-3b": TINY_3B, "tiny-7b": TINY_7B}
TINY_TEXT_LEN = 7
