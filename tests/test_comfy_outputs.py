"""The real-ComfyUI suite's checks (tests/comfy_outputs.py): a toy-world clip written to MP4, as a Preview node's
file is, passes against its own caption and fails against one naming another colour and motion; a replacement is
measured by the new colour over the former object's area."""

from dataclasses import replace

import numpy as np

import comfy_outputs
from engine.io.video import encode_mp4_bytes
from training.captions import caption
from training.scoring import NAMED_CHECKS
from training.toy_scene import sample_scene
from training.toy_world import render


def test_caption_check_passes_a_clip_of_its_caption_and_fails_another():
    scene = next(s for s in (sample_scene(seed) for seed in range(100))
                 if len(s.objects) == 1 and s.objects[0].motion == "moves right" and s.humming and s.objects[0].colour
                 != "blue" and s.background != "blue sky")
    clip = render(scene)
    mp4 = encode_mp4_bytes(clip.frames, audio=clip.audio)
    decoded = comfy_outputs.read_mp4(mp4, analysis=True)
    problems, checks = comfy_outputs.caption_problems(decoded, mp4, caption(scene))
    assert problems == [] and all(checks[k] for k in NAMED_CHECKS), checks
    other = caption(scene).replace(scene.objects[0].colour, "blue", 1).replace("moves right", "moves left")
    problems, checks = comfy_outputs.caption_problems(decoded, mp4, other)
    assert len(problems) == 1 and "colour" in problems[0] and "motion" in problems[0], problems
    assert not checks["colour"] and not checks["motion"] and checks["background"]


def test_only_a_text_only_text_to_video_is_scored_against_its_prompt():
    prompt = {"1": {"class_type": "H3ForgeTextToVideo", "inputs": {"prompt": "a red ball moves right"}},
              "2": {"class_type": "H3ForgeTextToVideo", "inputs": {"prompt": "a red ball", "first_frame": ["5", 0]}},
              "3": {"class_type": "H3ForgeUpscale", "inputs": {"source": ["1", 0]}}}
    assert comfy_outputs.prompt_of_plain_t2va(prompt, ["1", 0]) == "a red ball moves right"
    assert comfy_outputs.prompt_of_plain_t2va(prompt, ["2", 0]) is None
    assert comfy_outputs.prompt_of_plain_t2va(prompt, ["3", 0]) is None


def test_replacement_fill_finds_the_new_colour_over_the_former_objects_area():
    """The source at twice the output's size, its box masked with a margin (as h3_box_mask.png): the box repainted
    blue fills ~all of its area, the source returned unchanged none of it."""
    scene = sample_scene(0)
    scene = replace(scene, background="green grass under a blue sky", objects=(
        replace(scene.objects[0], shape="ball", colour="red", motion="stays still", x=0.25, y=0.5),
        replace(scene.objects[0], shape="box", colour="yellow", motion="stays still", x=0.75, y=0.5)))
    source = render(scene, 448, 256, num_frames=5)
    ys, xs = np.nonzero(source.masks[1, 0])
    mask = np.zeros((5, 256, 448), bool)
    mask[:, ys.min() - 6:ys.max() + 7, xs.min() - 6:xs.max() + 7] = True
    prompt = "a large red ball stays still and a large blue box stays still on green grass under a blue sky"
    new = render(replace(scene, objects=(scene.objects[0], replace(scene.objects[1], colour="blue"))), 224, 128,
                 num_frames=5)
    colour, filled = comfy_outputs.replacement_fill(source.frames, new.frames, mask, prompt)
    assert colour == "blue" and filled > 0.9
    kept = render(scene, 224, 128, num_frames=5)
    assert comfy_outputs.replacement_fill(source.frames, kept.frames, mask, prompt) == ("blue", 0.0)
