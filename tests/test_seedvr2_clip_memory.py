"""What a SeedVR2 upscale holds for the whole clip: the float tensors alive at its peak, counted op by op on the CPU
(benchmarks/seedvr2.py FloatMemory; the DiT stubbed, the whole clip one batch), grow with the clip by less than a
quarter of one float copy of its frames at the output size. Pixels exist whole only as uint8; what grows is latents.
(The pipeline before this change grew by more than two such copies per frame.)"""

import pytest
import torch

from benchmarks.seedvr2 import FloatMemory
from engine.models.seedvr2.pipeline import SeedVR2Pipeline


pytestmark = pytest.mark.usefixtures("one_thread")


def peak_float_bytes(pipe: SeedVR2Pipeline, frames: int) -> int:
    clip = torch.randint(0, 256, (frames, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with FloatMemory() as memory:
        out = pipe.upscale(clip, scale=2)
    assert out.shape == (frames, 32, 32, 3) and memory.now == 0  # nothing float outlives the call
    return memory.peak


def test_float_memory_does_not_grow_with_the_clip_at_pixel_size():
    pipe = SeedVR2Pipeline.from_preset("tiny")
    pipe.predict = lambda cond: torch.zeros_like(cond[..., :16])
    short, long = peak_float_bytes(pipe, 9), peak_float_bytes(pipe, 25)
    one_float_copy = (25 - 9) * 3 * 32 * 32 * 4  # the 16 frames more, [3, 32, 32] fp32 each
    assert short > one_float_copy  # the counter sees the VAE's chunks
    assert long - short < one_float_copy / 4


def test_the_counter_sees_what_is_held():
    with FloatMemory() as memory:
        held = [torch.ones(1000) for _ in range(3)]
        view = held[0][:10]
        del held[1:]
        assert memory.now == 4000 and memory.peak == 12000
        del held
        assert memory.now == 4000  # the view keeps its storage
        del view
    assert memory.now == 0
