"""The README's quick-start job: `python -m engine demo` starts the bundled engine on the embedded default (`toy`)
and writes an MP4 (and, asked, the frame strip the README shows)."""

import os
import subprocess
import sys

import av


def test_demo_writes_an_mp4_through_the_bundled_engine(tmp_path):
    out = tmp_path / "demo.mp4"
    env = {**os.environ, "H3FORGE_TOKEN_FILE": str(tmp_path / "token")}
    strip = tmp_path / "strip.png"
    proc = subprocess.run([sys.executable, "-m", "engine", "demo", "--steps", "3", "--out", str(out), "--strip",
                           str(strip)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting the bundled engine (toy preset)" in proc.stderr and "wrote" in proc.stderr
    with av.open(str(out)) as container:
        kinds = sorted(s.type for s in container.streams)
        assert kinds == ["audio", "video"]
        assert sum(1 for _ in container.decode(video=0)) == 124
    from PIL import Image

    assert Image.open(strip).size == (6 * 224, 128)  # six frames of the toy canvas, first to last
