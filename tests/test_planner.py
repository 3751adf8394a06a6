"""The memory planner (engine/runtime/planner.py): its choices for a table of GPUs and requests on the released
model's sizes, its refusals, and the engine that carries a plan out: streamed DiT units and text-encoder layers
give the same frames, a request that cannot fit is refused before work, and an out-of-memory inside a job ends
that job with the plan in its message, holds no memory after, and the next job runs."""

import asyncio
import json
import urllib.request

import pytest
import torch

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


# (GiB per GPU, GPUs, seconds) -> (precision, TP, units on the GPU (None: all), text encoder streamed)
TABLE = {
    (141, 1, 5): ("bf16", 1, None, False),  # an H200 holds everything, the text encoder too
    (141, 1, 15): ("bf16", 1, None, True),
    (80, 1, 5): ("bf16", 1, None, True),  # A100 / H100 80 GB: bf16 without streaming
    (80, 1, 15): ("fp8", 1, None, True),
    (48, 1, 5): ("fp8", 1, None, True),  # L40S / RTX 6000 Ada
    (32, 1, 5): ("int8", 1, 59, True),  # RTX 5090: int8 streamed
    (24, 1, 5): ("int8", 1, 33, True),  # RTX 4090
    (24, 2, 5): ("int8", 2, 79, True),  # 2 x 4090: TP 2 keeps more units on each
    (80, 4, 15): ("bf16", 1, None, True),  # 4 x A100-80: Ulysses 4 shares the activations
}


@pytest.mark.parametrize("case", TABLE, ids=lambda k: f"{k[0]}GiBx{k[1]}-{k[2]}s")
def test_the_plans_for_a_table_of_gpus_and_clips(case):
    gib, gpus, seconds = case
    plan = plan_memory(RELEASE, Hardware(gib * GiB, 256 * GiB, gpus), clip(seconds))
    precision, tp, resident, text_streamed = TABLE[case]
    assert (plan.precision, plan.tp, plan.ulysses) == (precision, tp, gpus // tp)
    assert plan.resident_units == (resident or RELEASE.units) and plan.streaming == (resident is not None)
    assert plan.text_encoder_streamed == text_streamed
    assert plan.device_bytes <= gib * GiB
    words = plan.describe()
    assert words.startswith(f"{precision} DiT") and f"of {gib}.0 GiB per GPU" in words
    if resident:
        assert f"{resident} of 102 units on the GPU, streaming" in words and plan.stream_bytes_per_step > 0
        assert plan.host_bytes >= plan.stream_bytes_per_step
    assert ("text encoder streamed" in words) == text_streamed


def test_pinned_choices_are_kept():
    hw = Hardware(80 * GiB, 256 * GiB)
    assert plan_memory(RELEASE, hw, clip(5), precision="int8").precision == "int8"
    bf16 = plan_memory(RELEASE, Hardware(24 * GiB, 256 * GiB), clip(5), precision="bf16")
    assert bf16.precision == "bf16" and bf16.streaming  # streamed rather than quantized when told bf16
    assert plan_memory(RELEASE, hw, clip(5), resident=10).resident_units == 10
    assert plan_memory(RELEASE, Hardware(141 * GiB, 256 * GiB, 4), clip(5), tp=4).tp == 4
    quantized = ModelSizes(**{**RELEASE.__dict__, "stored": "int8"})
    assert plan_memory(quantized, Hardware(141 * GiB, 256 * GiB), clip(5)).precision == "int8"  # as stored


def test_a_clip_that_cannot_fit_is_refused_with_what_would():
    with pytest.raises(DoesNotFit) as err:
        plan_memory(RELEASE, Hardware(24 * GiB, 256 * GiB), clip(15), rows_for_frames=rows)
    message = str(err.value)
    assert message.startswith("15.1 s (362 frames) at 1344x768 does not fit this engine's GPU (24.0 GiB)")
    assert "14.4 s (345 frames) at 1344x768 fits." in message and "needs 2 GPUs." in message
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


TOY_REQUEST = GenerateRequest(prompt="a red ball bounces on green grass under a blue sky, humming", seconds=5,
                              steps=3, seed=1)


def test_the_engine_carries_out_a_streaming_plan_bit_for_bit():
    """The toy pipeline planned for a 0.08 GiB 'GPU' (the planner on a CPU engine): DiT units and text-encoder
    layers streamed, the same frames as the pipeline without a plan; a 15 s clip is refused before work."""
    ctx = RankContext(0, 1, torch.device("cpu"))
    plain = load_pipeline(ModelSource(preset="toy"), ctx)
    planned = load_pipeline(ModelSource(preset="toy", dit_precision="bf16", gpu_memory_gb=0.08), ctx)  # as stored
    plan = planned.memory_plan.plan
    assert plan.streaming and plan.text_encoder_streamed and plan.precision == "fp32"
    plain.encode_mp4 = planned.encode_mp4 = False
    expected, got = plain.generate(TOY_REQUEST), planned.generate(TOY_REQUEST)
    assert torch.equal(expected.frames, got.frames) and torch.equal(expected.audio, got.audio)
    status = planned.describe()
    assert status["streaming"]["max_resident"] <= plan.resident_units
    assert status["text_encoder_streaming"]["max_resident"] <= 2
    assert status["memory_plan"]["plan"] in status["summary"]
    with pytest.raises(DoesNotFit, match=r"15.1 s \(362 frames\) at 224x128 does not fit .* fits\."):
        check_job(planned, GenerateRequest(prompt="a long one", seconds=15))


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
