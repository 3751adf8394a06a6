"""Ulysses sequence parallelism: 2 and 4 gloo ranks give the one-rank DiT output (fp32, S not divisible by the
degree), also under VSA and through the pipeline with the AdaLN cache agreeing over the group."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.kernels import vsa
from engine.models.h3 import layout as L
from engine.models.h3.config import TINY
from engine.models.h3.dit import build_dit
from engine.models.h3.request import GenerateRequest
from engine.parallel import ulysses

CONFIG = dataclasses.replace(TINY, num_attention_heads=4)  # 4 heads: degrees 2 and 4
# (keyframes, latent frames, latent height, latent width): S = 25, 37, 25 and 133, none divisible by 2 or 4;
# the edit mixes three video and audio timesteps.
CASES = {"t2va": ((), 2, 4, 6), "fl2va": (("first", "last"), 2, 4, 6), "edit": ((), 2, 4, 6),
         "vsa": (("first",), 5, 8, 10)}
REQ = GenerateRequest(prompt="two ranks, one answer", seconds=5, steps=4, seed=7, width=64, height=64)


def case(name):
    """The layout and DiT inputs of a case: 7 text rows, 3 stereo audio latents; the edit's rows are kept,
    partly or fully regenerated (three timesteps besides the text's)."""
    keyframes, T, h, w = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    lay = L.build_layout(torch.tensor([1, 1, 0, 1, 1, 0, 1]), T, h, w, 3, keyframes=keyframes)
    if name == "edit":
        levels = torch.tensor([1.0, 0.65, 0.3])
        t_video = levels[torch.randint(3, (lay.video_indices.numel(),), generator=gen)]
        t_audio = levels[torch.randint(3, (lay.audio_indices.numel(),), generator=gen)]
        timestep, idx = L.row_timesteps(lay, t_video, t_audio, t_text=0.45)
    else:
        timestep, idx = L.row_timesteps(lay, 0.3, 0.6)
    video = torch.randn(1, lay.video_indices.numel(), CONFIG.video_patch_dim, generator=gen)
    audio = torch.randn(1, lay.audio_indices.numel(), CONFIG.audio_in_channels, generator=gen)
    text = torch.randn(1, lay.num_text, CONFIG.text_dim, generator=gen)
    return lay, (video, audio, text, timestep, idx, lay.token_tags, lay.position_ids, lay.video_indices,
                 lay.audio_indices, lay.text_indices)


def run(dit, name):
    lay, inputs = case(name)
    if name != "vsa":
        return dit(*inputs)
    plan = vsa.build_plan(lay)
    with vsa.active(plan, topk=plan.num_cubes // 2):
        return dit(*inputs)


def pipeline_latents(group):
    from engine.models.h3.pipeline import H3Pipeline  # slow to import: only where it runs

    pipe = H3Pipeline.from_preset("tiny")  # 2 heads: degree 2
    pipe.video_vae.decode_chunks = lambda latents: iter([torch.zeros(1, 16, 16, 3, dtype=torch.uint8)])  # not tested
    pipe.audio_vae.decode = lambda latents: torch.zeros(2, 1)
    pipe.adaln_cache.group = group
    with ulysses.parallel(group):
        result = pipe.generate(REQ)
    return result.video_latents, result.audio_latents


def _rank(rank, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    dit = build_dit(CONFIG)
    results = {}
    with torch.no_grad():
        for name in CASES:
            for degree, group in groups.items():
                with ulysses.parallel(group):
                    results[name, degree] = run(dit, name)
        try:
            with ulysses.parallel(dist.group.WORLD):
                run(build_dit(TINY), "t2va")  # 2 heads over 4 ranks
        except ValueError as e:
            results["error"] = str(e)
    if rank < 2:
        results["pipeline"] = pipeline_latents(groups[2])
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses")
    mp.spawn(_rank, args=(str(out / "store"), out), nprocs=4)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("degree", [2, 4])
def test_ranks_equal_one_rank(ranks, name, degree):
    with torch.no_grad():
        video, audio = run(build_dit(CONFIG), name)
    for r in range(4):
        v, a = ranks[r][name, degree]
        assert v.shape == video.shape and a.shape == audio.shape
        assert rel(v, video) <= 1e-5 and rel(a, audio) <= 1e-5


def test_pipeline_with_two_ranks_equals_one_rank(ranks):
    video, audio = pipeline_latents(None)
    for r in range(2):
        v, a = ranks[r]["pipeline"]
        assert rel(v, video) <= 1e-5 and rel(a, audio) <= 1e-5


def test_degree_must_divide_heads(ranks):
    assert all("degree 4 must divide the attention head count 2" in r["error"] for r in ranks)


def test_without_a_group_nothing_is_split():
    sp = ulysses.shards(5)
    x = torch.arange(5)
    assert sp.split(x) is x and sp.gather(x) is x and sp.rows == 5
