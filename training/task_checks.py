"""Checks of the edit and extension tasks on toy clips, from the output pixels and sound against the source clip
the task was given (its render: masks, centroids, colours). The thresholds are issue 18's.

- removal: inside the mask at most 5 % of the object's colour pixels remain, outside it the clip is kept
  (PSNR >= 35 dB against the source), the other object is intact (>= 80 % of its pixels keep its colour);
- replacement: the named colour fills >= 50 % of the former object's area;
- repaint: the masked region's mean colour moves to the named background's (nearer to it than to the source's);
- extension: each window boundary continues the motion (velocity over the second before and after within 35 %,
  for objects moving in a line or still; `velocity_first_join` reports the source's own join alone, beside it, and
  `joins` each object's join by its kind: JOIN_KINDS),
  shows no jump (frame difference at the boundary <= 2x the clip's median), keeps the hum's pitch, and the last
  window's background stays within ΔE 5 of the first's.

`height_correlation` is a graded measure, not one of the issue's checks: how closely a generated object's height
follows the scene's own path (a bounce in time with the render's scores near 1, a still object near 0). So is
`steady_frames`: the extension's velocity criterion at every frame of one generated window, where no join is (how
steady a DiT's movers are on their own, which bounds what its later joins can reach), and `speed_kept`: a mover's
speed after a join over the guide's (whether a DiT reads the speed from the guide or draws its own for the prompt).
"""

from __future__ import annotations

import numpy as np

from training.quality import delta_e76, mean_colour_lab, psnr, srgb_to_lab
from training.scoring import colour_labels, contact_frames, hum_tones, track_colour
from training.toy_scene import BACKGROUNDS, COLOURS, DIRECTIONS, FPS, SAMPLE_RATE
from training.toy_world import ToyClip

REMOVED_SHARE = 0.05
KEPT_PSNR_DB = 35.0
INTACT_SHARE = 0.8
FILLED_SHARE = 0.5
VELOCITY_TOLERANCE = 0.35
MIN_SPEED_PX_S = 4.0  # slower than this on both sides of a boundary counts as still (velocities agree)
JUMP_RATIO = 2.0
DRIFT_DELTA_E = 5.0
LINEAR_MOTIONS = (*DIRECTIONS, "stays still")
# An extension's joins, by what the object does there: a mover at the source's own join, a mover at a later join
# after a wall hit of its render (its window's guide holds the turn), one with none yet, and a still object.
JOIN_KINDS = ("first", "after_wall", "moving", "still")
MIN_SEEN_FRAMES = 12  # height_correlation: fewer frames with the object found score 0
BOX_PAD = 6  # pixels around an object's bounding box, as a Mask Track Box drawn by hand leaves


def box_masks(mask: np.ndarray, pad: int = BOX_PAD) -> np.ndarray:
    """bool [F, H, W] object pixels -> float32 [F, H, W]: per frame, its bounding box grown by `pad` (what
    H3Forge Mask Track Box makes of keyed boxes)."""
    out = np.zeros(mask.shape, np.float32)
    _, height, width = mask.shape
    for f, frame in enumerate(mask):
        rows, cols = np.flatnonzero(frame.any(1)), np.flatnonzero(frame.any(0))
        if len(rows):
            out[f, max(0, rows[0] - pad):min(height, rows[-1] + pad + 1),
                max(0, cols[0] - pad):min(width, cols[-1] + pad + 1)] = 1
    return out


def _colour_pixels(frames: np.ndarray, colour: str) -> np.ndarray:
    return colour_labels(frames) == list(COLOURS).index(colour)


def removal_checks(frames: np.ndarray, source: ToyClip, removed: int, mask: np.ndarray) -> dict:
    inside = mask > 0.5
    colour = source.scene.objects[removed].colour
    before = (_colour_pixels(source.frames, colour) & inside).sum()
    remaining = float((_colour_pixels(frames, colour) & inside).sum() / max(before, 1))
    kept = psnr(frames[~inside], source.frames[~inside])
    measured = {"remaining_share": remaining, "outside_psnr": kept}
    checks = {"removed": bool(remaining <= REMOVED_SHARE), "outside_kept": bool(kept >= KEPT_PSNR_DB)}
    for k, other in enumerate(source.scene.objects):
        if k != removed:
            own = source.masks[k] & ~inside
            measured["other_intact_share"] = float((_colour_pixels(frames, other.colour) & own).sum()
                                                   / max(own.sum(), 1))
            checks["other_intact"] = bool(measured["other_intact_share"] >= INTACT_SHARE)
    return {"checks": checks, "measurements": measured}


def replacement_checks(frames: np.ndarray, source: ToyClip, replaced: int, colour: str) -> dict:
    area = source.masks[replaced]
    filled = float((_colour_pixels(frames, colour) & area).sum() / max(area.sum(), 1))
    return {"checks": {"filled": bool(filled >= FILLED_SHARE)}, "measurements": {"filled_share": filled}}


def repaint_checks(frames: np.ndarray, source: ToyClip, region: np.ndarray, background: str) -> dict:
    """`region` bool [H, W]: the repainted area; judged on its pixels outside the objects."""
    free = region[None] & ~source.masks.any(0)
    got = mean_colour_lab(frames, free)
    target = srgb_to_lab(np.asarray(BACKGROUNDS[background][0], np.float64))
    before = mean_colour_lab(source.frames, free)
    to_target, to_source = float(delta_e76(got, target)), float(delta_e76(got, before))
    return {"checks": {"moved": bool(to_target < to_source)},
            "measurements": {"delta_e_to_target": to_target, "delta_e_to_source": to_source}}


def _velocity(track, frames: slice) -> np.ndarray:
    """Pixels per second of the centroid over the frames (fit of a line to the present ones)."""
    t = np.arange(frames.start, frames.stop)
    seen = track.present[frames]
    if seen.sum() < 2:
        return np.full(2, np.nan)
    x, y = track.x[frames][seen], track.y[frames][seen]
    return np.array([np.polyfit(t[seen], x, 1)[0], np.polyfit(t[seen], y, 1)[0]]) * FPS


def _velocity_kept(track, before: slice, after: slice) -> tuple[bool, float]:
    """Whether the velocity over `after` agrees with `before`'s within VELOCITY_TOLERANCE of the faster (both below
    MIN_SPEED_PX_S: still, agreeing), and that relative error."""
    v0, v1 = _velocity(track, before), _velocity(track, after)
    s0, s1 = float(np.linalg.norm(v0)), float(np.linalg.norm(v1))
    error = float(np.linalg.norm(v1 - v0) / max(s0, s1, MIN_SPEED_PX_S))
    still = bool(np.isfinite([s0, s1]).all() and max(s0, s1) < MIN_SPEED_PX_S)
    return still or error <= VELOCITY_TOLERANCE, error


def steady_frames(frames: np.ndarray, truth: ToyClip) -> list[bool]:
    """The extension's velocity criterion at every frame b of one generated window, for each object the caption moves
    in a line: whether its velocity over the second after b agrees with the second before, at every b a second from
    either end and more than a second from the render's contacts and from those the frames draw (a wall hit turns
    the velocity)."""
    labels, (height, width) = colour_labels(frames), frames.shape[1:3]
    kept = []
    for k, obj in enumerate(truth.scene.objects):
        if obj.motion not in DIRECTIONS:
            continue
        track = track_colour(labels, obj.colour)
        contacts = [*truth.contact_frames[k], *(c for side in contact_frames(track, width, height) for c in side)]
        for b in range(FPS, len(frames) - FPS + 1):
            if all(abs(c - b) > FPS for c in contacts):
                kept.append(_velocity_kept(track, slice(b - FPS, b), slice(b, b + FPS))[0])
    return kept


def frame_differences(frames: np.ndarray) -> np.ndarray:
    """uint8 [F, H, W, 3] -> [F - 1]: the mean absolute change from frame i to i + 1."""
    return np.abs(np.diff(frames.astype(np.int16), axis=0)).mean((1, 2, 3))


def _window_audio(audio: np.ndarray, frames: slice) -> np.ndarray:
    return audio[:, int(frames.start / FPS * SAMPLE_RATE):int(frames.stop / FPS * SAMPLE_RATE)]


def speed_kept(frames: np.ndarray, truth: ToyClip, join: int) -> list[float]:
    """Each object moving in a line, away from its contacts: its speed over the second after `join` in `frames` over
    the render's over the second before (1 where the guide's speed is kept)."""
    labels, ratios = colour_labels(frames), []
    for k, obj in enumerate(truth.scene.objects):
        if obj.motion not in DIRECTIONS or any(abs(c - join) <= FPS for c in truth.contact_frames[k]):
            continue
        guide = np.hypot(*(truth.centroids[k, join - 1] - truth.centroids[k, join - FPS])) / (FPS - 1) * FPS
        ratios.append(float(np.hypot(*_velocity(track_colour(labels, obj.colour), slice(join, join + FPS))) / guide))
    return ratios


def extension_checks(frames: np.ndarray, audio: np.ndarray, truth: ToyClip, boundaries: list[int],
                     source_frames: int | None = None) -> dict:
    """`truth`: the scene rendered for the whole length (the source is its start); `boundaries`: the first frame
    each window adds (the source's length, then each later window's). Velocities are judged for objects that move
    in a line or stay still, away from their contacts (a wall hit turns the true velocity too). `source_frames`
    (default the first boundary): the length of the clip the extension began from, whose join is a mover's first
    (a later join judged alone keeps its own kind)."""
    labels = colour_labels(frames)
    diffs = frame_differences(frames)
    median = float(np.median(diffs))
    checks, measured = {}, {"median_frame_difference": median}
    speeds_agree, jumps, first_join, joins = [], [], [], []
    for b in boundaries:
        before, after = slice(max(0, b - FPS), b), slice(b, min(len(frames), b + FPS))
        for k, obj in enumerate(truth.scene.objects):
            if obj.motion not in LINEAR_MOTIONS or any(abs(c - b) <= FPS for c in truth.contact_frames[k]):
                continue
            agree, error = _velocity_kept(track_colour(labels, obj.colour), before, after)
            measured[f"{b}.{k}.velocity_error"] = error
            speeds_agree.append(agree)
            if b == boundaries[0]:
                first_join.append(speeds_agree[-1])
            kind = ("still" if obj.motion == "stays still" else "first" if b == (source_frames or boundaries[0])
                    else "after_wall" if any(c < b for c in truth.contact_frames[k]) else "moving")
            joins.append({"frame": b, "object": k, "kind": kind, "kept": agree})
        measured[f"{b}.frame_difference"] = float(diffs[b - 1])
        jumps.append(bool(diffs[b - 1] <= JUMP_RATIO * median))
    checks["velocity"], checks["velocity_first_join"] = all(speeds_agree), all(first_join)
    checks["no_jump"] = all(jumps)
    first, last = slice(0, boundaries[0]), slice(boundaries[-1], len(frames))
    if truth.scene.humming:
        heard = [list(hum_tones(_window_audio(audio, w)))[:len(truth.scene.objects)] for w in (first, last)]
        checks["pitch_kept"] = bool(set(heard[0]) == set(heard[1]) == {o.colour for o in truth.scene.objects})
    outside = [~((labels[w] >= 0) & (labels[w] < len(COLOURS))) for w in (first, last)]
    drift = float(delta_e76(mean_colour_lab(frames[first], outside[0]), mean_colour_lab(frames[last], outside[1])))
    measured["background_drift_delta_e"] = drift
    checks["no_drift"] = bool(drift <= DRIFT_DELTA_E)
    return {"checks": checks, "measurements": measured, "joins": joins}


def height_correlation(frames: np.ndarray, truth: ToyClip, index: int) -> float:
    """Pearson correlation of object `index`'s tracked height (by its colour) with its rendered centroid's, over
    the frames where it is seen; 0 when it is seen in fewer than MIN_SEEN_FRAMES or does not move."""
    track = track_colour(colour_labels(frames), truth.scene.objects[index].colour)
    seen = np.flatnonzero(track.present[:len(truth.centroids[index])])
    y, wanted = track.y[seen], truth.centroids[index, seen, 1]
    if len(seen) < MIN_SEEN_FRAMES or y.std() == 0 or wanted.std() == 0:
        return 0.0
    return float(np.corrcoef(y, wanted)[0, 1])
