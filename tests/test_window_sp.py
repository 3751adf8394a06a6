"""Window-aligned sequence parallelism for SeedVR2: the planner and its all-to-all plan (property tests), and real
gloo ranks (2, 3 and 4) giving the one-rank result for the NaDiT (tiny 3B and 7B, uneven edge windows, ranks
without windows), the Ulysses variant, the VAE with its chunks spread over ranks, and the pipeline."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models.seedvr2.config import TINY_3B, TINY_7B, TINY_VAE
from engine.models.seedvr2.nadit import build_nadit
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.models.seedvr2.vae import build_vae
from engine.models.seedvr2.vae_parallel import ParallelVAE
from engine.models.seedvr2.windows import WindowLayout
from engine.parallel import seedvr2_ulysses, window_sp

CONFIGS = {"3b": TINY_3B, "7b": TINY_7B, "3b-4heads": dataclasses.replace(TINY_3B, heads=4, head_dim=16)}
# Latent (T, H, W): token grids 3x8x12 (27 / 48 windows), 5x7x11 (clipped edge windows on every axis, both
# layouts) and 1x2x2 (one window: ranks without any).
SHAPES = [(3, 16, 24), (5, 14, 22), (1, 4, 4)]
DEGREES = (2, 3, 4)
VAE_FRAMES = (29, 5)  # 4 encode chunks (9, 8, 8, 4 frames) and 1 chunk


def perturbed_dit(name):
    model = build_nadit(CONFIGS[name], seed=1)
    with torch.no_grad():  # norms start at one and biases near zero: make every tensor matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def inputs(name, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    config = CONFIGS[name]
    return torch.randn(*shape, config.in_channels, generator=gen), torch.randn(5, config.text_dim, generator=gen)


def tiny_vae():
    vae = build_vae(TINY_VAE, seed=0)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    vae.tile_size, vae.tile_overlap = 32, 16
    return vae


def video(frames, height=32, width=48):
    return torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(frames)) * 2 - 1


def vae_run(vae, frames, tiling):
    moments = vae.encode(video(frames), tiling=tiling)
    return moments, vae.decode(moments[:, :16], tiling=tiling)


def restored(pipe):
    clip = torch.rand(3, 9, 64, 96, generator=torch.Generator().manual_seed(4)) * 2 - 1
    return pipe.restore(clip, seed=2, tiling=False)


# ---- planner (no ranks) ------------------------------------------------------------------------------------


def test_largest_first_balancing():
    assert window_sp.assign_windows([5, 9, 9, 1, 7], 2) == [1, 0, 1, 1, 0]  # 9, 9, 7, 5, 1 onto the lighter rank
    assert window_sp.assign_windows([3, 3], 4) == [0, 1]  # ranks 2 and 3 get nothing
    layout = WindowLayout.build((31, 68, 120), (8, 15, 27), shifted=True)  # 121 frames at 1080p: 150 windows
    for world in (3, 7, 8):
        loads = window_sp.Assignment.build(layout, world).loads
        assert sum(loads) == 31 * 68 * 120
        assert max(loads) <= sum(loads) / world + max(layout.token_counts)  # the list-scheduling bound
        assert max(loads) / (sum(loads) / world) < 1.05


def simulate(grid, size, world, layers=4):
    """Runs every rank's plan of every layout switch on token ids instead of activations; returns what each switch
    put on each rank and the ids sent over the network."""
    plans = [window_sp.plan(grid, size, layers, world, rank) for rank in range(world)]
    switches = []
    for i in range(1, layers):
        src, dst = [p.batches[i - 1] for p in plans], [p.batches[i] for p in plans]
        if src[0] is dst[0]:
            continue
        inbox = [[None] * world for _ in range(world)]  # inbox[destination][source]
        for rank, p in enumerate(plans):
            ex = p.exchanges[src[rank], dst[rank]]
            for d, part in enumerate(src[rank].index[ex.send].split(ex.send_counts)):
                inbox[d][rank] = part
        landed = []
        for rank, p in enumerate(plans):
            ex = p.exchanges[src[rank], dst[rank]]
            assert [part.numel() for part in inbox[rank]] == ex.recv_counts
            landed.append(torch.cat(inbox[rank])[ex.order])
        sent = torch.cat([part for row in inbox for part in row])
        switches.append((landed, [b.index for b in dst], sent))
    return plans, switches


@settings(max_examples=150, deadline=None)
@given(t=st.integers(1, 7), h=st.integers(1, 12), w=st.integers(1, 16), world=st.integers(1, 7),
       size=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 6)))
def test_all_to_all_moves_each_token_exactly_once(t, h, w, world, size):
    n = t * h * w
    plans, switches = simulate((t, h, w), size, world)
    assert len(switches) == 3  # regular -> shifted -> regular -> shifted
    for landed, wanted, sent in switches:
        assert sorted(sent.tolist()) == list(range(n))  # every token sent exactly once (to itself or a peer)
        for got, want in zip(landed, wanted):
            assert torch.equal(got, want)  # and it lands where the next layout's packing puts it
    for layout, assignment in plans[0].assignments.items():
        owned = sorted(i for ids in assignment.windows for i in ids)
        assert owned == list(range(len(layout)))  # whole windows, each on one rank
        assert torch.equal(torch.cat(assignment.index).sort().values, torch.arange(n))


def test_plan_is_built_once_per_grid():
    a = window_sp.plan((3, 8, 12), (1, 3, 4), 4, 3, 1)
    assert window_sp.plan((3, 8, 12), (1, 3, 4), 4, 3, 1) is a
    assert len(a.exchanges) == 2 and a.batches[0] is a.batches[2]


def test_one_rank_is_the_model():
    model = perturbed_dit("3b")
    vid, txt = inputs("3b", SHAPES[1])
    with torch.no_grad():
        torch.testing.assert_close(window_sp.predict(model, vid, txt, 1000.0, None), model(vid, txt, 1000.0),
                                   rtol=0, atol=0)


# ---- real gloo ranks ---------------------------------------------------------------------------------------


def _rank(rank, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    groups = {degree: g for degree, g in groups.items() if rank < degree}
    results = {}
    with torch.no_grad():
        for name in ("3b", "7b"):
            model = perturbed_dit(name)
            for shape in SHAPES:
                vid, txt = inputs(name, shape)
                for degree, group in groups.items():
                    results["window", name, shape, degree] = window_sp.predict(model, vid, txt, 1000.0, group)
                if 2 in groups:
                    results["ulysses", name, shape, 2] = seedvr2_ulysses.predict(model, vid, txt, 1000.0, groups[2])
        model = perturbed_dit("3b-4heads")
        vid, txt = inputs("3b-4heads", SHAPES[1])
        results["ulysses", "3b-4heads", SHAPES[1], 4] = seedvr2_ulysses.predict(model, vid, txt, 1000.0, groups[4])
        try:
            seedvr2_ulysses.predict(perturbed_dit("3b"), *inputs("3b", SHAPES[0]), 1000.0, groups.get(3))
        except ValueError as e:
            results["ulysses error"] = str(e)

        vae = tiny_vae()
        for degree, group in groups.items():
            for frames in VAE_FRAMES:
                results["vae", frames, degree, False] = vae_run(ParallelVAE(vae, group), frames, False)
        if 2 in groups:
            results["vae", VAE_FRAMES[0], 2, True] = vae_run(ParallelVAE(vae, groups[2]), VAE_FRAMES[0], True)
            pipe = SeedVR2Pipeline.from_preset("tiny")
            pipe.group = groups[2]
            results["pipeline"] = restored(pipe)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("window_sp")
    mp.spawn(_rank, args=(str(out / "store"), out), nprocs=4)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def one_rank():
    out = {}
    with torch.no_grad():
        for name in CONFIGS:
            model = perturbed_dit(name)
            for shape in SHAPES:
                out[name, shape] = model(*inputs(name, shape), 1000.0)
    return out


@pytest.mark.parametrize("name", ["3b", "7b"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("degree", DEGREES)
def test_window_sp_equals_one_rank(ranks, one_rank, name, shape, degree):
    expected = one_rank[name, shape]
    for rank in range(degree):
        got = ranks[rank]["window", name, shape, degree]
        assert got.shape == expected.shape and rel(got, expected) <= 1e-5


@pytest.mark.parametrize("name, shape, degree", [("3b", s, 2) for s in SHAPES] + [("7b", s, 2) for s in SHAPES]
                         + [("3b-4heads", SHAPES[1], 4)])
def test_ulysses_equals_one_rank(ranks, one_rank, name, shape, degree):
    expected = one_rank[name, shape]
    for rank in range(degree):
        assert rel(ranks[rank]["ulysses", name, shape, degree], expected) <= 1e-5


def test_ulysses_needs_the_degree_to_divide_the_heads(ranks):
    assert all("degree 3 must divide the attention head count 2" in ranks[r]["ulysses error"] for r in range(3))


@pytest.fixture(scope="module")
def vae_one_rank():
    vae = tiny_vae()
    with torch.no_grad():
        return {(frames, tiling): vae_run(vae, frames, tiling) for frames in VAE_FRAMES for tiling in (False, True)}


@pytest.mark.parametrize("frames", VAE_FRAMES)
@pytest.mark.parametrize("degree", DEGREES)
def test_vae_over_ranks_equals_one_rank(ranks, vae_one_rank, frames, degree):
    moments, pixels = vae_one_rank[frames, False]
    for rank in range(degree):
        m, p = ranks[rank]["vae", frames, degree, False]
        assert m.shape == moments.shape and p.shape == pixels.shape
        assert rel(m, moments) <= 1e-5 and rel(p, pixels) <= 1e-5


def test_tiled_vae_over_ranks_equals_one_rank(ranks, vae_one_rank):
    moments, pixels = vae_one_rank[VAE_FRAMES[0], True]
    for rank in range(2):
        m, p = ranks[rank]["vae", VAE_FRAMES[0], 2, True]
        assert rel(m, moments) <= 1e-5 and rel(p, pixels) <= 1e-5


def test_pipeline_over_two_ranks_equals_one_rank(ranks):
    with torch.no_grad():
        expected = restored(SeedVR2Pipeline.from_preset("tiny"))
    for rank in range(2):
        assert rel(ranks[rank]["pipeline"], expected) <= 1e-5
