"""Checks a UI-format ComfyUI workflow (version 0.4) against node definitions; returns a list of problems.

Node definitions are the pack's NODE_CLASS_MAPPINGS plus a few ComfyUI core nodes described in
CORE_NODES (same INPUT_TYPES / RETURN_TYPES shape, as ComfyUI's nodes.py and comfy_extras/nodes_video.py
declare them; a "COMBO" type without a list accepts any string, for combos whose options depend on the user's
files). The frontend stores an upload button's value ("image", for image and video uploads alike) after the
node's other widget values. A saved node may list fewer outputs than its class has now: outputs are only ever
appended, and ComfyUI adds the missing ones when it loads the workflow.
"""

from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROL = {"fixed", "increment", "decrement", "randomize"}

UPLOADS = ("image_upload", "video_upload")
# An audio upload stores one value after the file name, null: its upload button (ComfyUI frontend 1.35; its player,
# "audioUI", is not saved).
AUDIO_UPLOAD = "audio_upload"

CORE_NODES = {
    "LoadImage": {
        "input": {"required": {"image": ("COMBO", {"image_upload": True})}},
        "output": ("IMAGE", "MASK"),
        "output_node": False,
    },
    "LoadImageMask": {
        "input": {"required": {"image": ("COMBO", {"image_upload": True}),
                               "channel": (["alpha", "red", "green", "blue"],)}},
        "output": ("MASK",),
        "output_node": False,
    },
    "LoadAudio": {
        "input": {"required": {"audio": ("COMBO", {AUDIO_UPLOAD: True})}},
        "output": ("AUDIO",),
        "output_node": False,
    },
    "LoadVideo": {
        "input": {"required": {"file": ("COMBO", {"video_upload": True})}},
        "output": ("VIDEO",),
        "output_node": False,
    },
    "CreateVideo": {
        "input": {"required": {"images": ("IMAGE",), "fps": ("FLOAT", {"default": 30.0, "min": 1.0, "max": 120.0,
                                                                        "step": 1.0})},
                  "optional": {"audio": ("AUDIO",)}},
        "output": ("VIDEO",),
        "output_node": False,
    },
}


def node_definitions(node_class_mappings: dict) -> dict[str, dict]:
    defs = dict(CORE_NODES)
    for name, cls in node_class_mappings.items():
        defs[name] = {"input": cls.INPUT_TYPES(), "output": tuple(cls.RETURN_TYPES),
                      "output_node": bool(getattr(cls, "OUTPUT_NODE", False))}
    return defs


def _is_widget(spec: tuple) -> bool:
    kind = spec[0]
    options = spec[1] if len(spec) > 1 else {}
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput", False)


def widgets(node_def: dict) -> list[tuple[str, object, dict]]:
    """(name, type, options) of each widget value, in the order ComfyUI's frontend serialises them."""
    out, uploads = [], []
    for section in ("required", "optional"):
        for name, spec in node_def["input"].get(section, {}).items():
            if not _is_widget(spec):
                continue
            options = {**(spec[1] if len(spec) > 1 else {}), "_optional": section == "optional"}
            out.append((name, spec[0], options))
            if spec[0] == "INT" and (name in ("seed", "noise_seed") or options.get("control_after_generate")):
                out.append((f"{name}:control_after_generate", "CONTROL", {}))
            if any(options.get(kind) for kind in UPLOADS):
                uploads.append((f"{name}:upload", "UPLOAD", {}))
            if options.get(AUDIO_UPLOAD):
                uploads.append((f"{name}:upload", "NULL", {}))
    return out + uploads


def sockets(node_def: dict) -> dict[str, tuple[str, bool]]:
    """name -> (type, required) of every input that is connected by a link rather than a widget."""
    out = {}
    for section in ("required", "optional"):
        for name, spec in node_def["input"].get(section, {}).items():
            if not _is_widget(spec):
                out[name] = (spec[0], section == "required")
    return out


def check_value(name: str, kind, options: dict, value) -> str | None:
    if isinstance(kind, list):
        return None if value in kind else f"{name}: {value!r} is not one of {kind}"
    if kind == "CONTROL":
        return None if value in SEED_CONTROL else f"{name}: {value!r} is not one of {sorted(SEED_CONTROL)}"
    if kind == "UPLOAD":
        return None if value == "image" else f"{name}: upload widget value must be 'image', got {value!r}"
    if kind == "NULL":
        return None if value is None else f"{name}: this widget stores null, got {value!r}"
    if kind in ("STRING", "COMBO"):
        return None if isinstance(value, str) else f"{name}: expected a string, got {value!r}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name}: expected true/false, got {value!r}"
    if kind == "INT" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name}: expected an integer, got {value!r}"
    if kind == "FLOAT" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{name}: expected a number, got {value!r}"
    if "min" in options and value < options["min"]:
        return f"{name}: {value} is below the minimum {options['min']}"
    if "max" in options and value > options["max"]:
        return f"{name}: {value} is above the maximum {options['max']}"
    if kind == "INT" and options.get("step", 1) > 1 and (value - options.get("min", 0)) % options["step"]:
        return f"{name}: {value} is not on the step grid of {options['step']}"
    return None


def check_workflow(workflow: dict, defs: dict[str, dict]) -> list[str]:
    problems: list[str] = []
    for key in ("last_node_id", "last_link_id", "nodes", "links", "version"):
        if key not in workflow:
            problems.append(f"workflow has no {key!r}")
    if problems:
        return problems

    nodes = {}
    for node in workflow["nodes"]:
        if node["id"] in nodes:
            problems.append(f"node id {node['id']} is used twice")
        nodes[node["id"]] = node
    if nodes and max(nodes) > workflow["last_node_id"]:
        problems.append(f"last_node_id {workflow['last_node_id']} is below node id {max(nodes)}")

    for node in nodes.values():
        where = f"node {node['id']} ({node.get('type')})"
        node_def = defs.get(node.get("type"))
        if node_def is None:
            problems.append(f"{where}: unknown node type")
            continue
        for key in ("pos", "size", "flags", "order", "mode", "properties"):
            if key not in node:
                problems.append(f"{where}: missing {key!r}")
        specs = widgets(node_def)
        values = node.get("widgets_values", [])
        # A workflow saved before a node gained optional widgets lacks their values; the frontend gives them defaults.
        older = len(values) < len(specs) and all(options.get("_optional") for _, _, options in specs[len(values):])
        if older:
            specs = specs[:len(values)]
        if len(values) != len(specs):
            problems.append(f"{where}: {len(values)} widget values, expected {len(specs)} "
                            f"({', '.join(name for name, _, _ in specs)})")
        else:
            for (name, kind, options), value in zip(specs, values):
                problem = check_value(name, kind, options, value)
                if problem:
                    problems.append(f"{where}: {problem}")
        outputs = node.get("outputs", [])
        declared = [o.get("type") for o in outputs]
        if declared != list(node_def["output"][:len(declared)]) or (node_def["output"] and not declared):
            problems.append(f"{where}: outputs {declared} are not (the first of) {list(node_def['output'])}")
        known = sockets(node_def)
        connected = set()
        for slot in node.get("inputs", []):
            if slot.get("widget"):
                continue
            if slot.get("name") not in known:
                problems.append(f"{where}: input {slot.get('name')!r} is not a socket of this node")
            elif slot.get("type") != known[slot["name"]][0]:
                problems.append(f"{where}: input {slot['name']!r} has type {slot.get('type')}, "
                                f"expected {known[slot['name']][0]}")
            if slot.get("link") is not None:
                connected.add(slot.get("name"))
        for name, (kind, required) in known.items():
            if required and name not in connected:
                problems.append(f"{where}: required input {name!r} ({kind}) is not connected")

    link_ids = set()
    for link in workflow["links"]:
        if len(link) != 6:
            problems.append(f"link {link}: expected [id, from, from_slot, to, to_slot, type]")
            continue
        link_id, src, src_slot, dst, dst_slot, kind = link
        where = f"link {link_id}"
        if link_id in link_ids:
            problems.append(f"{where}: id used twice")
        link_ids.add(link_id)
        if link_id > workflow["last_link_id"]:
            problems.append(f"{where}: above last_link_id {workflow['last_link_id']}")
        if src not in nodes or dst not in nodes:
            problems.append(f"{where}: connects a missing node")
            continue
        src_def, dst_def = defs.get(nodes[src]["type"]), defs.get(nodes[dst]["type"])
        if src_def is None or dst_def is None:
            continue
        if src_slot >= len(src_def["output"]) or src_def["output"][src_slot] != kind:
            problems.append(f"{where}: source slot {src_slot} of node {src} does not give {kind}")
        outputs = nodes[src].get("outputs", [])
        if src_slot >= len(outputs) or link_id not in (outputs[src_slot].get("links") or []):
            problems.append(f"{where}: not listed in node {src}'s output {src_slot} links")
        inputs = nodes[dst].get("inputs", [])
        if dst_slot >= len(inputs):
            problems.append(f"{where}: node {dst} has no input slot {dst_slot}")
            continue
        slot = inputs[dst_slot]
        if slot.get("link") != link_id:
            problems.append(f"{where}: node {dst} input {slot.get('name')!r} points at link {slot.get('link')}")
        expected = sockets(dst_def).get(slot.get("name"), (None,))[0]
        if expected not in (kind, "*"):
            problems.append(f"{where}: carries {kind} into {slot.get('name')!r} which takes {expected}")

    for node in nodes.values():
        for slot in node.get("inputs", []):
            if slot.get("link") is not None and slot["link"] not in link_ids:
                problems.append(f"node {node['id']}: input {slot.get('name')!r} points at missing link {slot['link']}")
    if not any(defs.get(n.get("type"), {}).get("output_node") for n in nodes.values()):
        problems.append("workflow has no output node, so queueing it would do nothing")
    return problems
