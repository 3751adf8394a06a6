"""The memory planner: from one GPU's memory, the host's, the model's sizes and a request's packed sequence, the
DiT precision, the tensor-parallel x Ulysses degrees, how many of the DiT's streamed units stay on the GPU (the
rest wait in pinned host memory, engine/runtime/streaming.py), where the text encoder lives and how many tiles the
video VAE decodes and encodes in one call; said in words. A request that cannot fit is refused before work starts,
with what would fit.

Arithmetic on byte counts, so every case is a table row in tests/test_planner.py. The estimate per GPU is the
larger of two phases, plus a margin for the CUDA context and the allocator's fragmentation. The denoise: the DiT's
resident weights (its streamed units / TP, K of them when streaming, plus the rest), the text encoder (whole, or
two layers when streamed), the VAEs, the DiT's activations for the request (a block's peak rows of this rank's
sequence shard, its Ulysses exchange buffers, the fp32 final layer over the gathered sequence). The VAE phase
(decode, and the encode of a source): the same weights, less the streamed units (the streamer evicts them after the
denoise; a DiT held whole stays), and the VAE's working memory at its batch size, the largest that fits.

    plan = plan_memory(Hardware(24 * GiB, 128 * GiB), sizes, rows)
    plan.describe()  # "int8 DiT, 13 of 102 units on the GPU, streaming 33.4 GB/step from host memory; ..."
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate

from engine.models.h3 import layout as L

GiB = 2**30
MARGIN_BYTES = 1 * GiB  # CUDA context, cuBLAS / attention workspaces
MARGIN_SHARE = 0.02  # of the device: the caching allocator's fragmentation
HOST_RESERVE = 8 * GiB  # left to the OS, the server and the results store
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1}
QUANTIZED = ("fp8", "int8")  # what `auto` tries after the stored float weights; they change the output slightly
STREAMED_TEXT_LAYERS = 2  # text-encoder layers on the GPU at once when it is streamed
MIN_RESIDENT = 2  # a streamed DiT keeps at least the running unit and the one being copied in
# Copies of one decoded window's fp32 frames alive at the decode's peak (its tiles, their blends, the stitched
# window, the one before it kept for the cross-fade), and activations of the encoder's full-resolution width per
# voxel at its peak (a resnet's input, its padded normed input, a convolution's output, cuDNN's workspace). Measured
# on an H200 (random full-size weights, 5 s at 1344x768 and 768x448): the decode to uint8 host frames peaks 1.9 and
# 0.64 GiB above its start at one tile a call, 6.2 and 4.9 GiB at 64 k tokens (planned: 2.1, 0.77, 6.4, 5.2);
# the encode 10.9 and 9.4 GiB at 8 tiles (planned: 11.0, 10.0).
WINDOW_COPIES = 6
ENCODER_ACTIVATIONS = 4.5


class DoesNotFit(MemoryError):
    """No plan fits; the message says what was asked, what this engine has and what would fit."""


@dataclass(frozen=True)
class Hardware:
    device_bytes: int  # one GPU's memory (or --gpu-memory)
    host_bytes: int  # host memory available to the engine
    gpus: int = 1
    quantized_compute: tuple[str, ...] = ("fp8", "int8")  # precisions this GPU runs as GEMMs (else dequantized)


@dataclass(frozen=True)
class VideoVAESizes:
    """The video VAE's widths that set its working memory (the release's by default, specs/h3.md §3.1): the decoder,
    a ViT over tokens of 4 frames x 16 x 16 pixels, and the encoder, convolutions widest at full resolution; the
    largest tile of each, and the fast path's largest batches (video_vae_fast.DECODE_TOKENS, ENCODE_VOXELS)."""

    width: int = 2048  # the decoder's residual width
    ffn: int = 8192  # its SwiGLU's inner width
    token_values: int = 3 * 4 * 16 * 16  # pixel values one token decodes to
    tile_tokens: int = 7 * 16 * 16 + 5  # a 256-px tile of a 7-latent window, with the registers and the zero token
    window_frames: int = 28  # frames a 7-latent window decodes to
    channels: int = 128  # the encoder's full-resolution width
    tile_voxels: int = 17 * 256 * 256  # a 256-px tile of a 17-frame clip
    max_tokens: int = 1 << 16
    max_voxels: int = 8 * 17 * 256 * 256


@dataclass(frozen=True)
class ModelSizes:
    """Byte counts of the loaded (or about to be loaded) models, and the DiT's widths."""

    # Per streamed unit (engine.runtime.streaming.dit_units): the parameters of its GEMM weights that a precision
    # quantizes (a block's four GEMMs while they are float), and the bytes of the rest as stored (refiner blocks stay
    # in their float dtype, so an int8 unit is not half a bf16 one); `unit_adaln_params`: float AdaLN projection
    # weights, which int8 quantizes and fp8 does not (engine/models/h3/precision.py).
    unit_gemm_params: tuple[int, ...]
    unit_other_bytes: tuple[int, ...]
    dit_other_bytes: int  # the rest of the DiT (patch projections, time embedder, final layer, norms)
    text_encoder_bytes: int
    text_encoder_layers: int
    vae_bytes: int
    hidden: int
    inner: int  # attention heads x head width
    ffn: int
    heads: int
    stored: str = "bf16"  # bf16 / fp32 weights, or the quantized file's fp8 / int8 (run as stored)
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)  # legal TP sizes (engine.parallel.tensor.tp_degrees)
    video_vae: VideoVAESizes = VideoVAESizes()
    unit_adaln_params: tuple[int, ...] = ()  # () when there are none

    @property
    def float_bytes(self) -> int:
        """Per parameter of the DiT's float weights: as stored, bf16 beside a quantized file's layers."""
        return PRECISION_BYTES[self.stored] if self.stored in ("bf16", "fp32") else PRECISION_BYTES["bf16"]

    @property
    def text_layer_bytes(self) -> int:
        return -(-self.text_encoder_bytes // max(1, self.text_encoder_layers))

    @property
    def units(self) -> int:
        return len(self.unit_gemm_params)

    def resident_bytes(self, precision: str, tp: int = 1) -> list[int]:
        """[k] = the bytes on one rank of the k largest streamed units at `precision`: what k resident units hold
        (the streamer keeps the k - 2 largest; the others take turns in two places, at most the next two)."""
        adaln = PRECISION_BYTES["int8"] if precision == "int8" else self.float_bytes
        sizes = sorted((-(-(g * PRECISION_BYTES[precision] + a * adaln + o) // tp)
                        for g, a, o in zip(self.unit_gemm_params, self.unit_adaln_params or (0,) * self.units,
                                           self.unit_other_bytes)), reverse=True)
        return list(accumulate(sizes, initial=0))


@dataclass(frozen=True)
class Request:
    """What a job builds: its packed sequence and its decoded video."""

    rows: int  # packed sequence rows (text, conditions, audio, video)
    frames: int
    height: int
    width: int

    def words(self) -> str:
        return f"{self.frames / L.FPS:.1f} s ({self.frames} frames) at {self.width}x{self.height}"


TEXT_ROWS = 512  # planned for a prompt; the conditioner takes up to 2048 tokens, prompts are rarely past 300


def request(frames: int, height: int, width: int, condition_frames: int = 0, text_rows: int = TEXT_ROWS) -> Request:
    """A generation's shape: its packed rows from the layout rules (video, stereo audio, text, `condition_frames`
    keyframe or reference pictures at the canvas size)."""
    grid = (height // L.CANVAS_MULTIPLE) * (width // L.CANVAS_MULTIPLE)
    rows = (L.latent_frames(frames) + condition_frames) * grid + L.AUDIO_CHANNELS * L.audio_latents(frames)
    return Request(rows + text_rows, frames, height, width)


@dataclass(frozen=True)
class Plan:
    precision: str
    tp: int
    ulysses: int
    resident_units: int
    units: int
    text_encoder_streamed: bool
    device_bytes: int  # estimated peak per GPU
    budget_bytes: int  # what the GPU has
    host_bytes: int  # pinned host memory for the streamed weights
    stream_bytes_per_step: int
    dequantized: bool = False  # quantized weights on a GPU without those GEMMs
    decode_tokens: int = 0  # the video VAE's decoder tokens per call
    encode_voxels: int = 0  # its encoder's pixels x frames per call

    @property
    def streaming(self) -> bool:
        return self.resident_units < self.units

    def describe(self) -> str:
        dit = f"{self.precision} DiT" + (" (dequantized per layer)" if self.dequantized else "")
        if self.streaming:
            dit += (f", {self.resident_units} of {self.units} units on the GPU, streaming "
                    f"{size(self.stream_bytes_per_step)}/step from host memory")
        else:
            dit += ", all on the GPU"
        parts = [dit, "text encoder streamed" if self.text_encoder_streamed else "text encoder on the GPU"]
        if self.tp * self.ulysses > 1:
            parts.append(f"TP {self.tp} x Ulysses {self.ulysses}")
        parts.append(f"VAE decode {self.decode_tokens / 1024:.0f} k tokens, encode {self.encode_voxels / 1e6:.1f} M "
                     f"voxels a batch")
        parts.append(f"~{size(self.device_bytes)} of {size(self.budget_bytes)} per GPU"
                     + (f", {size(self.host_bytes)} pinned host memory" if self.host_bytes else ""))
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {"plan": self.describe(), "precision": self.precision, "tp": self.tp, "ulysses": self.ulysses,
                "resident_units": self.resident_units, "units": self.units,
                "text_encoder_streamed": self.text_encoder_streamed, "device_gib": round(self.device_bytes / GiB, 2),
                "budget_gib": round(self.budget_bytes / GiB, 2), "host_gib": round(self.host_bytes / GiB, 2),
                "stream_gb_per_step": round(self.stream_bytes_per_step / 1e9, 2), "decode_tokens": self.decode_tokens,
                "encode_voxels": self.encode_voxels}


def activation_bytes(m: ModelSizes, req: Request, tp: int, ulysses: int) -> int:
    """The DiT's working memory on one rank: a block's peak over this rank's rows (bf16), the Ulysses exchange
    of q, k, v (sent and received), the fp32 final layer over the gathered sequence."""
    rows = -(-req.rows // ulysses)
    attention = 2 * m.hidden + 7 * m.inner // tp  # x, h, qkv, q k v after the norms, the attention output
    mlp = 2 * m.hidden + 3 * m.ffn // tp  # x, h, fc1's gate and value, their product
    exchange = 2 * 3 * rows * (m.inner // tp) * 2 if ulysses > 1 else 0
    return rows * max(attention, mlp) * 2 + exchange + req.rows * m.hidden * (2 + 4)


def decode_bytes(v: VideoVAESizes, req: Request, tokens: int) -> int:
    """The video decode's working memory at `tokens` decoder tokens a call: per token a block's peak (the fp32
    residual, its normed bf16 copy, the SwiGLU's gate and value and their product in bf16) and the last call's fp32
    pixels (its tiles wait to be stitched while the next call runs); copies of one window's fp32 frames (the decode
    goes window by window to uint8 host frames, so the clip's length does not count)."""
    return tokens * _decode_token_bytes(v) + WINDOW_COPIES * 4 * 3 * v.window_frames * req.height * req.width


def _decode_token_bytes(v: VideoVAESizes) -> int:
    return (4 + 2) * v.width + (4 + 2) * v.ffn + 4 * v.token_values


def encode_bytes(v: VideoVAESizes, req: Request, voxels: int) -> int:
    """The video encode's working memory at `voxels` pixels x frames a call: its full-resolution activations in
    bf16, and the source (of the request's shape) in fp32."""
    return voxels * _encode_voxel_bytes(v) + 4 * 3 * req.frames * req.height * req.width


def _encode_voxel_bytes(v: VideoVAESizes) -> int:
    return int(ENCODER_ACTIVATIONS * 2 * v.channels)


def vae_batches(v: VideoVAESizes, req: Request, room: int) -> tuple[int, int] | None:
    """The most decoder tokens and encoder voxels a call, at most the fast path's, whose working memory fits in
    `room`; None when one decoder tile does not fit. The encoder gets at least one tile: a generation encodes no
    video, so its fit does not hang on an encode (an edit's source is encoded at this batch)."""
    tokens = min(v.max_tokens, (room - decode_bytes(v, req, 0)) // _decode_token_bytes(v))
    if tokens < v.tile_tokens:
        return None
    voxels = min(v.max_voxels, max(v.tile_voxels, (room - encode_bytes(v, req, 0)) // _encode_voxel_bytes(v)))
    return tokens, voxels


def _margin(device_bytes: int) -> int:
    return min(MARGIN_BYTES, device_bytes // 10) + int(MARGIN_SHARE * device_bytes)


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def fit(m: ModelSizes, hw: Hardware, req: Request, precision: str, tp: int, resident: int | None = None,
        text_streamed: bool | None = None) -> Plan | None:
    """The plan at this precision and TP degree with the most units on the GPU (at most `resident` when given):
    the text encoder stays on the GPU when the whole DiT fits beside it, else it is streamed (it runs once a job,
    the DiT every step; `text_streamed` pins that). None when even the fewest units do not fit."""
    ulysses = ulysses_degree(m, hw.gpus, tp)
    budget = hw.device_bytes - _margin(hw.device_bytes)
    held_units = m.resident_bytes(precision, tp)
    activations = activation_bytes(m, req, tp, ulysses)
    one_tile = decode_bytes(m.video_vae, req, m.video_vae.tile_tokens)
    cap = m.units if resident is None else min(resident, m.units)
    for streamed in (False, True) if text_streamed is None else (text_streamed,):
        held = m.dit_other_bytes + m.vae_bytes + (0 if streamed else m.text_encoder_bytes)
        # A streamed text encoder holds its layers only while it encodes, before the DiT's activations exist.
        denoise = held + max(activations, STREAMED_TEXT_LAYERS * m.text_layer_bytes if streamed else 0)
        room = budget - denoise
        most = min(cap, bisect_right(held_units, room) - 1)
        if most == m.units and held + held_units[most] + one_tile > budget:
            most -= 1  # a DiT held whole stays on the GPU while the VAE decodes: streamed, it leaves
        if most < min(MIN_RESIDENT, m.units) or (text_streamed is None and not streamed and most < cap):
            continue
        streaming = most < m.units
        vae_held = held + (0 if streaming else held_units[most])
        batches = vae_batches(m.video_vae, req, budget - vae_held)
        if batches is None:
            continue
        tokens, voxels = batches
        host = (held_units[-1] if streaming else 0) + (m.text_encoder_bytes if streamed else 0)
        peak = max(denoise + held_units[most], vae_held + decode_bytes(m.video_vae, req, tokens))
        return Plan(precision, tp, ulysses, int(most), m.units, streamed, peak, hw.device_bytes, host,
                    held_units[-1] - held_units[max(0, most - 2)] if streaming else 0,  # all but the kept units
                    dequantized=precision in QUANTIZED and precision not in hw.quantized_compute,
                    decode_tokens=tokens, encode_voxels=voxels)
    return None


def minimum_bytes(m: ModelSizes, req: Request, precision: str, tp: int, gpus: int) -> int:
    """The least a GPU needs for this request: the fewest units resident, the text encoder streamed, the VAE
    decoding one tile a call."""
    denoise = max(activation_bytes(m, req, tp, ulysses_degree(m, gpus, tp)), STREAMED_TEXT_LAYERS * m.text_layer_bytes)
    denoise += m.resident_bytes(precision, tp)[min(MIN_RESIDENT, m.units)]
    vae = decode_bytes(m.video_vae, req, m.video_vae.tile_tokens)
    return m.dit_other_bytes + m.vae_bytes + max(denoise, vae)


def ulysses_degree(m: ModelSizes, gpus: int, tp: int) -> int:
    """The Ulysses degree of `gpus` GPUs at TP `tp`: the rest, when it divides the heads left per rank; else 1, every
    GPU running the whole sequence (engine.parallel.mesh.meshes)."""
    return gpus // tp if (m.heads // tp) % (gpus // tp) == 0 else 1


def legal_tp(m: ModelSizes, gpus: int) -> list[int]:
    """TP degrees for `gpus` GPUs: legal for the model, dividing the GPUs, the rest Ulysses over whole heads (TP 1
    always runs, replicated when the heads do not split)."""
    return [t for t in m.tp_degrees if gpus % t == 0 and (t == 1 or (m.heads // t) % (gpus // t) == 0)]


def precisions(m: ModelSizes, precision: str) -> tuple[str, ...]:
    """What `precision` may become, least lossy first: a quantized file runs as stored; `bf16` keeps the stored
    float weights."""
    if m.stored in QUANTIZED:
        return (m.stored,)
    if precision in QUANTIZED:
        return (precision,)
    return (m.stored,) if precision != "auto" else (m.stored, *QUANTIZED)


def plan_memory(m: ModelSizes, hw: Hardware, req: Request, precision: str = "auto", tp: int | None = None,
                resident: int | None = None, rows_for_frames=None) -> Plan:
    """The plan for this request. Pinned choices (`precision` other than auto, `tp`, `resident`) are kept; the
    others are chosen: the first of bf16, fp8, int8 whose DiT fits whole on the GPU (at the smallest TP that
    allows it), else the most compact one streamed, at the TP that keeps the most units on the GPU. Raises
    DoesNotFit with what would fit (the longest clip at this canvas when `rows_for_frames(frames)` is given)."""
    tps = [tp] if tp is not None else legal_tp(m, hw.gpus)
    candidates = precisions(m, precision)
    for p in candidates:
        for t in tps:
            plan = fit(m, hw, req, p, t, resident)
            if plan is not None and (not plan.streaming or resident is not None):
                return _check_host(plan, hw, req)
    streamed = [plan for t in tps if (plan := fit(m, hw, req, candidates[-1], t, resident)) is not None]
    if streamed:
        return _check_host(max(streamed, key=lambda plan: plan.resident_units * plan.tp), hw, req)
    raise DoesNotFit(refusal(m, hw, req, precision, tp, resident, rows_for_frames))


def _check_host(plan: Plan, hw: Hardware, req: Request) -> Plan:
    if plan.host_bytes > hw.host_bytes - HOST_RESERVE:
        smaller = ["--dit-precision int8"] if plan.precision not in QUANTIZED else []
        smaller += ["--text-encoder-precision int8"] if plan.text_encoder_streamed else []
        raise DoesNotFit(f"{req.words()} with the {plan.precision} DiT streamed needs {size(plan.host_bytes)} "
                         f"of pinned host memory and this machine has {size(hw.host_bytes)} available "
                         f"({HOST_RESERVE / GiB:.0f} GiB kept for the rest). Use "
                         + " or ".join([*smaller, "more GPUs"]) + ".")
    return plan


def longest_that_fits(m: ModelSizes, hw: Hardware, req: Request, rows_for_frames, precision: str, tp: int | None,
                      resident: int | None) -> Request | None:
    """The longest clip at this canvas (frames 17n + 5, 5 to 15 s) that fits with these pinned choices."""
    best = None
    for frames in range(L.frames_for_seconds(L.MIN_SECONDS)[0], L.frames_for_seconds(L.MAX_SECONDS)[0] + 1,
                        L.CLIP_LENGTH):
        shorter = replace(req, frames=frames, rows=rows_for_frames(frames))
        try:
            plan_memory(m, hw, shorter, precision, tp, resident)
        except DoesNotFit:
            break
        best = shorter
    return best


def refusal(m: ModelSizes, hw: Hardware, req: Request, precision: str, tp: int | None, resident: int | None,
            rows_for_frames=None) -> str:
    """What was asked, what this engine has, and what would fit: a shorter clip, a more compact precision,
    streaming, more GPUs."""
    compact = precisions(m, precision)[-1]
    need = min(minimum_bytes(m, req, compact, t, hw.gpus) for t in ([tp] if tp else legal_tp(m, hw.gpus)))
    gpus = f" x {hw.gpus}" if hw.gpus > 1 else ""
    text = (f"{req.words()} does not fit this engine's GPU{'s' if gpus else ''} ({size(hw.device_bytes)}{gpus}): "
            f"it needs at least {size(need + _margin(hw.device_bytes))} per GPU.")
    if rows_for_frames is not None:
        shorter = longest_that_fits(m, hw, req, rows_for_frames, precision, tp, resident)
        if shorter is not None:
            text += f" {shorter.words()} fits."
    options = []
    if precision not in ("auto", "int8") and m.stored not in QUANTIZED and fit(m, hw, req, "int8", tp or 1):
        options.append("--dit-precision int8")
    if resident is not None and fit(m, hw, req, compact, tp or 1) is not None:
        options.append("fewer --resident-blocks")
    for more in (2, 4, 8):
        if more > hw.gpus and any(fit(m, replace(hw, gpus=more), req, p, t) is not None
                                  for p in precisions(m, precision) for t in legal_tp(m, more)):
            options.append(f"{more} GPUs")
            break
    if options:
        text += f" {req.words()} needs " + " or ".join(options) + "."
    else:
        text += " Ask for fewer seconds or a smaller canvas."
    return text


def plan_job(m: ModelSizes, hw: Hardware, req: Request, loaded: Plan, rows_for_frames=None) -> Plan:
    """The loaded plan for one job: its precision, TP and text-encoder place kept, at most its units on the GPU
    (a streaming engine keeps fewer for a longer clip; one holding the whole DiT cannot start streaming). Raises
    DoesNotFit with what would fit."""
    plan = fit(m, hw, req, loaded.precision, loaded.tp, loaded.resident_units, loaded.text_encoder_streamed)
    if plan is None or plan.streaming and not loaded.streaming:
        raise DoesNotFit(refusal(m, hw, req, loaded.precision, loaded.tp,
                                 loaded.resident_units if loaded.streaming else None, rows_for_frames))
    return plan
