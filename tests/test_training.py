"""The training script's CPU smoke run (`python -m training.train --smoke`): every stage (video VAE, audio VAE, DiT)
takes a few steps on one batch and its loss falls, and the files it writes are Comfy-Org single files the engine's
strict loaders read (the embedded architecture recognised from the text encoder's header)."""

import json
import subprocess
import sys

import torch

from engine.models.h3.pipeline import TINY_CANVAS, H3Pipeline
from engine_fixture import REPO
from training.train import FILES, TOY


def test_smoke_run_lowers_every_loss_and_writes_loadable_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "training.train", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "smoke_log.jsonl").read_text().splitlines()]
    for stage, key in (("video_vae", "recon"), ("audio_vae", "loss"), ("dit", "loss")):
        losses = [r[key] for r in rows if r["stage"] == stage]
        assert len(losses) == 6 and losses[-1] < losses[0], (stage, losses)
    assert any(r["stage"] == "eval" and "t2va_pass" in r for r in rows)  # the scoring path ran
    pipe = H3Pipeline.from_files(*(tmp_path / FILES[k] for k in ("dit", "text_encoder", "video_vae", "audio_vae")),
                                 device="cpu", dtype=torch.float32)
    assert pipe.dit.config == TOY and pipe.canvas == TINY_CANVAS
    assert pipe.describe()["summary"].startswith(f"DiT {FILES['dit']} (bf16")
