"""SeedVR2 NaDiT: sizes of the released models, and the tiny 3B / 7B against a float64 reference written from the
spec equations (specs/seedvr2.md §1.3-2.5) with plain loops over the windows."""

import math

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_timestep_embedding

from engine.models.seedvr2.config import NADIT_3B, NADIT_7B, TINY_3B, TINY_7B
from engine.models.seedvr2.nadit import NaDiT, build_nadit, patchify, timestep_sinusoid
from engine.models.seedvr2.windows import window_partition, window_spans, window_size


@pytest.mark.parametrize("config, params, tensors, rope", [(NADIT_3B, 3_391_475_776, 635, 21),
                                                           (NADIT_7B, 8_239_607_872, 1128, 10)])
def test_released_sizes(config, params, tensors, rope):
    with torch.device("meta"):
        model = NaDiT(config)
    sd = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == params and len(sd) == tensors
    assert sd["blocks.0.attn.rope.rope.freqs"].shape == (rope,)
    last = config.num_layers - 1
    if config is NADIT_3B:
        assert sd["blocks.9.mlp.txt.proj_in_gate.weight"].shape == (6912, 2560)
        assert sd["blocks.10.attn.proj_qkv.all.weight"].shape == (7680, 2560)
        assert sd["vid_out_ada.out_scale"].shape == (2560,) and "vid_out_ada.out_gate" not in sd
        assert f"blocks.{last}.ada.all.attn_shift" in sd  # vid-only, but a shared block: `.all`
    else:
        assert sd[f"blocks.{last}.mlp.txt.proj_in.bias"].shape == (12288,)
        assert "vid_out_norm.weight" not in sd


def test_timestep_embedding_is_sin_then_cos():
    t = torch.tensor([1000.0, 3.5])
    ref = get_timestep_embedding(t, 256, flip_sin_to_cos=False, downscale_freq_shift=0)
    torch.testing.assert_close(timestep_sinusoid(t, 256), ref)


def perturbed(config, seed):
    model = build_nadit(config, seed=seed)
    with torch.no_grad():  # norms start at one and biases near zero: make every tensor matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _rotate(x, angles):
    """x [S, H, D] (float64): channel pairs (2j, 2j+1) as complex numbers times e^(i angle_j)."""
    p = angles.shape[-1]
    z = torch.view_as_complex(x[..., : 2 * p].reshape(*x.shape[:-1], p, 2).contiguous())
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.cat([torch.view_as_real(z).flatten(-2), x[..., 2 * p:]], dim=-1)


def reference_forward(model, vid, txt, timestep):
    """The spec's forward pass, float64, reading weights by checkpoint key."""
    c, P = model.config, {k: v.double() for k, v in model.state_dict().items()}
    heads, hd, L, eps = c.heads, c.head_dim, txt.shape[0], c.norm_eps

    def lin(x, name, bias=True):
        return x @ P[name + ".weight"].T + (P[name + ".bias"] if bias else 0)

    def rms(x, weight=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x if weight is None else x * weight

    if c.rope == "mmrope3d":
        d = hd // 3
        freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d)
    else:
        freqs = torch.linspace(1, 128, hd // 2 // 3 // 2, dtype=torch.float64) * math.pi

    T, H, W, C = vid.shape
    grid = (T, H // 2, W // 2)
    x = lin(vid.double().reshape(T, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4 * C),
            "vid_in.proj")
    s = lin(txt.double(), "txt_in")
    half = c.freq_dim // 2
    a = timestep * torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    e = torch.cat([a.sin(), a.cos()])
    e = lin(F.silu(lin(F.silu(lin(e, "emb_in.proj_in")), "emb_in.proj_hid")), "emb_in.proj_out")
    slots = {("attn", g): e[i::6] for i, g in enumerate(("shift", "scale", "gate"))}
    slots |= {("mlp", g): e[3 + i::6] for i, g in enumerate(("shift", "scale", "gate"))}  # interleaved (d, l, g)

    size = window_size(grid, c.num_windows, c.window_area, c.window_max_t)
    for i in range(c.num_layers):
        pre, last = f"blocks.{i}.", i == c.num_layers - 1

        def S(stream):
            return "all" if i >= c.mm_layers else stream

        def mod(h, stream, layer):
            p = f"{pre}ada.{S(stream)}.{layer}_"
            return h * (slots[layer, "scale"] + P[p + "scale"]) + slots[layer, "shift"] + P[p + "shift"]

        def gate(h, stream, layer):
            return h * (slots[layer, "gate"] + P[f"{pre}ada.{S(stream)}.{layer}_gate"])

        def qkv(h, stream):
            q, k, v = lin(h, f"{pre}attn.proj_qkv.{S(stream)}", bias=False).view(-1, 3, heads, hd).unbind(1)
            norm = f"{pre}attn.norm_%s.{S(stream)}.weight"
            return rms(q, P[norm % "q"]), rms(k, P[norm % "k"]), v

        qv, kv, vv = qkv(mod(rms(x), "vid", "attn"), "vid")
        text_in = rms(s) if last and c.last_block_vid_only else mod(rms(s), "txt", "attn")
        qt, kt, vt = qkv(text_in, "txt")
        if c.rope == "mmrope3d":
            pos = torch.arange(L, dtype=torch.float64)
            ang = torch.cat([pos[:, None] * freqs] * 3, dim=-1)
            qt, kt = _rotate(qt, ang), _rotate(kt, ang)
        out_v, txt_acc = torch.zeros_like(qv), torch.zeros_like(qt)
        windows = window_partition(*grid, size, shifted=i % 2 == 1)
        for ix, spans in zip(windows, window_spans(grid, size, shifted=i % 2 == 1)):
            n = [b - a for a, b in spans]
            if c.rope == "mmrope3d":
                axes = [torch.arange(m, dtype=torch.float64) for m in n]
                axes[0] = axes[0] + L
            else:
                axes = [torch.linspace(-1, 1, m, dtype=torch.float64) for m in n]
            tt, hh, ww = torch.meshgrid(*axes, indexing="ij")
            ang = torch.cat([p.reshape(-1, 1) * freqs for p in (tt, hh, ww)], dim=-1)
            q = torch.cat([_rotate(qv[ix], ang), qt]).transpose(0, 1)
            k = torch.cat([_rotate(kv[ix], ang), kt]).transpose(0, 1)
            v = torch.cat([vv[ix], vt]).transpose(0, 1)
            o = (torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), dim=-1) @ v).transpose(0, 1)
            out_v[ix] = o[: len(ix)]
            txt_acc += o[len(ix):]
        x = x + gate(lin(out_v.flatten(1), f"{pre}attn.proj_out.{S('vid')}"), "vid", "attn")

        def mlp(h, stream):
            name = f"{pre}mlp.{S(stream)}"
            if c.mlp == "swiglu":
                return lin(F.silu(lin(h, name + ".proj_in_gate", False)) * lin(h, name + ".proj_in", False),
                           name + ".proj_out", False)
            return lin(F.gelu(lin(h, name + ".proj_in"), approximate="tanh"), name + ".proj_out")

        new_x = x + gate(mlp(mod(rms(x), "vid", "mlp"), "vid"), "vid", "mlp")
        if not last:
            s = s + gate(lin((txt_acc / len(windows)).flatten(1), f"{pre}attn.proj_out.{S('txt')}"), "txt", "attn")
            s = s + gate(mlp(mod(rms(s), "txt", "mlp"), "txt"), "txt", "mlp")
        x = new_x

    if c.output_norm:  # block 0's attn shift/scale slots + out_shift/out_scale
        x = rms(x, P["vid_out_norm.weight"]) * (slots["attn", "scale"] + P["vid_out_ada.out_scale"]) \
            + slots["attn", "shift"] + P["vid_out_ada.out_shift"]
    y = lin(x, "vid_out.proj")
    return y.view(*grid, 2, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(T, H, W, -1)


@pytest.mark.parametrize("config", [TINY_3B, TINY_7B], ids=["3b", "7b"])
def test_tiny_matches_spec_reference(config):
    model = perturbed(config, seed=1)
    gen = torch.Generator().manual_seed(0)
    vid = torch.randn(3, 16, 24, config.in_channels, generator=gen)  # grid 3x8x12: 27 / 48 windows
    txt = torch.randn(5, config.text_dim, generator=gen)
    layouts = model.layouts(model.grid(vid.shape[:3]))
    assert (len(layouts[0]), len(layouts[1])) == (27, 48)
    out = model(vid, txt, 1000.0)
    ref = reference_forward(model, vid, txt, 1000.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_window_order_and_split_do_not_matter():
    """Packing windows in another order, or splitting them over two 'ranks' whose text sums are added, changes
    nothing: what window-aligned sequence parallelism relies on."""
    model = perturbed(TINY_3B, seed=2)
    gen = torch.Generator().manual_seed(1)
    vid = torch.randn(3, 16, 24, 33, generator=gen)
    txt = torch.randn(5, TINY_3B.text_dim, generator=gen)
    grid = model.grid(vid.shape[:3])
    layouts = model.layouts(grid)
    emb = model.time_embedding(1000.0)
    rows = patchify(vid, TINY_3B.patch_size)

    def run(batches):
        out = model.forward_rows(rows[batches[0].index], txt, emb, batches)
        return torch.empty_like(out).index_copy_(0, batches[-1].index, out)

    reversed_ = {id(lay): lay.batch(list(reversed(range(len(lay))))) for lay in layouts}
    torch.testing.assert_close(run([reversed_[id(lay)] for lay in layouts]), run([lay.batch() for lay in layouts]))

    layout, attn = layouts[1], model.blocks[1].attn
    h_v = torch.randn(rows.shape[0], TINY_3B.dim, generator=gen)
    h_t = model.txt_in(txt)
    full_v, full_t = attn(h_v[layout.batch().index], h_t, layout.batch(), True, None)
    sums, parts = [], [list(range(0, len(layout), 2)), list(range(1, len(layout), 2))]
    for ids in parts:
        batch = layout.batch(ids)
        v, _ = attn(h_v[batch.index], h_t, batch, True, lambda s: sums.append(s.clone()) or s)
        torch.testing.assert_close(v, full_v[torch.cat([layout.batch().index.argsort()[batch.index]])])
    text = attn.proj_out.get("txt")(((sums[0] + sums[1]) / len(layout)).flatten(1))
    torch.testing.assert_close(text, full_t)


def test_last_block_drops_text_and_3b_text_skips_its_ada():
    model = build_nadit(TINY_3B)
    last = model.blocks[-1]
    assert last.ada.get("txt") is None and last.mlp.get("txt") is None and not last.text_out
    assert model.blocks[-2].ada.get("txt") is not None
    assert build_nadit(TINY_7B).blocks[-1].ada.get("txt") is not None
