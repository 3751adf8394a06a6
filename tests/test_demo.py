"""The README's quick-start job: `python -m engine demo` starts the bundled engine on the embedded default (`toy`)
and writes an MP4 (and, asked, the frame strip the README shows) that shows its prompt: scored from the MP4's frames
and sound (training/scoring.py), every check passes."""

import os
import subprocess
import sys

import av

import comfy_outputs
from engine.demo_cli import DEMO_PROMPT


def test_demo_writes_an_mp4_of_its_prompt_through_the_bundled_engine(tmp_path):
    out = tmp_path / "demo.mp4"
    env = {**os.environ, "H3FORGE_TOKEN_FILE": str(tmp_path / "token")}
    strip = tmp_path / "strip.png"
    proc = subprocess.run([sys.executable, "-m", "engine", "demo", "--out", str(out), "--strip", str(strip)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting the bundled engine (toy preset)" in proc.stderr and "wrote" in proc.stderr
    with av.open(str(out)) as container:
        kinds = sorted(s.type for s in container.streams)
        assert kinds == ["audio", "video"]
        assert sum(1 for _ in container.decode(video=0)) == 124
    from PIL import Image

    assert Image.open(strip).size == (6 * 224, 128)  # six frames of the toy canvas, first to last
    mp4 = out.read_bytes()
    _, checks = comfy_outputs.caption_problems(comfy_outputs.read_mp4(mp4, analysis=True), mp4, DEMO_PROMPT)
    assert all(checks.values()), checks
