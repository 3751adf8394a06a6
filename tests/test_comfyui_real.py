"""The pack inside a real ComfyUI (optional; skipped unless COMFYUI_DIR points at a ComfyUI checkout).

    COMFYUI_DIR=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/comfy-venv/bin/python pytest tests/test_comfyui_real.py

COMFYUI_PYTHON is the interpreter of that ComfyUI (default: `python` from PATH); it may be a command line, e.g.
"env PYTHONPATH=/opt/comfy-deps /usr/bin/python3" (the engine the nodes auto-launch inherits that environment
and interpreter, so both must import torch, diffusers and transformers). The test links this checkout into
$COMFYUI_DIR/custom_nodes/h3forge (whatever was there is put back afterwards), starts
`main.py --cpu --listen 127.0.0.1 --port <free>` with its input/output/temp/user folders in a temp dir, and then:
/object_info lists every node of the pack with the pack's inputs; every shipped UI-format workflow converts to the
API format against /object_info; the text-to-video and first/last-frame workflows run through /prompt (3 steps,
5 s, the nodes auto-launch the bundled engine on `tiny`) and their Preview nodes play an MP4.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")
if not COMFYUI_DIR:
    pytest.skip("set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its interpreter) to run the pack "
                "in a real ComfyUI", allow_module_level=True)
if not (Path(COMFYUI_DIR) / "main.py").is_file() or not (Path(COMFYUI_DIR) / "custom_nodes").is_dir():
    pytest.skip(f"COMFYUI_DIR={COMFYUI_DIR!r} is not a ComfyUI checkout (no main.py / custom_nodes)",
                allow_module_level=True)

from engine_fixture import free_port  # noqa: E402
from test_pack_import import load_pack  # noqa: E402
from workflow_check import widgets  # noqa: E402

PACK = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((PACK / "workflows").glob("*.json"))
LINK_NAME = "h3forge"
START_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
STEPS, SECONDS = 3, 5.0


@dataclass
class Comfy:
    url: str
    engine_port: int
    process: subprocess.Popen
    log_file: Path
    root: Path  # this run's input/output/temp/user folders

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log_file.read_text(errors="replace")[-chars:]
        engine_log = self.root / "temp" / f"h3forge-engine-{self.engine_port}.log"
        if engine_log.is_file():
            text += f"\n--- engine log ---\n{engine_log.read_text(errors='replace')[-chars:]}"
        return text

    def request(self, path: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 30):
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, reply.read()

    def get_json(self, path: str):
        return json.loads(self.request(path)[1])

    def post_json(self, path: str, body: dict):
        try:
            status, raw = self.request(path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        return status, json.loads(raw or b"{}")



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
        for folder in ("input", "output", "temp", "user"):
            (root / folder).mkdir()
        port, engine_port = free_port(), free_port()
        token_file = root / "engine-token"
        env = dict(os.environ, H3FORGE_TOKEN_FILE=str(token_file), H3FORGE_URL=f"ws://127.0.0.1:{engine_port}",
                   PYTHONUNBUFFERED="1")
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


def small_settings(prompt: dict, engine_port: int) -> dict:
    for node in prompt.values():
        if node["class_type"] == "H3ForgeEngine":
            node["inputs"].update(url=f"ws://127.0.0.1:{engine_port}", device="cpu", preset="tiny", models_dir="")
        if node["class_type"] == "H3ForgeTextToVideo":
            node["inputs"].update(steps=STEPS, seconds=SECONDS)
    return prompt


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(colour) * width
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b""))


def upload_image(comfy: Comfy, name: str, data: bytes) -> str:
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
            f"Content-Type: image/png\r\n\r\n").encode() + data + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="overwrite"\r\n\r\ntrue\r\n'
            f"--{boundary}--\r\n").encode()
    status, raw = comfy.request("/upload/image", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, raw
    reply = json.loads(raw)
    return f"{reply['subfolder']}/{reply['name']}" if reply.get("subfolder") else reply["name"]


def run_prompt(comfy: Comfy, prompt: dict) -> dict:
    status, reply = comfy.post_json("/prompt", {"prompt": prompt, "client_id": f"h3forge-test-{uuid.uuid4().hex}"})
    assert status == 200 and "prompt_id" in reply, f"/prompt refused the workflow: {json.dumps(reply, indent=1)}"
    prompt_id = reply["prompt_id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        history = comfy.get_json(f"/history/{prompt_id}")
        entry = history.get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"]["completed"] or entry["status"].get("status_str") == "error"):
            break
        assert comfy.process.poll() is None, f"ComfyUI exited while running the prompt:\n{comfy.log_tail()}"
        assert time.monotonic() < deadline, f"the prompt did not finish in {RUN_TIMEOUT_S} s:\n{comfy.log_tail()}"
        time.sleep(0.5)
    status = entry["status"]
    assert status.get("status_str") == "success" and status.get("completed"), (
        f"prompt failed: {json.dumps(status.get('messages'), indent=1)[-4000:]}\n{comfy.log_tail()}")
    return entry["outputs"]


def assert_preview_video(comfy: Comfy, prompt: dict, outputs: dict) -> None:
    previews = [node_id for node_id, node in prompt.items() if node["class_type"] == "H3ForgePreview"]
    assert previews
    for node_id in previews:
        ui = outputs.get(node_id)
        assert ui, f"Preview node {node_id} produced no output: {outputs}"
        (video,) = ui["images"]
        assert video["filename"].endswith(".mp4") and video["format"] == "video/h264-mp4", video
        assert ui.get("animated") == [True], ui
        query = urllib.parse.urlencode({k: video[k] for k in ("filename", "subfolder", "type")})
        status, data = comfy.request(f"/view?{query}")
        assert status == 200 and data[4:8] == b"ftyp" and len(data) > 1000, (status, data[:16], len(data))


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


def test_text_to_video_workflow_runs(comfy, object_info):
    prompt = small_settings(to_api(json.loads((PACK / "workflows/h3_text_to_video.json").read_text()), object_info),
                            comfy.engine_port)
    outputs = run_prompt(comfy, prompt)
    assert_preview_video(comfy, prompt, outputs)


def test_first_last_frame_workflow_runs(comfy, object_info):
    prompt = small_settings(to_api(json.loads((PACK / "workflows/h3_first_last_frame.json").read_text()),
                                   object_info), comfy.engine_port)
    colours = iter([(200, 120, 40), (30, 90, 200)])
    for node in prompt.values():
        if node["class_type"] == "LoadImage":  # the workflow names first_frame.png / last_frame.png
            node["inputs"]["image"] = upload_image(comfy, node["inputs"]["image"], png(96, 64, next(colours)))
    outputs = run_prompt(comfy, prompt)
    assert_preview_video(comfy, prompt, outputs)
