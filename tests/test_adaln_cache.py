"""AdaLN projection cache: bit-identical on/off, exact keys (weights version, numeric settings), LRU bound,
weight offload and reload, and ranks that agree on every miss."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.cache.adaln import AdaLNCache, nbytes, projections
from engine.models.h3.config import TINY
from engine.models.h3.dit import build_dit
from engine.models.h3.lora import LoraWeight, merge_lora, unmerge_lora
from engine.models.h3.pipeline import GenerateRequest, H3Pipeline

REQ = GenerateRequest(prompt="a cat playing piano in the rain", seconds=5, steps=4, seed=3, width=64, height=64)
FL2VA = GenerateRequest(prompt="a door opens", seconds=5, steps=5, seed=1, width=64, height=64,
                        first_frame=np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def latents(result):
    return result.video_latents, result.audio_latents


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(latents(a), latents(b)))


def tiny_pipeline():
    """The tiny preset without VAE decoding, which these tests do not look at (it is most of their time)."""
    pipe = H3Pipeline.from_preset("tiny")
    pipe.video_vae.decode_chunks = lambda latents: iter([torch.zeros(1, 16, 16, 3, dtype=torch.uint8)])
    pipe.audio_vae.decode = lambda latents: torch.zeros(2, 1)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


@pytest.fixture(scope="module")
def uncached(pipe):
    """Reference results with the cache off."""
    pipe.adaln_cache = None
    return {"t2va": pipe.generate(REQ), "fl2va": pipe.generate(FL2VA)}


def test_cache_on_and_off_are_bit_identical(pipe, uncached):
    pipe.adaln_cache = cache = AdaLNCache()
    assert equal(pipe.generate(REQ), uncached["t2va"])
    assert cache.stats() == {"hits": 0, "misses": 3, "entries": 3, "bytes": cache.bytes, "offloaded": False}
    assert equal(pipe.generate(REQ), uncached["t2va"])
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 3
    assert equal(pipe.generate(FL2VA), uncached["fl2va"])  # a new schedule: 4 more misses
    assert cache.stats()["misses"] == 7 and cache.stats()["entries"] == 7


def test_offload_after_a_cached_schedule_and_reload_on_a_miss(pipe, uncached):
    pipe.adaln_cache = cache = AdaLNCache(offload=True)
    weights = [p for linear in projections(pipe.dit) for p in linear.parameters()]
    before = [(p.data_ptr(), p.detach().clone()) for p in weights]
    assert equal(pipe.generate(REQ), uncached["t2va"]) and cache.stats()["offloaded"]
    # Offloaded = the same parameters on new (host) storage, same values.
    assert all(p.data_ptr() != ptr and torch.equal(p, value) for p, (ptr, value) in zip(weights, before))
    assert equal(pipe.generate(REQ), uncached["t2va"]) and cache.stats()["hits"] == 3

    schedule = cache.schedule(pipe.dit)
    schedule(torch.tensor([0.123]))  # a miss brings the weights home
    assert not cache.stats()["offloaded"]
    assert equal(pipe.generate(FL2VA), uncached["fl2va"]) and cache.stats()["offloaded"]
    assert all(torch.equal(p, value) for p, (_, value) in zip(weights, before))


def test_lru_bound_in_bytes(pipe):
    dit = pipe.dit
    one = nbytes(dit.modulations(dit.time_embedding(torch.tensor([0.5]))))
    cache = AdaLNCache(max_bytes=2 * one)
    schedule = cache.schedule(dit)
    for t in (0.1, 0.2, 0.3, 0.1):
        schedule(torch.tensor([t]))
    assert cache.stats() == {"hits": 0, "misses": 4, "entries": 2, "bytes": 2 * one, "offloaded": False}
    schedule(torch.tensor([0.3]))  # 0.3 and the second 0.1 are kept
    schedule(torch.tensor([0.1]))
    assert cache.hits == 2


def test_lora_merge_and_weight_or_numeric_changes_miss():
    dit = build_dit(TINY)
    cache = AdaLNCache()
    schedule = cache.schedule(dit)
    t = torch.tensor([0.25, 0.75])
    base = schedule(t)
    assert schedule(t) is base and cache.hits == 1

    gen = torch.Generator().manual_seed(0)
    lora = {"blocks.1.adaln_proj.linear": LoraWeight(torch.randn(2, TINY.time_embed_dim, generator=gen),
                                                      torch.randn(18 * TINY.hidden_size, 2, generator=gen), None)}
    handle = merge_lora(dit, lora)
    merged = schedule(t)
    assert cache.misses == 2 and cache.stats()["entries"] == 1  # the old version's entry can never hit again
    fresh = dit.modulations(dit.time_embedding(t))
    assert all(torch.equal(a, b) for a, b in zip(merged[0][1], fresh[0][1]))
    assert not torch.equal(merged[0][1][0], base[0][1][0])
    unmerge_lora(dit, handle)
    restored = schedule(t)
    assert cache.misses == 3 and all(torch.equal(a, b) for a, b in zip(restored[0][1], base[0][1]))

    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = not previous
    try:
        schedule(t)
        torch.use_deterministic_algorithms(True)
        schedule(t)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = previous
        torch.use_deterministic_algorithms(False)
    assert cache.misses == 5
    assert schedule(t) is restored and cache.hits == 2

    dit.set_dtype(torch.bfloat16)
    assert schedule(t)[1][0].dtype == torch.bfloat16 and cache.misses == 6


def _rank(rank, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    pipe = tiny_pipeline()
    pipe.adaln_cache = cache = AdaLNCache(offload=True, group=dist.group.WORLD)
    stats, results = [], []
    for run in range(3):
        if run == 2 and rank == 1:
            cache.clear()  # rank 1 misses, rank 0 would hit: both must recompute
        results.append(latents(pipe.generate(REQ)))
        stats.append(dict(cache.stats()))
    torch.save(results, out_dir / f"rank{rank}.pt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(stats))
    dist.destroy_process_group()


def test_one_rank_missing_makes_every_rank_recompute(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), tmp_path), nprocs=2)
    for rank in range(2):
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [(s["hits"], s["misses"], s["offloaded"]) for s in stats] == [(0, 3, True), (3, 3, True),
                                                                             (3, 6, True)]
    runs = [r for rank in range(2) for r in torch.load(tmp_path / f"rank{rank}.pt")]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0]))
