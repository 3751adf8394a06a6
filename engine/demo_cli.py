"""`python -m engine demo`: the quick-start job. Starts the bundled engine on the embedded `toy` preset (the
default, trained on the toy world) as the ComfyUI nodes do, runs one text-to-video+audio job through the real
WebSocket client with live progress, and writes the MP4 the engine returns."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path


# What the toy default shows best (every scored check passes; its bouncers knock, but a small DiT draws them rougher).
DEMO_PROMPT = "a large red ball moves right on green grass under a blue sky, humming"


def add_demo_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start the engine on the toy preset and generate one clip through the client")
    p.add_argument("--prompt", default=DEMO_PROMPT,
                   help="a caption of the toy world (training/captions.py): shapes, colours, motions, backgrounds")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo.mp4")
    p.add_argument("--strip", metavar="PNG", help="also write a strip of six frames from the first to the last")
    p.set_defaults(func=run_demo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _demo(args: argparse.Namespace) -> int:
    from nodes import launcher
    from nodes.client import EngineClient, EngineError

    url = f"ws://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    print(f"starting the bundled engine (toy preset) at {url} ...", file=sys.stderr)
    await launcher.ensure_engine({"url": url, "auto_launch": True, "preset": "toy", "device": "cpu"}, timeout=300)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def progress(event):
        if event.total:
            print(f"\r{event.stage}: step {event.step}/{event.total}"
                  + (f", eta {event.eta_s:.1f} s" if event.eta_s is not None else ""), end="", file=sys.stderr)

    params = {"prompt": args.prompt, "seconds": args.seconds, "steps": args.steps, "seed": args.seed}
    try:
        result = await EngineClient(url).run("t2va", params, on_progress=progress, mp4=True)
    except EngineError as error:
        print(f"\nerror: {error.message}", file=sys.stderr)
        return 2
    finally:
        print(file=sys.stderr)
    Path(args.out).write_bytes(result.mp4)
    if args.strip:
        write_strip(result.frames, args.strip)
    F, H, W, _ = result.frames.shape
    print(f"wrote {args.out}: {F} frames {W}x{H} @ {result.fps} fps with {result.audio.shape[0]}-channel audio "
          f"(job {result.job}, {time.perf_counter() - t0:.1f} s in all)", file=sys.stderr)
    return 0


def write_strip(frames, path: str, count: int = 6) -> None:
    """uint8 frames [F, H, W, 3] -> a PNG of `count` frames evenly spread from the first to the last, side by side."""
    import numpy as np
    from PIL import Image

    frames = np.asarray(frames)
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    Image.fromarray(np.concatenate(list(frames[picks]), axis=1)).save(path, optimize=True)


def run_demo(args: argparse.Namespace) -> int:
    return asyncio.run(_demo(args))
