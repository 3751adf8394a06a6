"""Block streaming (engine/runtime/streaming.py): the DiT's blocks in host memory, at most K on the device, give
the resident model's output bit for bit over whole generations, with weight edits between jobs and with quantized
blocks; the copies run ahead of use, so after the first pass hardly any call waits for its unit."""

import dataclasses

import pytest
import torch

from engine.kernels import attention
from engine.models.h3.pipeline import Canvas, GenerateRequest, H3Pipeline
from engine.models.h3.precision import set_precision
from engine.runtime.streaming import BlockStreamer, dit_units

REQUEST = GenerateRequest(prompt="a large red ball bounces on green grass under a blue sky", seed=5, steps=4)


def tiny(precision="bf16") -> H3Pipeline:
    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    pipe.canvas = Canvas(short_edge=32, max_pixels=32 * 32, default_steps=4)  # small, so it runs in seconds
    pipe.encode_mp4 = False
    set_precision(pipe.dit, precision)
    return pipe


def tensors(pipe):
    return [t.data_ptr() for t in (*pipe.dit.parameters(), *pipe.dit.buffers())]


@pytest.mark.parametrize("resident", [1, 3])
def test_streamed_generations_equal_the_resident_model(resident):
    plain, streamed = tiny(), tiny()
    streamed.stream_blocks(resident)
    streamer = streamed.streamer
    units = len(dit_units(streamed.dit))
    assert units == len(streamed.dit.token_refiner.blocks) + 2 * len(streamed.dit.blocks)
    for job in range(3):
        if job == 2:  # a weight edit between jobs (as a LoRA merge) lands on the host copies
            for pipe in (plain, streamed):
                with torch.no_grad():
                    pipe.dit.blocks[0].mlp.fc2.weight.mul_(1.5)
        misses = streamer.misses
        a, b = plain.generate(REQUEST), streamed.generate(REQUEST)
        assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio), job
        if job == 1 and resident > 1:
            # The AdaLN cache hits now, so the step skips the projections: one wrong guess, then learned.
            assert streamer.misses - misses <= 2, streamer.stats()
    stats = streamer.stats()
    assert stats["max_resident"] == resident and stats["fetches"] > 3 * units
    assert stats["host_bytes"] > 0 and not streamer.on_device  # released after every job
    assert streamed.describe()["streaming"]["resident"] == resident


def test_streaming_quantized_blocks_equals_the_resident_model():
    plain, streamed = tiny("fp8"), tiny("fp8")
    streamed.stream_blocks(2)
    a, b = plain.generate(REQUEST), streamed.generate(REQUEST)
    assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)


def test_at_most_k_units_are_on_the_device_during_a_pass():
    """Counted inside every unit's call: the streamed tensors not in host memory are those of at most K units, and
    the called unit's are among them."""
    pipe = tiny()
    pipe.stream_blocks(2)
    streamer = pipe.streamer
    host = {h.data_ptr() for u in streamer.units for h in u.host}
    seen = []

    def on_device(unit):
        return any((owner._parameters[name] if is_param else owner._buffers[name]).data_ptr() not in host
                   for owner, name, is_param in unit.slots)

    def count(module, args):
        resident = [u.module for u in streamer.units if on_device(u)]
        seen.append((len(resident), module in resident))

    hooks = [u.module.register_forward_pre_hook(count) for u in streamer.units]  # after the streamer's own
    pipe.generate(REQUEST)
    for hook in hooks:
        hook.remove()
    assert seen and all(n <= 2 and called for n, called in seen), seen


def test_a_pass_copies_only_the_units_that_take_turns():
    """K of N resident: the K - 2 largest units stay once copied, so after the first pass each pass copies the
    other N - (K - 2), not all N (LRU over a cyclic order would evict every unit before its next use)."""
    from engine.models.h3.config import TINY
    from engine.models.h3.dit import build_dit
    from test_ulysses import case

    dit = build_dit(dataclasses.replace(TINY, num_layers=4))
    _, inputs = case("t2va")
    expected = dit(*inputs)[0]
    units = len(dit_units(dit))
    for resident in (2, 4, units - 1):
        streamer = BlockStreamer(dit_units(dit), "cpu", resident)
        passes = []
        for _ in range(3):
            before = streamer.bytes_copied
            assert torch.equal(dit(*inputs)[0], expected)
            passes.append(streamer.bytes_copied - before)
        taking_turns = [u.nbytes for i, u in enumerate(streamer.units) if i not in streamer.kept]
        assert len(streamer.kept) == resident - 2 and streamer.max_resident == resident
        assert passes[1] == passes[2] == sum(taking_turns), (resident, passes)
        assert (sum(taking_turns) < streamer.host_bytes) == (resident > 2)
        assert all(streamer.units[i].nbytes >= max(taking_turns) for i in streamer.kept)  # the largest stay
        streamer.close()


def test_close_puts_every_block_back_and_a_bad_count_is_refused():
    pipe = tiny()
    before = pipe.generate(REQUEST)
    streamer = BlockStreamer(dit_units(pipe.dit), pipe.device, 2)
    streamer.close()
    after = pipe.generate(REQUEST)
    assert torch.equal(before.frames, after.frames) and streamer.stats()["fetches"] == 0
    with pytest.raises(ValueError, match="At least one unit"):
        BlockStreamer(dit_units(pipe.dit), pipe.device, 0)


def test_a_streaming_engine_swaps_partitions_and_streams_the_active_one():
    """fl2va -> ref2va -> fl2va on a streaming pipeline gives what the resident one gives; the idle DiT waits in
    host memory whole and the active one keeps K units on the device."""
    from engine.models.h3.references import ImageReference

    picture = torch.arange(32 * 32 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).view(32, 32, 3).numpy()
    ref = GenerateRequest(prompt="<Picture 1> rolls away", seed=3, steps=3, references=[ImageReference(picture)],
                          reference_size="match")
    plain, streamed = tiny(), tiny()
    streamed.stream_blocks(2)
    idle = []
    for request in (REQUEST, ref, REQUEST):
        a, b = plain.generate(request), streamed.generate(request)
        assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio), request.prompt
        assert streamed.streamer.stats()["max_resident"] == 2 and not streamed.streamer.on_device
        idle.append(streamed.describe()["partitions"]["idle"])
    assert idle == [{"ref2va": "disk"}, {"fl2va": "host"}, {"ref2va": "host"}]
    assert [s["to"] for s in streamed.partitions.swaps] == ["ref2va", "fl2va"]


def test_an_engine_started_with_resident_blocks_streams_and_says_so(tmp_path):
    """`serve --resident-blocks 2` through the real client: the job's frames equal an engine's without streaming
    for the same seed, and /v1/status shows the streaming counters."""
    import asyncio

    from engine_fixture import start_engine

    params = {"prompt": "rain", "steps": 3, "width": 64, "height": 64, "seed": 2}
    results = []
    for args in ((), ("--resident-blocks", "2")):
        with start_engine(tmp_path / str(len(results)), *args) as engine:
            results.append(asyncio.run(engine.client().run("t2va", params)))
            status = asyncio.run(engine.client().status())
    assert torch.equal(torch.as_tensor(results[0].frames), torch.as_tensor(results[1].frames))
    streaming = status["models"]["streaming"]
    assert streaming["resident"] == 2 and streaming["max_resident"] == 2 and streaming["fetches"] > 0
