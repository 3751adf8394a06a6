"""Tensor parallelism (engine/parallel/tensor.py, mesh.py): TP 2 (two ranks), TP 4 and TP 2 x Ulysses 2 over four
gloo ranks give the one-rank DiT output (fp32, S not divisible by the degrees) for t2va, fl2va, an edit layout and
under VSA; each rank holds 1/T of the cut layers; fp8 and int8 layers, a LoRA and the pipeline (AdaLN cache included)
are cut exactly; what cannot run is refused, naming what can."""

import asyncio
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from engine.models.h3.config import FULL, TINY
from engine.models.h3.dit import SwiGLU, build_dit
from engine.models.h3.lora import load_lora, merge_lora
from engine.models.h3.precision import block_gemms, int8_adaln, set_precision
from engine.models.h3.request import GenerateRequest
from engine.parallel import tensor
from engine.parallel.mesh import Mesh, Parallel, plan
from engine.quant.transform import QuantSpec, fuse_swiglu, quantize_linears
from engine.runtime.jobs import JobRunner
from engine.runtime.ranks import RankContext
from engine_fixture import REPO, free_port, start_engine
from test_ulysses import CASES, CONFIG, run  # 4 heads: TP 2 and 4, TP 2 x Ulysses 2

LORA_MODULES = ("blocks.0.attn.qkv_proj", "blocks.1.attn.out_proj", "blocks.0.mlp.fc1", "blocks.1.mlp.fc2",
                "token_refiner.blocks.0.attn.qkv_proj", "blocks.1.adaln_proj.linear", "video_patch_proj")
REQ = GenerateRequest(prompt="four ranks, one answer", seconds=5, steps=3, seed=7, width=64, height=64)
JOB = {"prompt": "two ranks, one answer", "steps": 3, "seed": 7, "width": 64, "height": 64}


def int8(dit, int_mm=False):
    """The block GEMMs int8 ConvRot in groups of 16 columns (fc2's 96 split 4 ways are not whole groups); run
    dequantized, or as W8A8 (`int_mm`), which quantizes each rank's slice of the activations on its own."""
    quantize_linears(dit, dict.fromkeys(block_gemms(dit), QuantSpec("int8_convrot", group=16)))
    for name in block_gemms(dit):
        dit.get_submodule(name).int_mm = int_mm
    return fuse_swiglu(dit, SwiGLU)


def counts(dit):
    """(parameters and buffers of the cut layers, of everything else)."""
    cut = {id(t) for name, m in dit.named_modules() if tensor.cut_of(name) for t in (*m.parameters(), *m.buffers())}
    tensors = (*dit.parameters(), *dit.buffers())
    return (sum(t.numel() for t in tensors if id(t) in cut), sum(t.numel() for t in tensors if id(t) not in cut))


def lora_file(path):
    gen = torch.Generator().manual_seed(3)
    dit = build_dit(CONFIG)
    tensors = {}
    for name in LORA_MODULES:
        linear = dit.get_submodule(name)
        tensors[f"{name}.lora_A.weight"] = torch.randn(4, linear.in_features, generator=gen) * 0.2
        tensors[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, 4, generator=gen) * 0.2
    save_file(tensors, str(path))
    return path


def with_lora(dit, path):
    """What H3Pipeline.loras merges: the file read at full width, cut like the DiT."""
    merge_lora(dit, tensor.shard_lora(dit, load_lora(path, tensor.full_width(dit))))
    return dit


def pipeline_latents(parallel, lora):
    from engine.models.h3.pipeline import H3Pipeline  # slow to import: only where it runs

    pipe = H3Pipeline.from_preset("tiny", config=CONFIG)
    pipe.video_vae.decode_chunks = lambda latents: iter([torch.zeros(1, 16, 16, 3, dtype=torch.uint8)])  # not tested
    pipe.audio_vae.decode = lambda latents: torch.zeros(2, 1)
    pipe.parallel, pipe.dit = parallel, parallel.shard(pipe.dit)
    pipe.adaln_cache.group = dist.group.WORLD if dist.is_initialized() else None
    with parallel.sequence_parallel():
        with_lora = pipe.generate(dataclasses.replace(REQ, loras=[(str(lora), 0.8)]))
        plain = pipe.generate(REQ)
        again = pipe.generate(REQ)  # the AdaLN tables of these timesteps come from the cache now
    return (with_lora.video_latents, with_lora.audio_latents, plain.video_latents, again.video_latents,
            pipe.adaln_cache.hits)


def _rank(rank, store, out_dir, lora):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    tp2 = Parallel.build(Mesh(4, 2, 2), dist.group.WORLD)  # TP {0, 1}, {2, 3}; Ulysses {0, 2}, {1, 3}
    tp4 = Parallel.build(Mesh(4, 4, 1), dist.group.WORLD)
    results = {}
    with torch.no_grad():
        for degree, parallel in ((2, tp2), (4, tp4)):
            dit = parallel.shard(build_dit(CONFIG))
            results["counts", degree] = counts(dit)
            for name in CASES:
                results[name, degree] = run(dit, name)
                if degree == 2:
                    with parallel.sequence_parallel():
                        results[name, "2x2"] = run(dit, name)
        results["lora"] = run(with_lora(tp2.shard(build_dit(CONFIG)), lora), "t2va")
        results["fp8"] = run(tp2.shard(set_precision(build_dit(CONFIG), "fp8")), "t2va")
        results["fp8 after"] = run(set_precision(tp2.shard(build_dit(CONFIG)), "fp8"), "t2va")
        results["int8"] = run(tp2.shard(int8(build_dit(CONFIG))), "t2va")
        results["w8a8"] = run(tp2.shard(int8(build_dit(CONFIG), int_mm=True)), "t2va")
        cut = tp2.shard(build_dit(CONFIG))
        results["int8 adaln after"] = run(quantize_linears(cut, int8_adaln(cut)), "t2va")
        for what, make in (("heads", lambda: build_dit(TINY)), ("int8", lambda: int8(build_dit(CONFIG)))):
            try:
                tp4.shard(make())
            except ValueError as e:
                results["error", what] = str(e)
    results["pipeline"] = pipeline_latents(tp2, lora)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return lora_file(tmp_path_factory.mktemp("lora") / "lora.safetensors")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, lora):
    out = tmp_path_factory.mktemp("tensor_parallel")
    mp.spawn(_rank, args=(str(out / "store"), out, lora), nprocs=4)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def assert_ranks_equal(ranks, key, video, audio, tol=1e-5):
    for r in range(4):
        v, a = ranks[r][key]
        assert v.shape == video.shape and a.shape == audio.shape
        assert rel(v, video) <= tol and rel(a, audio) <= tol, (key, r, rel(v, video), rel(a, audio))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mesh", [2, 4, "2x2"])
def test_ranks_equal_one_rank(ranks, name, mesh):
    with torch.no_grad():
        video, audio = run(build_dit(CONFIG), name)
    assert_ranks_equal(ranks, (name, mesh), video, audio)


@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_holds_a_share_of_the_cut_layers(ranks, degree):
    cut, other = counts(build_dit(CONFIG))
    assert cut > 10 * other  # the cut layers are most of the model
    assert all(r["counts", degree] == (cut // degree, other) for r in ranks)


def test_quantized_layers_are_cut_exactly(ranks):
    """Stored fp8 / int8 layers (a quantized file, or quantized before the cut) keep their exact rows on each rank;
    quantized after the cut (the engine's order) they keep the collectives, each slice with its own fp8 scale."""
    with torch.no_grad():
        fp8 = run(set_precision(build_dit(CONFIG), "fp8"), "t2va")
        assert_ranks_equal(ranks, "fp8", *fp8)
        assert_ranks_equal(ranks, "int8", *run(int8(build_dit(CONFIG)), "t2va"))
        assert_ranks_equal(ranks, "w8a8", *run(int8(build_dit(CONFIG), int_mm=True), "t2va"), tol=1e-3)
        assert_ranks_equal(ranks, "fp8 after", *fp8, tol=2e-3)  # 4e-2 without the collectives
        # Online int8's AdaLN projections (rows cut, then quantized row by row: the same rows as on one rank).
        whole = build_dit(CONFIG)
        adaln = run(quantize_linears(whole, int8_adaln(whole)), "t2va")
        assert rel(adaln[0], run(build_dit(CONFIG), "t2va")[0]) > 1e-4
        assert_ranks_equal(ranks, "int8 adaln after", *adaln)
        assert rel(run(build_dit(CONFIG), "t2va")[0], fp8[0]) > 1e-3  # fp8 rounding shows at that tolerance


def test_lora_on_the_shards_equals_one_rank(ranks, lora):
    with torch.no_grad():
        video, audio = run(with_lora(build_dit(CONFIG), lora), "t2va")
        assert rel(video, run(build_dit(CONFIG), "t2va")[0]) > 1e-2  # the LoRA changes the output
    assert_ranks_equal(ranks, "lora", video, audio)


def test_pipeline_with_tp2_ulysses2_equals_one_rank(ranks, lora):
    video, audio, plain, _, _ = pipeline_latents(Parallel(Mesh(1)), lora)
    assert rel(video, plain) > 1e-2  # the LoRA changes the output
    for r in ranks:
        v, a, v_plain, v_again, hits = r["pipeline"]
        assert rel(v, video) <= 1e-5 and rel(a, audio) <= 1e-5 and rel(v_plain, plain) <= 1e-5
        assert torch.equal(v_again, v_plain) and hits > 0


def test_illegal_degrees_are_refused(ranks):
    assert all("Tensor parallelism over 4 ranks does not fit this DiT (2 attention heads, FFN width 96): the degree "
               "must be one of 1, 2." == r["error", "heads"] for r in ranks)
    assert all(r["error", "int8"].startswith("'blocks.0.mlp.fc2' is stored int8 ConvRot, rotated in groups of 16 "
                                             "input columns; split 4 ways its 96 columns are 24 per rank")
               for r in ranks)


def test_serve_plan():
    assert tensor.tp_degrees(FULL) == [1, 2, 4, 8] and tensor.tp_degrees(CONFIG) == [1, 2, 4]
    assert plan(8, 2, FULL) == Mesh(8, 2, 4) and plan(8, 2, FULL).describe() == "tensor parallel x2 · ulysses x4"
    assert plan(4, 4, FULL).describe() == "tensor parallel x4" and plan(4, 1, FULL).describe() == "ulysses x4"
    assert plan(6, 1, FULL).describe() == "replicated on 6 ranks"
    with pytest.raises(ValueError) as e:
        plan(4, 3, FULL)
    assert str(e.value) == ("--gpus 4 --tp 3 is not possible: MiniMax-H3 has 56 attention heads; with 4 GPUs use "
                            "--tp 1 (Ulysses 4), --tp 2 (Ulysses 2) or --tp 4")
    with pytest.raises(ValueError, match=r"with 7 GPUs use --tp 1 \(Ulysses 7\)$"):
        plan(7, 7, FULL)  # 7 splits the heads, not sglang's 96 video channels
    with pytest.raises(ValueError, match=r"with 6 GPUs use --tp 1 \(the whole sequence on every GPU\)$"):
        plan(6, 2, FULL)  # 28 heads per TP pair do not split 3 ways


def test_status_names_the_mesh():
    class Pipeline:
        parallel = Parallel(Mesh(4, 2, 2))

        def describe(self):
            return {}

    assert JobRunner(RankContext(0, 4, torch.device("cpu")), Pipeline()).describe() == {
        "parallel": "tensor parallel x2 · ulysses x2"}


def test_serve_with_tp2_answers_as_one_rank(tmp_path):
    """`serve --gpus 2 --tp 2`: the tiny preset's DiT (2 heads) cut over two gloo ranks."""
    from engine.models.h3.pipeline import H3Pipeline
    from engine.runtime.jobs import JobSpec, generate_request

    with start_engine(tmp_path, "--gpus", "2", "--tp", "2") as engine:
        client = engine.client()
        assert asyncio.run(client.status())["models"]["parallel"] == "tensor parallel x2"
        two = torch.from_numpy(asyncio.run(client.run("t2va", JOB)).frames.copy()).float()
    one = H3Pipeline.from_preset("tiny").generate(generate_request(JobSpec("one", "t2va", JOB))).frames
    one = torch.as_tensor(np.asarray(one)).float()
    assert (two - one).abs().max() <= 2 and (two - one).abs().mean() < 0.05  # uint8 frames: float rounding only


def test_serve_refuses_a_tp_the_ranks_cannot_run(tmp_path):
    cmd = [sys.executable, "-m", "engine", "serve", "--preset", "tiny", "--device", "cpu", "--port", str(free_port()),
           "--token-file", str(tmp_path / "token"), "--gpus", "2", "--tp", "4"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("--gpus 2 --tp 4 is not possible: MiniMax-H3 has 2 attention heads; with 2 GPUs use --tp 1 (Ulysses 2) "
            "or --tp 2") in done.stderr
