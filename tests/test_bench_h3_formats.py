"""benchmarks/h3_formats.py --tiny: every format is written, loaded and timed, and the table's numbers are sane."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_h3_formats_tiny(tmp_path):
    out = tmp_path / "h3_formats.json"
    proc = subprocess.run([sys.executable, "benchmarks/h3_formats.py", "--tiny", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert not [k for k in results if k.endswith("_error")], results
    rows = {r["format"]: r for r in results["formats"]}
    assert list(rows) == ["bf16", "pruned_bf16", "pruned_fp8_scaled", "pruned_int8_convrot", "int8_convrot"]
    assert rows["bf16"]["22_dense_rel_err_vs_bf16"] == 0.0
    assert 0 < rows["pruned_bf16"]["22_dense_rel_err_vs_bf16"] < 1e-3  # the rank-8 curve alone
    assert 0 < rows["pruned_int8_convrot"]["22_dense_rel_err_vs_bf16"] < 0.05
    assert 0 < rows["pruned_fp8_scaled"]["22_vsa_rel_err_vs_bf16"] < 0.1
    assert rows["pruned_int8_convrot"]["file_GiB"] < rows["pruned_bf16"]["file_GiB"] < rows["bf16"]["file_GiB"]
    assert all(r["22_dense_ms"] > 0 and r["22_dense_speedup_vs_diffusers"] > 0 for r in rows.values())
    assert "pruned_int8_convrot" in proc.stdout and "VSA" in proc.stdout
