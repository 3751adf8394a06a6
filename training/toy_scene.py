"""Toy-world scenes: the vocabulary, the `Scene` description, `sample_scene(seed)`, and where each object is when.

A scene is complete physics, independent of canvas and length: positions and speeds are fractions of the canvas,
so the same scene draws the same picture at 2x, and a longer render continues a shorter one (objects reflect off
the walls and the floor, each contact a click). Colours are kept far apart in RGB so a scorer can find objects
and backgrounds by colour.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

FPS = 24
SAMPLE_RATE = 32_000
DEFAULT_WIDTH, DEFAULT_HEIGHT = 224, 128  # the embedded preset's canvas
DEFAULT_SECONDS = 5.0

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 60, 230),
    "yellow": (240, 220, 30),
    "white": (250, 250, 250),
    "purple": (150, 40, 200),
}
# Each colour hums at its own pitch, low to high, a fifth apart: bands of +-22 % never overlap.
PITCH_ORDER = ("red", "yellow", "green", "blue", "purple", "white")
LOWEST_PITCH_HZ, PITCH_STEP = 220.0, 1.5
PITCHES_HZ = {colour: LOWEST_PITCH_HZ * PITCH_STEP**i for i, colour in enumerate(PITCH_ORDER)}

SKY, GRASS = (110, 170, 235), (50, 110, 40)
HORIZON = 0.7  # grass covers the canvas below 70 % of its height
BACKGROUNDS = {  # name -> (colour above the horizon, colour below it)
    "black": ((0, 0, 0), (0, 0, 0)),
    "white": ((255, 255, 255), (255, 255, 255)),
    "grey": ((128, 128, 128), (128, 128, 128)),
    "blue sky": (SKY, SKY),
    "green grass under a blue sky": (SKY, GRASS),
    "night": ((15, 20, 60), (15, 20, 60)),
    "sand": ((220, 190, 130), (220, 190, 130)),
}
MIN_CONTRAST = 90.0  # RGB distance an object's colour keeps from every colour of its background

SHAPES = ("ball", "box", "triangle")
SIZES = {"small": 0.09, "large": 0.16}  # s, a fraction of the canvas height: every shape has the area of pi s^2
BOX_HALF_SIDE = np.sqrt(np.pi) / 2
TRIANGLE_SIDE = np.sqrt(4 * np.pi / np.sqrt(3))
TRIANGLE_HEIGHT = TRIANGLE_SIDE * np.sqrt(3) / 2
# Reach from the centroid in units of s: (half width, up, down); triangles point up.
EXTENTS = {
    "ball": (1.0, 1.0, 1.0),
    "box": (BOX_HALF_SIDE, BOX_HALF_SIDE, BOX_HALF_SIDE),
    "triangle": (TRIANGLE_SIDE / 2, 2 * TRIANGLE_HEIGHT / 3, TRIANGLE_HEIGHT / 3),
}
BOUNDING_RADIUS = {"ball": 1.0, "box": BOX_HALF_SIDE * np.sqrt(2), "triangle": 2 * TRIANGLE_HEIGHT / 3}

MOTIONS = ("moves left", "moves right", "moves up", "moves down", "bounces", "stays still", "grows", "shrinks")
DIRECTIONS = {"moves left": (0, -1), "moves right": (0, 1), "moves up": (1, -1), "moves down": (1, 1)}  # axis, sign
GROWTH = {"grows": (0.5, 1.5), "shrinks": (1.5, 0.5)}  # size scale at t = 0 and the scale it approaches
GROWTH_TIME_S = 3.0

# Sampling: a lone object starts near the middle of the canvas, two near a quarter and three quarters of the width
# (in caption order), each start varied by PLACEMENT_JITTER of its free range: the caption says what moves and how,
# not where, and a small DiT that must also invent the place (anywhere on the canvas, as the world was until stop
# 38) drew its objects faint and still. A mover crosses this share of its free range in CLEAR_SECONDS without
# touching a wall, its path centred on its place (so a 5 s clip has no wall hit; longer renders reach the walls);
# two objects stay OBJECT_GAP_PX apart for CLEAR_SECONDS; scenes are this often humming / rainy.
# Every bouncer bounces alike: apex BOUNCE_HEIGHT_SHARE of its free height, one floor contact every BOUNCE_PERIOD_S,
# BOUNCE_PHASE of a period gone at t = 0 (never a contact then). Until stop 41 all three were drawn per clip: the
# bounces then fall out of step within 1.5 s, their mean path is an object hovering near y ~ 75 px (the clips spread
# 18 px about it), and that mean is what the DiT drew from noise (its one-step estimate held the object at 73-77).
# The bounce is low, a contact every 34 frames from frame 20 (20, 54, 88, 122: each the 3rd frame of its latent, as a
# 17-frame VAE chunk holds a 1-frame latent and four 4-frame ones and 34 frames are two chunks): a video VAE keeps
# four frames in a latent, and the toy VAE's round trip of the stop-41 bounce (apex 0.65, 1.2 s, contacts drifting
# through the latent's frames at ~7 px a frame) drew all four contacts of a 5 s render in none of 12 held-out
# bouncers, the object smeared or held ~15 px above the floor. Stop 64's 28-frame bounce from frame 19 (its contacts
# the 2nd, 1st, 3rd and 1st frame of their latents) in 12 of 16; this one in 16 of 16 (from frame 19 / 21 / 24 / 25:
# 15 / 7 / 14 / 10).
SLOTS = {1: (0.5,), 2: (0.25, 0.75)}  # share of the free range across the width, by number of objects
PLACEMENT_JITTER = 0.1
CLEAR_SECONDS = 6.0
TRAVEL_SHARE = (0.35, 0.45)
WALL_MARGIN = 0.05  # share of the free range a mover's path keeps from each wall
BOUNCE_HEIGHT_SHARE = 0.3
BOUNCE_PERIOD_S = 34 / FPS
BOUNCE_PHASE = 1 - 20 / 34
HUMMING_PROBABILITY, RAIN_PROBABILITY = 0.75, 0.4
OBJECT_GAP_PX = 3.0


@dataclass(frozen=True)
class ToyObject:
    shape: str
    colour: str
    size: str
    motion: str
    x: float  # centroid at t = 0, fraction of the width
    y: float  # centroid at t = 0, fraction of the height (a bouncer's follows from its bounce)
    speed: float = 0.0  # "moves ...": fraction of the width (left/right) or height (up/down) per second
    bounce_height: float = 0.0  # "bounces": apex above the floor, fraction of the height
    bounce_period: float = 0.0  # seconds between floor contacts
    bounce_phase: float = 0.0  # share of a period already gone at t = 0

    @property
    def pitch_hz(self) -> float:
        return PITCHES_HZ[self.colour]


@dataclass(frozen=True)
class Scene:
    objects: tuple[ToyObject, ...]
    background: str
    humming: bool
    rain: bool
    seed: int  # seeds the noises (clicks, rain)


def visible_on(colour: str, background: str) -> bool:
    rgb = np.asarray(COLOURS[colour], float)
    return all(np.linalg.norm(rgb - np.asarray(part, float)) >= MIN_CONTRAST for part in BACKGROUNDS[background])


def size_px(obj: ToyObject, t: np.ndarray, height: int) -> np.ndarray:
    base = SIZES[obj.size] * height
    if obj.motion not in GROWTH:
        return np.full(np.shape(t), base)
    start, end = GROWTH[obj.motion]
    return base * (end + (start - end) * np.exp(-np.asarray(t) / GROWTH_TIME_S))


def _range_px(shape: str, s: float, axis: int, width: int, height: int) -> tuple[float, float]:
    """Where the centroid may go on one axis (0: x, 1: y) without a shape of size s leaving the canvas."""
    half_width, up, down = EXTENTS[shape]
    return (half_width * s, width - half_width * s) if axis == 0 else (up * s, height - down * s)


def _free_range_px(obj: ToyObject, axis: int, width: int, height: int) -> tuple[float, float]:
    return _range_px(obj.shape, SIZES[obj.size] * height, axis, width, height)


def _reflect(p: np.ndarray, lo: float, hi: float) -> np.ndarray:
    span = hi - lo
    if span <= 0:
        return np.full(np.shape(p), (lo + hi) / 2)
    q = np.mod(p - lo, 2 * span)
    return lo + np.where(q <= span, q, 2 * span - q)


def centroid_px(obj: ToyObject, t: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The centroid (x, y) in pixels at times t (seconds)."""
    t = np.asarray(t, float)
    x = _reflect(np.full(t.shape, obj.x * width), *_free_range_px(obj, 0, width, height))
    y = np.full(t.shape, obj.y * height)
    if obj.motion in DIRECTIONS:
        axis, sign = DIRECTIONS[obj.motion]
        start, extent = (obj.x * width, width) if axis == 0 else (obj.y * height, height)
        moved = _reflect(start + sign * obj.speed * extent * t, *_free_range_px(obj, axis, width, height))
        return (moved, y) if axis == 0 else (x, moved)
    if obj.motion == "bounces":
        floor = _free_range_px(obj, 1, width, height)[1]
        u = np.mod(t / obj.bounce_period + obj.bounce_phase, 1.0)
        return x, floor - obj.bounce_height * height * 4 * u * (1 - u)
    return x, y


def contact_times(obj: ToyObject, duration: float, width: int, height: int) -> np.ndarray:
    """Times in [0, duration) at which the object hits the floor or a wall (each one a click)."""
    if obj.motion == "bounces":
        turns = np.arange(np.floor(obj.bounce_phase) + 1, np.ceil(obj.bounce_phase + duration / obj.bounce_period))
        return (turns - obj.bounce_phase) * obj.bounce_period
    if obj.motion not in DIRECTIONS:
        return np.zeros(0)
    axis, sign = DIRECTIONS[obj.motion]
    lo, hi = _free_range_px(obj, axis, width, height)
    start, extent = (obj.x * width, width) if axis == 0 else (obj.y * height, height)
    if hi <= lo or obj.speed == 0:
        return np.zeros(0)
    # In units of the free span, walls sit at the integers; count the ones crossed.
    rate = sign * obj.speed * extent / (hi - lo)
    u0 = (start - lo) / (hi - lo)
    u1 = u0 + rate * duration
    walls = np.arange(np.floor(u0) + 1, np.ceil(u1)) if rate > 0 else np.arange(np.ceil(u0) - 1, np.floor(u1), -1)
    return (walls - u0) / rate


def _place(rng: np.random.Generator, centre: float, lo: float, hi: float) -> float:
    """A start in pixels near `centre` (a share of the range lo..hi), varied by PLACEMENT_JITTER of the range."""
    return float(np.clip(lo + (centre + rng.uniform(-PLACEMENT_JITTER, PLACEMENT_JITTER)) * (hi - lo), lo, hi))


def _sample_object(rng: np.random.Generator, colour: str, slot: float, width: int, height: int) -> ToyObject:
    shape = SHAPES[rng.integers(len(SHAPES))]
    size = tuple(SIZES)[rng.integers(len(SIZES))]
    motion = MOTIONS[rng.integers(len(MOTIONS))]
    s = SIZES[size] * height * max(GROWTH.get(motion, (1.0,)))  # the largest it gets
    x = _place(rng, slot, *_range_px(shape, s, 0, width, height)) / width
    y = _place(rng, 0.5, *_range_px(shape, s, 1, width, height)) / height
    if motion in DIRECTIONS:
        axis, sign = DIRECTIONS[motion]
        extent = width if axis == 0 else height
        lo, hi = _range_px(shape, s, axis, width, height)
        travel = rng.uniform(*TRAVEL_SHARE) * (hi - lo)
        margin = WALL_MARGIN * (hi - lo)
        start = float(np.clip((x if axis == 0 else y) * extent - sign * travel / 2,
                              lo + margin + travel * (sign < 0), hi - margin - travel * (sign > 0))) / extent
        x, y = (start, y) if axis == 0 else (x, start)
        return ToyObject(shape, colour, size, motion, float(x), float(y), speed=float(travel / CLEAR_SECONDS / extent))
    if motion == "bounces":
        lo, hi = _range_px(shape, s, 1, width, height)
        obj = ToyObject(shape, colour, size, motion, float(x), float(y),
                        bounce_height=BOUNCE_HEIGHT_SHARE * (hi - lo) / height, bounce_period=BOUNCE_PERIOD_S,
                        bounce_phase=BOUNCE_PHASE)
        return replace(obj, y=float(centroid_px(obj, 0.0, width, height)[1]) / height)
    return ToyObject(shape, colour, size, motion, float(x), float(y))


def _apart(a: ToyObject, b: ToyObject, width: int, height: int) -> bool:
    t = np.arange(int(CLEAR_SECONDS * FPS)) / FPS
    (ax, ay), (bx, by) = centroid_px(a, t, width, height), centroid_px(b, t, width, height)
    reach = (BOUNDING_RADIUS[a.shape] * size_px(a, t, height) + BOUNDING_RADIUS[b.shape] * size_px(b, t, height))
    return bool(np.all(np.hypot(ax - bx, ay - by) > reach + OBJECT_GAP_PX))


def sample_scene(seed: int, width: int = DEFAULT_WIDTH, height: int = DEFAULT_HEIGHT) -> Scene:
    """A scene drawn from a seed, laid out for a canvas of this aspect: one or two objects of different colours,
    each visible on the background, in their SLOTS and apart from each other during the first CLEAR_SECONDS."""
    rng = np.random.default_rng(seed)
    while True:
        background = tuple(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
        palette = [colour for colour in COLOURS if visible_on(colour, background)]
        colours = rng.choice(palette, size=rng.integers(1, 3), replace=False)
        objects = tuple(_sample_object(rng, str(colour), slot, width, height)
                        for colour, slot in zip(colours, SLOTS[len(colours)]))
        if len(objects) == 1 or _apart(*objects, width, height):
            break
    return Scene(objects, background, humming=bool(rng.random() < HUMMING_PROBABILITY),
                 rain=bool(rng.random() < RAIN_PROBABILITY), seed=seed)
