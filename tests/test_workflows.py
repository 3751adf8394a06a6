"""Every shipped workflow matches the pack's node definitions (types, widgets, links)."""

import copy
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from test_pack_import import load_pack
from workflow_check import check_workflow, node_definitions

WORKFLOWS = sorted((Path(__file__).resolve().parent.parent / "workflows").glob("*.json"))


@pytest.fixture(scope="module")
def defs():
    return node_definitions(load_pack().NODE_CLASS_MAPPINGS)


EDIT_WORKFLOWS = ("h3_object_removal.json", "h3_object_replacement.json", "h3_repaint.json")


def test_workflows_are_shipped():
    assert {p.name for p in WORKFLOWS} >= {"h3_text_to_video.json", "h3_first_last_frame.json", *EDIT_WORKFLOWS,
                                           "h3_extend_30s.json", "h3_t2v_extend_preview.json"}


@pytest.mark.parametrize("name", EDIT_WORKFLOWS)
def test_mask_preview_sees_the_mask_and_video_of_the_edit(name):
    workflow = json.loads((WORKFLOWS[0].parent / name).read_text())
    links = {link[0]: (link[1], link[2]) for link in workflow["links"]}

    def sources(node_type):
        node = next(n for n in workflow["nodes"] if n["type"] == node_type)
        return {slot["name"]: links[slot["link"]] for slot in node["inputs"] if slot["link"] is not None}

    edit, preview = sources("H3ForgeMaskedEdit"), sources("H3ForgeMaskPreview")
    assert preview["mask"] == edit["mask"] and preview["video"] == edit["source"]


def test_extensions_start_from_the_stored_job():
    for name in ("h3_extend_30s.json", "h3_t2v_extend_preview.json"):
        workflow = json.loads((WORKFLOWS[0].parent / name).read_text())
        extend = next(n for n in workflow["nodes"] if n["type"] == "H3ForgeExtendVideo")
        linked = {slot["name"] for slot in extend["inputs"] if slot["link"] is not None}
        assert {"source", "source_job"} <= linked


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_matches_node_definitions(path, defs):
    workflow = json.loads(path.read_text())
    assert check_workflow(workflow, defs) == []
    assert any(node["type"].startswith("H3Forge") for node in workflow["nodes"])


def test_first_last_frame_workflow_feeds_both_frames(defs):
    workflow = json.loads((WORKFLOWS[0].parent / "h3_first_last_frame.json").read_text())
    t2v = next(n for n in workflow["nodes"] if n["type"] == "H3ForgeTextToVideo")
    linked = {slot["name"] for slot in t2v["inputs"] if slot["link"] is not None}
    assert linked == {"first_frame", "last_frame"}


def _broken(workflow, edit):
    workflow = copy.deepcopy(workflow)
    edit(workflow)
    return workflow


def test_checker_catches_mistakes(defs):
    """The checker itself: each kind of mistake a hand-edited or outdated workflow can carry is reported."""
    good = json.loads((WORKFLOWS[0].parent / "h3_text_to_video.json").read_text())
    t2v = next(i for i, n in enumerate(good["nodes"]) if n["type"] == "H3ForgeTextToVideo")

    def widgets(wf, values):
        wf["nodes"][t2v]["widgets_values"] = values

    mistakes = {
        "unknown node type": lambda wf: wf["nodes"][0].update(type="H3ForgeNoSuchNode"),
        "widget values, expected": lambda wf: widgets(wf, wf["nodes"][t2v]["widgets_values"][:-2]),
        "above the maximum": lambda wf: wf["nodes"][t2v]["widgets_values"].__setitem__(1, 30.0),
        "is not one of": lambda wf: wf["nodes"][t2v]["widgets_values"].__setitem__(2, "2:1"),
        "step grid": lambda wf: wf["nodes"][t2v]["widgets_values"].__setitem__(3, 100),
        "expected an integer": lambda wf: wf["nodes"][t2v]["widgets_values"].__setitem__(6, "7"),
        "does not give": lambda wf: wf["links"][0].__setitem__(5, "IMAGE"),
        "not connected": lambda wf: wf["nodes"][-1]["inputs"][0].update(link=None),
        "no output node": lambda wf: wf.update(nodes=[n for n in wf["nodes"] if n["type"] != "H3ForgePreview"],
                                              links=wf["links"][:1]),
    }
    for expected, edit in mistakes.items():
        problems = check_workflow(_broken(good, edit), defs)
        assert any(expected in p for p in problems), f"{expected!r} not reported: {problems}"


def test_a_workflow_saved_before_the_engine_node_had_file_inputs_stays_valid(defs):
    """Workflows saved before the Engine node gained its optional file widgets carry 9 values; the frontend gives
    the rest their defaults. Dropping a required widget's value is still a mistake."""
    wf = json.loads((WORKFLOWS[0].parent / "h3_text_to_video.json").read_text())
    engine = next(n for n in wf["nodes"] if n["type"] == "H3ForgeEngine")
    assert engine["widgets_values"][9:] == ["none", "auto", "auto", "auto", ""]
    engine["widgets_values"] = engine["widgets_values"][:9]
    assert check_workflow(wf, defs) == []
    engine["widgets_values"] = engine["widgets_values"][:8]
    assert any("8 widget values, expected" in p for p in check_workflow(wf, defs))


LOADERS = {"LoadImage": 0, "LoadImageMask": 0, "LoadVideo": 0}  # node type -> index of its file widget
EXAMPLES = WORKFLOWS[0].parent / "example_inputs"


def named_inputs(workflow: dict) -> set[str]:
    return {n["widgets_values"][LOADERS[n["type"]]] for n in workflow["nodes"] if n["type"] in LOADERS}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_file_a_workflow_loads_ships_with_the_pack(path):
    for name in named_inputs(json.loads(path.read_text())):
        assert (EXAMPLES / name).is_file(), f"{path.name} loads {name}, which the pack does not ship"


def test_example_inputs_go_into_comfyuis_input_folder_when_missing(tmp_path):
    load_pack()
    example_inputs = importlib.import_module("h3forge_pack.nodes.example_inputs")
    (tmp_path / "h3_first_frame.png").write_bytes(b"the user's own file")
    copied = example_inputs.install(tmp_path)
    wanted = set().union(*(named_inputs(json.loads(p.read_text())) for p in WORKFLOWS))
    assert wanted <= {p.name for p in tmp_path.iterdir()} and "h3_first_frame.png" not in copied
    assert (tmp_path / "h3_first_frame.png").read_bytes() == b"the user's own file"
    assert example_inputs.install(tmp_path) == []


def test_example_inputs_are_what_their_script_draws(tmp_path):
    import numpy as np
    from PIL import Image

    from engine.io.video import read_video

    spec = importlib.util.spec_from_file_location("make_example_inputs", EXAMPLES / "make_example_inputs.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.main(tmp_path)
    for name in ("h3_first_frame.png", "h3_last_frame.png", "h3_box_mask.png", "sky_mask.png"):
        assert np.array_equal(np.asarray(Image.open(tmp_path / name)), np.asarray(Image.open(EXAMPLES / name))), name
    frames, fps, audio, rate = read_video((EXAMPLES / "h3_scene.mp4").read_bytes())
    assert frames.shape == (make.FRAMES, make.HEIGHT, make.WIDTH, 3) and fps == 24 and audio.shape[0] == 2
    # The removal workflow's track box follows the drawn ball.
    track = next(n for n in json.loads((WORKFLOWS[0].parent / "h3_object_removal.json").read_text())["nodes"]
                 if n["type"] == "H3ForgeMaskTrackBox")["widgets_values"][0]
    keys = {int(f): tuple(int(v) for v in box.split(",")) for f, box in
            (line.split(":") for line in track.splitlines() if line and not line.startswith("#"))}
    assert keys == make.BALL_TRACK
