"""Picture quality against a reference: PSNR, SSIM (gaussian window, the standard constants), CIE Lab and ΔE76.

Frames are uint8 (or floats on the same 0..255 scale), [..., H, W, 3].
"""

from __future__ import annotations

import numpy as np

PEAK = 255.0
SSIM_SIGMA, SSIM_RADIUS = 1.5, 5  # an 11-tap gaussian, as in Wang et al. 2004
SSIM_C1, SSIM_C2 = (0.01 * PEAK) ** 2, (0.03 * PEAK) ** 2
# sRGB primaries to CIE XYZ (D65), and the D65 white point.
SRGB_TO_XYZ = np.array([[0.4124564, 0.3575761, 0.1804375],
                        [0.2126729, 0.7151522, 0.0721750],
                        [0.0193339, 0.1191920, 0.9503041]])
D65_WHITE = np.array([0.95047, 1.0, 1.08883])
LAB_EPSILON = (6 / 29) ** 3


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB over all frames; inf for identical inputs."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"PSNR needs two pictures of one shape, got {a.shape} and {b.shape}.")
    pairs = zip(a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:])) if a.ndim > 3 else [(a, b)]
    squared = 0.0
    for x, y in pairs:  # frame by frame: no clip-sized float copies
        d = np.subtract(x, y, dtype=np.float32).ravel()
        squared += float(np.dot(d, d))
    mse = squared / a.size
    return float("inf") if mse == 0 else float(10 * np.log10(PEAK**2 / mse))


def _gaussian_filter(x: np.ndarray, axis: int, weights: np.ndarray) -> np.ndarray:
    """'valid' correlation along axis -3 or -2: a weighted sum of shifted views."""
    n = x.shape[axis] - len(weights) + 1
    lead = (Ellipsis,) + (slice(None),) * (-axis - 1)

    def tap(i):
        return x[lead[:1] + (slice(i, i + n),) + lead[1:]]

    out = weights[0] * tap(0)
    for i, w in enumerate(weights[1:], 1):
        out += w * tap(i)
    return out


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean structural similarity over every frame, pixel and channel, [..., H, W, C] (H, W >= 11)."""
    # float32 around mid-grey: the variances stay precise and the work halves.
    a, b = np.asarray(a, np.float32) - PEAK / 2, np.asarray(b, np.float32) - PEAK / 2
    if a.shape != b.shape or a.ndim < 3 or min(a.shape[-3:-1]) < 2 * SSIM_RADIUS + 1:
        raise ValueError(f"SSIM needs two pictures of one shape, at least 11x11, got {a.shape} and {b.shape}.")
    offsets = np.arange(-SSIM_RADIUS, SSIM_RADIUS + 1)
    weights = np.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    weights = (weights / weights.sum()).astype(np.float32)

    def blur(x):
        return _gaussian_filter(_gaussian_filter(x, -3, weights), -2, weights)

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    mean_a, mean_b = mu_a + PEAK / 2, mu_b + PEAK / 2
    index = ((2 * mean_a * mean_b + SSIM_C1) * (2 * cov + SSIM_C2)
             / ((mean_a**2 + mean_b**2 + SSIM_C1) * (var_a + var_b + SSIM_C2)))
    return float(index.mean(dtype=np.float64))


def srgb_to_linear(rgb: np.ndarray) -> np.ndarray:
    c = np.asarray(rgb, np.float64) / PEAK
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def linear_to_lab(linear: np.ndarray) -> np.ndarray:
    xyz = linear @ SRGB_TO_XYZ.T / D65_WHITE
    f = np.where(xyz > LAB_EPSILON, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """CIE L*a*b* (D65) of sRGB colours on the 0..255 scale, [..., 3]."""
    return linear_to_lab(srgb_to_linear(rgb))


def mean_colour_lab(frames: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Lab of the mean colour (averaged in linear light) of the pixels, or of those under a bool mask [..., H, W]."""
    pixels = np.asarray(frames)
    pixels = (pixels if mask is None else pixels[np.asarray(mask, bool)]).reshape(-1, 3)
    if len(pixels) == 0:
        raise ValueError("The mask selects no pixels, so they have no mean colour.")
    if pixels.dtype != np.uint8:
        return linear_to_lab(srgb_to_linear(pixels).mean(0))
    table = srgb_to_linear(np.arange(256))  # uint8: average through per-channel histograms
    counts = np.stack([np.bincount(pixels[:, c], minlength=256) for c in range(3)])
    return linear_to_lab(counts @ table / len(pixels))


def delta_e76(lab_a: np.ndarray, lab_b: np.ndarray) -> np.ndarray | float:
    """CIE 1976 colour difference: the distance in Lab."""
    return np.linalg.norm(np.asarray(lab_a, np.float64) - np.asarray(lab_b, np.float64), axis=-1)
