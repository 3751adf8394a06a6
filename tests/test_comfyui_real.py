"""The pack inside a real ComfyUI: every shipped workflow runs through /prompt and loads in the real frontend.

Skipped unless COMFYUI_DIR points at a ComfyUI checkout. Run it from the repository root with the ComfyUI interpreter
in COMFYUI_PYTHON (a path or a command line, e.g. "env PYTHONPATH=/opt/deps python3"); the engine the nodes
auto-launch inherits that interpreter, so it must also import torch, diffusers, transformers and av:

    COMFYUI_DIR=/work/comfy/ComfyUI COMFYUI_PYTHON=/work/comfy/venv/bin/python \
        python -m pytest -s tests/test_comfyui_real.py

What it does: links this checkout into $COMFYUI_DIR/custom_nodes/h3forge (whatever was there is put back
afterwards), starts `main.py --cpu` on a free port with its input/output/temp/user folders in a temp dir (the pack
copies its example inputs into that input folder when it loads), and then
- /object_info lists every node of the pack with the pack's inputs; every workflow converts to an API prompt;
- every workflows/*.json runs through /prompt as shipped (only the Engine node's url and device are pointed at this
  test's engine port and the CPU; nodes without an Engine node use H3FORGE_URL), the nodes auto-launching the
  bundled engine on its embedded default; each Preview node's MP4 is fetched through /view and decoded: frame count,
  fps, size and sound as the workflow asks for; for the edit workflows the output differs from the source inside the
  mask and keeps it outside (comfy_outputs.py; outside only on trained weights, see RANDOM_WEIGHTS); on the trained
  embedded default a preview made from text alone must show its prompt (object colours, motions, background, hum
  pitch: `comfy_outputs.caption_problems`); each workflow must finish within WORKFLOW_BUDGET_S;
- every workflow loads into ComfyUI's frontend in headless Chromium (comfy_frontend.py) without console errors,
  missing node types or widget values that did not land on their widgets; a screenshot of each is saved.
Per-workflow results (wall time, checks, numbers) are printed at the end (with -s) and written with the screenshots
to $H3FORGE_ARTIFACTS (default: tests/artifacts/comfyui_real/, git-ignored), as results.json and results.txt.
Failure messages carry the tail of the ComfyUI log and of the engine log.

The environment it was developed with (ComfyUI v0.8.0 = pollockjj/ComfyUI 618b803d, frontend 1.35.9, CPU only):

    mkdir -p /work/comfy/ComfyUI
    git --git-dir=/work/.mirror/pollockjj+ComfyUI/repo archive HEAD -- . \
        ':!comfy/text_encoders/llama_tokenizer/tokenizer.json' | tar -x -C /work/comfy/ComfyUI  # blob absent there
    python3.11 -m venv /work/comfy/venv
    PINS='^(diffusers|transformers|av|numpy|pillow|aiohttp|safetensors|tokenizers|huggingface.hub|yarl|pydantic)'
    /work/main/.venv/bin/pip freeze | grep -iE "$PINS" > /work/comfy/pins.txt  # the project venv's versions
    /work/comfy/venv/bin/pip install -c /work/comfy/pins.txt "torch===2.13.0" torchvision==0.28.0 torchaudio \
        -r /work/comfy/ComfyUI/requirements.txt diffusers==0.42.1
    apt-get install chromium   # headless Debian chromium; or set CHROMIUM to a Chrome binary

A venv of its own because the only torchvision 0.28 (torch 2.13) wheel here is PyPI's CUDA build, which does not
load against the project's CPU torch (`operator torchvision::nms does not exist`), and ComfyUI imports torchvision
at start; `torch===2.13.0` picks PyPI's CUDA build of torch (it runs on the CPU) over the local 2.13.0+cpu wheel.
The test process itself needs aiohttp, av, numpy, pillow and torch (the project's venv has them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")
if not COMFYUI_DIR:
    pytest.skip("set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its interpreter) to run the pack "
                "in a real ComfyUI", allow_module_level=True)
if not (Path(COMFYUI_DIR) / "main.py").is_file() or not (Path(COMFYUI_DIR) / "custom_nodes").is_dir():
    pytest.skip(f"COMFYUI_DIR={COMFYUI_DIR!r} is not a ComfyUI checkout (no main.py / custom_nodes)",
                allow_module_level=True)

import comfy_frontend  # noqa: E402
import comfy_outputs  # noqa: E402
from engine_fixture import free_port  # noqa: E402
from test_pack_import import load_pack  # noqa: E402
from training.task_checks import FILLED_SHARE  # noqa: E402
from workflow_check import widgets  # noqa: E402

PACK = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((PACK / "workflows").glob("*.json"))
EXAMPLE_INPUTS = PACK / "workflows" / "example_inputs"
ARTIFACTS = Path(os.environ.get("H3FORGE_ARTIFACTS") or PACK / "tests" / "artifacts" / "comfyui_real")
LINK_NAME = "h3forge"
START_TIMEOUT_S = 240
WORKFLOW_BUDGET_S = float(os.environ.get("H3FORGE_WORKFLOW_BUDGET_S", 180))  # issue 15: <= 3 min on 2 CPU cores
RUN_TIMEOUT_S = WORKFLOW_BUDGET_S + 120  # a run over budget still finishes if it can, to report how long it took
FRONTEND_TIMEOUT_S = 120
EDIT_WORKFLOWS = {"h3_object_removal.json", "h3_object_replacement.json", "h3_repaint.json"}
# An edit changes the masked area and keeps the rest: mean abs difference (0..255) to the source, inside the mask
# above EDIT_CHANGED, outside below EDIT_KEPT, inside at least EDIT_CONTRAST times outside. A node that returned its
# source gives ~encode noise inside; one that regenerated everything changes the outside as much as the inside.
EDIT_CHANGED, EDIT_KEPT, EDIT_CONTRAST = 12.0, 8.0, 3.0
# Engines whose weights are drawn from a seed (engine/models/h3/pipeline.py `from_preset`): their video VAE decodes
# even the kept latents to noise (its decoder is a ViT attending across 128-px tiles), so on them "kept" cannot be
# seen in pixels and only "changed" is checked. Keyed by /v1/status models.weights.
RANDOM_WEIGHTS = {"tiny"}
EMBEDDED_WEIGHTS = {"tiny", "toy"}  # the small canvas and named sizes of the embedded presets
# The frontend starts without the new-user template browser and the release check (no internet here).
FRONTEND_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Notification.ShowVersionUpdates": False}


@dataclass
class Comfy:
    url: str
    engine_port: int
    process: subprocess.Popen
    log_file: Path
    root: Path  # this run's input/output/temp/user folders

    def engine_logs(self) -> list[Path]:
        """The auto-launched engine's log files, wherever this pack version writes them: $H3FORGE_LOG_DIR (set
        to root/logs here), ~/.h3forge/logs, or (older versions) ComfyUI's temp folder."""
        found = []
        for folder in (self.root / "logs", Path.home() / ".h3forge" / "logs", self.root / "temp", self.root):
            found += sorted(folder.glob(f"h3forge-engine-{self.engine_port}*.log"))
        return found

    def log_tail(self, chars: int = 6000) -> str:
        text = f"--- ComfyUI log ({self.log_file}) ---\n" + self.log_file.read_text(errors="replace")[-chars:]
        for path in self.engine_logs():
            text += f"\n--- engine log ({path}) ---\n{path.read_text(errors='replace')[-chars:]}"
        return text

    def request(self, path: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 30):
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, reply.read()

    def get_json(self, path: str):
        return json.loads(self.request(path)[1])


# --- the pack in custom_nodes, ComfyUI and its auto-launched engine ------------------------------------------------

def link_pack(custom_nodes: Path) -> tuple[Path, Path | None]:
    """custom_nodes/h3forge -> this checkout; whatever was there is moved to a `.disabled` name ComfyUI skips."""
    link = custom_nodes / LINK_NAME
    backup = None
    if link.is_symlink() or link.exists():
        backup = custom_nodes / f"{LINK_NAME}.test-backup-{os.getpid()}.disabled"
        link.rename(backup)
    link.symlink_to(PACK, target_is_directory=True)
    return link, backup


def unlink_pack(link: Path, backup: Path | None) -> None:
    if link.is_symlink() and link.resolve() == PACK:
        link.unlink()
    if backup is not None and not (link.is_symlink() or link.exists()):
        backup.rename(link)


def stop_group(process: subprocess.Popen, first: signal.Signals, grace_s: float) -> None:
    """Signals the process group this test started (its own session), then kills it if it outlives grace_s."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, first)
            process.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def stop_leftover_engine(port: int, token_file: Path) -> None:
    """ComfyUI stops the engine it launched at exit; if it did not (killed), stop the engine serving `port`
    with this run's token file (started by the nodes in this test's ComfyUI, so ours)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "serve" in args and "--port" in args and str(port) in args and str(token_file) in args:
            try:
                os.killpg(int(proc.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = Path(COMFYUI_DIR).resolve()
    python = shlex.split(os.environ.get("COMFYUI_PYTHON", "python"))
    with tempfile.TemporaryDirectory(prefix="h3forge-comfy-") as tmp:
        root = Path(tmp)
        for folder in ("input", "output", "temp", "user/default", "logs"):
            (root / folder).mkdir(parents=True)
        (root / "user/default/comfy.settings.json").write_text(json.dumps(FRONTEND_SETTINGS))
        port, engine_port = free_port(), free_port()
        token_file = root / "engine-token"
        env = dict(os.environ, H3FORGE_TOKEN_FILE=str(token_file), H3FORGE_URL=f"ws://127.0.0.1:{engine_port}",
                   H3FORGE_LOG_DIR=str(root / "logs"), PYTHONUNBUFFERED="1")
        cmd = python + ["main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
                        "--input-directory", str(root / "input"), "--output-directory", str(root / "output"),
                        "--temp-directory", str(root), "--user-directory", str(root / "user"),
                        "--database-url", "sqlite:///:memory:"]
        log_file = root / "comfyui.log"
        link, backup = link_pack(comfy_dir / "custom_nodes")
        process = None
        try:
            with open(log_file, "wb") as log:
                process = subprocess.Popen(cmd, cwd=comfy_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            server = Comfy(f"http://127.0.0.1:{port}", engine_port, process, log_file, root)
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if process.poll() is not None:
                    pytest.fail(f"ComfyUI exited with code {process.returncode} while starting "
                                f"({shlex.join(cmd)}):\n{server.log_tail()}")
                try:
                    server.request("/system_stats", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"ComfyUI did not answer within {START_TIMEOUT_S} s:\n{server.log_tail()}")
                    time.sleep(0.5)
            yield server
        finally:
            if process is not None:
                stop_group(process, signal.SIGINT, grace_s=30)  # KeyboardInterrupt: ComfyUI's atexit stops the engine
            stop_leftover_engine(engine_port, token_file)
            unlink_pack(link, backup)


@pytest.fixture(scope="module")
def object_info(comfy):
    return comfy.get_json("/object_info")


@pytest.fixture(scope="module")
def results():
    """Per-workflow results, written to ARTIFACTS and printed when the module is done."""
    table: dict[str, dict] = {}
    yield table
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "results.json").write_text(json.dumps(table, indent=1, sort_keys=True))
    lines = [f"{'workflow':32} {'run':>8} {'result':7} {'frontend':8}  details"]
    for name in sorted(table):
        row = table[name]
        run_s = f"{row['run_s']:.1f} s" if "run_s" in row else "-"
        details = "; ".join(row.get("problems", []) + row.get("frontend_problems", []))[:300] or row.get("notes", "")
        lines.append(f"{name:32} {run_s:>8} {row.get('run', '-'):7} {row.get('frontend', '-'):8}  {details}")
    text = "\n".join(lines)
    (ARTIFACTS / "results.txt").write_text(text + "\n")
    print(f"\n{text}\n(results and screenshots in {ARTIFACTS})")


@pytest.fixture(scope="module")
def browser(comfy):
    binary = comfy_frontend.chromium_binary()
    if binary is None:
        pytest.skip("no chromium on PATH (set CHROMIUM to a Chrome/Chromium binary) for the frontend checks")
    with tempfile.TemporaryDirectory(prefix="h3forge-chromium-") as tmp:
        with comfy_frontend.start_chromium(Path(tmp), binary) as chromium:
            yield chromium


# --- UI workflow -> API prompt -------------------------------------------------------------------------------------

def to_api(workflow: dict, object_info: dict) -> dict:
    """The API-format prompt ComfyUI's frontend would queue for a UI-format workflow: widget values mapped to input
    names in INPUT_TYPES order (the seed's control_after_generate value and upload buttons dropped), links to
    [source id, output slot]. Muted and bypassed nodes are left out."""
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        where = f"node {node['id']} ({node['type']})"
        assert node["type"] in object_info, f"{where}: ComfyUI has no such node"
        specs = widgets(object_info[node["type"]])
        values = node.get("widgets_values") or []
        assert len(values) == len(specs), f"{where}: {values} do not match widgets {[s[0] for s in specs]}"
        inputs = {name: value for (name, kind, _), value in zip(specs, values) if kind not in ("CONTROL", "UPLOAD")}
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                _, source, source_slot, *_ = links[slot["link"]]
                inputs[slot["name"]] = [str(source), source_slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def point_at_test_engine(prompt: dict, engine_port: int) -> dict:
    """The one change to a shipped workflow: its Engine node talks to this test's engine port, on the CPU."""
    for node in prompt.values():
        if node["class_type"] == "H3ForgeEngine":
            node["inputs"].update(url=f"ws://127.0.0.1:{engine_port}", device="cpu")
    return prompt


def run_prompt(comfy: Comfy, prompt: dict) -> tuple[dict, dict[str, float]]:
    """Queues the prompt and follows it on ComfyUI's WebSocket; returns its /history outputs and the seconds from
    each node's `executing` event to the next one (the node's time for blocking nodes; async nodes overlap, so for
    them it is only a hint). A prompt still running after
    RUN_TIMEOUT_S is interrupted (the nodes cancel their engine job), so that the next workflow starts on an idle
    ComfyUI."""
    try:
        return asyncio.run(asyncio.wait_for(_run_prompt(comfy, prompt), RUN_TIMEOUT_S + 60))
    except (AssertionError, asyncio.TimeoutError):
        interrupt(comfy)
        raise


def interrupt(comfy: Comfy, wait_s: float = 60) -> None:
    """Stops what ComfyUI runs: its interrupt (the nodes cancel their engine job at the next step), and if the
    engine is inside a step that long, this test's engine is stopped (the next workflow auto-launches a new one)."""
    with contextlib.suppress(OSError):
        comfy.request("/interrupt", b"{}", {"Content-Type": "application/json"})
    if not wait_idle(comfy, wait_s):
        stop_leftover_engine(comfy.engine_port, comfy.root / "engine-token")
        wait_idle(comfy, wait_s)


def wait_idle(comfy: Comfy, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and comfy.process.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            queue = comfy.get_json("/queue")
            if not queue["queue_running"] and not queue["queue_pending"]:
                return True
        time.sleep(1)
    return False


async def _run_prompt(comfy: Comfy, prompt: dict) -> tuple[dict, dict[str, float]]:
    client_id = f"h3forge-test-{uuid.uuid4().hex}"
    node_s: dict[str, float] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{comfy.url.replace('http', 'ws', 1)}/ws?clientId={client_id}") as ws:
            async with http.post(f"{comfy.url}/prompt", json={"prompt": prompt, "client_id": client_id}) as reply:
                answer = await reply.json(content_type=None)
            assert reply.status == 200 and "prompt_id" in answer, (
                f"/prompt refused the workflow: {json.dumps(answer, indent=1)}")
            prompt_id, running, since = answer["prompt_id"], None, time.monotonic()
            while True:
                assert comfy.process.poll() is None, f"ComfyUI exited while running the prompt:\n{comfy.log_tail()}"
                left = deadline - time.monotonic()
                assert left > 0, f"the prompt did not finish in {RUN_TIMEOUT_S:.0f} s:\n{comfy.log_tail()}"
                try:
                    message = await ws.receive(timeout=min(left, 5))
                except asyncio.TimeoutError:
                    continue
                if message.type != aiohttp.WSMsgType.TEXT:
                    assert message.type == aiohttp.WSMsgType.BINARY, f"ComfyUI's WebSocket closed: {message}"
                    continue  # a preview image
                event = json.loads(message.data)
                data = event.get("data") or {}
                if data.get("prompt_id") != prompt_id:
                    continue
                if event["type"] in ("executing", "execution_success", "execution_error", "execution_interrupted"):
                    now = time.monotonic()
                    if running is not None:
                        node_s[running] = round(node_s.get(running, 0) + now - since, 1)
                    running, since = data.get("node") if event["type"] == "executing" else None, now
                if event["type"] in ("execution_success", "execution_error", "execution_interrupted") or (
                        event["type"] == "executing" and data.get("node") is None):
                    break
        # ComfyUI files the prompt's history just after it says the prompt is done.
        entry = None
        for _ in range(120):
            async with http.get(f"{comfy.url}/history/{prompt_id}") as reply:
                entry = (await reply.json()).get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                break
            await asyncio.sleep(0.5)
        assert entry, f"prompt {prompt_id} finished but has no /history entry after 60 s:\n{comfy.log_tail()}"
    status = entry["status"]
    assert status.get("status_str") == "success" and status.get("completed"), (
        f"prompt failed: {json.dumps(status.get('messages'), indent=1)[-4000:]}\n{comfy.log_tail()}")
    return entry["outputs"], node_s


def engine_status(comfy: Comfy) -> dict:
    token = (comfy.root / "engine-token").read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{comfy.engine_port}/v1/status",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


def fetch_preview(comfy: Comfy, outputs: dict, node_id: str) -> bytes:
    ui = outputs.get(node_id)
    assert ui, f"Preview node {node_id} produced no output: {outputs}"
    (video,) = ui["images"]
    assert video["filename"].endswith(".mp4") and video["format"] == "video/h264-mp4", video
    assert ui.get("animated") == [True], ui
    query = urllib.parse.urlencode({k: video[k] for k in ("filename", "subfolder", "type")})
    status, data = comfy.request(f"/view?{query}")
    assert status == 200 and data[4:8] == b"ftyp", (status, data[:16], len(data))
    return data


def input_clips(comfy: Comfy, prompt: dict, analysis: bool) -> dict[str, comfy_outputs.Clip]:
    """The videos the workflow's LoadVideo nodes read from ComfyUI's input folder, by file name."""
    names = {n["inputs"]["file"] for n in prompt.values() if n["class_type"] == "LoadVideo"}
    clips = {}
    for name in names:
        path = comfy.root / "input" / name
        assert path.is_file(), f"{name} is not in ComfyUI's input folder (the pack copies its example inputs there)"
        clips[name] = comfy_outputs.read_mp4(path.read_bytes(), analysis)
    return clips


# --- tests ---------------------------------------------------------------------------------------------------------

def test_object_info_lists_every_pack_node(comfy, object_info):
    pack = load_pack()
    missing = sorted(set(pack.NODE_CLASS_MAPPINGS) - set(object_info))
    assert not missing, f"ComfyUI did not load {missing}:\n{comfy.log_tail()}"
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        info = object_info[name]
        assert info["python_module"] == f"custom_nodes.{LINK_NAME}", info["python_module"]
        assert info["display_name"] == pack.NODE_DISPLAY_NAME_MAPPINGS[name]
        assert info["category"] == cls.CATEGORY
        assert info["output"] == list(cls.RETURN_TYPES)
        assert info["output_node"] == bool(getattr(cls, "OUTPUT_NODE", False))
        spec = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            assert list(info["input"].get(section, {})) == list(spec.get(section, {})), (name, section)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_converts_to_an_api_prompt(path, object_info):
    prompt = to_api(json.loads(path.read_text()), object_info)
    for node_id, node in prompt.items():
        required = object_info[node["class_type"]]["input"].get("required", {})
        missing = sorted(set(required) - set(node["inputs"]))
        assert not missing, f"{path.name} node {node_id} ({node['class_type']}) lacks required inputs {missing}"
        for value in node["inputs"].values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                assert value[0] in prompt, f"{path.name} node {node_id} links to missing node {value[0]}"
    assert any(object_info[n["class_type"]]["output_node"] for n in prompt.values())


def test_example_inputs_are_in_comfyui_input_folder(comfy):
    shipped = sorted(p.name for p in EXAMPLE_INPUTS.iterdir() if p.suffix in (".png", ".mp4"))
    assert shipped, f"no example inputs in {EXAMPLE_INPUTS}"
    for name in shipped:
        copied = comfy.root / "input" / name
        assert copied.is_file() and copied.read_bytes() == (EXAMPLE_INPUTS / name).read_bytes(), (
            f"the pack did not copy {name} into ComfyUI's input folder:\n{comfy.log_tail()}")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_loads_in_the_frontend(path, comfy, browser, results):
    row = results.setdefault(path.name, {})
    row["frontend"] = "FAIL"
    report = asyncio.run(comfy_frontend.load_workflow(browser, comfy.url, json.loads(path.read_text()),
                                                      timeout=FRONTEND_TIMEOUT_S))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{path.stem}.png"
    shot.write_bytes(report.screenshot)
    row["screenshot"] = str(shot)
    row["frontend_problems"] = report.failures()
    assert report.nodes == len(json.loads(path.read_text())["nodes"]), report
    assert not report.failures(), (f"{path.name} in the frontend (screenshot {shot}):\n"
                                   + "\n".join(report.failures()) + f"\n{comfy.log_tail(3000)}")
    row["frontend"] = "ok"


def test_frontend_check_reports_missing_nodes_and_bad_widget_values(comfy, browser):
    """A workflow with an unknown node type and a combo value the node does not offer fails the frontend check."""
    workflow = json.loads((PACK / "workflows" / "h3_text_to_video.json").read_text())
    t2v = next(n for n in workflow["nodes"] if n["type"] == "H3ForgeTextToVideo")
    t2v["widgets_values"][2] = "7:5"  # aspect: not one of the choices
    workflow["nodes"].append({"id": 99, "type": "H3ForgeNoSuchNode", "pos": [0, 600], "size": [200, 60], "flags": {},
                              "order": 9, "mode": 0, "properties": {}, "widgets_values": []})
    workflow["last_node_id"] = 99
    report = asyncio.run(comfy_frontend.load_workflow(browser, comfy.url, workflow, timeout=FRONTEND_TIMEOUT_S))
    failures = "\n".join(report.failures())
    assert "H3ForgeNoSuchNode" in report.missing, failures
    assert "node 99 (H3ForgeNoSuchNode): node type unknown to the frontend" in failures, failures
    assert '"7:5" is not one of its choices' in failures, failures


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_as_shipped(path, comfy, object_info, results):
    row = results.setdefault(path.name, {})
    row["run"] = "FAIL"
    prompt = point_at_test_engine(to_api(json.loads(path.read_text()), object_info), comfy.engine_port)
    is_edit = path.name in EDIT_WORKFLOWS
    started = time.monotonic()
    try:
        outputs, node_s = run_prompt(comfy, prompt)
    except AssertionError as error:
        row["problems"] = [str(error).splitlines()[0][:300]]
        raise
    finally:
        row["run_s"] = round(time.monotonic() - started, 1)
    row["node_s"] = {f"{i} {prompt[i]['class_type']}": t for i, t in node_s.items() if i in prompt}
    sources = input_clips(comfy, prompt, analysis=is_edit)
    weights = engine_status(comfy)["models"]["weights"]
    real_weights, trained_toy = weights not in EMBEDDED_WEIGHTS, weights in EMBEDDED_WEIGHTS - RANDOM_WEIGHTS
    problems, clips = [], {}
    for node_id, node in prompt.items():
        if node["class_type"] != "H3ForgePreview":
            continue
        mp4 = fetch_preview(comfy, outputs, node_id)
        caption = comfy_outputs.prompt_of_plain_t2va(prompt, node["inputs"]["video"]) if trained_toy else None
        clip = comfy_outputs.read_mp4(mp4, analysis=is_edit or caption is not None)
        expect = comfy_outputs.expectation(prompt, node["inputs"]["video"], sources, real_weights)
        clips[node_id] = clip
        row.setdefault("previews", {})[node_id] = {"from": expect.what, "frames": clip.frames, "fps": clip.fps,
                                                   "size": [clip.width, clip.height], "audio_s": round(clip.audio_s, 2)}
        problems += [f"Preview {node_id}: {p}" for p in expect.problems(clip)]
        if caption is not None:
            missed, row["previews"][node_id]["scored"] = comfy_outputs.caption_problems(clip, mp4, caption)
            problems += [f"Preview {node_id}: {p}" for p in missed]
    assert clips, f"{path.name} has no H3Forge Preview node"
    if is_edit:
        problems += check_edit(comfy, prompt, sources, clips, row)
    row["problems"] = problems
    if row["run_s"] > WORKFLOW_BUDGET_S:
        problems.append(f"took {row['run_s']:.0f} s, over the {WORKFLOW_BUDGET_S:.0f} s budget")
    assert not problems, f"{path.name}:\n" + "\n".join(problems) + f"\n{comfy.log_tail(3000)}"
    row["run"] = "ok"


def check_edit(comfy: Comfy, prompt: dict, sources: dict, clips: dict, row: dict) -> list[str]:
    """The edit's preview differs from its source inside the mask and matches it outside; on the trained embedded
    default a replacement shows the colour its prompt names over at least half of the former object's area."""
    (edit_id,) = [i for i, n in prompt.items() if n["class_type"] == "H3ForgeMaskedEdit"]
    (preview_id,) = [i for i, n in prompt.items()
                     if n["class_type"] == "H3ForgePreview" and n["inputs"]["video"][0] == edit_id]
    source_name = prompt[prompt[edit_id]["inputs"]["source"][0]]["inputs"]["file"]
    source, output = sources[source_name], clips[preview_id]
    mask, spread, frame_range = comfy_outputs.edit_regions(prompt, edit_id, comfy.root / "input", source.frames,
                                                           source.width, source.height)
    change = comfy_outputs.edit_change(source.pixels, output.pixels, output.width, mask, spread, frame_range)
    weights = engine_status(comfy)["models"]["weights"]
    check_kept = weights not in RANDOM_WEIGHTS
    row["edit"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in change.items()}
    if not check_kept:
        row["notes"] = f"edit: outside the mask not checked (random-weight {weights!r} VAE)"
    problems = edit_problems(change, check_kept)
    edit = prompt[edit_id]["inputs"]
    if edit["preset"] == "replace" and weights in EMBEDDED_WEIGHTS - RANDOM_WEIGHTS:
        colour, filled = comfy_outputs.replacement_fill(source.pixels, output.pixels, mask, edit["prompt"])
        row["edit"]["filled"] = {colour: round(filled, 2)}
        if filled < FILLED_SHARE:
            problems.append(f"the new {colour} object fills {filled:.0%} of the former object's area, under "
                            f"{FILLED_SHARE:.0%}")
    return problems


def edit_problems(change: dict, check_kept: bool = True) -> list[str]:
    inside, outside = change["inside"], change["outside"]
    problems = []
    if inside < EDIT_CHANGED:
        problems.append(f"the masked area hardly changed: mean abs diff {inside:.1f} < {EDIT_CHANGED} (the source "
                        f"came back unedited?)")
    if not check_kept:
        return problems
    if outside > EDIT_KEPT:
        problems.append(f"the area outside the mask changed: mean abs diff {outside:.1f} > {EDIT_KEPT} (the whole "
                        f"clip regenerated?)")
    if inside < EDIT_CONTRAST * outside:
        problems.append(f"inside the mask changed {inside:.1f}, outside {outside:.1f}: not {EDIT_CONTRAST}x more")
    return problems


def test_edit_check_tells_an_edit_from_no_edit_and_a_full_regeneration(comfy):
    """The thresholds above reject the source returned unchanged and a clip that differs everywhere."""
    source = comfy_outputs.read_mp4((EXAMPLE_INPUTS / "h3_scene.mp4").read_bytes(), analysis=True)
    mask = comfy_outputs.load_mask_png(EXAMPLE_INPUTS / "h3_box_mask.png", "red", source.width, source.height)
    mask = mask[None].repeat(source.frames, 0)
    unchanged = comfy_outputs.edit_change(source.pixels, source.pixels, source.width, mask, 0, None)
    assert any("hardly changed" in p for p in edit_problems(unchanged)), unchanged
    everywhere = 255 - source.pixels
    regenerated = comfy_outputs.edit_change(source.pixels, everywhere, source.width, mask, 0, None)
    assert any("outside the mask changed" in p for p in edit_problems(regenerated)), regenerated
    edited = source.pixels.copy()
    inside = comfy_outputs.F.interpolate(comfy_outputs.torch.from_numpy(mask[:, None].astype("float32")),
                                         size=edited.shape[1:3], mode="nearest")[:, 0].numpy() > 0
    edited[inside] = 255 - edited[inside]
    assert not edit_problems(comfy_outputs.edit_change(source.pixels, edited, source.width, mask, 0, None))
