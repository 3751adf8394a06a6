"""H3 speed on one GPU, ours and diffusers in the same run (full-size random weights, bf16).

  1. DiT step at 1344x768, 124 and 362 frames: one block timed for diffusers, ours dense (auto backend: FA3 on
     Hopper) and ours with VSA at --sparsity, taking turns for 3 rounds (best of each); the 50-block step
     estimate and the ratio to diffusers.
  2. GPU output path: float -> uint8 on the GPU + device-to-host vs copying floats and converting on the CPU,
     for a decoded 5 s 1344x768 clip.
  3. End to end t2va, 5 s 1344x768, --steps grid points (5 = 4 DiT evaluations, Turbo-LoRA settings):
     conditioner (Qwen3-VL-32B width, 50 layers) -> prompt cache -> conditioner released -> DiT + VAEs, dense
     and VSA, the second VSA run hitting the AdaLN cache (time saved per step); the MP4 is encoded while the VAE
     decodes (NVENC where PyAV has it, else libx264 with the per-canvas preset and threads); when the last frame is
     out of the decode (a streaming client has the clip then) and when the MP4 is finished; peak memory.
     `--fp8`: then the same VSA run with the DiT's block GEMMs and the video decoder's in fp8 (serve
     --dit-precision fp8; VideoVAE.decode_fp8), quantized in place from the bf16 weights.

    python benchmarks/h3_speed.py [--sparsity 0.875] [--steps 5] [--fp8] [--out benchmarks/results/h3_speed.json]
    python benchmarks/h3_speed.py --tiny     # the same code path on CPU with tiny configs (a smoke check)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import RESULTS, log, save, stage  # noqa: E402
from benchmarks.timing import timed  # noqa: E402
from engine.io.convert import to_uint8_frames  # noqa: E402
from engine.kernels import attention as attn  # noqa: E402
from engine.kernels import vsa  # noqa: E402
from engine.models.h3 import layout as L  # noqa: E402
from engine.models.h3.config import FULL, NUM_MODALITIES, TEXT_TAG, TINY  # noqa: E402
from engine.models.h3.dit import build_dit, rope_table  # noqa: E402

ROUNDS = 3


def dit_step(args, device, sync):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    config = TINY if args.tiny else FULL
    ours = build_dit(replace(config, num_layers=1, num_refiner_layers=0), seed=0, dtype=args.dtype, device=device)
    block = ours.blocks[0]
    ref = MiniMaxH3TransformerBlock(config.hidden_size, config.num_attention_heads, config.attention_head_dim,
                                    config.ffn_dim, config.time_embed_dim, config.norm_eps, config.qk_norm_eps)
    ref = ref.to(device, args.dtype).eval().requires_grad_(False)
    from engine.models.h3.checkpoint import to_diffusers

    sd = {k.removeprefix("transformer_blocks.0."): v for k, v in to_diffusers(
        {k: v for k, v in ours.state_dict().items() if k.startswith("blocks.0.")}).items()}
    ref.load_state_dict(sd)
    frames_list = [22] if args.tiny else args.frames
    for frames in frames_list:
        h, w = (8, 14) if args.tiny else (48, 84)
        lay = L.build_layout(torch.full((64,), TEXT_TAG), L.latent_frames(frames), h, w, L.audio_latents(frames))
        lay = lay.to(device)
        ts, idx = L.row_timesteps(lay, 0.4, 0.6)
        with torch.no_grad():
            x = torch.randn(1, lay.seq_len, config.hidden_size, device=device, dtype=args.dtype) * 0.5
            temb = ours.time_embedding(ts.to(device))
            mods = block.adaln_proj(temb)
            rows = idx.to(device) * NUM_MODALITIES + lay.token_tags
            rope = rope_table(lay.position_ids, ours.rope_inv_freq)
            row = {"frames": frames, "S": lay.seq_len, "backend": attn.choose(device)}
            plan = vsa.build_plan(lay)
            topk = vsa.topk_for_sparsity(args.sparsity, plan.num_cubes)

            def sparse():
                with vsa.active(plan, topk):
                    return block(x, mods, rows, rope)

            # The three take turns, ROUNDS times, and each keeps its best: GPU clocks drift as the card heats
            # over minutes, and whoever ran last would pay for it.
            runs = {"diffusers": lambda: ref(x, temb, rows, rope), "ours_dense": lambda: block(x, mods, rows, rope),
                    "ours_vsa": sparse}
            rounds = [{name: timed(fn, sync) for name, fn in runs.items()} for _ in range(ROUNDS)]
            for name in runs:
                row[f"{name}_ms_per_block"] = round(min(r[name] for r in rounds), 2)
            y_sparse = sparse().float()
            y_dense, y_ref = block(x, mods, rows, rope).float(), ref(x, temb, rows, rope).float()
        row["vsa_topk"], row["vsa_cubes"] = topk, plan.num_cubes
        row["dense_rel_err_vs_diffusers"] = round(((y_dense - y_ref).abs().max() / y_ref.abs().max()).item(), 5)
        row["vsa_rel_diff_vs_dense"] = round(((y_sparse - y_dense).abs().max() / y_dense.abs().max()).item(), 4)
        for name in ("diffusers", "ours_dense", "ours_vsa"):
            row[f"{name}_step_est_s"] = round(50 * row[f"{name}_ms_per_block"] / 1e3, 2)
        row["dense_speedup"] = round(row["diffusers_ms_per_block"] / row["ours_dense_ms_per_block"], 3)
        row["vsa_speedup"] = round(row["diffusers_ms_per_block"] / row["ours_vsa_ms_per_block"], 3)
        RESULTS.setdefault("dit_step", []).append(row)
        log(f"dit step {row}")
    del ours, ref, block
    gc.collect()


def output_path(args, device, sync):
    F, H, W = (124, 128, 224) if args.tiny else (124, 768, 1344)
    x = torch.rand(1, 3, F, H, W, device=device) * 1.2 - 0.1
    pinned = torch.empty(F, H, W, 3, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def gpu():
        pinned.copy_(to_uint8_frames(x), non_blocking=True)

    def cpu():
        to_uint8_frames(x.cpu())

    RESULTS["output_gpu_uint8_d2h_ms"] = round(timed(gpu, sync), 1)
    RESULTS["output_cpu_convert_ms"] = round(timed(cpu, sync, warmup=0, iters=1), 1)
    RESULTS["output_speedup"] = round(RESULTS["output_cpu_convert_ms"] / RESULTS["output_gpu_uint8_d2h_ms"], 1)
    log(f"output path gpu {RESULTS['output_gpu_uint8_d2h_ms']} ms, cpu {RESULTS['output_cpu_convert_ms']} ms")
    del x, pinned


def random_conditioner(args, device):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from engine.models.h3 import conditioner as C

    if args.tiny:
        return C.build_tiny_conditioner(0, TINY.text_dim)
    ids = {t: 256 + i for i, t in enumerate(C.TINY_SPECIALS)}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=256 + len(C.TINY_SPECIALS), hidden_size=5120, intermediate_size=25600,
                         num_hidden_layers=C.REAL_LAYER, num_attention_heads=64, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=32768,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120,
                           num_position_embeddings=2304, deepstack_visual_indexes=[1]),
        image_token_id=ids[C.IMAGE_PAD], video_token_id=ids[C.VIDEO_PAD], vision_start_token_id=ids[C.VISION_START],
        vision_end_token_id=ids[C.VISION_END])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(args.dtype)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)
    return C.Conditioner(model, C.build_tiny_tokenizer(), C.build_tiny_image_processor(), layer=C.REAL_LAYER)


def end_to_end(args, device, sync):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    from engine.models.h3.pipeline import FULL_CANVAS, TINY_CANVAS, H3Pipeline
    from engine.models.h3.precision import set_precision
    from engine.models.h3.request import GenerateRequest
    from engine.models.h3.vae import AudioVAE, VideoVAE, build_tiny_audio_vae, build_tiny_video_vae

    prompt = "Waves roll onto a rocky beach at sunset while gulls cry overhead and wind hisses."  # ~80 tokens here
    width, height = (224, 128) if args.tiny else (1344, 768)
    req = GenerateRequest(prompt=prompt, seconds=5, width=width, height=height, steps=args.steps, seed=0)
    e2e = RESULTS.setdefault("e2e", {"canvas": f"{width}x{height}", "frames": 124, "steps": args.steps})
    long_req = replace(req, seconds=args.long_seconds) if args.long_seconds else None

    t0 = time.perf_counter()
    conditioner = random_conditioner(args, device)
    sync()
    e2e["conditioner_build_s"] = round(time.perf_counter() - t0, 1)
    shell = H3Pipeline(None, None, None, conditioner, FULL_CANVAS, device, "random")
    shell.encode_prompt("A cat sleeps on a warm windowsill.")  # warm-up: a first forward pays the library set-up
    sync()
    t0 = time.perf_counter()
    shell.encode_prompt(prompt)
    sync()
    e2e["conditioner_encode_s"] = round(time.perf_counter() - t0, 2)
    e2e["conditioner_peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else 0
    prompt_cache = shell.prompt_cache
    del shell, conditioner  # the conditioner leaves the GPU; the prompt cache keeps its output
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    t0 = time.perf_counter()
    dit = build_dit(TINY if args.tiny else FULL, seed=0, dtype=args.dtype, device=device)
    if args.tiny:
        video_vae, audio_vae = build_tiny_video_vae(0), build_tiny_audio_vae(0)
    else:
        with torch.device(device):  # random init on the GPU: the 2.6 B-parameter VAE is slow to init on CPU
            video_vae = VideoVAE(AutoencoderKLMiniMaxH3().eval().requires_grad_(False))
            audio_vae = AudioVAE(AutoencoderKLMiniMaxH3Audio().eval().requires_grad_(False))
    sync()
    e2e["dit_vae_build_s"] = round(time.perf_counter() - t0, 1)
    pipe = H3Pipeline(dit, video_vae.to(device), audio_vae.to(device), None, TINY_CANVAS if args.tiny else FULL_CANVAS,
                      device, "random")
    pipe.prompt_cache = prompt_cache

    def run(label, request=req):
        pipe.adaln_cache.clear() if label != "vsa_cached" else None
        last_frame = []

        def on_step(event):  # the decode hands out its last frame: what the engine streams to the client then
            decoded = getattr(event, "frames", None)
            if decoded is not None and decoded.start + len(decoded.pixels) == decoded.total:
                last_frame.append(time.perf_counter())

        sync()
        t0 = time.perf_counter()
        result = pipe.generate(request, on_step=on_step)
        sync()
        total = time.perf_counter() - t0
        e2e[f"{label}_last_frame_after_s"] = round(last_frame[0] - t0, 2)
        e2e[f"{label}_denoise_s"] = round(result.timings["denoise_s"], 2)
        e2e[f"{label}_decode_s"] = round(result.timings["decode_s"], 2)  # VAE decode with the MP4 encode overlapped
        e2e[f"{label}_mp4_wait_s"] = round(result.timings["mp4_s"], 2)  # encoder still busy after the last chunk
        e2e[f"{label}_generate_s"] = round(total, 2)
        log(f"e2e {label}: {result.timings}")
        return result

    # Warm-up, not timed: the first VSA pass builds its Triton kernels for this shape (the long clip's shape builds
    # them in its own run, which is timed cold), the VAE and the MP4 encoder set up.
    pipe.vsa_sparsity = args.sparsity
    pipe.generate(replace(req, steps=2))
    pipe.vsa_sparsity = 0.0
    run("dense")
    pipe.vsa_sparsity = args.sparsity
    run("vsa")
    result = run("vsa_cached")
    evaluations = args.steps - 1
    e2e["adaln_cache_saved_ms_per_step"] = round((e2e["vsa_denoise_s"] - e2e["vsa_cached_denoise_s"]) * 1e3
                                                 / evaluations, 1)
    with torch.no_grad():  # what a hit skips each step, timed alone: every block's tables for 3 distinct timesteps
        temb = dit.time_embedding(torch.tensor([0.3, 0.6, 0.999], device=device))
        e2e["adaln_tables_ms_per_step"] = round(timed(lambda: dit.modulations(temb), sync), 1)
    e2e["adaln_cache"] = pipe.adaln_cache.stats()
    adaln_bytes = sum(b.adaln_proj.linear.weight.numel() * b.adaln_proj.linear.weight.element_size()
                      for b in dit.blocks) + dit.final_layer.adaln_proj.linear.weight.numel() * 2
    e2e["adaln_weights_GiB_offloadable"] = round(adaln_bytes / 2**30, 2)
    from engine.io.video import encode_mp4_bytes

    e2e["mp4_encoder"] = next(n for n in result.notes if n.startswith("MP4 encoded with")).removeprefix(
        "MP4 encoded with ")
    e2e["mp4_MB"] = round(len(result.mp4) / 1e6, 1)
    t0 = time.perf_counter()  # what the MP4 would add if it were encoded after the decode (libx264)
    encode_mp4_bytes(result.frames, result.fps, result.audio, result.sample_rate)
    e2e["mp4_after_decode_libx264_s"] = round(time.perf_counter() - t0, 2)
    def peak():
        return round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else 0

    e2e["peak_GiB_dit_vae"] = peak()
    if long_req is not None:  # the long clip once, VSA (its AdaLN cache cold)
        e2e["long_frames"] = len(run("long_vsa", long_req).frames)
    e2e["long_peak_GiB_dit_vae"] = peak()
    labels = ["dense", "vsa", "vsa_cached"] + ["long_vsa"] * (long_req is not None)
    if args.fp8:
        set_precision(dit, "fp8")
        video_vae.decode_fp8 = True
        pipe.generate(replace(req, steps=2))  # warm-up: the fp8 GEMMs' first calls, the decoder packed in fp8
        run("fp8_vsa")
        labels.append("fp8_vsa")
    for label in labels:
        # generate_s includes the overlapped MP4 encode: the MP4 is ready then
        e2e[f"{label}_end_to_end_s"] = round(e2e["conditioner_encode_s"] + e2e[f"{label}_generate_s"], 2)
        e2e[f"{label}_last_frame_s"] = round(e2e["conditioner_encode_s"] + e2e.pop(f"{label}_last_frame_after_s"), 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, nargs="+", default=[124, 362])
    parser.add_argument("--sparsity", type=float, default=0.875)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--long-seconds", type=float, default=15, help="e2e: one more VSA run this long (0: none)")
    parser.add_argument("--fp8", action="store_true", help="e2e: one more VSA run with fp8 DiT and decoder GEMMs")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to skip: dit output e2e")
    parser.add_argument("--out", default="benchmarks/results/h3_speed.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    RESULTS.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   attention_backends=attn.backends(device), sparsity=args.sparsity)
    out = Path(args.out)
    for name, fn in (("dit", dit_step), ("output", output_path), ("e2e", end_to_end)):
        if name not in args.skip:
            stage(name, lambda fn=fn: fn(args, device, sync), out)

    log("\n== H3 speed (ours vs diffusers, same run) ==")
    for r in RESULTS.get("dit_step", []):
        log(f"{r['frames']:>4} frames S={r['S']:>6}: diffusers {r['diffusers_ms_per_block']:>7} ms/block | ours dense "
            f"{r['ours_dense_ms_per_block']:>7} ({r['dense_speedup']}x) | ours VSA {args.sparsity:g} "
            f"{r['ours_vsa_ms_per_block']:>7} ({r['vsa_speedup']}x) | step est {r['ours_dense_step_est_s']} / "
            f"{r['ours_vsa_step_est_s']} vs {r['diffusers_step_est_s']} s")
    if "output_speedup" in RESULTS:
        log(f"output path: GPU uint8 + D2H {RESULTS['output_gpu_uint8_d2h_ms']} ms vs CPU convert "
            f"{RESULTS['output_cpu_convert_ms']} ms ({RESULTS['output_speedup']}x)")
    e2e = RESULTS.get("e2e", {})
    for label in ("dense", "vsa", "vsa_cached", "long_vsa", "fp8_vsa"):
        if f"{label}_end_to_end_s" in e2e:
            seconds = args.long_seconds if label == "long_vsa" else 5
            log(f"e2e t2va {e2e['canvas']} {seconds:g} s {e2e['steps']} grid points, {label}: last frame at "
                f"{e2e[f'{label}_last_frame_s']} s, MP4 at {e2e[f'{label}_end_to_end_s']} s (conditioner "
                f"{e2e['conditioner_encode_s']}, denoise {e2e[f'{label}_denoise_s']}, decode + {e2e['mp4_encoder']} "
                f"MP4 {e2e[f'{label}_decode_s']}, of which waiting for the encoder {e2e[f'{label}_mp4_wait_s']}; MP4 "
                f"after the decode would take {e2e['mp4_after_decode_libx264_s']})")
    if "adaln_cache_saved_ms_per_step" in e2e:
        log(f"AdaLN cache: {e2e['adaln_cache_saved_ms_per_step']} ms saved per step (the tables alone take "
            f"{e2e['adaln_tables_ms_per_step']} ms), "
            f"{e2e['adaln_weights_GiB_offloadable']} GiB of projection weights offloadable; peak "
            f"{e2e.get('peak_GiB_dit_vae')} GiB (DiT + VAEs), conditioner peak {e2e.get('conditioner_peak_GiB')} GiB")
    save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
