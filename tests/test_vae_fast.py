"""The video VAE's fast path (engine/models/h3/video_vae_fast.py) against diffusers on the tiny preset (the real
compression), in fp32: decode and encode, tiled on an odd 3 x 5 grid whose overlaps are widened, untiled, every
latent / frame count, batch limits that split the batched calls differently; and its kernels (Triton interpreted on
the CPU) against the eager maths."""

import pytest
import torch
import torch.nn as nn

from engine.kernels import fused, group_norm
from engine.models.h3 import vae as V
from engine.models.h3.video_vae_fast import TileGrid, decode_clips, encode_video
from engine.quant.fp8 import Fp8Linear
from engine.quant.transform import QuantSwiGLU
from triton_interpreter import load_kernels

TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, else interpreted
# 48-px tiles, 16-px overlaps: a 96 x 160 canvas is 3 x 5 tiles, and the slack widens the first overlap of each axis;
# the encoder (costlier on the CPU) gets 96 x 64, 3 x 2 tiles, both axes widened too.
TILE, OVERLAP, HEIGHT, WIDTH = 48, 16, 96, 160
ENCODE_WIDTH = 64


@pytest.fixture(scope="module")
def vae():
    return V.VideoVAE(V.build_tiny_video_vae(seed=0).model, tile_size=TILE, tile_overlap=OVERLAP)


@pytest.fixture(scope="module")
def untiled():
    vae = V.build_tiny_video_vae(seed=1)
    vae.model.disable_tiling()
    return vae


def latents(num, h, w, seed=0):
    return torch.randn(1, 24, num, h, w, generator=torch.Generator().manual_seed(seed))


def pixels(batch, frames, height, width, seed=0):
    return torch.randn(batch, 3, frames, height, width, generator=torch.Generator().manual_seed(seed))


def max_err(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_the_test_canvas_is_an_odd_grid_with_widened_overlaps(vae):
    grid = TileGrid.of(vae.model, HEIGHT, WIDTH)
    assert (len(grid.rows), len(grid.cols)) == (3, 5)
    assert grid.row_overlaps == [32, 16] and grid.col_overlaps == [32, 16, 16, 16]
    assert TileGrid.of(vae.model, HEIGHT, ENCODE_WIDTH).col_overlaps == [32]


# --- decode ------------------------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("tiled, num_latents", [(True, 12), (True, 17), (False, 7), (False, 12)])
def test_decode_matches_diffusers(vae, untiled, tiled, num_latents):
    vae = vae if tiled else untiled
    z = latents(num_latents, HEIGHT // 16, WIDTH // 16, seed=num_latents) * vae.latents_std + vae.latents_mean
    ours = torch.cat(list(vae._decoded_chunks(z)), dim=2)
    assert max_err(ours, vae.model.decode(z, return_dict=False)[0]) < TOL


@torch.no_grad()
@pytest.mark.parametrize("num_latents", [2, 7])
def test_decode_chunks_match_the_reference_path(vae, num_latents):
    """Through `decode_chunks` (the 2-latent special case, uint8 host frames): as the diffusers path gives them."""
    z = latents(num_latents, HEIGHT // 16, WIDTH // 16, seed=10 + num_latents)
    ours = list(vae.decode_chunks(z))
    vae.reference = True
    try:
        reference = list(vae.decode_chunks(z))
    finally:
        vae.reference = False
    assert [c.shape for c in ours] == [c.shape for c in reference]
    assert max_err(torch.cat(ours).int(), torch.cat(reference).int()) <= 1  # float rounding may tip a level


@torch.no_grad()
def test_single_latent_decodes_as_one_tiled_clip(vae):
    z = latents(1, HEIGHT // 16, WIDTH // 16, seed=3)
    ours = next(decode_clips(vae.fast_decoder(), vae.model, [z]))
    assert max_err(ours, vae.model._decode_clip(z)) < TOL


@torch.no_grad()
def test_served_bytes_are_what_the_packed_networks_hold(vae):
    """The planner counts `served_bytes` for a GPU engine's video VAE: the packed bf16 decoder and encoder that
    `place` puts on the device, not diffusers' fp32 model, which stays in host memory."""
    from engine.models.h3.video_vae_fast import CausalEncoder, ViTDecoder

    def held(module):
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                   if t.is_floating_point() and t.numel() > 1)

    packed = (held(ViTDecoder.from_diffusers(vae.model, torch.bfloat16, torch.device("cpu")))
              + held(CausalEncoder(vae.model, torch.bfloat16, torch.device("cpu"))))
    diffusers = sum(p.numel() * 4 for p in vae.model.parameters())
    assert abs(vae.served_bytes() - packed) <= 0.05 * packed
    assert vae.served_bytes() < 0.6 * diffusers
    vae.place(torch.device("cpu"))  # off a GPU `place` is a plain move: the reference path stays whole
    assert vae.model.post_quant_conv.weight.device.type == "cpu"


def test_decoder_batch_limits_do_not_change_the_output(vae):
    """One tile per call, 4 per call (runs straddle clips: 15 tiles each), everything in one call."""
    decoder = vae.fast_decoder()
    z = latents(12, HEIGHT // 16, WIDTH // 16, seed=4)
    windows = [z[:, :, :7], z[:, :, 5:12]]
    tile_tokens = decoder.tokens(TileGrid.of(vae.model, HEIGHT, WIDTH).crops(windows[0], 16)[0].shape)
    runs = [list(decode_clips(decoder, vae.model, windows, max_tokens=n * tile_tokens)) for n in (1, 4, 30)]
    for run in runs[1:]:
        for clip, first in zip(run, runs[0]):
            assert max_err(clip, first) < TOL


@torch.no_grad()
def test_fp8_decoder_runs_dequantized_on_the_cpu(vae):
    z = latents(7, HEIGHT // 16, WIDTH // 16, seed=5) * vae.latents_std + vae.latents_mean
    exact = torch.cat(list(vae._decoded_chunks(z)), dim=2)
    vae.decode_fp8 = True
    try:
        assert isinstance(vae.fast_decoder().blocks[0].ff, QuantSwiGLU)
        gemms = [m for m in vae.fast_decoder().modules() if isinstance(m, Fp8Linear)]
        assert len(gemms) == 4 * len(vae.fast_decoder().blocks) and all(g.fast_accum for g in gemms)
        approx = torch.cat(list(vae._decoded_chunks(z)), dim=2)
    finally:
        vae.decode_fp8 = False
    assert 0 < max_err(approx, exact) < 0.1 * exact.abs().max().item()


@torch.no_grad()
def test_fp8_decoder_with_the_norms_quantizing_its_gemm_inputs_is_the_unfused_fp8_decoder(vae):
    """With fp8 GEMMs (`torch._scaled_mm`, which the CPU runs too) the norms hand qkv and fc1 their rows quantized;
    in fp32 that is the very quantization the layers would do, so the decode is the same to the bit."""
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
                         scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only (torch 2.11; 2.13 takes row scales)")
    z = latents(7, HEIGHT // 16, WIDTH // 16, seed=5) * vae.latents_std + vae.latents_mean
    vae.decode_fp8 = True
    decoder = vae.fast_decoder()
    try:
        assert decoder.fp8_rows is False  # no fp8 GEMMs on the CPU: the layers dequantize their weights
        for layer in decoder.modules():
            if hasattr(layer, "scaled_mm"):
                layer.scaled_mm = True
        unfused = torch.cat(list(vae._decoded_chunks(z)), dim=2)
        decoder.fp8_rows = True
        fused_rows = torch.cat(list(vae._decoded_chunks(z)), dim=2)
    finally:
        vae.decode_fp8 = False
        vae._fast.pop("decoder")
    assert torch.equal(fused_rows, unfused)


# --- encode ------------------------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("num_frames", [1, 22, 39])
@pytest.mark.parametrize("tiled", [True, False])
def test_encode_matches_diffusers(vae, untiled, num_frames, tiled):
    vae = vae if tiled else untiled
    height, width = (HEIGHT, ENCODE_WIDTH) if tiled else (64, 96)
    x = pixels(1, num_frames, height, width, seed=num_frames)
    calls = []
    ours = vae._encoded_clips(x, lambda: calls.append(1))
    assert len(calls) == vae.encode_chunks(num_frames)
    assert max_err(ours, vae.model._encode(x)) < TOL


@torch.no_grad()
def test_encoder_with_its_biases_folded_as_on_a_gpu_matches_diffusers(vae):
    """The CUDA path's order of work, run in fp32 on the CPU: bias folding (conv1's into norm2; conv2's and the
    shortcut's into the residual sum; conv_in's and the downsamplers' into the next block), conv_in as a conv2d over
    stacked frames, the downsamplers' inputs written by the residual sums: diffusers' latents to rounding."""
    encoder = vae.fast_encoder()
    x = pixels(1, 22, HEIGHT, ENCODE_WIDTH, seed=22)
    encoder.fold_biases = encoder.stack_conv_in = True
    try:
        ours = vae._encoded_clips(x, lambda: None)
    finally:
        encoder.fold_biases = encoder.stack_conv_in = False
    assert max_err(ours, vae.model._encode(x)) < TOL
    assert not torch.equal(ours, vae._encoded_clips(x, lambda: None))  # the folded order of additions did run


@torch.no_grad()
def test_encode_of_a_batch_and_its_posterior_match_diffusers(vae):
    """Two videos at once (training encodes batches), frame count off the 17n + 5 rule (padded by repetition)."""
    x = pixels(2, 10, HEIGHT, ENCODE_WIDTH, seed=6)
    ours = vae._encoded_clips(x, lambda: None)
    reference = vae.model.encode(x).latent_dist
    assert max_err(ours, reference.parameters) < TOL


@torch.no_grad()
def test_encoder_batch_limits_do_not_change_the_output(vae):
    """One tile per call, 4 per call (runs straddle the clips: 6 tiles each), all of a clip in one call."""
    encoder = vae.fast_encoder()
    x = pixels(1, 22, HEIGHT, ENCODE_WIDTH, seed=7)
    runs = [encode_video(encoder, vae.model, x, lambda: None, max_voxels=n * 17 * TILE * TILE) for n in (1, 4, 12)]
    for run in runs[1:]:
        assert max_err(run, runs[0]) < TOL


def test_encode_frames_recipe_matches_the_reference_path(untiled):
    frames = torch.randint(0, 256, (22, 32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    ours = untiled.encode_frames(frames)
    untiled.reference = True
    try:
        reference = untiled.encode_frames(frames)
    finally:
        untiled.reference = False
    # The same posterior sample: only where the fp16 rounding of the recipe tips does a value move (one fp16 step).
    assert max_err(ours, reference) < 2e-3 * reference.abs().max().item()


@torch.no_grad()
def test_fp8_encoder_runs_its_block_convolutions_in_fp8(vae):
    """`encode_fp8`: every ResNet block's k3 convolution takes fp8 inputs (the norm before it writes them) and fp8
    weights, one scale per output channel (on the CPU convolved in fp32); near diffusers, not equal to it, and the
    served bytes count those weights at one byte."""
    x = pixels(1, 22, HEIGHT, ENCODE_WIDTH, seed=9)
    exact = vae.model._encode(x)
    bf16_bytes = vae.served_bytes()
    vae.encode_fp8 = True
    try:
        encoder = vae.fast_encoder()
        blocks = [b for level in encoder.encoder.down_blocks for b in level.resnets]
        assert set(encoder.fp8) == {c for b in blocks for c in (b.conv1, b.conv2)}
        assert all(c.weight is None for c in encoder.fp8)
        approx = vae._encoded_clips(x, lambda: None)
        assert vae.served_bytes() < bf16_bytes
    finally:
        vae.encode_fp8 = False
    # fp8 keeps 3 mantissa bits to bf16's 7: on this 4-16 channel network the latents move ~14 % on average
    assert 0 < (approx - exact).abs().mean() < 0.2 * exact.abs().mean()


# --- kernels -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channels, out_channels", [(32, 48), (128, 16)])
def test_fp8_conv_kernel_is_the_convolution_of_the_fp8_values(channels, out_channels):
    """The implicit-GEMM kernel over a channels-last padded fp8 input (output channels off the block size, a row of
    output pixels split across blocks) against PyTorch's fp32 convolution of the same fp8 values."""
    from engine.kernels import conv_fp8

    kernels = load_kernels("engine.kernels.conv_fp8_triton")
    g = torch.Generator().manual_seed(channels)
    padded = torch.randn(2, channels, 5, 7, 9, generator=g).to(memory_format=torch.channels_last_3d)
    padded = padded.to(torch.float8_e4m3fn)
    weight, scale = conv_fp8.quantize_weight(torch.randn(out_channels, channels, 3, 3, 3, generator=g))
    want = conv_fp8.conv3d_k3(padded, weight, scale, torch.float32)
    assert want.shape == (2, out_channels, 3, 5, 7)
    out = torch.empty(2, 3, 5, 7, out_channels, device=DEVICE)
    kernels.conv3d_k3(padded.to(DEVICE).permute(0, 2, 3, 4, 1), weight.to(DEVICE), scale.to(DEVICE), out,
                      (16, 32, 64, 2, 4))
    assert max_err(out.permute(0, 4, 1, 2, 3).cpu(), want) < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("channels, groups, with_bias, reflect", [(12, 4, False, False), (256, 32, False, False),
                                                            (12, 4, True, True), (256, 32, True, True)])
def test_frame_group_norm_kernels_match_eager(channels, groups, with_bias, reflect):
    """Channels-last input 40 standard deviations from zero (the shifted sums keep the variance: the eager fp32 norm
    is off by 1e-3 there), written into the interior of a padded channels-last buffer; against the eager fp64 norm.
    With a bias folded in (a convolution's, per channel), against the eager norm of x + bias. With `reflect` the
    buffer's border is the interior reflected (F.pad's), on both paths, and its causal frames stay untouched."""
    kernels = load_kernels("engine.kernels.group_norm_triton")
    g = torch.Generator().manual_seed(channels)
    # 256 channels: blocks of 32 pixels, rows of 40 (blocks inside a row and across two, the border stores in few)
    n, t, h, w = (2, 3, 5, 7) if channels == 12 else (2, 2, 9, 40)
    x = (torch.randn(n, channels, t, h, w, generator=g) * 0.5 + 20.0).to(memory_format=torch.channels_last_3d)
    bias = 3 * torch.randn(channels, generator=g) if with_bias else None
    norm = nn.GroupNorm(groups, channels, eps=1e-6)
    norm.weight.data = 1 + 0.2 * torch.randn(channels, generator=g)
    norm.bias.data = 0.2 * torch.randn(channels, generator=g)
    want = torch.empty_like(x, dtype=torch.float64)
    x64 = x.double() if bias is None else x.double() + bias.double().view(-1, 1, 1, 1)
    group_norm.frame_group_norm_silu(x64, norm.double(), want)
    if reflect:
        want = torch.nn.functional.pad(want, (1, 1, 1, 1, 0, 0), mode="reflect")
    if bias is not None:  # the eager path folds the bias in too
        eager = torch.empty_like(want)
        group_norm.frame_group_norm_silu(x.double(), norm.double(), eager, bias.double(), reflect)
        assert max_err(eager, want) < 1e-12
    x, norm, bias = x.to(DEVICE), norm.float().to(DEVICE), None if bias is None else bias.to(DEVICE)
    buffer = torch.zeros(n, channels, t + 2, h + 2, w + 2, device=DEVICE).to(memory_format=torch.channels_last_3d)
    written = buffer[:, :, 2:] if reflect else buffer[:, :, 2:, 1:-1, 1:-1]
    group_norm.frame_group_norm_silu_triton(x, norm, written[..., 1:-1, 1:-1] if reflect else written, bias)
    if reflect:
        kernels.reflect_border(written, 1, 1, 1, 1)
    assert max_err(written.double().cpu(), want) < 1e-4
    assert buffer[:, :, :2].abs().max() == 0  # nothing written outside
    if not reflect:
        assert buffer[..., 0].abs().max() == 0 and buffer[..., -1, :].abs().max() == 0


@pytest.mark.parametrize("out_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_scaled_residual_norm_kernel_matches_eager(out_dtype, tol):
    kernels = load_kernels("engine.kernels.fused_triton")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 11, 53, generator=g) for _ in range(2))
    gate = 0.3 * torch.randn(53, generator=g)
    norm = nn.RMSNorm(53, eps=1e-5)
    norm.weight.data = 1 + 0.2 * torch.randn(53, generator=g)
    with torch.no_grad():
        want_x, want_h = fused.scaled_residual_norm(x, y.to(out_dtype), gate, norm, out_dtype)
        want_norm, want_residual = fused.rms_norm(x, norm, out_dtype), fused.scaled_residual(x, y, gate)
    x, y, gate, weight = (t.to(DEVICE) for t in (x, y, gate, norm.weight.detach()))
    got_x, got_h = kernels.scaled_residual_norm(x, y.to(out_dtype), gate, weight, norm.eps, out_dtype)
    assert got_x.dtype == torch.float32 and got_h.dtype == out_dtype
    assert max_err(got_x.cpu(), want_x) < 1e-5
    assert max_err(got_h.float().cpu(), want_h.float()) < tol
    assert max_err(kernels.scaled_residual_norm(x, None, None, weight, norm.eps, out_dtype)[1].float().cpu(),
                   want_norm.float()) < tol
    assert max_err(kernels.scaled_residual_norm(x, y, gate, None, None, None)[0].cpu(), want_residual) < 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("pad", [None, 0, 1])
def test_residual_bias_adds_skip_and_bias(dtype, tol, pad):
    """In place (pad None), or into a downsampler's padded input: its 2 causal frames untouched, the sum in the
    interior, with pad 1 the bottom row and right column reflected (F.pad's); the eager path and the kernel alike."""
    kernels = load_kernels("engine.kernels.group_norm_triton")
    g = torch.Generator().manual_seed(0)
    # 130 channels: two channel blocks, one masked; blocks of 32 pixels over rows of 40
    h, skip = (torch.randn(2, 130, 3, 9, 40, generator=g).to(memory_format=torch.channels_last_3d) for _ in range(2))
    bias = torch.randn(130, generator=g)
    want = h + skip + bias.view(-1, 1, 1, 1)
    if pad:
        want = torch.nn.functional.pad(want, (0, 1, 0, 1, 0, 0), mode="reflect")

    def padded_input(x):
        return torch.zeros(2, 130, 5, 9 + pad, 40 + pad, dtype=x.dtype, device=x.device).to(
            memory_format=torch.channels_last_3d)

    x = h.clone()
    buffer = None if pad is None else padded_input(x)
    got = group_norm.residual_bias(x, skip, bias, *(() if pad is None else (buffer[:, :, 2:], pad, pad)))
    assert max_err(got, want) < 1e-6  # the eager path
    assert got is x if pad is None else buffer[:, :, :2].abs().max() == 0

    x = h.to(DEVICE, dtype)
    buffer = None if pad is None else padded_input(x)
    out = x if pad is None else buffer[:, :, 2:]
    kernels.residual_bias(x, skip.to(DEVICE, dtype), bias.to(DEVICE), out[..., :9, :40])
    if pad:
        kernels.reflect_border(out, 0, 1, 0, 1)
    assert max_err(out.float().cpu(), want) < tol * want.abs().max().item()
    if pad is not None:
        assert buffer[:, :, :2].abs().max() == 0


@pytest.mark.parametrize("sides", [(1, 1, 1, 1), (0, 1, 0, 1), (1, 0, 0, 1)])
def test_reflect_border_kernel_is_f_pad_reflect(sides):
    """One launch writes the named borders of a strided buffer (a frames view of a padded input) from its interior,
    corners both ways, as F.pad's reflect; the kernel and the eager copies alike, nothing else touched."""
    kernels = load_kernels("engine.kernels.group_norm_triton")
    top, bottom, left, right = sides
    g = torch.Generator().manual_seed(sum(sides))
    interior = torch.randn(2, 70, 3, 6, 37, generator=g)
    want = torch.nn.functional.pad(interior, (left, right, top, bottom, 0, 0), mode="reflect")
    for device in ("cpu", DEVICE):
        buffer = torch.full((2, 70, 5, 6 + top + bottom, 37 + left + right), 7.0, device=device).to(
            memory_format=torch.channels_last_3d)
        frames = buffer[:, :, 2:]
        frames[..., top:top + 6, left:left + 37] = interior.to(device)
        if device == "cpu":
            group_norm.reflect_border(frames, top, bottom, left, right)
        else:
            kernels.reflect_border(frames, top, bottom, left, right)
        assert max_err(frames.cpu(), want) == 0
        assert (buffer[:, :, :2] == 7.0).all()


def test_scaled_residual_norm_kernel_quantizes_fp8_rows_as_the_reference():
    kernels = load_kernels("engine.kernels.fused_triton")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 11, 53, generator=g) for _ in range(2))
    x[0, 3] *= 1e3  # rows of very different ranges: one scale each
    gate = 0.3 * torch.randn(53, generator=g)
    norm = nn.RMSNorm(53, eps=1e-5)
    norm.weight.data = 1 + 0.2 * torch.randn(53, generator=g)
    with torch.no_grad():
        want_x, want = fused.scaled_residual_norm(x, y, gate, norm, torch.bfloat16, fp8_rows=True)
        want_alone = fused.rms_norm(x, norm, torch.bfloat16, fp8_rows=True)
    assert isinstance(want, fused.Fp8Rows) and want.dtype == torch.bfloat16 and want.scale.shape == (2, 11, 1)
    x, y, gate, weight = (t.to(DEVICE) for t in (x, y, gate, norm.weight.detach()))
    got_x, (q, scale) = kernels.scaled_residual_norm(x, y, gate, weight, norm.eps, torch.float8_e4m3fn)
    q_alone, scale_alone = kernels.scaled_residual_norm(x, None, None, weight, norm.eps, torch.float8_e4m3fn)[1]
    assert max_err(got_x.cpu(), want_x) < 1e-5
    for (q, scale), want in ((q, scale), want), ((q_alone, scale_alone), want_alone):
        assert q.dtype == torch.float8_e4m3fn and scale.shape == want.scale.shape
        assert torch.allclose(scale.cpu(), want.scale, rtol=1e-5)
        q, codes = q.cpu().float(), want.q.float()
        apart = q != codes
        if DEVICE == "cpu":  # triton 3.6's interpreter casts a value just under a power of two an octave down
            assert torch.equal(2 * q[apart], codes[apart])  # (125 -> 64, not 128); the GPU's cvt rounds as torch
        else:
            assert apart.float().mean() < 0.01  # its fp32 division may round a tie the other way


# --- on a GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_paths_on_the_gpu_stay_near_diffusers_fp32(dtype, tol):
    """The compiled kernels, cuDNN / FA3 attention and channels-last convolutions on the tiny preset: relative max
    error of the fast decode (fp16, bf16) and encode (bf16: 2.2 % where the CPU emulates it) against diffusers in fp32
    on the same GPU."""
    vae = V.VideoVAE(V.build_tiny_video_vae(seed=0).model, tile_size=TILE, tile_overlap=OVERLAP).to("cuda")
    vae.decode_dtype = dtype
    z = latents(12, HEIGHT // 16, WIDTH // 16).cuda() * vae.latents_std + vae.latents_mean
    reference = vae.model.decode(z, return_dict=False)[0]
    ours = torch.cat(list(vae._decoded_chunks(z)), dim=2)
    assert max_err(ours, reference) < tol * reference.abs().max().item()
    x = pixels(1, 22, HEIGHT, ENCODE_WIDTH).cuda()
    reference = vae.model._encode(x)
    ours = vae._encoded_clips(x, lambda: None)
    assert max_err(ours, reference) < 5e-2 * reference.abs().max().item()
    vae.encode_fp8 = True  # the fp8 inputs written by the compiled norms (4-16 channels: convolved in fp32)
    ours = vae._encoded_clips(x, lambda: None)
    assert (ours - reference).abs().mean() < 0.2 * reference.abs().mean()
