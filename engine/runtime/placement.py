"""The memory plan (engine/runtime/planner.py) applied to the engine: the sizes of a pipeline loaded in host
memory, this machine's GPU and host memory, the plan carried out (precision, streamed units, the move to the
GPU), the check of each job before it starts, and the words for a job that ran out of memory anyway."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.kernels import capability
from engine.models.h3 import layout as L
from engine.models.h3.partitions import host_available_bytes, module_bytes
from engine.parallel import tensor
from engine.runtime.planner import (QUANTIZED, STREAMED_TEXT_LAYERS, GiB, Hardware, ModelSizes, Plan, Request,
                                    VideoVAESizes, plan_job, plan_memory, request)
from engine.runtime.streaming import dit_units, unit_tensors


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def stored_precision(dit) -> str:
    """fp8 / int8 for a DiT whose block GEMMs are stored quantized, else its float dtype (bf16 / fp32)."""
    from engine.models.h3.precision import stored_as

    return stored_as(dit.blocks[0].attn.qkv_proj) or ("fp32" if dit.dtype == torch.float32 else "bf16")


def pipeline_sizes(pipe) -> ModelSizes:
    """The byte counts the planner needs, read off the loaded models."""
    from engine.models.h3.precision import block_gemms, int8_adaln

    dit, c = pipe.dit, pipe.dit.config
    units = dit_units(dit)
    float_gemms = {id(layer.weight) for layer in map(dit.get_submodule, block_gemms(dit)) if type(layer) is nn.Linear}
    float_adaln = {id(dit.get_submodule(name).weight) for name in int8_adaln(dit)}
    gemm_params, adaln_params, other_bytes = [], [], []
    for module, exclude in units:
        tensors = [getattr(owner, name) for owner, name, _ in unit_tensors(module, exclude)]
        gemm_params.append(sum(t.numel() for t in tensors if id(t) in float_gemms))
        adaln_params.append(sum(t.numel() for t in tensors if id(t) in float_adaln))
        other_bytes.append(_bytes(t for t in tensors if id(t) not in float_gemms | float_adaln))
    other = [getattr(owner, name) for owner, name, _ in unit_tensors(dit, tuple(m for m, _ in units))]
    text = pipe.conditioner.model
    return ModelSizes(unit_gemm_params=tuple(gemm_params), unit_other_bytes=tuple(other_bytes),
                      dit_other_bytes=_bytes(other),
                      text_encoder_bytes=module_bytes(text),
                      text_encoder_layers=len(text.model.language_model.layers),
                      vae_bytes=pipe.video_vae.served_bytes() + module_bytes(pipe.audio_vae.model),
                      hidden=c.hidden_size, inner=c.inner_dim, ffn=c.ffn_dim, heads=c.num_attention_heads,
                      stored=stored_precision(dit), tp_degrees=tuple(tensor.tp_degrees(c)),
                      video_vae=video_vae_sizes(pipe.video_vae), unit_adaln_params=tuple(adaln_params))


def video_vae_sizes(vae) -> VideoVAESizes:
    """The widths of a video VAE (engine.models.h3.vae.VideoVAE) that set its working memory, and its tiles."""
    from engine.models.h3.video_vae_fast import DECODE_TOKENS, ENCODE_VOXELS

    model, c = vae.model, vae.model.config
    width = c.decoder_num_attention_heads * c.decoder_attention_head_dim
    s, t = model.spatial_compression_ratio, model.temporal_compression_ratio
    window = model.tokens_chunk_size + model.token_overlap  # latents a decoder clip reads
    tile = model.tile_sample_min_height * model.tile_sample_min_width  # pixels
    return VideoVAESizes(width=width, ffn=width * c.decoder_ffn_mult, token_values=c.out_channels * t * s * s,
                         tile_tokens=window * tile // s**2 + c.decoder_num_register_tokens + 1,
                         window_frames=window * t, channels=c.block_out_channels[0], tile_voxels=c.clip_length * tile,
                         max_tokens=DECODE_TOKENS, max_voxels=ENCODE_VOXELS)


RELEASE_TEXT_ENCODER = (62 * GiB, 50)  # the released Qwen3-VL text encoder in bf16: bytes, decoder layers
RELEASE_VAES = int(6.5 * GiB)  # the released video (fp16) and audio (fp32) VAEs


def config_sizes(config, text_encoder=RELEASE_TEXT_ENCODER, vae_bytes: int = RELEASE_VAES) -> ModelSizes:
    """The sizes of a DiT of this config (bf16) without building it, beside the released text encoder and VAEs:
    the released model's for benchmarks and the planner's tests."""
    from engine.models.h3.precision import adaln_group

    c = config
    block = c.hidden_size * 3 * c.inner_dim + c.inner_dim * c.hidden_size + 3 * c.hidden_size * c.ffn_dim
    adaln = c.time_embed_dim * 6 * 3 * c.hidden_size
    other = (c.video_patch_dim + c.audio_in_channels + c.text_dim + c.freq_dim) * c.hidden_size + (
        c.time_embed_hidden_dim * (c.freq_dim + c.time_embed_dim) + c.time_embed_dim * 2 * c.hidden_size
        + c.hidden_size * (c.video_patch_dim + c.audio_in_channels))
    # dit_units' order: the refiner blocks (bf16 at any precision), the AdaLN projections (int8 takes full-width
    # ones; curve ones, 8 inputs, stay fp32), then the blocks, whose four GEMMs a precision stores.
    gemms = (0,) * (c.num_refiner_layers + c.num_layers) + (block,) * c.num_layers
    quantizable = adaln_group(c.time_embed_dim) is not None
    adalns = (0,) * c.num_refiner_layers + (adaln if quantizable else 0,) * c.num_layers + (0,) * c.num_layers
    others = ((2 * block,) * c.num_refiner_layers + (0 if quantizable else 2 * adaln,) * c.num_layers
              + (0,) * c.num_layers)
    return ModelSizes(unit_gemm_params=gemms, unit_other_bytes=others, dit_other_bytes=4 * other,
                      text_encoder_bytes=text_encoder[0], text_encoder_layers=text_encoder[1], vae_bytes=vae_bytes,
                      hidden=c.hidden_size, inner=c.inner_dim, ffn=c.ffn_dim, heads=c.num_attention_heads,
                      tp_degrees=tuple(tensor.tp_degrees(c)), unit_adaln_params=adalns)


def hardware(device: torch.device, gpus: int, gpu_memory_gb: float | None, host_memory_gb: float | None,
             held_bytes: int = 0, group=None, host_ranks: int = 1) -> Hardware:
    """One rank's memory: `--gpu-memory` or the GPU's own; its share of the host's (`--host-memory` or what the
    host has available, split between the `host_ranks` ranks on this host) plus, when measured, `held_bytes`: this
    rank's weights already loaded in host memory (streaming pins them in place of their pageable copy, so they
    count as room for the plan's pinned weights, not against it). With the ranks' `group` (gloo), the least of
    every rank's, so that all make the same plan (their TP degree must agree)."""
    if gpu_memory_gb is not None:
        device_bytes = int(gpu_memory_gb * GiB)
    else:
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    cap = capability.capability(device)
    compute = tuple(p for p, ok in (("fp8", capability.fp8_gemm(device.type, cap)),
                                    ("int8", capability.int8_gemm(device.type, cap))) if ok)
    host = int(host_memory_gb * GiB) if host_memory_gb is not None else host_available_bytes()
    if host is None:  # no /proc/meminfo: the whole RAM
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // host_ranks
    else:
        host = host // host_ranks + (held_bytes if host_memory_gb is None else 0)
    if group is not None:
        least = torch.tensor([device_bytes, host, *(p in compute for p in QUANTIZED)], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
        device_bytes, host = int(least[0]), int(least[1])
        compute = tuple(p for p, ok in zip(QUANTIZED, least[2:].tolist()) if ok)
    return Hardware(device_bytes, host, gpus, compute)


def reference_request(canvas) -> Request:
    """What an engine is planned for at start: 5 s at its largest 16:9 canvas."""
    height, width = L.canvas_for_aspect(16, 9, canvas.short_edge, canvas.max_pixels)
    return request(L.frames_for_seconds(5.0)[0], height, width)


@dataclass(frozen=True)
class EnginePlan:
    """The plan an engine loaded with, and what it was made from (each job is planned against them)."""

    plan: Plan
    hardware: Hardware
    sizes: ModelSizes

    def describe(self) -> str:
        return self.plan.describe()

    def as_dict(self) -> dict:
        return self.plan.as_dict()


def held_on_host(pipe) -> int:
    """Bytes of the DiT and the text encoder (what a plan may pin) that are in host memory now."""
    return _bytes(t for model in (pipe.dit, pipe.conditioner.model) for t in (*model.parameters(), *model.buffers())
                  if t.device.type == "cpu")


def plan_engine(pipe, hw: Hardware, precision: str, resident: int | None, tp: int | None = 1) -> EnginePlan:
    """Plan a pipeline loaded in host memory (not yet sharded; `tp` ways, or as the planner chooses when None) for
    the reference request; DoesNotFit says what would fit."""
    req, sizes = reference_request(pipe.canvas), pipeline_sizes(pipe)
    plan = plan_memory(sizes, hw, req, precision, tp=tp, resident=resident or None,
                       rows_for_frames=lambda f: request(f, req.height, req.width).rows)
    return EnginePlan(plan, hw, sizes)


def apply_plan(pipe, planned: EnginePlan, device: torch.device) -> None:
    """Quantize as planned, then move the pipeline to `device` with the planned units streamed."""
    from engine.models.h3.precision import set_precision

    plan = planned.plan
    if plan.precision in ("fp8", "int8"):
        set_precision(pipe.dit, plan.precision)
    pipe.place(device, plan.resident_units if plan.streaming else 0,
               STREAMED_TEXT_LAYERS if plan.text_encoder_streamed else 0)
    set_vae_batches(pipe, plan)
    pipe.memory_plan = planned


def set_vae_batches(pipe, plan: Plan) -> None:
    pipe.video_vae.decode_tokens, pipe.video_vae.encode_voxels = plan.decode_tokens, plan.encode_voxels


def job_request(pipe, req) -> Request:
    """The shape of a generation request (engine.models.h3.request.GenerateRequest) on this pipeline's canvas."""
    frames, height, width, _, _ = pipe.plan(req)
    pictures = (req.first_frame is not None) + (req.last_frame is not None)
    pictures += sum(r.kind == "image" for r in req.references or ())
    return request(frames, height, width, condition_frames=pictures)


def check_job(pipe, req) -> Plan | None:
    """The loaded plan for this generation (its streamed units and VAE batches set), or DoesNotFit before any
    work; None when the engine does not plan its memory."""
    planned = getattr(pipe, "memory_plan", None)
    if planned is None:
        return None
    shape = job_request(pipe, req)
    plan = plan_job(planned.sizes, planned.hardware, shape, planned.plan,
                    rows_for_frames=lambda f: request(f, shape.height, shape.width).rows)
    if pipe.streamer is not None:
        pipe.streamer.resident = plan.resident_units
    set_vae_batches(pipe, plan)
    return plan


def out_of_memory_message(pipe, req=None) -> str:
    """What an artist reads when a job (a generation `req`, or another task) ran out of memory although it was
    planned to fit."""
    planned = getattr(pipe, "memory_plan", None)
    try:
        words = job_request(pipe, req).words() if req is not None else "this job"
    except ValueError:
        words = "this job"
    text = f"The engine ran out of GPU memory on {words}"
    if planned is not None:
        text += f" (its memory plan: {planned.describe()})"
    return (text + ". Ask for fewer seconds or a smaller canvas, or start the engine with --dit-precision int8, "
                   "fewer --resident-blocks or more GPUs.")
