"""The README's quick-start job: `python -m engine demo` starts the bundled engine and writes an MP4."""

import os
import subprocess
import sys

import av


def test_demo_writes_an_mp4_through_the_bundled_engine(tmp_path):
    out = tmp_path / "demo.mp4"
    env = {**os.environ, "H3FORGE_TOKEN_FILE": str(tmp_path / "token")}
    proc = subprocess.run([sys.executable, "-m", "engine", "demo", "--steps", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting the bundled engine" in proc.stderr and "wrote" in proc.stderr
    with av.open(str(out)) as container:
        kinds = sorted(s.type for s in container.streams)
        assert kinds == ["audio", "video"]
        assert sum(1 for _ in container.decode(video=0)) == 124
