"""The memory planner (engine/runtime/planner.py): its choices for a table of GPUs and requests on the released
model's sizes (TP and the VAE's batches included), its refusals, and the engine that carries a plan out: streamed
DiT units and text-encoder layers and the planned VAE batches give the same frames, ranks without --tp take the
planned TP, a request that cannot fit is refused before work, and an out-of-memory inside a job ends that job with
the plan in its message, holds no memory after, and the next job runs."""

import asyncio
from dataclasses import replace
import json
import urllib.request

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.models.h3 import layout as L
from engine.models.h3.config import FULL
from engine.models.h3.request import GenerateRequest
from engine.runtime.jobs import ModelSource, load_pipeline
from engine.runtime.placement import check_job, config_sizes
from engine.runtime.planner import GiB, DoesNotFit, Hardware, ModelSizes, plan_job, plan_memory, request
from engine.runtime.ranks import RankContext
from engine_fixture import start_engine
from nodes.client import EngineError

# The release: 33.0 B parameters in 102 streamed units, a 62 GiB text encoder of 50 layers, ~6.5 GiB of VAEs.
RELEASE = config_sizes(FULL)


def clip(seconds: float) -> "object":
    return request(L.frames_for_seconds(seconds)[0], 768, 1344)


def rows(frames: int) -> int:
    return request(frames, 768, 1344).rows


# (model, GiB per GPU, GPUs, seconds) -> (precision, TP, units on the GPU (None: all), text encoder streamed).
# "release": the official bf16 DiT (quantized online: fp8 leaves its AdaLN projections, 26 GB, in bf16, int8 takes
# them too: fp8 43.6 GiB, int8 31.5 GiB);
# "pruned": the Comfy-Org pruned file most 24-48 GB cards load (curve AdaLN: int8 19.5 GB, bf16 37.4 GB).
TABLE = {
    ("release", 141, 1, 5): ("bf16", 1, None, False),  # an H200 holds everything, the text encoder too
    ("release", 141, 1, 15): ("bf16", 1, None, True),
    ("release", 80, 1, 5): ("bf16", 1, None, True),  # A100 / H100 80 GB: bf16 without streaming
    ("release", 80, 1, 15): ("fp8", 1, None, True),
    ("release", 48, 1, 5): ("int8", 1, None, True),  # L40S / RTX 6000 Ada: the bf16 AdaLN keeps fp8 off the card
    ("release", 32, 1, 5): ("int8", 1, 48, True),  # RTX 5090: int8 streamed
    ("release", 24, 1, 5): ("int8", 1, 26, True),  # RTX 4090
    ("release", 24, 2, 5): ("int8", 2, 71, True),  # 2 x 4090: TP 2 keeps more units on each
    ("release", 80, 4, 15): ("bf16", 1, None, True),  # 4 x A100-80: Ulysses 4 shares the activations
    ("release", 48, 4, 5): ("bf16", 2, None, True),  # 4 x L40S: TP 2 holds the bf16 DiT, Ulysses 2 over the pairs
    ("pruned", 48, 1, 5): ("fp8", 1, None, True),
    ("pruned", 32, 1, 5): ("int8", 1, 48, True),
    ("pruned", 24, 1, 5): ("int8", 1, 27, True),
    ("pruned", 24, 2, 5): ("fp8", 2, None, True),
}
MODELS = {"release": RELEASE, "pruned": config_sizes(replace(FULL, adaln_curve_grid=1025, time_embed_dim=8))}


@pytest.mark.parametrize("case", TABLE, ids=lambda k: f"{k[0]}-{k[1]}GiBx{k[2]}-{k[3]}s")
def test_the_plans_for_a_table_of_gpus_and_clips(case):
    model, gib, gpus, seconds = case
    sizes = MODELS[model]
    plan = plan_memory(sizes, Hardware(gib * GiB, 256 * GiB, gpus), clip(seconds))
    precision, tp, resident, text_streamed = TABLE[case]
    assert (plan.precision, plan.tp, plan.ulysses) == (precision, tp, gpus // tp)
    assert plan.resident_units == (resident or sizes.units) and plan.streaming == (resident is not None)
    assert plan.text_encoder_streamed == text_streamed
    assert plan.device_bytes <= gib * GiB
    words = plan.describe()
    assert words.startswith(f"{precision} DiT") and f"of {gib}.0 GiB per GPU" in words
    if resident:
        assert f"{resident} of 102 units on the GPU, streaming" in words and plan.stream_bytes_per_step > 0
        assert plan.host_bytes >= plan.stream_bytes_per_step
    assert ("text encoder streamed" in words) == text_streamed
    assert (f"TP {tp} x Ulysses {gpus // tp}" in words) == (gpus > 1)


def test_resident_units_are_the_largest_at_their_stored_size():
    """What k resident units hold is the k largest units' bytes at the precision (the streamer keeps the largest):
    the refiner blocks stay bf16 (0.77 GB each) and outweigh an int8 block (0.39 GB), which outweighs an int8 AdaLN
    projection (0.26 GB; fp8 leaves them in bf16, 0.52 GB, ahead of its blocks). Before, every unit counted as the
    mean at one byte a parameter, and a 24 GiB plan for int8 promised 33 units where 20 fit."""
    int8, fp8 = RELEASE.resident_bytes("int8"), RELEASE.resident_bytes("fp8")
    gemm, adaln, other = (sum(p) for p in (RELEASE.unit_gemm_params, RELEASE.unit_adaln_params,
                                           RELEASE.unit_other_bytes))
    assert len(int8) == RELEASE.units + 1 and int8[0] == 0
    assert int8[2] == fp8[2] == 2 * RELEASE.unit_other_bytes[0]  # the two refiner blocks
    assert int8[52] - int8[2] == 50 * RELEASE.unit_gemm_params[-1]  # then the int8 blocks
    assert int8[-1] - int8[52] == 50 * RELEASE.unit_adaln_params[2]  # the int8 AdaLN projections last
    assert fp8[52] - fp8[2] == 2 * 50 * RELEASE.unit_adaln_params[2]  # fp8: the bf16 projections come first
    assert RELEASE.resident_bytes("bf16")[-1] == 2 * gemm + 2 * adaln + other
    assert fp8[-1] == gemm + 2 * adaln + other and int8[-1] == gemm + adaln + other
    assert RELEASE.resident_bytes("int8", tp=2)[-1] == pytest.approx(int8[-1] / 2, abs=RELEASE.units)


def test_the_planned_sizes_are_what_online_quantization_leaves():
    """config_sizes' units at bf16, fp8 and int8 against a bf16 DiT of that config quantized by set_precision
    (int8 takes the AdaLN projections, ConvRot group 64 for 128 inputs). The planner leaves out biases and row scales
    (6 bytes a row: 4.7 % of an int8 row of this model's 128 inputs, 0.2 % of the release's 2688)."""
    from engine.models.h3.dit import build_dit
    from engine.models.h3.precision import set_precision
    from engine.runtime.streaming import dit_units, unit_tensors
    from test_comfy_files import CONFIG

    sizes = config_sizes(CONFIG)
    for precision in ("bf16", "fp8", "int8"):
        dit = set_precision(build_dit(CONFIG, seed=0, dtype=torch.bfloat16), precision)
        units = sorted((sum(getattr(o, n).numel() * getattr(o, n).element_size() for o, n, _ in unit_tensors(m, ex))
                        for m, ex in dit_units(dit)), reverse=True)
        planned = sizes.resident_bytes(precision)
        assert [b - a for a, b in zip(planned, planned[1:])] == pytest.approx(units, rel=0.05), precision
        if precision == "int8":
            assert dit.blocks[0].adaln_proj.linear.group == 64


def test_pinned_choices_are_kept():
    hw = Hardware(80 * GiB, 256 * GiB)
    assert plan_memory(RELEASE, hw, clip(5), precision="int8").precision == "int8"
    bf16 = plan_memory(RELEASE, Hardware(24 * GiB, 256 * GiB), clip(5), precision="bf16")
    assert bf16.precision == "bf16" and bf16.streaming  # streamed rather than quantized when told bf16
    assert plan_memory(RELEASE, hw, clip(5), resident=10).resident_units == 10
    assert plan_memory(RELEASE, Hardware(141 * GiB, 256 * GiB, 4), clip(5), tp=4).tp == 4
    quantized = ModelSizes(**{**RELEASE.__dict__, "stored": "int8"})
    assert plan_memory(quantized, Hardware(141 * GiB, 256 * GiB), clip(5)).precision == "int8"  # as stored


def test_the_vae_batches_fit_beside_what_stays_on_the_gpu():
    """The video VAE decodes (and encodes) as many tiles a call as fit beside what stays on the GPU meanwhile: a DiT
    held whole stays, a streamed one leaves after the denoise (the streamer evicts every unit). An H200 (140 GiB)
    holding the whole model, text encoder included, leaves the decoder 56 k tokens a call; an 80 GB card (text
    encoder streamed), the same H200 with the DiT streamed and a 24 GiB card streaming an int8 DiT the fast path's
    64 k. The release's VAE widths are the ones read off a released VAE."""
    from engine.models.h3 import vae as V
    from engine.runtime.placement import video_vae_sizes
    from engine.runtime.planner import decode_bytes, encode_bytes

    h200, a100, rtx4090 = (plan_memory(RELEASE, Hardware(gib * GiB, 256 * GiB), clip(5)) for gib in (140, 80, 24))
    streamed = plan_memory(RELEASE, Hardware(140 * GiB, 256 * GiB), clip(5), resident=100)
    assert not h200.streaming and not h200.text_encoder_streamed and rtx4090.streaming
    assert h200.decode_tokens < a100.decode_tokens == streamed.decode_tokens == rtx4090.decode_tokens == 65536
    assert h200.encode_voxels < a100.encode_voxels < streamed.encode_voxels == rtx4090.encode_voxels == 8912896
    assert "VAE decode 56 k tokens, encode 4.1 M voxels a batch" in h200.describe()
    assert "VAE decode 64 k tokens, encode 8.9 M voxels a batch" in rtx4090.describe()
    assert (h200.as_dict()["decode_tokens"], h200.as_dict()["encode_voxels"]) == (57286, 4139394)
    budget = 140 * GiB - (1 * GiB + int(0.02 * 140 * GiB))  # less the margin
    whole = (RELEASE.dit_other_bytes + RELEASE.vae_bytes + RELEASE.text_encoder_bytes
             + RELEASE.resident_bytes("bf16")[-1])  # what stays on the GPU while the VAE decodes
    v = RELEASE.video_vae
    assert whole + decode_bytes(v, clip(5), h200.decode_tokens) <= budget
    assert whole + decode_bytes(v, clip(5), h200.decode_tokens + 1) > budget
    assert whole + encode_bytes(v, clip(5), h200.encode_voxels) <= budget
    with torch.device("meta"):
        released = V.AutoencoderKLMiniMaxH3(**V.video_vae_config_from_original({}, {}))
    assert video_vae_sizes(V.VideoVAE(released)) == v


def test_a_clip_that_cannot_fit_is_refused_with_what_would():
    with pytest.raises(DoesNotFit) as err:
        plan_memory(RELEASE, Hardware(24 * GiB, 256 * GiB), clip(15), rows_for_frames=rows)
    message = str(err.value)
    assert message.startswith("15.1 s (362 frames) at 1344x768 does not fit this engine's GPU (24.0 GiB)")
    assert "13.7 s (328 frames) at 1344x768 fits." in message and "needs 2 GPUs." in message
    with pytest.raises(DoesNotFit) as err:  # bf16 pinned on a card whose working memory alone is too much
        plan_memory(RELEASE, Hardware(16 * GiB, 256 * GiB), clip(10), precision="bf16", rows_for_frames=rows)
    assert "fits." in str(err.value) and "--dit-precision int8" not in str(err.value)
    with pytest.raises(DoesNotFit, match="pinned host memory and this machine has 64.0 GiB available"):
        plan_memory(RELEASE, Hardware(24 * GiB, 64 * GiB), clip(5))


def test_each_job_is_planned_against_the_loaded_plan():
    hw = Hardware(32 * GiB, 256 * GiB)
    streaming = plan_memory(RELEASE, hw, clip(5))
    longer = plan_job(RELEASE, hw, clip(10), streaming)
    assert longer.precision == streaming.precision and longer.resident_units < streaming.resident_units
    whole = plan_memory(RELEASE, Hardware(80 * GiB, 256 * GiB), clip(5))
    with pytest.raises(DoesNotFit) as err:  # a DiT held whole cannot start streaming for one job
        plan_job(RELEASE, Hardware(80 * GiB, 256 * GiB), clip(15), whole, rows_for_frames=rows)
    assert "does not fit" in str(err.value) and "fits." in str(err.value)


def test_weights_already_in_host_memory_count_as_room_for_the_pinned_ones(monkeypatch):
    """The engine plans after loading the weights into host memory; streaming pins them in place of that copy, so
    what the host has available then plus what they hold is the budget (a measured one; --host-memory is a total);
    ranks on one host share it.
    Before, a 24 GiB plan of the release was refused on a machine that had just loaded it."""
    from engine.runtime import placement

    monkeypatch.setattr(placement, "host_available_bytes", lambda: 30 * GiB)  # after a 90 GiB load on 128 GiB
    cpu = torch.device("cpu")
    with pytest.raises(DoesNotFit, match="needs 93.5 GiB of pinned host memory .* --text-encoder-precision int8"):
        plan_memory(RELEASE, placement.hardware(cpu, 1, 24, None), clip(5))
    hw = placement.hardware(cpu, 1, 24, None, held_bytes=90 * GiB)
    assert hw.host_bytes == 120 * GiB
    assert plan_memory(RELEASE, hw, clip(5)).host_bytes <= hw.host_bytes
    assert placement.hardware(cpu, 1, 24, 64, held_bytes=90 * GiB).host_bytes == 64 * GiB
    # Two ranks on the host: each has its half of what is available (or of --host-memory) plus its own weights.
    assert placement.hardware(cpu, 2, 24, None, held_bytes=90 * GiB, host_ranks=2).host_bytes == 105 * GiB
    assert placement.hardware(cpu, 2, 24, 64, held_bytes=90 * GiB, host_ranks=2).host_bytes == 32 * GiB
    pipe = load_pipeline(ModelSource(preset="toy"), RankContext(0, 1, cpu))
    assert placement.held_on_host(pipe) == sum(t.numel() * t.element_size() for m in (pipe.dit, pipe.conditioner.model)
                                               for t in (*m.parameters(), *m.buffers()))


def _planned_rank(rank, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = RankContext(rank, 2, torch.device("cpu"), dist.group.WORLD, dist.new_group(backend="gloo"))
    # Rank 1 alone would plan TP 1 (Ulysses 2) on its 0.2 GiB: the ranks plan with the least of their memories.
    source = ModelSource(preset="toy", dit_precision="bf16", gpu_memory_gb=(0.137, 0.2)[rank],
                         host_memory_gb=64 + rank)
    pipe = load_pipeline(source, ctx)
    planned = pipe.memory_plan
    torch.save({"mesh": pipe.parallel.mesh, "plan": planned.describe(), "hardware": planned.hardware,
                "qkv_rows": pipe.dit.blocks[0].attn.qkv_proj.weight.shape[0]}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ranks_without_tp_take_the_planned_one(tmp_path):
    """`serve --gpus 2` without --tp on a toy-sized 'GPU' where the fp32 DiT and the VAE's decode do not fit whole
    on one, but do on two halves: both gloo ranks plan TP 2 (from the least memory of either) and cut the DiT so;
    --tp pins it, and one the ranks cannot run is refused with the ones they can (test_tensor_parallel.py)."""
    mp.spawn(_planned_rank, args=(str(tmp_path / "store"), tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert (ranks[0]["mesh"].tp, ranks[0]["mesh"].ulysses) == (2, 1)
    assert "fp32 DiT, all on the GPU" in ranks[0]["plan"] and "TP 2 x Ulysses 1" in ranks[0]["plan"]
    hw = ranks[0]["hardware"]
    assert (hw.device_bytes, hw.host_bytes) == (int(0.137 * GiB), 64 * GiB)
    assert ranks[0]["qkv_rows"] == 3 * 256 // 2  # each rank holds half the heads of the toy's q, k and v


TOY_REQUEST = GenerateRequest(prompt="a red ball bounces on green grass under a blue sky, humming", seconds=5,
                              steps=3, seed=1)


def decoder_calls(pipe) -> list[int]:
    """The tiles of each call of the pipeline's fast video decoder, from now on."""
    calls = []
    pipe.video_vae.fast_decoder().register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    return calls


def test_the_engine_carries_out_a_streaming_plan_bit_for_bit():
    """The toy pipeline planned for a 0.12 GiB 'GPU' (the planner on a CPU engine): DiT units and text-encoder
    layers streamed, the video decoded 2 tiles a call (the unplanned engine decodes all 7 windows' tiles in one),
    the same frames as the pipeline without a plan. A 15 s clip is planned against the loaded plan (the toy's decode,
    window by window, needs more than its DiT's activations at any length: it fits wherever 5 s does)."""
    ctx = RankContext(0, 1, torch.device("cpu"))
    plain = load_pipeline(ModelSource(preset="toy"), ctx)
    planned = load_pipeline(ModelSource(preset="toy", dit_precision="bf16", gpu_memory_gb=0.12), ctx)  # as stored
    plan = planned.memory_plan.plan
    assert plan.streaming and plan.text_encoder_streamed and plan.precision == "fp32"
    tile = planned.video_vae.fast_decoder().tokens((1, 24, 7, 128 // 16, 224 // 16))  # the toy canvas is one tile
    assert planned.video_vae.decode_tokens == plan.decode_tokens and plan.decode_tokens // tile == 2
    assert planned.video_vae.encode_voxels == plan.encode_voxels
    plain.encode_mp4 = planned.encode_mp4 = False
    plain_calls, planned_calls = decoder_calls(plain), decoder_calls(planned)
    expected, got = plain.generate(TOY_REQUEST), planned.generate(TOY_REQUEST)
    assert plain_calls == [7] and planned_calls == [2, 2, 2, 1]
    assert torch.equal(expected.frames, got.frames) and torch.equal(expected.audio, got.audio)
    status = planned.describe()
    assert status["streaming"]["max_resident"] <= plan.resident_units
    assert status["text_encoder_streaming"]["max_resident"] <= 2
    assert status["memory_plan"]["plan"] in status["summary"]
    longer = check_job(planned, GenerateRequest(prompt="a long one", seconds=15))
    assert longer.resident_units <= plan.resident_units and longer.decode_tokens == planned.video_vae.decode_tokens


def _tensors(engine) -> dict:
    with urllib.request.urlopen(f"{engine.http_url}/v1/status?tensors=1&token={engine.token}", timeout=30) as r:
        return json.load(r)["tensors"]


def test_an_out_of_memory_in_a_job_fails_that_job_frees_its_memory_and_the_next_runs(tmp_path):
    params = {"prompt": "a blue box moves right on a white background", "steps": 4, "seed": 2}
    with start_engine(tmp_path, "--preset", "toy", "--gpu-memory", "0.15",
                      env={"H3FORGE_INJECT_OOM": "2@2"}) as engine:
        client = engine.client()

        def run():
            return asyncio.run(asyncio.wait_for(client.run("t2va", dict(params)), 300))

        first = run()
        held = _tensors(engine)
        with pytest.raises(EngineError) as err:
            run()  # the second job runs out of memory at its third step
        assert err.value.code == "out_of_memory"
        assert err.value.message.startswith("The engine ran out of GPU memory on 5.2 s (124 frames) at 224x128")
        assert "its memory plan: fp32 DiT, all on the GPU" in err.value.message
        assert "--dit-precision int8" in err.value.message
        assert _tensors(engine) == held  # nothing of the failed job is left
        third = run()
        assert (third.frames == first.frames).all()
