"""The example inputs the shipped workflows load (workflows/example_inputs/: a drawn scene as video, keyframes,
masks, reference images and a sound), put into ComfyUI's input folder when missing so that every shipped workflow
runs as imported. A file of the same name already there is the user's and is left alone."""

from __future__ import annotations

import shutil
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "workflows" / "example_inputs"
KINDS = (".png", ".mp4", ".wav")


def install(input_dir: str | Path) -> list[str]:
    """Copies the examples missing from `input_dir`; returns their names."""
    input_dir = Path(input_dir)
    input_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for example in sorted(EXAMPLES.iterdir()):
        target = input_dir / example.name
        if example.suffix in KINDS and not target.exists():
            shutil.copyfile(example, target)
            copied.append(example.name)
    return copied
