"""`python -m engine generate`: one t2va / fl2va / ref2va job in this process, written to an MP4."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_generate_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate one video with audio and write it to an MP4")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="toy", choices=("toy", "tiny"),
                     help="embedded weights: toy (trained, the default) or tiny (random)")
    src.add_argument("--models", metavar="DIR", help="models directory with real MiniMax-H3 checkpoints")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seconds", type=float, default=5.0, help="5 to 15; snapped up to 17n+5 frames at 24 fps")
    p.add_argument("--out", default="out.mp4")
    p.add_argument("--first-frame", metavar="IMG")
    p.add_argument("--last-frame", metavar="IMG")
    for kind, what in (("image", "an image file"), ("video", "a video file (its sound included)"),
                       ("audio", "a sound file")):
        p.add_argument(f"--ref-{kind}", action=_Reference, dest="references", default=[], metavar="FILE",
                       help=f"ref2va: {what} as a reference; repeatable, all references in the order given (at most "
                            "9 images, 3 videos, 3 sounds, 12 in all; sound never alone)")
    p.add_argument("--ref-size", default="diffusers", choices=("diffusers", "match", "max"),
                   help="image references: diffusers (short edge 2048, the release's), match (the canvas' area, "
                        "never upscaled: what the Ref2VA Turbo LoRA expects), max (downscaled only past 2048)")
    p.add_argument("--lora", action="append", default=[], metavar="FILE[:SCALE]")
    p.add_argument("--steps", type=int, help="sigma grid points; N points = N-1 DiT evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--aspect", help="e.g. 16:9, 9:16, 1:1 (ignored with --width/--height)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.set_defaults(func=run_generate)


class _Reference(argparse.Action):
    """--ref-image / --ref-video / --ref-audio into one list, in the order given."""

    def __call__(self, parser, namespace, value, option_string=None):
        getattr(namespace, self.dest).append((option_string.removeprefix("--ref-"), value))


def _load_reference(kind: str, path: str):
    import av

    from engine.io.video import read_audio, read_video
    from engine.models.h3.references import AudioReference, ImageReference, VideoReference

    if not Path(path).is_file():
        raise FileNotFoundError(f"reference {kind} {path} not found")
    try:
        if kind == "image":
            return ImageReference(_load_image(path))
        if kind == "video":
            frames, fps, audio, rate = read_video(path)
            return VideoReference(frames, float(fps), audio, rate or 32000)
        audio, rate = read_audio(path)
        return AudioReference(audio, rate)
    except (OSError, ValueError, av.FFmpegError) as exc:
        raise ValueError(f"reference {kind} {path} could not be read ({exc})") from None


def _load_image(path: str):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from engine.models.h3.layout import LayoutError
    from engine.models.h3.lora import parse_lora_spec
    from engine.models.h3.pipeline import GenerateRequest, H3Pipeline, StepEvent

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    try:
        request = GenerateRequest(
            prompt=args.prompt, seconds=args.seconds, width=args.width, height=args.height, aspect=args.aspect,
            steps=args.steps, seed=args.seed,
            first_frame=_load_image(args.first_frame) if args.first_frame else None,
            last_frame=_load_image(args.last_frame) if args.last_frame else None,
            loras=[parse_lora_spec(spec) for spec in args.lora],
            references=[_load_reference(kind, path) for kind, path in args.references], reference_size=args.ref_size)
        if args.models:
            pipe = H3Pipeline.from_models(args.models, device=device)
        else:
            pipe = H3Pipeline.from_preset(args.preset, device=device)
        print(f"loaded {pipe.name} on {device} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        frames, height, width, steps, notes = pipe.plan(request)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        bar = tqdm(total=None, desc="denoising", unit="step", file=sys.stderr)

        def on_step(event):
            if not isinstance(event, StepEvent):  # the other phases' chunk boundaries
                return
            bar.total = event.total
            bar.update(1)

        result = pipe.generate(request, on_step=on_step)
        bar.close()
    except (LayoutError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    Path(args.out).write_bytes(result.mp4)  # encoded while the VAE decoded
    F, H, W, _ = result.frames.shape
    print(f"wrote {args.out}: {F} frames {W}x{H} @ {result.fps} fps, audio {result.audio.shape[0]} ch "
          f"{result.audio.shape[1] / result.sample_rate:.2f} s @ {result.sample_rate} Hz "
          f"({', '.join(f'{k} {v:.2f}' for k, v in result.timings.items())})", file=sys.stderr)
    return 0
