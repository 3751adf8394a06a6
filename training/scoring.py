"""Scoring a toy-world clip from its decoded frames and audio alone (no model): does it show and sound like its
caption? `score_clip` returns named checks (bool), measurements (numbers) and what was detected (names, frames).

Objects are found by colour (each pixel labelled with the nearest toy-world colour within COLOUR_MATCH_DISTANCE),
tracked by centroid and area; the named motion is judged over the first MOTION_WINDOW_S (one 5 s window: longer
clips reflect off the walls). Contacts are reversals of the track with the object at the floor or a wall; clicks
are transients of the audio in the knock's band; hums are tones in each colour's pitch band; pan is each hum's
left/right energy against its object's x. Given a `Scene` instead of a caption, the clip is also compared with the
generator's own render of it (PSNR, SSIM, ΔE of the mean colour).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from functools import cache

import numpy as np

from training.captions import SceneDescription, describe, parse_caption
from training.quality import delta_e76, mean_colour_lab, psnr, ssim
from training.toy_scene import BACKGROUNDS, COLOURS, FPS, HORIZON, PITCH_STEP, PITCHES_HZ, SAMPLE_RATE, SIZES, Scene
from training.toy_world import render

# Pictures
COLOUR_MATCH_DISTANCE = 70.0  # RGB distance to a toy colour that still counts as that colour
LUT_BITS = 6  # colour labels are looked up per 6-bit-per-channel cell
MIN_OBJECT_AREA = 0.002  # share of the canvas an object covers at least
MAX_SPREAD = 2.0  # a blob's second moment over a disc's of the same area: scattered pixels are no object
PRESENT_SHARE = 0.8  # of the frames
MOTION_WINDOW_S = 5.0
GROWTH_RATIO = 1.5  # area of the last half second over the first's
GROWTH_SPAN_S = 0.5
STILL_TRAVEL = 0.05  # share of the canvas crossed in the window below which an object stays still
MIN_BOUNCES = 2
LARGE_AREA = np.pi * SIZES["small"] * SIZES["large"]  # of height^2: between a small and a large shape's area
REVERSAL_FRAMES = 8  # a contact is a turn of the track over this many frames each side ...
MIN_REVERSAL = 0.008  # ... by at least this share of the canvas ...
EDGE_MARGIN = 0.05  # ... with the object this near the floor or the wall (share of the canvas)
BACKGROUND_MATCH_DISTANCE = 40.0
BACKGROUND_SHARE = 0.6  # of the pixels outside objects that match the background
FRAME_STRIDE = 4  # the background and the mean colour are judged on every 4th frame
SSIM_FRAMES = 8  # SSIM against the ground truth on this many frames spread over the clip
# Sound
CLICK_BAND_HZ = (2400.0, 4000.0)  # around the knock's 3 kHz: above every hum, below most of the rain's power
CLICK_HOP = 32  # samples (1 ms)
CLICK_RATIO = 10.0  # a click hop's band power over the clip's median hop
CLICK_FLOOR = 1e-3  # and at least this power: a knock at a quarter of its rendered level (~0.02) still counts,
# rain stays near 1e-5
CLICK_MERGE_S = 0.1
CLICK_TOLERANCE_FRAMES = 2
TONE_PROMINENCE = 30.0  # a hum's spectral peak over the median power of the hum range
MIN_TONE_AMPLITUDE = 0.01
PAN_WINDOW = 2048  # samples around each frame
PAN_BAND = 0.08  # +-8 % around a hum's pitch
PAN_TOLERANCE = 0.12  # |x from the pan - x of the object|, share of the width
PAN_MIN_CORRELATION = 0.8
PAN_MIN_TRAVEL = 0.05  # std of x (share of the width) above which pan must also correlate with x
RAIN_LEVEL = 0.025  # median RMS of the high band with rain falling
# Issue 18's t2va criterion: every named object's colour and motion (or stillness), the background and, when
# humming, the hum's pitch. "All checks" adds size, pan, rain and clicks.
NAMED_CHECKS = ("colour", "motion", "background", "pitch")

BACKGROUND_RGB = np.array(list(dict.fromkeys(rgb for parts in BACKGROUNDS.values() for rgb in parts)), np.float32)
PALETTE_RGB = np.concatenate([np.array(list(COLOURS.values()), np.float32), BACKGROUND_RGB])  # objects first


class ScoreInputError(ValueError):
    """Frames or audio that cannot be scored; the message says what is expected."""


@dataclass(frozen=True)
class Track:
    area: np.ndarray  # [F] pixels of the object's colour
    present: np.ndarray  # [F] bool
    x: np.ndarray  # [F] centroid in pixels (nan where absent)
    y: np.ndarray
    left: np.ndarray  # [F] extent in pixels (nan where absent)
    right: np.ndarray
    top: np.ndarray
    bottom: np.ndarray

    def first(self, n: int) -> Track:
        return Track(*(getattr(self, f.name)[:n] for f in fields(self)))


def _cell_colours() -> np.ndarray:
    """[cells, 1, 3] the centre colour of every 6-bit-per-channel RGB cell."""
    levels = (np.arange(2**LUT_BITS, dtype=np.float32) + 0.5) * 2 ** (8 - LUT_BITS)
    return np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 1, 3)


@cache
def _label_table() -> np.ndarray:
    """For every cell, the index of the nearest palette colour within COLOUR_MATCH_DISTANCE, else -1."""
    distance = np.linalg.norm(_cell_colours() - PALETTE_RGB, axis=-1)
    return np.where(distance.min(-1) <= COLOUR_MATCH_DISTANCE, distance.argmin(-1), -1).astype(np.int8)


@cache
def _background_table() -> np.ndarray:
    """For every cell, bit i set when it lies within BACKGROUND_MATCH_DISTANCE of BACKGROUND_RGB[i]."""
    near = np.linalg.norm(_cell_colours() - BACKGROUND_RGB, axis=-1) <= BACKGROUND_MATCH_DISTANCE
    return (near.astype(np.uint16) << np.arange(len(BACKGROUND_RGB), dtype=np.uint16)).sum(-1).astype(np.uint16)


def _cells(frames: np.ndarray) -> np.ndarray:
    q = frames >> (8 - LUT_BITS)
    return (q[..., 0].astype(np.int32) << 2 * LUT_BITS) | (q[..., 1].astype(np.int32) << LUT_BITS) | q[..., 2]


def colour_labels(frames: np.ndarray) -> np.ndarray:
    """int8 [F, H, W]: index into PALETTE_RGB (below len(COLOURS): an object colour) or -1 for no toy colour."""
    return _label_table()[_cells(frames)]


def track_colour(labels: np.ndarray, colour: str) -> Track:
    mask = labels == list(COLOURS).index(colour)
    _, height, width = mask.shape
    rows, cols = mask.sum(2, dtype=np.float64), mask.sum(1, dtype=np.float64)  # [F, H], [F, W]
    area = rows.sum(1)
    ys, xs = np.arange(height) + 0.5, np.arange(width) + 0.5
    with np.errstate(invalid="ignore", divide="ignore"):
        x, y = cols @ xs / area, rows @ ys / area
        spread = (cols @ xs**2 / area - x**2 + rows @ ys**2 / area - y**2) / (area / (2 * np.pi))
    present = (area >= MIN_OBJECT_AREA * height * width) & (spread <= MAX_SPREAD)

    def extent(hits, size):
        first, last = hits.argmax(1), size - 1 - hits[:, ::-1].argmax(1)
        return np.where(present, first, np.nan), np.where(present, last, np.nan)

    left, right = extent(cols > 0, width)
    top, bottom = extent(rows > 0, height)
    return Track(area, present, np.where(present, x, np.nan), np.where(present, y, np.nan), left, right, top, bottom)


def _turns(position: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Frames where a track turns: a local maximum and a local minimum, each by MIN_REVERSAL on both sides."""
    k = REVERSAL_FRAMES
    padded = np.pad(position, k, constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * k + 1)
    before, after = windows[:, :k], windows[:, k + 1:]
    depth = MIN_REVERSAL * size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # windows that are all nan (object unseen)
        peak = (position >= np.nanmax(windows, 1)) & (position - np.nanmin(before, 1) >= depth) \
            & (position - np.nanmin(after, 1) >= depth)
        dip = (position <= np.nanmin(windows, 1)) & (np.nanmax(before, 1) - position >= depth) \
            & (np.nanmax(after, 1) - position >= depth)
    return peak, dip


def _step(position: np.ndarray) -> np.ndarray:
    """[F] the larger move to a neighbouring frame: how far a contact between two frames may be from either."""
    moves = np.abs(np.diff(position))
    return np.fmax(np.pad(moves, (1, 0), constant_values=np.nan), np.pad(moves, (0, 1), constant_values=np.nan))


def _held_turns(turn: np.ndarray, at_edge: np.ndarray) -> list[float]:
    """The middle frame of every run of consecutive `turn` frames with the object `at_edge` in one of them: a turn
    held over several frames (a video VAE draws the frames of one latent alike) is one contact, not one per frame."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], turn, [False]]).astype(np.int8)))
    return [float(a + b - 1) / 2 for a, b in zip(edges[::2], edges[1::2]) if at_edge[a:b].any()]


def contact_frames(track: Track, width: int, height: int) -> tuple[list[float], list[float]]:
    """(floor bounces, wall and ceiling hits): frames where the track turns with the object at that edge (within
    EDGE_MARGIN plus the frame's step, as a fast object meets the edge between two frames); a turn held over
    consecutive frames counts once, at its middle (x.5 between two frames)."""
    x_peak, x_dip = _turns(track.x, width)
    y_peak, y_dip = _turns(track.y, height)
    x_reach, y_reach = EDGE_MARGIN * width + _step(track.x), EDGE_MARGIN * height + _step(track.y)
    with np.errstate(invalid="ignore"):
        floor = _held_turns(y_peak, track.bottom >= height - 1 - y_reach)
        walls = (_held_turns(x_peak, track.right >= width - 1 - x_reach) + _held_turns(x_dip, track.left <= x_reach)
                 + _held_turns(y_dip, track.top <= y_reach))
    return floor, sorted(walls)


def classify_motion(track: Track, width: int, height: int, fps: float = FPS) -> str | None:
    """One of the toy-world motions, judged over the first MOTION_WINDOW_S; None when the object is not seen."""
    n = min(len(track.area), int(round(MOTION_WINDOW_S * fps)))
    seen = np.flatnonzero(track.present[:n])
    if len(seen) < 2:
        return None
    span = max(1, int(round(GROWTH_SPAN_S * fps)))
    growth = np.median(track.area[seen[-span:]]) / np.median(track.area[seen[:span]])
    if growth >= GROWTH_RATIO:
        return "grows"
    if growth <= 1 / GROWTH_RATIO:
        return "shrinks"
    floor, _ = contact_frames(track.first(n), width, height)
    if len(floor) >= MIN_BOUNCES:
        return "bounces"
    t = seen / fps
    vx = np.polyfit(t, track.x[seen] / width, 1)[0]
    vy = np.polyfit(t, track.y[seen] / height, 1)[0]
    if max(abs(vx), abs(vy)) * n / fps < STILL_TRAVEL:
        return "stays still"
    if abs(vx) >= abs(vy):
        return "moves right" if vx > 0 else "moves left"
    return "moves down" if vy > 0 else "moves up"


def background_shares(frames: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """For each background, the share of pixels outside objects (every FRAME_STRIDE-th frame) that match it:
    within BACKGROUND_MATCH_DISTANCE of its colour above the horizon or of its ground below."""
    near = _background_table()[_cells(frames[::FRAME_STRIDE])]  # [n, H, W] bits over BACKGROUND_RGB
    outside = ~((labels[::FRAME_STRIDE] >= 0) & (labels[::FRAME_STRIDE] < len(COLOURS)))
    if not outside.any():
        return dict.fromkeys(BACKGROUNDS, 0.0)
    height = frames.shape[1]
    ground = np.arange(height) + 0.5 >= HORIZON * height  # rows mostly covered by the ground
    index = {tuple(rgb): i for i, rgb in enumerate(BACKGROUND_RGB.astype(int).tolist())}
    shares = {}
    for name, (above, below) in BACKGROUNDS.items():
        bit = np.where(ground, index[below], index[above]).astype(np.uint16)[None, :, None]
        shares[name] = float(((near >> bit) & 1).astype(bool)[outside].mean())
    return shares


def _high_band(audio: np.ndarray) -> np.ndarray:
    """The mono mix, second-differenced: rain stays, hums (below 2 kHz) fall away."""
    return np.diff(audio.mean(0), 2)


def click_band(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """The mono mix with everything outside CLICK_BAND_HZ removed."""
    mono = audio.mean(0)
    spectrum = np.fft.rfft(mono)
    freqs = np.fft.rfftfreq(len(mono), 1 / sample_rate)
    spectrum[(freqs < CLICK_BAND_HZ[0]) | (freqs > CLICK_BAND_HZ[1])] = 0
    return np.fft.irfft(spectrum, len(mono))


def detect_clicks(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, fps: float = FPS) -> list[int]:
    """Frames of the transients in the audio (onset of each burst of power in the knock's band)."""
    band = click_band(audio, sample_rate)
    hops = len(band) // CLICK_HOP
    power = (band[: hops * CLICK_HOP].reshape(hops, CLICK_HOP) ** 2).mean(1)
    loud = np.flatnonzero(power > max(CLICK_RATIO * np.median(power), CLICK_FLOOR))
    merge = CLICK_MERGE_S * sample_rate / CLICK_HOP
    onsets = [h for i, h in enumerate(loud) if i == 0 or h - loud[i - 1] > merge]
    return [int(round(h * CLICK_HOP / sample_rate * fps)) for h in onsets]


def rain_level(audio: np.ndarray) -> float:
    """Median RMS of the high band over 1 ms hops: steady noise counts, sparse clicks do not."""
    band = _high_band(audio)
    hops = len(band) // CLICK_HOP
    return float(np.sqrt(np.median((band[: hops * CLICK_HOP].reshape(hops, CLICK_HOP) ** 2).mean(1))))


def _band(pitch_hz: float) -> tuple[float, float]:
    return pitch_hz / np.sqrt(PITCH_STEP), pitch_hz * np.sqrt(PITCH_STEP)


def hum_tones(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> dict[str, float]:
    """Amplitude of the tone in each colour's pitch band, for the bands holding a clear tone (strongest first)."""
    mono = audio.mean(0)
    size = 1 << (len(mono) - 1).bit_length()  # zero-padded to a power of two: a fast transform
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(len(mono)), size)) ** 2
    freqs = np.fft.rfftfreq(size, 1 / sample_rate)
    lo, hi = _band(min(PITCHES_HZ.values()))[0], _band(max(PITCHES_HZ.values()))[1]
    floor = np.median(spectrum[(freqs >= lo) & (freqs <= hi)])
    tones = {}
    for colour, pitch in PITCHES_HZ.items():
        b_lo, b_hi = _band(pitch)
        peak = spectrum[(freqs >= b_lo) & (freqs < b_hi)].max()
        amplitude = 4 * np.sqrt(peak) / len(mono)  # a Hann window keeps half a sine's amplitude
        if peak > TONE_PROMINENCE * floor and amplitude >= MIN_TONE_AMPLITUDE:
            tones[colour] = float(amplitude)
    return dict(sorted(tones.items(), key=lambda item: -item[1]))


def hum_pan(audio: np.ndarray, pitch_hz: float, num_frames: int, sample_rate: int = SAMPLE_RATE,
            fps: float = FPS) -> np.ndarray:
    """[F] x position (share of the width) that the hum's left/right energy says, per frame (nan when silent)."""
    half = PAN_WINDOW // 2
    padded = np.pad(audio, ((0, 0), (half, half)))
    centres = ((np.arange(num_frames) + 0.5) / fps * sample_rate).astype(int).clip(0, audio.shape[1] - 1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, PAN_WINDOW, axis=1)[:, centres]
    spectrum = np.abs(np.fft.rfft(windows * np.hanning(PAN_WINDOW), axis=-1)) ** 2
    freqs = np.fft.rfftfreq(PAN_WINDOW, 1 / sample_rate)
    energy = spectrum[..., np.abs(freqs - pitch_hz) <= PAN_BAND * pitch_hz].sum(-1)  # [2, F]
    with np.errstate(invalid="ignore"):
        return np.where(energy.sum(0) > 0, np.arctan2(np.sqrt(energy[1]), np.sqrt(energy[0])) / (np.pi / 2), np.nan)


def _checked(frames, audio) -> tuple[np.ndarray, np.ndarray]:
    frames, audio = np.asarray(frames), np.asarray(audio, np.float32)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape[1:3]) < 16:
        raise ScoreInputError(f"Frames must be uint8 [F, H, W, 3] of at least 16x16 pixels, got {frames.dtype} "
                              f"{list(frames.shape)}.")
    if audio.ndim != 2 or audio.shape[0] != 2 or audio.shape[1] < PAN_WINDOW:
        raise ScoreInputError(f"Audio must be stereo [2, S] with S >= {PAN_WINDOW} samples, got {list(audio.shape)}.")
    return frames, audio


def _matched(frames_a: list[int], frames_b: list[int]) -> bool:
    return all(any(abs(a - b) <= CLICK_TOLERANCE_FRAMES for b in frames_b) for a in frames_a)


def clicks_agree(contacts: list[float], clicks: list[int], num_frames: int) -> bool:
    """Every contact has a click within CLICK_TOLERANCE_FRAMES and every click a contact; a turn needs frames on
    both sides, so a click in the first or last REVERSAL_FRAMES need not show one."""
    judged = [f for f in clicks if REVERSAL_FRAMES <= f < num_frames - REVERSAL_FRAMES]
    return bool(clicks) and _matched(contacts, clicks) and _matched(judged, contacts)


def score_clip(frames, audio, caption_or_scene: str | SceneDescription | Scene, sample_rate: int = SAMPLE_RATE,
               fps: float = FPS) -> dict[str, dict]:
    """{"checks": name -> bool, "measurements": name -> number, "detected": name -> what was found}.

    checks: colour (every object's colour present in >= 80 % of frames), size (when named, not for grows or
    shrinks), motion, background, and with humming pitch and pan; clicks (every contact has a click within +-2 frames and every click a contact) when
    something bounces or a contact or click is found; rain (noise present exactly when rain is named).
    Per-object entries are keyed "<index>.<name>".
    """
    frames, audio = _checked(frames, audio)
    scene = caption_or_scene if isinstance(caption_or_scene, Scene) else None
    if scene is not None:
        description = describe(scene)
    elif isinstance(caption_or_scene, SceneDescription):
        description = caption_or_scene
    else:
        description = parse_caption(caption_or_scene)
    num_frames, height, width, _ = frames.shape
    labels = colour_labels(frames)
    checks, measured, detected = {}, {}, {}

    tracks = [track_colour(labels, o.colour) for o in description.objects]
    presence = [float(t.present.mean()) for t in tracks]
    motions = [classify_motion(t, width, height, fps) for t in tracks]
    contacts = [contact_frames(t, width, height) for t in tracks]
    for i, (o, track) in enumerate(zip(description.objects, tracks)):
        measured[f"{i}.presence"] = presence[i]
        measured[f"{i}.area"] = float(np.median(track.area[track.present])) / height**2 if track.present.any() else 0.0
        detected[f"{i}.motion"] = motions[i]
        detected[f"{i}.contacts"] = sorted(contacts[i][0] + contacts[i][1])
    checks["colour"] = all(p >= PRESENT_SHARE for p in presence)
    checks["motion"] = all(m == o.motion for m, o in zip(motions, description.objects))
    sized = [i for i, o in enumerate(description.objects) if o.size and o.motion not in ("grows", "shrinks")]
    if sized:
        checks["size"] = all((measured[f"{i}.area"] >= LARGE_AREA) == (description.objects[i].size == "large")
                             for i in sized)

    shares = background_shares(frames, labels)
    detected["background"] = max(shares, key=shares.get)
    measured["background_share"] = shares[description.background]
    checks["background"] = (detected["background"] == description.background
                            and shares[description.background] >= BACKGROUND_SHARE)

    if description.humming:
        tones = hum_tones(audio, sample_rate)
        named = {o.colour for o in description.objects}
        detected["pitch"] = list(tones)
        checks["pitch"] = set(list(tones)[: len(named)]) == named
        errors, correlations = [], []
        for i, (o, track) in enumerate(zip(description.objects, tracks)):
            heard = hum_pan(audio, PITCHES_HZ[o.colour], num_frames, sample_rate, fps)
            seen = track.present & np.isfinite(heard)
            if not seen.any():
                errors.append(np.inf)
                continue
            x = track.x[seen] / width
            errors.append(float(np.median(np.abs(heard[seen] - x))))
            measured[f"{i}.pan_error"] = errors[-1]
            if np.std(x) >= PAN_MIN_TRAVEL:
                correlations.append(float(np.corrcoef(heard[seen], x)[0, 1]))
                measured[f"{i}.pan_correlation"] = correlations[-1]
        checks["pan"] = all(e <= PAN_TOLERANCE for e in errors) and all(c >= PAN_MIN_CORRELATION
                                                                         for c in correlations)

    clicks = detect_clicks(audio, sample_rate, fps)
    found = sorted(f for c in contacts for f in c[0] + c[1])
    detected["clicks"], detected["contacts"] = clicks, found
    measured["clicks"], measured["contacts"] = len(clicks), len(found)
    if clicks or found or any(o.motion == "bounces" for o in description.objects):
        checks["clicks"] = clicks_agree(found, clicks, num_frames)

    measured["rain_level"] = rain_level(audio)
    checks["rain"] = (measured["rain_level"] >= RAIN_LEVEL) == description.rain

    if scene is not None:
        truth = render(scene, width, height, num_frames=num_frames).frames
        measured["psnr"] = psnr(frames, truth)
        spread = np.unique(np.linspace(0, num_frames - 1, SSIM_FRAMES).round().astype(int))
        measured["ssim"] = ssim(frames[spread], truth[spread])
        measured["delta_e"] = float(delta_e76(mean_colour_lab(frames[::FRAME_STRIDE]),
                                              mean_colour_lab(truth[::FRAME_STRIDE])))
    return {"checks": checks, "measurements": measured, "detected": detected}
