"""The pack loads the way ComfyUI loads it: fast, without torch or the engine's model code, with complete node defs."""

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "diffusers", "transformers", "av")
ENGINE_INTERNALS = ("engine.models", "engine.server", "engine.runtime", "engine.kernels", "engine.io")

LOAD = f"""
import importlib.util, json, sys, time
t0 = time.perf_counter()
spec = importlib.util.spec_from_file_location("h3forge_pack", {str(PACK / "__init__.py")!r})
pack = importlib.util.module_from_spec(spec)
sys.modules["h3forge_pack"] = pack
spec.loader.exec_module(pack)
print(json.dumps({{"seconds": time.perf_counter() - t0, "modules": sorted(sys.modules),
                  "nodes": sorted(pack.NODE_CLASS_MAPPINGS), "web": pack.WEB_DIRECTORY}}))
"""


def load_pack():
    """The pack package, loaded like ComfyUI's load_custom_node does (by file location, under its own name)."""
    if "h3forge_pack" not in sys.modules:
        spec = importlib.util.spec_from_file_location("h3forge_pack", PACK / "__init__.py")
        pack = importlib.util.module_from_spec(spec)
        sys.modules["h3forge_pack"] = pack
        spec.loader.exec_module(pack)
    return sys.modules["h3forge_pack"]


def test_import_is_fast_and_light(tmp_path):
    # A fresh interpreter outside the repo, as ComfyUI would start (best of 3 against a busy machine).
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", LOAD], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout))
    report = min(runs, key=lambda r: r["seconds"])
    assert report["seconds"] < 1.0, f"pack import took {report['seconds']:.2f} s"
    loaded = [m for m in report["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)
              or any(f".{part}" in f".{m}" for part in ENGINE_INTERNALS)]
    assert loaded == [], f"pack import pulled in {loaded}"
    assert report["nodes"] == ["H3ForgeEngine", "H3ForgeExtendVideo", "H3ForgeLora", "H3ForgeMaskFeather", "H3ForgeMaskFrameRange",
                               "H3ForgeMaskGrow", "H3ForgeMaskPreview", "H3ForgeMaskTrackBox", "H3ForgeMaskedEdit",
                               "H3ForgePreview", "H3ForgeReferences", "H3ForgeTextToVideo", "H3ForgeUpscale"]
    assert (PACK / report["web"] / "h3forge.js").is_file()


def test_mappings_are_consistent():
    pack = load_pack()
    assert set(pack.NODE_CLASS_MAPPINGS) == set(pack.NODE_DISPLAY_NAME_MAPPINGS)
    assert all(name.startswith("H3Forge") for name in pack.NODE_DISPLAY_NAME_MAPPINGS.values())


@pytest.mark.parametrize("name", ["H3ForgeEngine", "H3ForgeTextToVideo", "H3ForgeReferences", "H3ForgePreview"])
def test_node_definition_is_complete(name):
    cls = load_pack().NODE_CLASS_MAPPINGS[name]
    assert cls.CATEGORY == "H3Forge"
    assert cls.DESCRIPTION
    assert callable(getattr(cls, cls.FUNCTION))
    assert isinstance(cls.RETURN_TYPES, tuple)
    if cls.RETURN_TYPES:
        assert len(cls.RETURN_NAMES) == len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES)
    else:
        assert cls.OUTPUT_NODE is True
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"}
    for section in ("required", "optional"):
        for input_name, (kind, *options) in spec.get(section, {}).items():
            assert options and options[0].get("tooltip"), f"{name}.{input_name} has no tooltip"
            if isinstance(kind, list):
                assert options[0].get("default", kind[0]) in kind
    signature = inspect.signature(getattr(cls, cls.FUNCTION))
    inputs = [p for section in ("required", "optional", "hidden") for p in spec.get(section, {})]
    assert [p for p in signature.parameters if p != "self"] == inputs
    validate = getattr(cls, "VALIDATE_INPUTS", None)
    if validate is not None:  # ComfyUI leaves out linked and unset inputs, so every argument needs a default
        assert all(p.default is not p.empty for p in inspect.signature(validate).parameters.values())


def test_nodes_that_do_work_are_coroutines():
    """ComfyUI runs a plain node function on its event loop, stalling the other nodes' network timers; a coroutine
    can hand its work to a thread. Only the nodes that return settings (Engine, LoRA) stay plain."""
    for name, cls in load_pack().NODE_CLASS_MAPPINGS.items():
        plain = name in ("H3ForgeEngine", "H3ForgeLora")
        assert inspect.iscoroutinefunction(getattr(cls, cls.FUNCTION)) != plain, name
