"""What every benchmark script shares: one results dict, saved as JSON (to the given path and $OUT) after each
stage, and stages that record their error and wall time instead of ending the run."""

import json
import os
import time
import traceback
from pathlib import Path

RESULTS: dict = {}


def log(msg):
    print(msg, flush=True)


def save(out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(RESULTS, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(RESULTS, indent=1))


def stage(name, fn, out):
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as error:  # a failed stage is recorded and the others still run
        RESULTS[f"{name}_error"] = "".join(traceback.format_exception_only(error)).strip()[-600:]
        log(traceback.format_exc())
    RESULTS[f"{name}_wall_s"] = round(time.perf_counter() - t0, 1)
    save(out)
