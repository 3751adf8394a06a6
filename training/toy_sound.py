"""The toy world's sound: hums panned by position, clicks at contacts, rain; stereo float32 [2, S].

Works on plain arrays (pitches, pan positions at sample times, click samples) so it knows nothing of scenes.
The rain comes from generators seeded per use, so a longer render starts with the same samples as a shorter one.
"""

from __future__ import annotations

import numpy as np

HUM_AMPLITUDE = 0.12
CLICK_AMPLITUDE = 0.5
CLICK_HZ = 3000.0  # above every hum's pitch band (the highest ends at 2045 Hz)
CLICK_DECAY_S = 0.004
CLICK_LENGTH_S = 0.02
RAIN_RMS = 0.02


def pan(signal: np.ndarray, x_fraction: np.ndarray | float) -> np.ndarray:
    """Constant-power pan: x 0 is hard left, 1 hard right (left = cos, right = sin of x * pi/2)."""
    angle = np.clip(x_fraction, 0.0, 1.0) * (np.pi / 2)
    return np.stack([signal * np.cos(angle), signal * np.sin(angle)])


def hum(pitch_hz: float, num_samples: int, sample_rate: int) -> np.ndarray:
    t = np.arange(num_samples) / sample_rate
    return HUM_AMPLITUDE * np.sin(2 * np.pi * pitch_hz * t)


def click(sample_rate: int) -> np.ndarray:
    """A knock: a CLICK_HZ sine with a fast exponential decay, the same waveform at every contact. A VAE decoder
    learns a waveform it can predict; a burst of noise (the clicks before stop 52) it could only guess, and every
    decoder trained on those gave them back as silence."""
    t = np.arange(int(CLICK_LENGTH_S * sample_rate)) / sample_rate
    return CLICK_AMPLITUDE * np.exp(-t / CLICK_DECAY_S) * np.sin(2 * np.pi * CLICK_HZ * t)


def rain(num_samples: int, seed: tuple[int, ...]) -> np.ndarray:
    """High-passed white noise (first difference), independent per channel, at RAIN_RMS."""
    channels = []
    for channel in range(2):
        white = np.random.default_rng((*seed, channel)).standard_normal(num_samples + 1)
        channels.append(np.diff(white) * (RAIN_RMS / np.sqrt(2)))
    return np.stack(channels)


def mix(hums: list[tuple[float, np.ndarray]], clicks: list[tuple[int, float]], with_rain: bool, seed: int,
        num_samples: int, sample_rate: int) -> np.ndarray:
    """hums: (pitch Hz, x fraction at every sample); clicks: (start sample, x fraction); seed for the rain."""
    out = np.zeros((2, num_samples))
    for pitch_hz, x_fraction in hums:
        out += pan(hum(pitch_hz, num_samples, sample_rate), x_fraction)
    knock = click(sample_rate)
    for start, x_fraction in clicks:
        tick = pan(knock, x_fraction)[:, : num_samples - start]
        out[:, start:start + tick.shape[1]] += tick
    if with_rain:
        out += rain(num_samples, (seed,))
    return np.clip(out, -1.0, 1.0).astype(np.float32)
