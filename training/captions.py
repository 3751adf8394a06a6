"""The toy world's caption grammar: `caption(scene)` and `parse_caption(text)` -> what an evaluation checks.

    caption    := object [" and " object] " " background [", humming"] ["; rain falls"]
    object     := "a " [size " "] colour " " shape " " motion
    e.g. "a small red ball bounces on green grass under a blue sky, humming; rain falls"

The size may be left out of a parsed caption (then it is not checked); `caption` always writes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from training.toy_scene import COLOURS, DIRECTIONS, MOTIONS, SHAPES, SIZES, Scene, contact_times, visible_on

BACKGROUND_PHRASES = {
    "black": "on a black background",
    "white": "on a white background",
    "grey": "on a grey background",
    "blue sky": "in a blue sky",
    "green grass under a blue sky": "on green grass under a blue sky",
    "night": "at night",
    "sand": "on sand",
}
HUMMING, RAIN = ", humming", "; rain falls"
EXAMPLE = "a small red ball bounces on green grass under a blue sky, humming; rain falls"


class CaptionError(ValueError):
    """A caption outside the grammar; the message says what the grammar allows."""


@dataclass(frozen=True)
class ObjectDescription:
    colour: str
    shape: str
    motion: str
    size: str | None = None  # None: not named


@dataclass(frozen=True)
class SceneDescription:
    objects: tuple[ObjectDescription, ...]
    background: str
    humming: bool
    rain: bool


def describe(scene: Scene) -> SceneDescription:
    objects = tuple(ObjectDescription(o.colour, o.shape, o.motion, o.size) for o in scene.objects)
    return SceneDescription(objects, scene.background, scene.humming, scene.rain)


def caption(scene: Scene | SceneDescription) -> str:
    objects = " and ".join(
        " ".join(word for word in ("a", o.size, o.colour, o.shape, o.motion) if word) for o in scene.objects)
    return (f"{objects} {BACKGROUND_PHRASES[scene.background]}"
            f"{HUMMING if scene.humming else ''}{RAIN if scene.rain else ''}")


OPPOSITE = {"moves left": "moves right", "moves right": "moves left", "moves up": "moves down",
            "moves down": "moves up"}


def caption_at(scene: Scene, seconds: float, width: int, height: int) -> str:
    """The caption of what the scene shows from `seconds` on: a mover that has hit walls an odd number of times by
    then moves the other way (what an artist would write for an extension window starting there)."""
    said = describe(scene)
    turned = [o.motion in DIRECTIONS and len(contact_times(o, seconds, width, height)) % 2 for o in scene.objects]
    objects = tuple(replace(d, motion=OPPOSITE[d.motion]) if t else d for d, t in zip(said.objects, turned))
    return caption(replace(said, objects=objects))


def _alternatives(words) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_OBJECT = (rf"a (?:({_alternatives(SIZES)}) )?({_alternatives(COLOURS)}) ({_alternatives(SHAPES)}) "
           rf"({_alternatives(MOTIONS)})")
_PHRASE_TO_BACKGROUND = {phrase: name for name, phrase in BACKGROUND_PHRASES.items()}
_CAPTION = re.compile(rf"{_OBJECT}(?: and {_OBJECT})? ({_alternatives(_PHRASE_TO_BACKGROUND)})"
                      rf"({re.escape(HUMMING)})?({re.escape(RAIN)})?")


def parse_caption(text: str) -> SceneDescription:
    """Read a caption of the grammar back into what it names; raises CaptionError for anything else."""
    normal = " ".join(str(text).lower().replace("gray", "grey").split()).rstrip(".")
    match = _CAPTION.fullmatch(normal)
    if match is None:
        raise CaptionError(
            f"Could not read the caption {text!r}. Captions look like {EXAMPLE!r} or 'a red ball moves right and "
            f"a blue box stays still on a white background': sizes {', '.join(SIZES)} (optional); colours "
            f"{', '.join(COLOURS)}; shapes {', '.join(SHAPES)}; motions {', '.join(MOTIONS)}; backgrounds "
            f"{'; '.join(BACKGROUND_PHRASES.values())}; then optionally '{HUMMING}' and '{RAIN}'.")
    groups = match.groups()
    objects = tuple(ObjectDescription(colour, shape, motion, size)
                    for size, colour, shape, motion in (groups[0:4], groups[4:8]) if colour)
    background = _PHRASE_TO_BACKGROUND[groups[8]]
    if len(objects) == 2 and objects[0].colour == objects[1].colour:
        raise CaptionError(f"The two objects in {text!r} are both {objects[0].colour}: they cannot be told apart "
                           f"by colour. Give them different colours.")
    for o in objects:
        if not visible_on(o.colour, background):
            fits = [c for c in COLOURS if visible_on(c, background)]
            raise CaptionError(f"A {o.colour} {o.shape} cannot be seen {BACKGROUND_PHRASES[background]}; "
                               f"pick another colour ({', '.join(fits)}) or background.")
    return SceneDescription(objects, background, humming=groups[9] is not None, rain=groups[10] is not None)
