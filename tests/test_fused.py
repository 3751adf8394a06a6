"""The fused block ops (engine/kernels/fused.py): the Triton kernels (interpreted on the CPU) against the reference
maths, which is the eager H3 block; odd widths, partial RoPE, padded head counts, batches, strided AdaLN tables."""

import pytest
import torch
import torch.nn as nn

from engine.kernels import fused, vsa
from engine.models.h3.dit import rope_inv_freq, rope_table
from engine.models.h3.config import TINY
from triton_interpreter import load_kernels


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, else interpreted


def rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def on(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.fixture
def kernels():
    return load_kernels("engine.kernels.fused_triton")


def tables(R, N, g):
    """Six AdaLN tables as the block gets them: chunks of one [R, 6N] projection (row stride 6N)."""
    return (torch.randn(R, 6 * N, generator=g) * 0.3).chunk(6, dim=-1)


def norm(N, g):
    layer = nn.RMSNorm(N, eps=1e-5)
    layer.weight.data = 1 + 0.2 * torch.randn(N, generator=g)
    return layer


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_residual_norm_kernels_match_reference(kernels, dtype, tol):
    g = torch.Generator().manual_seed(0)
    B, S, N, R = 2, 11, 48 + 5, 6  # a width that is not a power of two
    x, y = (torch.randn(B, S, N, generator=g) for _ in range(2))
    shift, scale, gate = tables(R, N, g)[:3]
    rows = torch.randint(0, R, (S,), generator=g)
    layer = norm(N, g)
    want_h = fused.modulated_rms_norm(x, layer, shift, scale, rows)
    want_x = fused.gated_residual(x, y, gate, rows)
    want_x2, want_h2 = fused.gated_residual_norm(x, y, gate, rows, layer, shift, scale)
    assert torch.equal(want_x2, want_x)

    x, y, shift, scale, gate, w, rows = on(x, y, shift, scale, gate, layer.weight, rows)
    c = lambda t: t.to(dtype)  # noqa: E731
    got_h = kernels.residual_norm(c(x), None, None, rows, c(w), layer.eps, c(shift), c(scale))[1]
    got_x = kernels.residual_norm(c(x), c(y), c(gate), rows)[0]
    got_x2, got_h2 = kernels.residual_norm(c(x), c(y), c(gate), rows, c(w), layer.eps, c(shift), c(scale))
    assert got_h.dtype == got_x.dtype == dtype
    assert rel_err(got_h, want_h) <= tol and rel_err(got_x, want_x) <= tol
    assert torch.equal(got_x2, got_x) and rel_err(got_h2, want_h2) <= tol


@pytest.mark.parametrize("heads,head_dim,rope_dim", [(3, 32, 24), (2, 16, 12), (5, 8, 0)])
def test_qk_norm_rope_kernel_matches_reference(kernels, heads, head_dim, rope_dim):
    """Partial rotation (24 of 32 channels, as 96 of 128 in the full model), a head count that is not a power of two,
    and no RoPE at all (the token refiner)."""
    g = torch.Generator().manual_seed(1)
    B, S = 2, 9
    qkv = torch.randn(B, S, 3 * heads * head_dim, generator=g)
    q_norm, k_norm = norm(head_dim, g), norm(head_dim, g)
    rope = None
    if rope_dim:
        positions = torch.randint(0, 30, (S, 3), generator=g).double() / 3
        inv_freq = 1.0 / (1e4 ** (torch.arange(0, rope_dim // 3, 2) / (rope_dim // 3)))
        rope = rope_table(positions, inv_freq)
        assert rope[0].shape == (S, rope_dim)
    want = fused.qk_norm_rope(qkv, heads, q_norm, k_norm, rope)
    for head_major in (False, True):
        got = kernels.qk_norm_rope(*on(qkv), heads, *on(q_norm.weight, k_norm.weight), q_norm.eps,
                                   rope and on(*rope), head_major)
        for a, b in zip(got, want):
            assert a.shape == b.shape == (B, S, heads, head_dim)
            assert rel_err(a, b) <= 1e-5
        assert all((t.transpose(1, 2) if head_major else t).is_contiguous() for t in got)


def test_qk_norm_rope_kernel_on_the_model_rope_table(kernels):
    """The tiny preset's real table: rope_freq_dim 4 -> 24 rotated channels of 32."""
    g = torch.Generator().manual_seed(2)
    S, heads, D = 7, TINY.num_attention_heads, TINY.attention_head_dim
    rope = rope_table(torch.randint(0, 9, (S, 3), generator=g), rope_inv_freq(TINY))
    qkv = torch.randn(1, S, 3 * heads * D, generator=g).bfloat16()
    q_norm, k_norm = norm(D, g).bfloat16(), norm(D, g).bfloat16()
    want = fused.qk_norm_rope(qkv.float(), heads, q_norm.float(), k_norm.float(), rope)
    got = kernels.qk_norm_rope(*on(qkv), heads, *on(q_norm.weight, k_norm.weight), q_norm.eps, on(*rope), True)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("F", [96, 2049 + 7])
def test_swiglu_kernel_matches_reference(kernels, F):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 2 * F, generator=g)
    assert rel_err(kernels.swiglu(*on(x)), fused.swiglu(x)) <= 1e-5


def test_kernels_refuse_a_table_of_the_wrong_width(kernels):
    x, table, rows = on(torch.randn(1, 3, 8), torch.zeros(2, 9), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="AdaLN table must be"):
        kernels.residual_norm(x, x, table, rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run swaps the kernels in; on a GPU they are the default")
@torch.no_grad()
def test_dit_with_the_kernels_equals_the_eager_dit(kernels, monkeypatch):
    """The whole tiny DiT (token refiner, 2 blocks, partial RoPE) with every fused op on the Triton path, dense (q/k/v
    head-major, as FA3 wants them) and under VSA (row-major, as its tiling wants them)."""
    from test_vsa import dit_case

    model, layout, args = dit_case()
    plan = vsa.build_plan(layout)
    eager = model(*args)
    with vsa.active(plan, topk=2):
        eager_sparse = model(*args)
    monkeypatch.setattr(fused, "_triton", lambda x: True)
    layouts = []
    qk_norm_rope = kernels.qk_norm_rope
    monkeypatch.setattr(kernels, "qk_norm_rope", lambda *a: layouts.append(a[-1]) or qk_norm_rope(*a))
    for a, b in zip(model(*args), eager):
        assert rel_err(a, b) <= 1e-5
    assert layouts and all(layouts)
    layouts.clear()
    with vsa.active(plan, topk=2):
        for a, b in zip(model(*args), eager_sparse):
            assert rel_err(a, b) <= 1e-5
    assert layouts and not any(layouts)
