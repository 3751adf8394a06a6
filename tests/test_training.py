"""The training script's CPU smoke run (`python -m training.train --smoke`): every stage (video VAE, audio VAE, text
encoder, DiT) takes a few steps on one batch and its loss falls, and the files it writes are Comfy-Org single files
the engine's strict loaders read (the embedded architecture recognised from the text encoder's header)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.models.h3 import mask as M
from engine.models.h3.pipeline import TINY_CANVAS, H3Pipeline
from engine_fixture import REPO
from training.train import FILES, TOY, clip_odds, pick_batch


def test_smoke_run_lowers_every_loss_and_writes_loadable_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "training.train", "--smoke", "--video-shift", "3", "--out",
                           str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "smoke_log.jsonl").read_text().splitlines()]
    for stage, key in (("video_vae", "recon"), ("audio_vae", "loss"), ("text", "loss"), ("dit", "loss")):
        losses = [r[key] for r in rows if r["stage"] == stage]
        assert len(losses) == 6 and losses[-1] < losses[0], (stage, losses)
    assert any(r["stage"] == "eval" and "t2va_pass" in r for r in rows)  # the scoring path ran
    pipe = H3Pipeline.from_files(*(tmp_path / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                 device="cpu", dtype=torch.float32)
    assert pipe.dit.config == TOY and pipe.canvas == TINY_CANVAS
    assert pipe.video_shift == 3.0  # trained for, recorded in the DiT file's header, used by the schedule
    assert pipe.describe()["summary"].startswith(f"DiT {FILES['dit']} (bf16")


def test_every_task_layout_trains_the_dit():
    """Each row layout of the mix (t2va, fl2va first / first+last with picture blocks, masked edit, extension guide
    rows on a shifted clock) gives a finite loss whose gradient reaches the DiT's text, video and audio inputs."""
    import numpy as np

    from engine.kernels import attention
    from training.train import TASKS, by_caption_length, dit_loss, prepare, toy_clips

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    data = prepare(pipe, toy_clips(range(2), 96, 64, 0.9, 1))
    groups = by_caption_length(pipe, data)
    assert sorted(i for g in groups for i in g) == [0, 1]
    sample = data[groups[0][0]]
    pictures = sample["tags"][("first", "last")].numel() - sample["tags"][()].numel()
    assert pictures > 0 and sample["text"][("first",)].shape[0] < sample["text"][("first", "last")].shape[0]
    pipe.dit.requires_grad_(True)
    for task in TASKS:
        pipe.dit.zero_grad(set_to_none=True)
        loss = dit_loss(pipe.dit, [sample] * 2, task, np.random.default_rng(0), torch.Generator().manual_seed(0))
        loss.backward()
        assert torch.isfinite(loss), task
        for proj in (pipe.dit.condition_proj, pipe.dit.video_patch_proj, pipe.dit.audio_patch_proj):
            assert proj.weight.grad.abs().sum() > 0, task
        with torch.no_grad():  # the same draws with the error's change between latent frames added: every layout's
            steadier = dit_loss(pipe.dit, [sample] * 2, task, np.random.default_rng(0),  # rows are frame-major
                                torch.Generator().manual_seed(0), temporal_weight=1.0)
        assert steadier > loss, task


def test_a_deepened_dit_computes_what_it_did_and_trains_its_new_blocks():
    """`--dit-layers`: the added blocks (copies with closed gates) leave every output as it was; their gates then
    take gradient, and a DiT cannot be shrunk."""
    from engine.kernels import attention
    from training.train import deepen, dit_loss, prepare, toy_clips

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    sample = prepare(pipe, toy_clips(range(1), 96, 64, 0.9, 1))[0]

    def loss(task):
        return dit_loss(pipe.dit, [sample], task, np.random.default_rng(0), torch.Generator().manual_seed(0))

    with torch.no_grad():
        before = {task: loss(task) for task in ("t2va", "extend")}
    old = pipe.dit.blocks[1]
    pipe.dit = deepen(pipe.dit, 5)
    assert len(pipe.dit.blocks) == pipe.dit.config.num_layers == 5 and pipe.dit.blocks[3] is old  # 0 0' 0' 1 1'
    with torch.no_grad():
        for task, value in before.items():
            assert torch.allclose(loss(task), value, rtol=1e-5, atol=1e-6), task
    pipe.dit.requires_grad_(True)
    loss("t2va").backward()
    added = [b for b in pipe.dit.blocks if b.adaln_proj.linear.bias.grad.abs().sum() > 0]
    assert len(added) == 5
    with pytest.raises(ValueError, match="only grow"):
        deepen(pipe.dit, 4)


def test_temporal_error_weighs_a_wavering_error_and_not_a_steady_one():
    from training.train import temporal_error

    frames, rows = 4, 6
    steady = torch.full((1, frames * rows, 3), 0.5)
    wavering = (torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5).repeat_interleave(rows)[None, :, None].expand(1, -1, 3)
    weight = torch.ones(1, frames * rows)
    assert float(temporal_error(steady, weight, frames)) == 0.0
    assert float(temporal_error(wavering, weight, frames)) == 1.0  # a change of 1 between every pair of frames
    kept = weight.clone()
    kept[0, rows:2 * rows] = 0  # an edit's kept cells in frame 1: its pairs with frames 0 and 2 do not count
    only_last = wavering.clone()
    only_last[0, :2 * rows] = 0.5
    assert float(temporal_error(only_last, kept, frames)) == 1.0  # frames 2-3 alone, as all frames wavering


def test_seedvr2_smoke_run_lowers_its_losses_and_writes_the_official_layout(tmp_path):
    from engine.models.seedvr2.config import TOY_3B, TOY_VAE
    from engine.models.seedvr2.pipeline import SeedVR2Pipeline

    proc = subprocess.run([sys.executable, "-m", "training.train_seedvr2", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "smoke_log.jsonl").read_text().splitlines()]
    for stage, key in (("sr_vae", "recon"), ("sr_dit", "loss")):
        losses = [r[key] for r in rows if r["stage"] == stage]
        assert len(losses) == 4 and losses[-1] < losses[0], (stage, losses)
    assert any(r["stage"] == "sr_eval" and "bicubic_psnr" in r for r in rows)
    pipe = SeedVR2Pipeline.from_preset("toy", root=tmp_path)  # the strict loaders of the official files
    assert pipe.dit.config == TOY_3B and pipe.vae.config == TOY_VAE and pipe.name == "toy"  # as the headers say


def test_a_fresh_seedvr2_vae_starts_with_little_posterior_noise():
    """At the default init the posterior's noise (std ~1) swamps the means (std ~0.3); fresh_vae starts it small."""
    from engine.models.seedvr2.config import TOY_VAE
    from engine.models.seedvr2.vae import build_vae
    from training.train_seedvr2 import fresh_vae

    x = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    stds = []
    for vae in (build_vae(TOY_VAE, seed=0), fresh_vae(TOY_VAE, 0, "cpu")):
        mean, logvar = vae.encoder(x).chunk(2, dim=1)
        stds.append((mean.std().item(), logvar.mul(0.5).exp().mean().item()))
    (mean_std, noise), (fresh_mean_std, fresh_noise) = stds
    assert noise > mean_std and fresh_noise < 0.05 * fresh_mean_std and fresh_mean_std == mean_std, stds


def test_embedded_default_loads_through_the_strict_loaders():
    from engine.models.seedvr2.pipeline import SeedVR2Pipeline

    pipe = H3Pipeline.from_preset("toy")
    assert pipe.dit.config == TOY and pipe.canvas == TINY_CANVAS and pipe.name == "toy"
    assert pipe.video_vae.latent_rgb[0].shape == (24, 3)
    assert SeedVR2Pipeline.from_preset("toy").name == "toy"


def test_a_fresh_dit_learns_to_read_the_caption():
    """Two clips that differ only in their background and their caption's background word: after 100 steps from a
    fresh DiT on the frozen text encoder, the right captions give a clearly lower loss than the swapped ones."""
    import numpy as np

    from engine.kernels import attention
    from engine.models.h3.dit import build_dit
    from training.toy_scene import Scene, ToyObject
    from training.toy_world import render
    from training.train import dit_loss, object_cover, object_tracks, prepare

    attention.set_backend("sdpa")
    torch.manual_seed(0)
    pipe = H3Pipeline.from_preset("toy")  # its trained VAEs and text encoder; the DiT drawn fresh
    pipe.dit = build_dit(TOY, seed=1).train().requires_grad_(True)
    clips = []
    for background in ("black", "white"):
        clip = render(Scene((ToyObject("ball", "red", "large", "stays still", 0.5, 0.5),), background, False, False, 1),
                      96, 64, num_frames=22)
        clips.append((clip.frames, clip.audio, clip.caption, object_cover(clip.masks), object_tracks(clip.masks), None,
                      clip.click_frames))
    data = prepare(pipe, clips)  # the text encoder frozen, as in training
    opt = torch.optim.AdamW(pipe.dit.parameters(), lr=1e-3)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    for _ in range(100):
        loss = dit_loss(pipe.dit, data, "t2va", rng, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def held_out_loss(batch):
        with torch.no_grad():
            return np.mean([dit_loss(pipe.dit, batch, "t2va", np.random.default_rng(s), torch.Generator().manual_seed(s))
                            .item() for s in range(4)])

    swapped = [{**data[0], "text": data[1]["text"]}, {**data[1], "text": data[0]["text"]}]
    right, wrong = held_out_loss(data), held_out_loss(swapped)
    assert right < 0.8 * wrong, (right, wrong)


def test_the_toy_audio_vae_learns_a_hum():
    """`train_audio_vae` on a fresh TOY_AUDIO_VAE and one batch of hums (two pitches, random phases): the decoded
    round trip carries each hum's pitch at its level. With log-magnitude STFT losses this decoded to near-silence
    (the committed tiny-preset audio VAE decodes every input to RMS 3e-4)."""
    import numpy as np

    from training.train import Log, fresh_audio_vae, train_audio_vae

    torch.manual_seed(0)
    t = np.arange(4000) / 32000
    rng = np.random.default_rng(0)
    hums = [0.12 * np.sin(2 * np.pi * pitch * t + rng.uniform(0, 2 * np.pi)) for pitch in (330.0, 742.5)]
    clips = [(None, np.stack([h, h]).astype(np.float32)) for h in hums]
    vae = fresh_audio_vae(0)
    train_audio_vae(vae, clips, 600, 2, 4000 / 32000, Log(None), rng, max_steps=40)
    for hum in hums:
        out = vae.decode(vae.encode(torch.from_numpy(np.stack([hum, hum]).astype(np.float32)), 32000))[0, :4000]
        spectrum_in, spectrum_out = (np.abs(np.fft.rfft(np.asarray(a) * np.hanning(4000))) for a in (hum, out))
        peak = spectrum_in.argmax()
        assert spectrum_out.argmax() == peak and 0.5 < spectrum_out[peak] / spectrum_in[peak] < 1.5


def test_the_click_recipe_crops_around_clicks_and_trains_toward_the_rain_free_sound(tmp_path):
    """`--audio-clicks`: most crops hold a click, the target is the scene's sound without its rain (the input
    keeps it), the knocks' envelope is judged where they are, and the whole VAE's loss falls on one batch."""
    import numpy as np

    from training.scoring import click_band
    from training.toy_scene import SAMPLE_RATE, sample_scene
    from training.toy_world import render
    from training.train import (CLICK_CENTRED, Log, click_envelope, click_segment, dry_sound, fresh_audio_vae,
                                train_audio_vae)

    seed = next(s for s in range(100) if sample_scene(s, 96, 64).rain
                and any(o.motion == "bounces" for o in sample_scene(s, 96, 64).objects))
    rainy = render(sample_scene(seed, 96, 64), 96, 64, num_frames=124).audio
    dry, starts = dry_sound((seed, 96, 64, 124))
    assert starts and dry.shape == rainy.shape and np.abs(rainy - dry).std() > 0.01  # the rain, and only it
    clips, length, rng = [(None, rainy)], 12800, np.random.default_rng(0)
    crops = [click_segment(clips, [(dry, starts)], [0], length, rng) for _ in range(200)]
    burst = [np.abs(click_band(target[None], SAMPLE_RATE)).max() > 0.05 for _, target in crops]  # a knock ~0.3
    assert CLICK_CENTRED - 0.1 < np.mean(burst) <= 1
    targets = torch.from_numpy(np.stack([t for _, t in crops[:4]]))[:, None]
    assert click_envelope(targets, targets, 800) == 0 and click_envelope(targets * 0, targets, 800) > 0
    heard, target = crops[0]  # the same samples of the same channel, with and without the rain
    channel, start = next((c, i) for c in range(2) for i in range(rainy.shape[1] - length + 1)
                          if np.array_equal(rainy[c, i:i + length], heard))
    assert np.array_equal(target, dry[channel, start:start + length])
    log = tmp_path / "log.jsonl"
    train_audio_vae(fresh_audio_vae(0), clips, 600, 2, length / SAMPLE_RATE, Log(log), rng, max_steps=6,
                    dry=[(dry, starts)], click_weight=100.0)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_the_header_stage_records_the_sampling_guidance_and_keeps_every_tensor(tmp_path):
    """`--stages header --sampling-guidance W` (how the committed DiT came to name 1.5) trains nothing: the four
    files written again hold the same tensors, and the DiT's header names W for the engine."""
    from safetensors import safe_open

    from engine.models.h3.checkpoint import GUIDANCE_METADATA, trained_sampling

    toy = REPO / "engine" / "weights" / "toy"
    proc = subprocess.run([sys.executable, "-m", "training.train", "--resume", str(toy), "--stages", "header",
                           "--sampling-guidance", "2.5", "--device", "cpu", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert trained_sampling(tmp_path / FILES["dit"], GUIDANCE_METADATA) == 2.5
    for name in FILES.values():
        with safe_open(toy / name, "pt") as before, safe_open(tmp_path / name, "pt") as after:
            assert set(before.keys()) == set(after.keys()), name
            assert all(torch.equal(before.get_tensor(k), after.get_tensor(k)) for k in before.keys()), name


def test_task_shares_take_overrides_and_name_the_tasks():
    from training.train import TASKS, task_shares

    assert task_shares(["extend=0.35"]) == {**TASKS, "extend": 0.35}
    with pytest.raises(SystemExit, match="one of t2va, first"):
        task_shares(["extension=0.3"])


def test_the_training_canvas_is_the_engines():
    """The clips are trained under the canvas rules the engine serves the toy preset with, reference size included
    (a 2048-px reference per clip made the data preparation of a 1536-clip run take over 5 minutes)."""
    import numpy as np

    from training.train import prepare, toy_clips, training_canvas

    assert training_canvas(224, 128) == TINY_CANVAS
    pipe = H3Pipeline.from_preset("tiny")
    pipe.canvas = training_canvas(96, 64)
    sample = prepare(pipe, toy_clips(range(1), 96, 64, 0.9, 1))[0]
    compression = pipe.video_vae.spatial_compression
    assert tuple(sample["reference"].shape[-2:]) == (128 // compression, 192 // compression)
    assert np.isfinite(sample["text"]["ref2va"].numpy()).all()


def test_a_fresh_video_decoder_keeps_the_latents(tmp_path):
    """`--fresh-video-decoder`: the committed encoder (so the latents the DiT learned) with a wider decoder, which
    decoder-only training improves while the latents stay the same."""
    import numpy as np

    from engine.models.h3.vae import TOY_VIDEO_VAE
    from training.train import Log, encode_video, fresh_video_decoder, toy_clips, train_video_vae

    torch.manual_seed(0)
    pipe = H3Pipeline.from_preset("toy")
    clips = toy_clips(range(1), 96, 64, 0.9, 1)
    before = encode_video(pipe.video_vae, clips[0])
    vae = fresh_video_decoder(pipe.video_vae, seed=0)
    assert vae.model.decoder.proj_in.out_features == (TOY_VIDEO_VAE["decoder_num_attention_heads"]
                                                       * TOY_VIDEO_VAE["decoder_attention_head_dim"])
    assert torch.equal(encode_video(vae, clips[0]), before)
    train_video_vae(vae, clips, 60.0, 1, Log(tmp_path / "log.jsonl"), np.random.default_rng(0), max_steps=6,
                    decoder_only=True)
    losses = [json.loads(line)["recon"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert torch.equal(encode_video(vae, clips[0]), before)


def fresh_decoder_log(log, clips, steps: int, **weights) -> list[dict]:
    """The log rows of a fresh video decoder (on the toy preset's encoder) fitting `clips` for `steps` steps."""
    from training.train import Log, fresh_video_decoder, train_video_vae

    torch.manual_seed(0)
    vae = fresh_video_decoder(H3Pipeline.from_preset("toy").video_vae, seed=0)
    train_video_vae(vae, clips, 60.0, 1, Log(log), np.random.default_rng(0), max_steps=steps, decoder_only=True,
                    **weights)
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_temporal_weight_fits_the_frame_to_frame_change(tmp_path):
    """`--vae-temporal-weight`: the decoder's error on each frame-to-frame change falls faster with it than on the
    frames' error alone (same clip, seed and steps)."""
    from training.train import toy_clips

    clips = toy_clips(range(1), 96, 64, 0.9, 1)
    last = {w: fresh_decoder_log(tmp_path / f"log{w}.jsonl", clips, 6, temporal_weight=w)[-1]["step_error"]
            for w in (0.0, 1.0)}
    assert last[1.0] < last[0.0] / 2, last


def test_the_seam_weight_acts_on_the_change_across_latent_boundaries(tmp_path):
    """`--vae-seam-weight`: a fresh decoder fitting one clip of two decode windows: the change it draws across latent
    boundaries, over the change inside latents (the log's `seam_ratio`), falls with the weight and not without."""
    from training.train import SEAM_WINDOW_FRAMES, toy_clips

    clips = toy_clips([3], 224, 128, 1.7, 1)
    assert clips[0][0].shape[0] >= SEAM_WINDOW_FRAMES
    ratios = {w: [row["seam_ratio"] for row in fresh_decoder_log(tmp_path / f"{w}.jsonl", clips, 8, seam_weight=w)]
              for w in (0.0, 8.0)}
    assert ratios[0.0][0] == pytest.approx(ratios[8.0][0], rel=0.05), ratios
    assert ratios[8.0][-1] < 0.5 * ratios[0.0][-1] and ratios[8.0][-1] < 0.5 * ratios[8.0][0], ratios


def test_two_runs_video_vae_files_average_tensor_by_tensor(tmp_path):
    """`python -m training.average`: the mean of two video VAE files loads through the strict loader, each weight
    the mean of the two (to fp16 rounding); a file of another architecture is refused by name."""
    from engine.models.h3.vae import (TOY_VIDEO_VAE, build_tiny_video_vae, load_video_vae_file,
                                      save_video_vae_file)
    from training.average import main

    files = [save_video_vae_file(build_tiny_video_vae(seed), tmp_path / f"{seed}.safetensors") for seed in (0, 1)]
    assert main([*map(str, files), "--out", str(tmp_path / "mean.safetensors")]) == 0
    runs = [load_video_vae_file(f).model.state_dict() for f in files]
    mean = load_video_vae_file(tmp_path / "mean.safetensors").model.state_dict()
    for key in ("decoder.proj_in.weight", "encoder.conv_in.weight"):
        assert not torch.equal(runs[0][key], runs[1][key])
        torch.testing.assert_close(mean[key], (runs[0][key] + runs[1][key]) / 2, atol=1e-3, rtol=1e-3)
    other = save_video_vae_file(build_tiny_video_vae(0, TOY_VIDEO_VAE), tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match="toy.safetensors: its header differs"):
        main([str(files[0]), str(other), "--out", str(tmp_path / "bad.safetensors")])


def test_motion_pixels_mark_what_changes_inside_a_latent():
    """A still ball marks nothing; a bouncing one marks pixels only where it is in some frame of the latent, in
    the latent of its floor contact too, and fewest at the top of its bounce."""
    from training.toy_scene import Scene, ToyObject
    from training.toy_world import render
    from training.train import VAE_FRAMES, motion_pixels, object_pixels

    still = render(Scene((ToyObject("ball", "red", "large", "stays still", 0.5, 0.5),), "grey", False, False, 0))
    assert not motion_pixels(still.frames[None, :VAE_FRAMES]).any()
    ball = ToyObject("ball", "red", "large", "bounces", 0.5, 0.5, bounce_height=0.5, bounce_period=1.2,
                     bounce_phase=0.35)
    clip = render(Scene((ball,), "grey", False, False, 0))
    moving = motion_pixels(clip.frames[None, :VAE_FRAMES])[0]
    spans = M.latent_frame_spans(VAE_FRAMES)
    for a, b in spans:
        assert not (moving[a:b] & ~object_pixels(clip.frames[a:b], clip.caption).any(0)).any()  # only its path
    top = int(np.argmin(clip.centroids[0, 1:VAE_FRAMES, 1])) + 1
    contact = clip.contact_frames[0][0]
    marked = {frame: next(moving[a:b].sum() for a, b in spans if a <= frame < b) for frame in (top, contact)}
    assert 0 < marked[top] < marked[contact], (marked, top, contact)


def test_the_motion_weight_fits_what_moves_inside_a_latent(tmp_path):
    """`--vae-motion-weight`: the committed decoder, a few more steps on one bouncing clip: its error on the pixels
    that change inside a latent falls further with the weight than without (same clip, seed and steps)."""
    from engine.models.h3.vae import load_video_vae_file
    from training.train import Log, motion_pixels, pixels, toy_clips, train_video_vae

    clips = toy_clips([11], 96, 64, 0.9, 1)
    assert "bounces" in clips[0][2]
    x = pixels(clips[0][0][None], "cpu")
    moving = torch.from_numpy(motion_pixels(clips[0][0][None]))[:, None].expand_as(x)
    error = {}
    for weight in (0.0, 8.0):
        torch.manual_seed(0)
        vae = load_video_vae_file(REPO / "engine/weights/toy" / FILES["video_vae"])
        train_video_vae(vae, clips, 60.0, 1, Log(tmp_path / f"log{weight}.jsonl"), np.random.default_rng(0),
                        max_steps=10, decoder_only=True, motion_weight=weight)
        with torch.no_grad():
            y = vae.model.decode(vae.model.encode(x).latent_dist.mode()).sample
        error[weight] = float((y - x).pow(2)[moving].mean())
    assert error[8.0] < 0.85 * error[0.0], error


COMPILED = """
import sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from training.train import load_compiled, save_compiled
path = Path(sys.argv[1])
load_compiled(path)
torch.compile(torch.nn.Linear(8, 16))(torch.randn(4, 8))  # no generated kernel: no C++ build on CPU
save_compiled(path)
print(counters["inductor"]["fxgraph_cache_hit"])
"""


def test_a_compile_cache_file_carries_the_kernels_to_a_fresh_process(tmp_path):
    """`--compile-cache`: a second process (its own empty Inductor cache folder, as on a fresh GPU machine) loads what
    the first compiled from the file (Inductor's graph cache hits) instead of compiling it."""
    import os

    hits = []
    for run in range(2):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{run}"),
               "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", COMPILED, str(tmp_path / "compiled.bin")], env=env, check=True,
                             capture_output=True, text=True, cwd=REPO)
        hits.append(int(out.stdout.split()[-1]))
        assert (tmp_path / "compiled.bin").stat().st_size > 0
    assert hits[0] == 0 and hits[1] >= 1, hits


def test_text_encoder_stage_labels_every_attribute_a_caption_names():
    """`attributes` gives each of ATTRIBUTES a class within its count, the second object's 0 when there is none, and
    scenes whose captions differ in one word differ in exactly that attribute; the readout has a head per attribute."""
    from dataclasses import replace

    from training.text_encoder import ATTRIBUTES, SceneReadout, attributes
    from training.toy_scene import sample_scene

    scenes = [sample_scene(seed) for seed in range(40)]
    assert {len(s.objects) for s in scenes} == {1, 2}
    names = list(ATTRIBUTES)
    for scene in scenes:
        classes = dict(zip(names, attributes(scene)))
        assert all(0 <= classes[k] < n for k, n in ATTRIBUTES.items())
        assert (classes["second colour"] == 0) == (len(scene.objects) == 1)
    scene = next(s for s in scenes if len(s.objects) == 1)
    other = "green" if scene.objects[0].colour != "green" else "red"
    changed = [k for k, a, b in zip(names, attributes(scene),
                                    attributes(replace(scene, objects=(replace(scene.objects[0], colour=other),))))
               if a != b]
    assert changed == ["colour"]
    logits = SceneReadout(32)(torch.randn(3, 17, 32))
    assert [x.shape for x in logits] == [(3, n) for n in ATTRIBUTES.values()]


def test_pick_batch_draws_boosted_clips_by_their_odds_within_one_caption_length():
    groups = [[0, 1, 2, 3], [4, 5]]  # clip 1 and clip 4 bounce, boosted 3x
    odds = [[1.0, 3.0, 1.0, 1.0], [3.0, 1.0]]
    rng = np.random.default_rng(0)
    batches = [pick_batch(groups, odds, 8, rng) for _ in range(3000)]
    assert all(set(b) <= set(groups[0]) or set(b) <= set(groups[1]) for b in batches)
    first = [b for b in batches if b[0] in groups[0]]
    assert abs(len(first) / len(batches) - 6 / 10) < 0.03  # a group by the sum of its odds
    picks = np.concatenate(first)
    assert abs((picks == 1).mean() - 3 / 6) < 0.02 and abs((picks == 0).mean() - 1 / 6) < 0.02


def test_clip_odds_multiply_the_boosts_a_caption_meets():
    lone = "a red ball moves right on a white background"
    bouncer = "a red ball bounces on a white background, humming"
    pair = "a blue box moves left and a red ball moves up in a blue sky"
    bouncing_pair = "a small green box bounces and a large yellow triangle stays still on sand, humming; rain falls"
    assert [clip_odds(c, 3.0, 2.0) for c in (lone, bouncer, pair, bouncing_pair)] == [1.0, 3.0, 2.0, 6.0]
    assert clip_odds(bouncing_pair) == 1.0


def test_edit_steps_regenerate_each_clips_own_object_track():
    """With --edit-tracks, edit steps regenerate in each clip the track of one of its objects as Mask Track Box
    boxes it (what a replacement or removal gives the DiT; the engine's own mask of that box): the rows the DiT sees
    at a generated timestep are exactly that clip's track, which covers every token its object touches."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention
    from engine.models.h3 import layout as L
    from engine.models.h3 import mask as M
    from training.task_checks import box_masks
    from training.toy_scene import sample_scene
    from training.toy_world import render

    clip = render(sample_scene(3, 224, 128), 224, 128, num_frames=39)
    engine_rows = [M.token_mask(M.cell_mask(torch.from_numpy(box_masks(m)), 39, 128, 224)) for m in clip.masks]
    assert np.array_equal(train.object_tracks(clip.masks), torch.stack(engine_rows).numpy())

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    clips = train.toy_clips(range(4), 96, 64, 0.9, 1)
    data = train.prepare(pipe, clips)
    for clip, sample in zip(clips, data):
        tracks = sample["tracks"]
        assert tracks.shape == (clip[2].count(" and ") + 1, sample["weight"].numel())
        assert set(tracks.unique().tolist()) <= {0.0, 1.0} and 0 < tracks.sum(1).min() and tracks.mean() < 1
        assert ((tracks.amax(0) == 1) | (sample["weight"] == 1)).all()  # every token an object covers
    two = next(s for s in data if len(s["tracks"]) == 2)
    batch = [two, dict(two, tracks=two["tracks"].flip(0))]
    seen = {}
    pipe.dit.register_forward_pre_hook(lambda _, args: seen.update(t=args[3][args[4]]))  # each row's timestep
    pipe.dit.requires_grad_(True)
    layout = L.build_layout(two["tags"][()], *two["video"].shape[1:], two["audio"].shape[-1])
    differ = []
    for seed in range(4):
        loss = train.dit_loss(pipe.dit, batch, "edit", np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                              edit_tracks=1.0)
        loss.backward()
        assert torch.isfinite(loss)
        regenerated = (seen["t"][:, layout.video_indices] < L.CONDITION_TIMESTEP).float()
        for sample, rows in zip(batch, regenerated):
            assert (sample["tracks"] == rows).all(1).any()
        differ.append(bool((regenerated[0] != regenerated[1]).any()))
    assert any(differ)  # each clip its own mask in one step


def test_later_windows_give_the_extension_steps_guides_from_mid_scene():
    """With --later-windows each clip also carries its scene from a later start (the render's own frames there),
    and the extension steps take their guide rows and targets from it: a clip always starts with its objects in their
    slots, the guide of a real extension shows them mid-path."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention
    from engine.models.h3 import layout as L
    from training.toy_scene import sample_scene
    from training.toy_world import render

    attention.set_backend("sdpa")
    frames, audio, _, _, _, window, _ = train.render_clip((5, 96, 64, 0.9, train.LaterDraw()))
    later, later_audio, cover, _, _ = window
    whole = render(sample_scene(5, 96, 64), 96, 64, num_frames=train.MAX_FRAMES)
    start = next(s for s in range(train.MAX_FRAMES) if np.array_equal(whole.frames[s:s + len(frames)], later))
    assert start > 0 and later.shape == frames.shape and later_audio.shape == audio.shape
    assert np.abs(later_audio - whole.audio[:, round(start / 24 * 32000):][:, :audio.shape[1]]).max() < 1e-6
    assert cover.shape == train.object_cover(whole.masks[:, :len(frames)]).shape

    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([5], 96, 64, 0.9, 1, later=train.LaterDraw()))[0]
    assert not torch.allclose(sample["later"]["video"], sample["video"])
    guides = []
    per_frame = sample["video"][0, 0].numel() // 4  # rows of one latent frame (2x2 patches)
    pipe.dit.register_forward_pre_hook(lambda _, args: guides.append(args[0][0, :per_frame]))  # the first guide rows
    train.dit_loss(pipe.dit, [sample], "extend", np.random.default_rng(0), torch.Generator().manual_seed(0))
    later_rows = L.patchify(sample["later"]["video"][None])[0, :per_frame]
    own_rows = L.patchify(sample["video"][None])[0, :per_frame]
    assert (guides[0] - later_rows).abs().max() < 0.05 < (guides[0] - own_rows).abs().max()


def test_the_extension_steps_draw_their_guide_lengths_from_the_overlaps_given():
    """--extend-overlaps: each extension step's guide (the condition rows before the window's) is one of the given
    lengths, 2 and 7 latents (Extend's shortest and default) unless told, 12 (a longer stretch of the mover's path)
    when asked."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([5], 96, 64, 2.4, 1, later=train.LaterDraw()))[0]
    _, _, T, h, w = sample["later"]["video"][None].shape
    per_frame = h * w // 4  # rows of one latent frame (2x2 patches)
    rows = []
    pipe.dit.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[1]))

    def guides(**overlaps) -> set[int]:
        rows.clear()
        for seed in range(8):
            train.dit_loss(pipe.dit, [sample], "extend", np.random.default_rng(seed),
                           torch.Generator().manual_seed(seed), **overlaps)
        return {n // per_frame - T for n in rows}

    assert guides() == {2, 7}
    assert guides(overlaps=(12,)) == {12} and guides(overlaps=(7, 12)) == {7, 12}


def test_a_later_window_is_prompted_with_what_it_shows_after_the_guide():
    """A later window's prompt is `caption_at` its first new frame after the Extend node's default guide: past a
    wall hit the mover goes the other way, and the scene's own caption would tell the extension steps the wrong
    direction. The extension steps read that prompt; the other layouts the clip's own."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention
    from training.captions import caption_at
    from training.toy_scene import sample_scene
    from training.toy_world import render

    attention.set_backend("sdpa")
    frames, _, told, _, _, (later, _, _, later_told, _), _ = train.render_clip((4, 96, 64, 0.9, train.LaterDraw()))
    assert told == "a small blue triangle moves right on sand; rain falls"
    assert later_told == "a small blue triangle moves left on sand; rain falls"
    scene = sample_scene(4, 96, 64)
    whole = render(scene, 96, 64, num_frames=train.MAX_FRAMES)
    start = next(s for s in range(train.MAX_FRAMES) if np.array_equal(whole.frames[s:s + len(frames)], later))
    assert later_told == caption_at(scene, (start + 22) / 24, 96, 64)

    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([4], 96, 64, 0.9, 1, later=train.LaterDraw()))[0]
    expected, _ = pipe.conditioner.encode(later_told)
    torch.testing.assert_close(sample["later"]["text"][()], expected[0].float())
    texts = []
    pipe.dit.register_forward_pre_hook(lambda _, args: texts.append(args[2][0]))
    for task in ("extend", "t2va"):
        train.dit_loss(pipe.dit, [sample], task, np.random.default_rng(0), torch.Generator().manual_seed(0))
    torch.testing.assert_close(texts[0], sample["later"]["text"][()])
    torch.testing.assert_close(texts[1], sample["text"][()])


def test_later_t2va_steps_train_text_to_video_on_the_later_windows():
    """`--later-t2va`: a text-to-video step drawn on the later windows scores the DiT on each window's own latents,
    sound and prompt (a mover mid-path or turning at a wall), exactly as a t2va step on those windows as clips."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([4], 96, 64, 0.9, 1, later=train.LaterDraw()))[0]

    def loss(batch, later):
        return float(train.dit_loss(pipe.dit, batch, "t2va", np.random.default_rng(0),
                                    torch.Generator().manual_seed(0), later=later))

    on_later = loss([sample], True)
    assert on_later == loss([sample["later"]], False)
    assert abs(on_later - loss([sample], False)) > 1e-3 * on_later


def test_a_speed_spread_runs_each_later_window_mover_at_its_own_speed_under_the_same_prompt():
    """`--later-speed-spread 2`: a later window's movers cross the frames at 1/2..2 times the scene's speed (measured
    on the rendered pixels), each its own factor, from the same start frame and under the prompt of the scene at that
    speed (`caption_at`: only a direction turned by a wall hit differs); the clip itself is the scene's."""
    import numpy as np

    import training.train as train
    from training.captions import parse_caption
    from training.scoring import colour_labels, track_colour
    from training.toy_scene import DIRECTIONS, sample_scene

    def speed(frames, colour):  # mean pixels a frame of the colour's centroid
        track = track_colour(colour_labels(frames), colour)
        return float(np.nanmean(np.hypot(np.diff(track.x), np.diff(track.y))))

    ratios = []
    seeds = [s for s in range(60) if any(o.motion in DIRECTIONS for o in sample_scene(s, 224, 128).objects)][:8]
    for seed in seeds:
        plain, spread = (train.render_clip((seed, 224, 128, 3.0, train.LaterDraw(s))) for s in (1.0, 2.0))
        np.testing.assert_array_equal(plain[0], spread[0])  # the clip: the scene's own
        said, told = parse_caption(plain[5][3]), parse_caption(spread[5][3])
        assert [(o.colour, o.shape) for o in said.objects] == [(o.colour, o.shape) for o in told.objects]
        assert said.background == told.background
        for obj in sample_scene(seed, 224, 128).objects:
            if obj.motion in DIRECTIONS:
                ratios.append(speed(spread[5][0], obj.colour) / speed(plain[5][0], obj.colour))
    assert all(0.45 < r < 2.2 for r in ratios), ratios
    assert min(ratios) < 0.8 and max(ratios) > 1.25, ratios  # both ways, not one factor for all


def test_wall_hits_start_the_later_windows_where_a_mover_turns_in_the_frames_they_generate():
    """`--later-wall-hits 1`: every later window of a scene whose mover reaches a wall by 15 s starts so the mover
    turns (on the rendered pixels) in the frames after the Extend node's default guide, prompted with the direction
    it goes in there before the hit; unasked, only some of the same scenes' windows hold a turn there."""
    import numpy as np

    import training.train as train
    from training.captions import caption_at
    from training.scoring import colour_labels, track_colour
    from training.toy_scene import DIRECTIONS, sample_scene

    guide = 22  # frames of Extend's default 7-latent guide

    def turns(window, scene) -> bool:  # a mover goes one way at the guide's end and the other at the window's
        labels = colour_labels(window[0])
        for obj in scene.objects:
            if obj.motion in DIRECTIONS:
                track = track_colour(labels, obj.colour)
                place = track.x if DIRECTIONS[obj.motion][0] == 0 else track.y
                if (place[guide] - place[guide - 6]) * (place[-1] - place[-7]) < 0:
                    return True
        return False

    seeds = [s for s in range(40) if any(o.motion in DIRECTIONS for o in sample_scene(s, 224, 128).objects)][:6]
    turned = {}
    for wall_hits in (0.0, 1.0):
        windows = [train.render_clip((s, 224, 128, 5.0, train.LaterDraw(wall_hits=wall_hits)))[5] for s in seeds]
        turned[wall_hits] = [turns(w, sample_scene(s, 224, 128)) for s, w in zip(seeds, windows)]
    assert all(turned[1.0]) and not all(turned[0.0]), turned
    window, scene = windows[0], sample_scene(seeds[0], 224, 128)
    whole = train.render(scene, 224, 128, num_frames=train.MAX_FRAMES)
    start = next(s for s in range(train.MAX_FRAMES) if np.array_equal(whole.frames[s:s + len(window[0])], window[0]))
    assert window[3] == caption_at(scene, (start + guide) / 24, 224, 128)


def test_the_cache_keeps_the_later_windows_prompts_and_refuses_one_without_them(tmp_path):
    """`--cache`: a second run reads the later windows' prompts back with their tags on the host (the layouts are
    built there); a cache written before the windows had prompts, or before the clips had knocks (the old toy
    world's), or at another `--later-speed-spread` or `--later-wall-hits`, is refused with what to do."""
    import pytest

    import training.train as train

    pipe = H3Pipeline.from_preset("tiny")
    clips, cache = train.toy_clips([4], 96, 64, 0.9, 1, later=train.LaterDraw()), tmp_path / "c.pt"
    made = train.encoded(pipe, clips, cache, later=train.LaterDraw())[0]["later"]
    read = train.encoded(pipe, None, cache, later=train.LaterDraw())[0]["later"]
    assert read["prompt"] == made["prompt"] == clips[0][5][3]
    torch.testing.assert_close(read["text"][()], made["text"][()])
    assert read["tags"][()].device.type == "cpu" and torch.equal(read["tags"][()], made["tags"][()])
    fresh = torch.load(cache)
    for stale in ([{**s, "later": {k: v for k, v in s["later"].items() if k not in ("prompt", "text", "tags")}}
                   for s in fresh], [{k: v for k, v in s.items() if k != "knocks"} for s in fresh]):
        torch.save(stale, cache)
        with pytest.raises(SystemExit, match="knocks' audio rows .* with their prompts"):
            train.encoded(pipe, None, cache, later=train.LaterDraw())
    spread, cache_2 = train.toy_clips([4], 96, 64, 0.9, 1, later=train.LaterDraw(2.0)), tmp_path / "c2.pt"
    train.encoded(pipe, spread, cache_2, later=train.LaterDraw(2.0))
    assert train.encoded(pipe, None, cache_2, later=train.LaterDraw(2.0))[0]["later"]["speed_spread"] == 2.0
    asked = "; this run asks for --later-speed-spread"
    with pytest.raises(SystemExit, match=f"drawn at --later-speed-spread 2 --later-wall-hits 0{asked} 1 "):
        train.encoded(pipe, None, cache_2, later=train.LaterDraw())
    torch.save(fresh, cache)
    with pytest.raises(SystemExit, match=f"drawn at --later-speed-spread 1 --later-wall-hits 0{asked} 2 "):
        train.encoded(pipe, None, cache, later=train.LaterDraw(2.0))
    with pytest.raises(SystemExit, match=f"--later-wall-hits 0{asked} 1 --later-wall-hits 1"):
        train.encoded(pipe, None, cache, later=train.LaterDraw(wall_hits=1.0))


def test_compiled_blocks_train_as_the_eager_ones_and_the_dit_ends_eager(monkeypatch):
    """`--compile`: the training steps run each DiT block through torch.compile (Dynamo's graph capture; here its
    eager backend, as the CPU has no kernels to gain) and give the eager steps' losses; afterwards the DiT holds its
    own blocks again, so it evaluates and saves under its file's key names."""
    from engine.kernels import attention
    from training.toy_scene import sample_scene
    from training.train import prepare, toy_clips, train_dit

    attention.set_backend("sdpa")
    compiled, compile = [], torch.compile

    def eager_backend(model, **options):
        compiled.append(model)
        return compile(model, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", eager_backend)
    clips = toy_clips(range(2), 96, 64, 0.9, 1)

    def losses(compile_blocks: bool) -> tuple[list[float], H3Pipeline]:
        pipe, seen = H3Pipeline.from_preset("tiny"), []

        def log(stage, step, total=None, **values):
            if stage == "dit":
                seen.append(values["loss"])

        train_dit(pipe, prepare(pipe, clips), 600, 2, log, np.random.default_rng(0), torch.Generator().manual_seed(0),
                  [sample_scene(0, 96, 64)], 1000, 3e-4, max_steps=3, compile=compile_blocks)
        return seen, pipe

    eager, _ = losses(False)
    assert not compiled
    stepped, pipe = losses(True)
    assert compiled == list(pipe.dit.blocks)  # each block alone, and the DiT has them back
    assert not any("_orig_mod" in k for k in pipe.dit.state_dict())
    np.testing.assert_allclose(stepped, eager, rtol=1e-4)
    assert stepped[-1] < stepped[0]


def test_edit_steps_with_kept_sound_give_the_dit_another_clips_sound_as_a_masked_edit_does():
    """--edit-kept-sound: an edit step gives the DiT a sound clean at timestep 1 (Masked Edit with keep_audio, the
    engine's default: `Target(anchor=clean, model_mask=0)`) and does not score the DiT's audio; the sound is the
    next clip's of the batch, so it cannot tell what the hole held. Without it the sound is noised and generated."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention
    from engine.models.h3 import layout as L

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([3], 96, 64, 0.9, 1))[0]
    other = {**sample, "audio": sample["audio"].flip(-1)}
    layout = L.build_layout(sample["tags"][()], *sample["video"].shape[1:], sample["audio"].shape[-1])
    seen, shift = {}, {"audio": 0.0}

    def given(_, args):
        seen.update(audio=args[1], t=args[3][args[4]][..., layout.audio_indices])

    def shifted(_, args, out):  # moves the DiT's audio output: the loss notices only when it scores the audio
        return out[0], out[1] + shift["audio"]

    pipe.dit.register_forward_pre_hook(given)
    pipe.dit.register_forward_hook(shifted)

    def loss(kept: float, audio_shift: float) -> float:
        shift["audio"] = audio_shift
        with torch.no_grad():
            return float(train.dit_loss(pipe.dit, [sample, other], "edit", np.random.default_rng(0),
                                        torch.Generator().manual_seed(0), edit_kept_sound=kept))

    clean = L.pack_audio(torch.stack([sample["audio"], other["audio"]]))
    kept = loss(1.0, 0.0)
    assert (seen["t"] == 1).all() and torch.equal(seen["audio"], clean.flip(0))
    assert loss(1.0, 5.0) == kept
    generated = loss(0.0, 0.0)
    assert (seen["t"] < 1).all() and not torch.equal(seen["audio"], clean)
    assert not torch.equal(seen["audio"], clean.flip(0))
    assert loss(0.0, 5.0) > generated + 1


def test_keep_video_learns_the_sound_from_the_data_and_the_pictures_from_the_starting_dit():
    """`--dit-keep-video`: with the DiT still as it started, the video rows' loss is nil, so the video head gets no
    gradient while the audio head does, on every task's layout; `--dit-data-tasks extend`: the other layouts' rows
    all learn the starting DiT (no gradient on either head), the extension's the data; a few steps of each then
    lower the loss."""
    import copy

    from engine.kernels import attention
    from training import train
    from training.toy_scene import sample_scene

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    data = train.prepare(pipe, train.toy_clips(range(2), 96, 64, 0.9, 1))
    teacher = copy.deepcopy(pipe.dit).eval().requires_grad_(False)
    pipe.dit.train().requires_grad_(True)
    head = pipe.dit.final_layer

    def gradients(task, keep):
        pipe.dit.zero_grad(set_to_none=True)
        train.dit_loss(pipe.dit, data[:1], task, np.random.default_rng(0), torch.Generator().manual_seed(0),
                       teacher=teacher, keep=keep).backward()
        return float(head.video_out.weight.grad.abs().max()), float(head.audio_out.weight.grad.abs().max())

    for task in ("t2va", "first", "edit", "extend"):
        video, audio = gradients(task, ("video",))
        assert video == 0 and audio > 0, task
        assert gradients(task, ("video", "audio")) == (0, 0), task
    for task in ("extend", "t2va"):  # a layout in --dit-data-tasks learns the data, t2va too (not the teacher)
        video, audio = gradients(task, ())
        assert video > 0 and audio > 0, task

    start = copy.deepcopy(pipe.dit.state_dict())
    for options in ({"keep_video": True}, {"data_tasks": ("extend",)}):
        pipe.dit.load_state_dict(start)
        losses = []

        def log(stage, step, total=None, **values):
            if stage == "dit":
                losses.append(values["loss"])

        train.train_dit(pipe, data, 600, 2, log, np.random.default_rng(0),
                        torch.Generator().manual_seed(0), [sample_scene(0, 96, 64)], 1000, 1e-3, max_steps=4,
                        **options)
        assert losses[-1] < losses[0], (options, losses)


def test_the_knock_weight_counts_the_audio_rows_at_a_contact():
    """`knocks` marks the audio latents around each click the render made (the click's loudest sample falls in the
    marked span), and the knock weight changes a bouncer's loss but not that of a clip with no contact."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention
    from engine.models.h3 import layout as L
    from training.scoring import click_band

    attention.set_backend("sdpa")
    clips = train.toy_clips(range(40), 96, 64, 0.9, 1)
    bouncer = next(c for c in clips if c[6])
    still = next(c for c in clips if not c[6])
    pipe = H3Pipeline.from_preset("tiny")
    bouncing, calm = train.prepare(pipe, [bouncer, still])
    marked = np.flatnonzero(bouncing["knocks"].numpy())
    loudest = np.abs(click_band(bouncer[1], 32000)).argmax() / 32000 * L.AUDIO_LATENTS_PER_SECOND
    assert 0 < len(marked) <= 5 and marked.min() <= loudest < marked.max() + 1, (marked, loudest)
    assert not calm["knocks"].any()

    def loss(sample, weight):
        return float(train.dit_loss(pipe.dit, [sample], "t2va", np.random.default_rng(0),
                                    torch.Generator().manual_seed(0), knock_weight=weight))

    assert loss(calm, 0) == pytest.approx(loss(calm, 20), rel=1e-6)
    assert loss(bouncing, 0) != pytest.approx(loss(bouncing, 20), rel=1e-3)


def test_the_join_weight_counts_the_video_rows_after_an_extension_guide():
    """The join weight changes an extension step's loss (the rows after its guide) and leaves text-to-video's."""
    import numpy as np

    import training.train as train
    from engine.kernels import attention

    attention.set_backend("sdpa")
    pipe = H3Pipeline.from_preset("tiny")
    sample = train.prepare(pipe, train.toy_clips([3], 96, 64, 1.6, 1))[0]

    def loss(task, weight):
        return float(train.dit_loss(pipe.dit, [sample], task, np.random.default_rng(0),
                                    torch.Generator().manual_seed(0), join_weight=weight))

    assert loss("t2va", 0) == pytest.approx(loss("t2va", 50), rel=1e-6)
    assert loss("extend", 0) != pytest.approx(loss("extend", 50), rel=1e-3)
