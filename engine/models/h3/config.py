"""MiniMax-H3 DiT configuration and the named presets (`full`, `tiny`, test configs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# Modality tags of packed rows; also the AdaLN table's modality axis.
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
NUM_MODALITIES = 3


@dataclass(frozen=True)
class H3Config:
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    # Pruned "curve" AdaLN (specs/h3.md §7.3): > 0 is the grid size G of `adaln_t_table [G, time_embed_dim]`,
    # which replaces the time embedder; 0 is the full model.
    adaln_curve_grid: int = 0

    @property
    def video_patch_dim(self) -> int:
        p = self.patch_size
        return self.in_channels * p[0] * p[1] * p[2]

    @property
    def curve(self) -> bool:
        return self.adaln_curve_grid > 0

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def to_dict(self) -> dict:
        """The diffusers config fields (also MiniMaxH3Transformer3DModel's kwargs); a pruned config adds its grid."""
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        if not self.curve:
            del d["adaln_curve_grid"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "H3Config":
        """Accepts our/diffusers field names and the original (sglang-native) ones of `transformer/config.json`."""
        renames = {
            "latents_dim": "in_channels",
            "audio_latents_dim": "audio_in_channels",
            "token_refiner_num_layers": "num_refiner_layers",
            "ffn_hidden_size": "ffn_dim",
            "timestep_input_dim": "freq_dim",
            "time_embed_hidden_size": "time_embed_hidden_dim",
            "rope_inv_freq_len": "rope_freq_dim",
        }
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in d.items():
            key = renames.get(key, key)
            if key in known:
                kwargs[key] = tuple(value) if key == "patch_size" else value
        return cls(**kwargs)


FULL = H3Config()

# Embedded default: same architecture at tiny width; heads*head_dim != hidden and partial RoPE exercised.
TINY = H3Config(
    num_attention_heads=2, attention_head_dim=32, hidden_size=48, num_layers=2, num_refiner_layers=2, ffn_dim=96,
    text_dim=32, freq_dim=16, time_embed_hidden_dim=48, time_embed_dim=32, rope_freq_dim=4,
)

# The diffusers unit-test config (specs/h3.md §8): inner width 32 != hidden 24, 12 of 16 channels rotated.
TEST_DIFFUSERS = H3Config(
    num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2, ffn_dim=32,
    in_channels=4, audio_in_channels=6, text_dim=8, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=16,
    rope_freq_dim=2,
)

# The diffusers conversion fixture (`--version test`): inner width == hidden, real latent widths.
TEST_CONVERSION = H3Config(
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=2, ffn_dim=128,
    text_dim=48, freq_dim=16, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4,
)

PRESETS = {"full": FULL, "tiny": TINY}
