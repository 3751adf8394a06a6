"""benchmarks/vae_motion.py on one held-out bouncer through the committed toy video VAE: every 4-frame latent where the
bouncer is seen gives the latent's 3x3 cells and the rendered and decoded heights' motion inside it, and the decoder
draws part of that motion (this scene: R^2 0.25 over 29 latents; 0.36 on stop 64's bounce every 28 frames, 0.32 over 24
on the old, higher bounce). Its contacts agree with the clicks, as the render's own do (since stop 64's low bounce; the
old bounce's round trip lost them; since stop 66 a contact every 34 frames, each on its latent's third frame). Across
latent boundaries the round trip steps less than twice its median frame difference (median over the boundaries; stop
51's decoder: 3.8 at the joins, 3.0 elsewhere), as the render does."""

import numpy as np

from benchmarks.vae_motion import HEIGHT, WIDTH, boundary_steps, contacts, latent_rows, scene_tracks, scores
from engine.models.h3.vae import load_video_vae_file
from training.scoring import clicks_agree
from training.toy_scene import sample_scene
from training.toy_world import render
from training.train import EVAL_SEED, FILES
from engine_fixture import REPO


def test_a_bouncers_motion_inside_each_latent_is_measured_from_the_render_and_the_round_trip():
    vae = load_video_vae_file(REPO / "engine" / "weights" / "toy" / FILES["video_vae"])
    scene = next(s for s in (sample_scene(EVAL_SEED + i) for i in range(40))
                 if any(o.motion == "bounces" for o in s.objects))
    features, wanted, drawn, lost, agree, (joins, others) = latent_rows(vae, scene)
    assert len(features) == len(wanted) == len(drawn) >= 10 and lost >= 0
    assert np.array(features).shape[1] == 24 * 9
    wanted, drawn = np.array(wanted), np.array(drawn)
    assert wanted.shape[1] == 4 and np.allclose(wanted.sum(1), 0, atol=1e-3) and np.allclose(drawn.sum(1), 0, atol=1e-3)
    assert np.abs(wanted).max() > 4  # the render's bounce moves several pixels inside a latent
    measured = scores(drawn, wanted)
    assert 0 < measured["r2"] < 0.9 and measured["latents"] == len(wanted), measured
    assert scores(wanted, wanted)["r2"] == 1.0
    assert agree is True
    truth = render(scene, WIDTH, HEIGHT)
    assert clicks_agree(contacts(scene_tracks(truth.frames, scene)), list(truth.click_frames), len(truth.frames))
    assert len(truth.frames) == 124 and len(joins) == 6 and len(others) == 30  # joins at 22, 39, ..., 107
    assert np.median(joins) < 2 and np.median(others) < 2, (joins, others)
    rendered = boundary_steps(truth.frames)
    assert np.median(rendered[0]) < 2 and np.median(rendered[1]) < 2, rendered
