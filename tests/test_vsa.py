"""VSA (engine/kernels/vsa.py): cube tiling, top-k = all equals dense, padding, selection, DiT routing, gates."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import attention as attn
from engine.kernels import vsa
from engine.models.h3.config import TEXT_TAG, TINY, VIDEO_TAG
from engine.models.h3.dit import build_dit
from engine.models.h3.layout import ReferenceBlock, build_layout, build_ref2va_layout, row_timesteps
from triton_interpreter import load_kernels


def make_layout(T=5, h=5, w=7, text=7, audio=3, keyframes=("first",)):
    tags = torch.full((text,), TEXT_TAG)
    tags[1:3] = VIDEO_TAG  # vision pads inside the text stream are still text rows
    return build_layout(tags, T, 2 * h, 2 * w, audio, keyframes=keyframes)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def qkv(S, B=2, H=3, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g) for _ in range(3)]


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 9), h=st.integers(1, 9), w=st.integers(1, 9), text=st.integers(1, 70),
       audio=st.integers(0, 40), keyframes=st.sampled_from([(), ("first",), ("first", "last")]))
def test_tile_reorder_and_inverse_exact(T, h, w, text, audio, keyframes):
    layout = make_layout(T, h, w, text, audio, keyframes)
    plan = vsa.build_plan(layout)
    S, P = layout.seq_len, plan.num_dense
    assert plan.grid == (T, h, w) and P == S - T * h * w
    assert plan.num_cubes == math.ceil(T / 4) * math.ceil(h / 4) * math.ceil(w / 4)
    assert int(plan.cube_sizes.sum()) == T * h * w and int(plan.cube_sizes.min()) >= 1

    x = torch.randn(2, S, 3)
    tiled = plan.tile(x)
    assert tiled.shape[1] == P + plan.num_cubes * 64
    assert torch.equal(plan.untile(tiled), x)
    video = tiled[:, P:].view(2, plan.num_cubes, 64, 3)
    assert torch.equal(video[:, ~plan.cube_valid], torch.zeros_like(video[:, ~plan.cube_valid]))
    assert plan.slot.unique().numel() == S

    # Every cube holds one 4x4x4 neighbourhood of the (t, h, w) grid, real tokens first in (t, h, w) order; the
    # cubes in (t, h, w) order.
    t, r, c = torch.meshgrid(torch.arange(T), torch.arange(h), torch.arange(w), indexing="ij")
    cube_of_row = ((t // 4 * math.ceil(h / 4) + r // 4) * math.ceil(w / 4) + c // 4).flatten()
    assert torch.equal(plan.video_slot // 64, cube_of_row)
    assert torch.equal(plan.cube_sizes, torch.bincount(cube_of_row, minlength=plan.num_cubes).to(torch.int32))
    offsets = plan.video_slot % 64
    for cube in range(plan.num_cubes):
        rows = (plan.video_slot // 64 == cube).nonzero().flatten()
        assert torch.equal(offsets[rows], torch.arange(rows.numel()))

    # Prefix chunks never straddle text | condition | audio and hold at most 64 rows.
    text_end = layout.num_text
    cond_end = text_end + layout.num_condition_video_rows
    for lo, hi in [(0, text_end), (text_end, cond_end), (cond_end, P)]:
        if hi > lo:
            assert int(plan.prefix_tile_sizes[plan.prefix_tile[lo:hi].unique()].sum()) == hi - lo
    assert bool((plan.prefix_tile_sizes <= 64).all())

def ref2va_layout(T=5, h=5, w=7):
    """References at their own grids between the text and the target: image, a video with its sound, a sound."""
    blocks = (ReferenceBlock("image", 1, 4, 6), ReferenceBlock("video", 2, 6, 4, audio_latents=3),
              ReferenceBlock("audio", audio_latents=2))
    return build_ref2va_layout(torch.full((7,), TEXT_TAG), blocks, T, 2 * h, 2 * w, 3)


@pytest.mark.parametrize("keyframes", [(), ("first", "last"), "ref2va"])
def test_topk_all_equals_dense(keyframes):
    plan = vsa.build_plan(ref2va_layout() if keyframes == "ref2va" else make_layout(keyframes=keyframes))
    q, k, v = qkv(plan.seq_len)
    out = vsa.vsa_attention(q, k, v, plan, topk=plan.num_cubes)
    assert rel_err(out, attn.sdpa(q, k, v)) <= 1e-5


def test_padded_tokens_get_no_weight():
    plan = vsa.build_plan(make_layout(T=3, h=3, w=5))
    assert not bool(plan.cube_valid.all())
    q, k, v = qkv(plan.seq_len)
    qv, kv, vv = (plan.tile_video(x) for x in (q, k, v))
    P, C = plan.num_dense, plan.num_cubes
    selected = torch.arange(C, dtype=torch.int32).expand(2, 3, C, C)
    args = (k[:, :P], v[:, :P], selected, plan.cube_sizes)
    clean = vsa.fine_reference(qv, kv, vv, *args)
    pad = ~plan.cube_valid.flatten()
    kv[:, pad], vv[:, pad] = 1e4, -1e4
    assert torch.equal(vsa.fine_reference(qv, kv, vv, *args), clean)


def test_sparse_selection_has_topk_cubes_and_differs_from_dense():
    plan = vsa.build_plan(make_layout(T=9, h=6, w=7))
    q, k, v = qkv(plan.seq_len)
    C, topk = plan.num_cubes, 3
    assert C == 12 and vsa.topk_for_sparsity(0.75, C) == topk

    qv, kv = plan.tile_video(q), plan.tile_video(k)
    scores = vsa.pool_cubes(qv, plan.cube_sizes) @ vsa.pool_cubes(kv, plan.cube_sizes).transpose(-1, -2)
    selected = vsa.select_cubes(scores, topk)
    assert selected.shape == (2, 3, C, topk)
    assert all(row.unique().numel() == topk for row in selected.view(-1, topk))
    expected = scores.argsort(dim=-1, descending=True)[..., :topk].sort(dim=-1).values
    assert torch.equal(selected.long(), expected)

    out = vsa.vsa_attention(q, k, v, plan, topk)
    dense = attn.sdpa(q, k, v)
    assert torch.allclose(out[:, :plan.num_dense], dense[:, :plan.num_dense], rtol=1e-5, atol=1e-6)
    assert (out[:, plan.num_dense:] - dense[:, plan.num_dense:]).abs().max() > 1e-2


def test_coarse_branch_formula():
    """gate * coarse: pooled attention over the segment-pure prefix chunks and the cubes, for every row."""
    layout = make_layout(T=3, h=2, w=5, text=5, audio=70)
    plan = vsa.build_plan(layout)
    q, k, v = qkv(plan.seq_len)
    gate = torch.ones_like(q)
    out = vsa.vsa_attention(q, k, v, plan, 1, gate) - vsa.vsa_attention(q, k, v, plan, 1)

    text, cond, audio = range(5), range(5, 15), range(15, 155)
    video = range(155, plan.seq_len)
    groups = [text, cond, audio[:64], audio[64:128], audio[128:]]
    cube_rows = [[155 + i for i in range(len(video)) if int(plan.video_slot[i]) // 64 == c] for c in range(2)]
    tiles = [list(g) for g in groups] + cube_rows
    assert sum(map(len, tiles)) == plan.seq_len and plan.prefix_tile_sizes.tolist() == [5, 10, 64, 64, 12]
    pooled = [torch.stack([x[:, rows].mean(1) for rows in tiles], dim=1) for x in (q, k, v)]  # [B, tiles, H, D]
    weights = torch.einsum("bihd,bjhd->bhij", pooled[0], pooled[1]).div(4.0).softmax(-1)
    coarse = torch.einsum("bhij,bjhd->bihd", weights, pooled[2])
    for i, rows in enumerate(tiles):
        assert torch.allclose(out[:, rows], coarse[:, i:i + 1].expand_as(out[:, rows]), atol=1e-5)


def test_zero_gate_equals_training_free():
    plan = vsa.build_plan(make_layout())
    q, k, v = qkv(plan.seq_len)
    assert torch.equal(vsa.vsa_attention(q, k, v, plan, 2, torch.zeros_like(q)), vsa.vsa_attention(q, k, v, plan, 2))


def dit_case():
    model = build_dit(TINY, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    layout = make_layout(T=5, h=3, w=6, text=6, audio=4)
    g = torch.Generator().manual_seed(1)
    video = torch.randn(1, layout.video_indices.numel(), TINY.video_patch_dim, generator=g)
    audio = torch.randn(1, layout.audio_indices.numel(), TINY.audio_in_channels, generator=g)
    text = torch.randn(1, layout.num_text, TINY.text_dim, generator=g)
    timestep, idx = row_timesteps(layout, 0.3, 0.6)
    args = (video, audio, text, timestep, idx, layout.token_tags, layout.position_ids, layout.video_indices,
            layout.audio_indices, layout.text_indices)
    return model, layout, args


@torch.no_grad()
def test_dit_under_vsa_all_cubes_equals_dense():
    model, layout, args = dit_case()
    plan = vsa.build_plan(layout)
    dense = model(*args)
    with vsa.active(plan, topk=plan.num_cubes):
        full = model(*args)
    with vsa.active(plan, topk=1):
        sparse = model(*args)
    assert attn._sparse is None
    for ours, ref, sp in zip(full, dense, sparse):
        assert rel_err(ours, ref) <= 1e-5
        assert rel_err(sp, ref) > 1e-4  # the hook really routes the packed attention


@torch.no_grad()
def test_dit_trained_gates():
    model, layout, args = dit_case()
    plan = vsa.build_plan(layout)
    inner = TINY.num_attention_heads * TINY.attention_head_dim
    zeros = {f"blocks.{i}.attn.to_gate_compress.weight": torch.zeros(inner, TINY.hidden_size) for i in range(2)}
    trained = {key: torch.randn(inner, TINY.hidden_size) * 0.1 for key in zeros}
    with vsa.active(plan, topk=2):
        free = model(*args)
    with vsa.active(plan, topk=2, gates=vsa.block_gates(model, zeros)):
        zero = model(*args)
    gates = vsa.block_gates(model, trained)
    assert set(gates) == {block.attn for block in model.blocks}
    with vsa.active(plan, topk=2, gates=gates):
        gated = model(*args)
    assert all(not block.attn._forward_pre_hooks for block in model.blocks)
    for f, z, g in zip(free, zero, gated):
        assert torch.equal(f, z)
        assert rel_err(g, f) > 1e-3


def test_triton_kernel_matches_reference():
    """Runs the Triton kernel in the interpreter on CPU where triton is installed (else skipped)."""
    block_sparse_attention = load_kernels("engine.kernels.vsa_triton").block_sparse_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = vsa.build_plan(make_layout(T=5, h=5, w=6, text=9, audio=40)).to(device)
    assert plan.num_dense % 64 and bool((plan.cube_sizes < 64).any())  # padding in the prefix and in cubes
    # Head-major views, as the fused q/k-norm + RoPE kernel hands them over.
    q, k, v = (x.to(device).transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(plan.seq_len, D=32))
    P = plan.num_dense
    tol = 1e-2 if device == "cuda" else 1e-5  # tf32 dots on the GPU
    # Second case: every real score far below 0, so the padding keys' exact 0 is each row's max and subtracting
    # their share of the softmax sum would leave nothing: the kernel must rerun those blocks with the mask.
    for q, k in ((q, k), (-3 * q.abs(), 3 * k.abs())):
        qv, kv, vv = (plan.tile_video(x) for x in (q, k, v))
        scores = vsa.pool_cubes(qv, plan.cube_sizes) @ vsa.pool_cubes(kv, plan.cube_sizes).transpose(-1, -2)
        selected = vsa.select_cubes(scores, 3)
        args = (qv, kv, vv, k[:, :P], v[:, :P], selected, plan.cube_sizes)
        ref = plan.untile_video(vsa.fine_reference(*args))
        out = q.new_full(q.shape, float("nan"))
        block_sparse_attention(*args, plan.video_order, out[:, P:])  # writes every video row, untiled, in place
        assert rel_err(out[:, P:], ref) <= tol
        assert out[:, :P].isnan().all()


def test_triton_tiling_matches_plan():
    """The one-pass tiling (+ cube means) equals VSAPlan.tile_video (+ pool_cubes), from strided and head-major
    rows."""
    tile_video = load_kernels("engine.kernels.vsa_triton").tile_video
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = vsa.build_plan(make_layout(T=5, h=5, w=6, text=9, audio=40)).to(device)
    strided = torch.randn(2, plan.seq_len, 3, 5, 32, device=device)[:, :, 1]  # [B, S, H, D] sliced from fused QKV
    head_major = torch.randn(2, 5, plan.seq_len, 32, device=device).transpose(1, 2)
    for x in (strided, head_major):
        tiled, pooled = tile_video(x, plan.video_order, plan.cube_sizes, plan.num_dense, pool=True)
        assert torch.equal(tiled, plan.tile_video(x))
        assert torch.allclose(pooled, vsa.pool_cubes(plan.tile_video(x), plan.cube_sizes), rtol=1e-5, atol=1e-6)
    assert tile_video(x, plan.video_order, plan.cube_sizes, plan.num_dense, pool=False)[1] is None


def test_triton_cube_selection_matches_topk():
    """The radix-select kernel picks torch.topk's set, ascending; ties go to the lower cube; strided rows work
    (trained-gate mode selects from the video corner of a larger score matrix)."""
    kernels = load_kernels("engine.kernels.vsa_triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 1, 37, 37, generator=g)  # one head per batch: the interpreter runs a row per program
    scores[0, 0, 0] = torch.tensor([-0.0, 0.0, float("-inf"), 1e30, -1e30] * 7 + [2.5, 2.5])  # signs, extremes
    scores[1, 0, 5] = 1.0  # all tied
    scores[1, 0, 6, ::3] = 7.0  # ties across the cut
    for topk in (1, 5, 13, 37):
        expected = vsa.select_cubes(scores, topk)
        got = kernels.select_cubes(scores.to(device), topk).cpu()
        assert got.dtype == torch.int32 and torch.equal(got[1, 0, 5], torch.arange(topk, dtype=torch.int32))
        assert torch.equal(got.diff(dim=-1).gt(0).all(), torch.tensor(True))
        untied = torch.ones(2, 1, 37, dtype=torch.bool)
        untied[0, 0, 0] = untied[1, 0, 5] = untied[1, 0, 6] = False
        assert torch.equal(got[untied], expected[untied])
        picked = scores.gather(-1, got.long())
        kth = scores.topk(topk, dim=-1).values[..., -1:]
        assert bool((picked >= kth).all())  # a top-k set even where ties make it one of several
    assert kernels.select_cubes(scores.to(device), 3)[0, 0, 0].tolist() == [3, 8, 13]  # 7 tied at 1e30
    assert kernels.select_cubes(scores.to(device), 9)[0, 0, 0].tolist() == [3, 8, 13, 18, 23, 28, 33, 35, 36]
    gated = torch.randn(1, 2, 41, 41, generator=g)
    corner = gated[..., 4:, 4:]
    assert torch.equal(kernels.select_cubes(corner.to(device), 9).cpu(), vsa.select_cubes(corner, 9))


HOPPER_BUILD = textwrap.dedent("""
    import inspect, subprocess
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from engine.kernels import vsa_triton as kernels

    def build(fn, types, constexprs, **options):
        params = list(inspect.signature(fn.fn).parameters)
        signature = {p: types.get(p, "constexpr" if p in constexprs else "i32") for p in params}
        src = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        with open("kernel.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", "kernel.ptx", "-o", "kernel.cubin"],
                                capture_output=True, text=True, check=True).stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in report, report
        # Two CTAs per SM: 227 KiB of shared memory usable per SM, 1 KiB of it reserved per CTA (at 115 712 bytes
        # the fine kernel ran one CTA per SM on the H200: 132 instead of 116 ms at 362 frames).
        assert compiled.metadata.shared <= 227 * 1024 // 2 - 1024, compiled.metadata.shared
        print(fn.__name__, compiled.metadata.shared, "bytes of shared memory")

    tile, rows = "tensordesc<bf16[64,128]>", "tensordesc<bf16[1,64,1,128]>"
    build(kernels._fine_kernel, dict(Q=tile, K=tile, V=tile, KP=rows, VP=rows, O="*bf16", SEL="*i32", SIZES="*i32",
                                     ORDER="*i64", scale_log2="fp32"), dict(BLOCK=64, HEAD_DIM=128, TOPK_POW2=256),
          num_warps=4)
    for pooled in (False, True):
        build(kernels._tile_kernel, dict(X="*bf16", T="*bf16", POOL="*fp32", ORDER="*i64", SIZES="*i32"),
              dict(BLOCK=64, BLOCK_N=256, HEAD_DIM=128, POOLED=pooled), num_warps=4)
    build(kernels._select_kernel, dict(SCORES="*fp32", SEL="*i32"), dict(BLOCK_C=2048), num_warps=1)
""")


def test_triton_kernels_build_for_hopper(tmp_path):
    """The interpreter runs the kernels' logic on the CPU; this builds them for sm_90 (the H200) with triton's own
    ptxas, no GPU needed, at the full-size geometry: both compile, neither spills registers, and two fine-kernel
    CTAs fit on one SM."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", HOPPER_BUILD], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(name in run.stdout for name in ("_fine_kernel", "_tile_kernel", "_select_kernel"))


def test_pipeline_sparsity_zero_is_dense_and_sparse_differs():
    from engine.models.h3.pipeline import GenerateRequest, H3Pipeline

    pipe = H3Pipeline.from_preset("tiny")
    req = GenerateRequest(prompt="a kite in the wind", steps=3)
    dense = pipe.generate(req).video_latents
    pipe.vsa_sparsity = 0.5
    sparse = pipe.generate(req).video_latents
    pipe.vsa_sparsity = 0.0
    assert torch.equal(pipe.generate(req).video_latents, dense)
    assert not torch.equal(sparse, dense)


def test_every_backend_available_on_cpu_agrees_with_sdpa():
    from engine.kernels import attention as attn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 77, 2, 32, generator=g) for _ in range(3))
    reference = attn.sdpa(q, k, v)
    names = attn.backends("cpu")
    assert "flex" in names and "sdpa" in names
    for name in names:
        with attn.use_backend(name):
            out = attn.attention(q, k, v)
        assert torch.allclose(out, reference, atol=1e-5, rtol=1e-5), name
