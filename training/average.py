"""The mean, tensor by tensor, of weight files of one architecture: two runs of a stage, the second resumed from the
first. The video decoder stage trains at a constant learning rate, so where one run stops is one draw from the noise
of its late steps; the mean of two draws beat both in stop 58 (README). Tensors the runs share (the encoder, the
latent statistics) come back unchanged.

    python -m training.average out/sd2/minimax_h3_toy_video_vae_fp16.safetensors \
        out/sd2b/minimax_h3_toy_video_vae_fp16.safetensors --out engine/weights/toy/minimax_h3_toy_video_vae_fp16.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def average_files(paths: list[Path], out: Path) -> Path:
    """Write to `out` the mean of the files' floating tensors (integer ones must agree), with the first's header."""
    files = [safe_open(str(p), "pt") for p in paths]
    first, metadata = files[0], files[0].metadata()
    keys = set(first.keys())
    for path, f in zip(paths[1:], files[1:]):
        if f.metadata() != metadata:
            raise ValueError(f"{path}: its header differs from {paths[0]}'s (another architecture)")
        if set(f.keys()) != keys:
            name = sorted(keys ^ set(f.keys()))[0]
            raise ValueError(f"{path}: key {name} is in one file and not the other ({paths[0]})")
    mean = {}
    for key in sorted(keys):
        tensors = [f.get_tensor(key) for f in files]
        for path, t in zip(paths[1:], tensors[1:]):
            if t.shape != tensors[0].shape or t.dtype != tensors[0].dtype:
                raise ValueError(f"{path}: {key} is {t.dtype} {tuple(t.shape)}, {paths[0]} has "
                                 f"{tensors[0].dtype} {tuple(tensors[0].shape)}")
            if not t.is_floating_point() and not torch.equal(t, tensors[0]):
                raise ValueError(f"{path}: integer tensor {key} differs from {paths[0]}'s")
        if tensors[0].is_floating_point():
            mean[key] = (sum(t.float() for t in tensors) / len(tensors)).to(tensors[0].dtype)
        else:
            mean[key] = tensors[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(mean, str(out), metadata=metadata)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Average weight files of one architecture, tensor by tensor.")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if len(args.files) < 2:
        p.error("give two or more files to average")
    print(average_files(args.files, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
