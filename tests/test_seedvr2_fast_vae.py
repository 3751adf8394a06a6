"""The SeedVR2 VAE's fast path (channels-last activations, GroupNorm + SiLU in one pass, zero padding inside the
convolution, time bands) against the reference path, in fp32 on the CPU: several temporal chunks (the causal
carries), time bands and the row-band fallback, spatial tiles, and its chunks spread over two gloo ranks (carries
sent channels-last). Every causal conv of a fast run sees channels-last input, so a layout lost on the way (a silent
fallback to the reference) fails here."""

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine.models.seedvr2.vae as V
from engine.models.seedvr2.config import VAEConfig
from engine.models.seedvr2.vae import CausalConv3d, build_vae, channels_last, depth_to_space
from engine.models.seedvr2.vae_parallel import ParallelVAE

# Channels change between blocks (shortcut convs) and every group norms 2-4 channels.
CONFIG = VAEConfig(block_out_channels=(8, 16, 16, 32), layers_per_block=1, norm_groups=4)
TOL = {"rtol": 1e-5, "atol": 1e-5}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vae():
    model = build_vae(CONFIG, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="module")
def clip():
    return torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1


@contextmanager
def layouts(model):
    """Counts the inputs of the causal convs inside the block: {True: channels-last, False: not}."""
    seen = Counter()
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.update([channels_last(args[0])]))
             for m in model.modules() if isinstance(m, CausalConv3d)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def run(model, x, fast, encode_chunk=64, decode_chunk=16, tiling=False, group=None):
    model.channels_last, model.encode_chunk, model.decode_chunk = fast, encode_chunk, decode_chunk
    coder = model if group is None else ParallelVAE(model, group)
    try:
        with torch.no_grad():
            moments = coder.encode(x, tiling=tiling)
            return moments, coder.decode(moments[:, :16], tiling=tiling)
    finally:
        model.channels_last, model.encode_chunk, model.decode_chunk = None, 8, 2


@pytest.fixture(scope="module")
def reference(vae, clip):
    """The whole clip in one chunk, contiguous activations."""
    return run(vae, clip, fast=False)


def test_fast_path_equals_the_reference_across_chunks(vae, clip, reference):
    with layouts(vae) as seen:
        moments, pixels = run(vae, clip, fast=True, encode_chunk=4, decode_chunk=1)  # chunks: 5, 4 frames; 2, 1 latents
    assert seen[True] > 0 and seen[False] == 0  # every conv of the fast run saw channels-last input
    assert moments.shape == (1, 32, 3, 2, 3) and pixels.shape == (1, 3, 9, 16, 24)
    torch.testing.assert_close(moments, reference[0], **TOL)
    torch.testing.assert_close(pixels, reference[1], **TOL)


def test_fast_time_bands_and_row_bands_equal_the_reference(vae, clip, reference, monkeypatch):
    calls = Counter()
    for name in ("_conv", "_conv_padded"):
        method = getattr(CausalConv3d, name)
        monkeypatch.setattr(CausalConv3d, name, lambda self, x, name=name, method=method:
                            calls.update([name]) or method(self, x))
    # Full-resolution convs (8 or 16 channels x 16 x 24, padded 18 x 26) in bands of 1-4 output frames.
    monkeypatch.setattr(V, "CHANNELS_LAST_CONV_MAX_ELEMENTS", 3 * 16 * 18 * 26)
    with layouts(vae) as convs:
        banded = run(vae, clip, fast=True, encode_chunk=8, decode_chunk=2)
    assert calls["_conv_padded"] > convs[True] and calls["_conv"] == 0  # more calls than convs: bands

    calls.clear()  # not even one output frame fits: the reference's row bands, frame by frame
    monkeypatch.setattr(V, "CHANNELS_LAST_CONV_MAX_ELEMENTS", 2 * 8 * 18 * 26)
    monkeypatch.setattr(V, "CONV_MAX_ELEMENTS", 6000)  # 3-4 row bands per frame
    rows = run(vae, clip, fast=True, encode_chunk=8, decode_chunk=2)
    assert calls["_conv"] > 0
    for got in (banded, rows):
        torch.testing.assert_close(got[0], reference[0], **TOL)
        torch.testing.assert_close(got[1], reference[1], **TOL)


def test_fast_tiles_equal_the_reference_tiles(vae, clip):
    vae.tile_size, vae.tile_overlap = 16, 8  # 1 x 2 tiles of 16x16 pixels; 2x2 latents, each with its own carries
    try:
        tiled_reference = run(vae, clip, fast=False, tiling=True)
        tiled_fast = run(vae, clip, fast=True, encode_chunk=4, decode_chunk=1, tiling=True)
    finally:
        vae.tile_size, vae.tile_overlap = 1024, 128
    torch.testing.assert_close(tiled_fast[0], tiled_reference[0], **TOL)
    torch.testing.assert_close(tiled_fast[1], tiled_reference[1], **TOL)


def test_depth_to_space_keeps_the_layout():
    x = torch.randn(1, 4 * 2 * 3, 2, 3, 5)
    fast = depth_to_space(x.contiguous(memory_format=torch.channels_last_3d), 2, torch.channels_last_3d)
    assert channels_last(fast) and fast.shape == (1, 3, 4, 6, 10)
    assert torch.equal(fast, depth_to_space(x, 2))


def _rank(rank, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = build_vae(CONFIG, seed=0)
    torch.manual_seed(1)  # the same weights on both ranks
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    x = torch.rand(1, 3, 25, 8, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with layouts(model) as seen:  # chunks of 9, 8, 8 frames and 3, 2, 2 latents: two rounds, carries both ways
        fast = run(model, x, fast=True, encode_chunk=8, decode_chunk=2, group=dist.group.WORLD)
    torch.save((fast, seen[False], run(model, x, fast=False)), out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_fast_chunks_over_two_ranks_equal_the_reference(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), tmp_path), nprocs=2)
    for rank in range(2):
        (moments, pixels), contiguous, (ref_moments, ref_pixels) = torch.load(tmp_path / f"rank{rank}.pt")
        assert contiguous == 0  # the carries from the other rank arrived channels-last too
        torch.testing.assert_close(moments, ref_moments, **TOL)
        torch.testing.assert_close(pixels, ref_pixels, **TOL)
