"""Qwen3-VL's video processor (transformers' `Qwen3VLVideoProcessor`, diffusers' `processor.video_processor`) for
ref2va reference videos, and a stand-in for where torchvision cannot be imported: the project's CPU torch has no
matching torchvision build, and transformers' video processors need its resize and normalize."""

from __future__ import annotations

import platform

import torch
from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.utils import is_torchvision_v2_available

QWEN3VL_VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}  # Qwen3-VL's video_preprocessor_config.json
_TORCH_MODES = {PILImageResampling.BICUBIC: "bicubic", PILImageResampling.BILINEAR: "bilinear"}


class _TorchKernels(TorchvisionBackend):
    """torchvision v2's resize (bicubic / bilinear, antialiased) and normalize of an image tensor, in torch alone."""

    def resize(self, image: torch.Tensor, size: SizeDict, resample=None, antialias: bool = True, **kwargs):
        mode = _TORCH_MODES.get(PILImageResampling.BILINEAR if resample is None else PILImageResampling(resample))
        if mode is None or not (size.height and size.width):
            raise ValueError(f"Without torchvision the video processor resizes bicubic or bilinear to a height and "
                             f"width, got resample={resample!r}, size={size}.")
        shape = image.shape
        if tuple(shape[-2:]) == (size.height, size.width):
            return image
        image = image.reshape(-1, *shape[-3:])
        # torchvision resizes uint8 on the CPU natively (bilinear where the CPU has AVX2), else in float32, rounded.
        native = image.device.type == "cpu" and (mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in (
            "AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64"))
        cast = image.dtype not in (torch.float32, torch.float64) and not (native and image.dtype == torch.uint8)
        dtype = image.dtype
        out = torch.nn.functional.interpolate(image.float() if cast else image, size=[size.height, size.width],
                                              mode=mode, align_corners=False, antialias=antialias)
        if cast:
            if mode == "bicubic" and dtype == torch.uint8:
                out = out.clamp_(0, 255)
            if not dtype.is_floating_point:
                out = out.round_()
            out = out.to(dtype)
        return out.reshape(*shape[:-2], size.height, size.width)

    def normalize(self, image: torch.Tensor, mean, std, inplace: bool = False, **kwargs) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
        if mean.ndim == 1:
            mean = mean.view(-1, 1, 1)
        if std.ndim == 1:
            std = std.view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


class TorchQwen3VLVideoProcessor(Qwen3VLVideoProcessor, _TorchKernels):
    """Qwen3-VL's video processor where torchvision cannot be imported (the project's CPU torch has no matching
    torchvision build): transformers' own processing with torchvision's three kernels done in torch, equal to it
    bit for bit (tests/test_conditioner.py checks where torchvision is there). Saves as a Qwen3VLVideoProcessor."""

    def convert_to_rgb(self, video: torch.Tensor) -> torch.Tensor:
        if video.shape[-3] == 1:  # grey; 3 channels (all the conditioner gets) pass as they are
            return video.expand(*video.shape[:-3], 3, *video.shape[-2:]).clone()
        return video

    def to_dict(self) -> dict:
        return super().to_dict() | {"video_processor_type": Qwen3VLVideoProcessor.__name__}


# transformers' Qwen3-VL video processor, the one diffusers' `processor.video_processor` is, where it can run.
VIDEO_PROCESSOR_CLASS = Qwen3VLVideoProcessor if is_torchvision_v2_available() else TorchQwen3VLVideoProcessor


def video_processor_like(image_processor, size: dict | None = None) -> Qwen3VLVideoProcessor:
    """A Qwen3-VL video processor of the image processor's geometry (patch, temporal patch, merge, mean / std,
    resampling) with `size` (default: Qwen3-VL's video pixel budget, over a whole clip)."""
    return VIDEO_PROCESSOR_CLASS(
        patch_size=image_processor.patch_size, temporal_patch_size=image_processor.temporal_patch_size,
        merge_size=image_processor.merge_size, image_mean=list(image_processor.image_mean),
        image_std=list(image_processor.image_std), resample=image_processor.resample,
        size=dict(QWEN3VL_VIDEO_SIZE if size is None else size))
