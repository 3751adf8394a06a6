"""Security: the token on every route but /v1/health, compared in constant time; 127.0.0.1 unless told otherwise
and a loud warning when not; LoRA paths confined to the models folder; weights-only checkpoint loading; size caps on
every input, each refused with an error that names the limit."""

import argparse
import ast
import asyncio
import hmac
import json
import pickle
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from engine import protocol
from engine.models.h3.checkpoint import load_dit
from engine.models.h3.lora import load_lora
from engine.models.h3.pipeline import H3Pipeline
from engine.models.seedvr2.checkpoint import load_nadit, load_text_embedding, load_vae
from engine.runtime.jobs import JobRunner, JobSpec
from engine.runtime.ranks import RankContext
from engine.server import auth
from engine.server.app import OPEN_ROUTES, make_app
from engine.server.cli import add_serve_args
from engine.server.scheduler import describe_failure
from engine_fixture import start_engine
from test_server import http_get, next_control, raw_ws

from .helpers import serving

ENGINE_ARGS = ["--max-tensor-mb", "1"]
SERVER_SOURCES = sorted(Path(auth.__file__).parent.glob("*.py"))


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the engine's app registers, with a job id filled into the templates."""
    routes = set()
    for route in make_app(None).router.routes():
        path = route.resource.canonical.replace("{job}", "0123456789abcdef0123456789abcdef")
        routes.add((route.method, path))
    return sorted(routes)


def test_every_route_but_health_refuses_requests_without_the_right_token(engine, recorder):
    async def status(method, path, headers):
        async with aiohttp.ClientSession() as session:
            async with session.request(method, engine.http_url + path, headers=headers) as response:
                return response.status

    routes = app_routes()
    assert ("GET", "/v1/status") in routes and ("GET", "/v1/health") in routes
    for method, path in routes:
        if path in OPEN_ROUTES:  # /v1/ws checks the token in its hello (the next test)
            continue
        for headers, query in (({}, ""), ({"Authorization": "Bearer wrong"}, ""), ({}, "?token=wrong"),
                               ({"Authorization": f"Bearer {engine.token[:-1]}"}, ""),
                               ({"Authorization": engine.token}, "")):  # no "Bearer ": not a token
            with recorder.case("security"):
                assert asyncio.run(status(method, path + query, headers)) == 401, (method, path, headers, query)
    with recorder.case("security"):
        assert http_get(engine, "/v1/health")[0] == 200 and http_get(engine, "/v1/status", engine.token)[0] == 200


def test_the_websocket_takes_nothing_before_a_hello_with_the_right_token(engine, recorder):
    async def hello_then_submit(token):
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine, token=token)
            await ws.send_json({"type": "submit", "id": "s", "task": "t2va", "params": {"prompt": "x"}})
            return await next_control(ws), await next_control(ws)

    for token in (None, "", "wrong", engine.token.upper(), ["list"]):
        with recorder.case("security"):
            refused, after = asyncio.run(hello_then_submit(token))
            assert refused["code"] == "auth"
            assert after == {"type": "closed", "code": aiohttp.WSCloseCode.POLICY_VIOLATION}


def test_tokens_are_compared_in_constant_time_only(monkeypatch, recorder):
    with recorder.case("security"):
        calls = []
        monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or a == b)
        assert auth.token_matches("secret", "secret") and not auth.token_matches("secreT", "secret")
        assert not auth.token_matches(None, "secret") and not auth.token_matches(["secret"], "secret")
        assert calls == [(b"secret", b"secret"), (b"secreT", b"secret")]
    with recorder.case("security"):  # and no `==` / `!=` on a token anywhere in the server
        for source in SERVER_SOURCES:
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                    operands = " ".join(ast.unparse(part) for part in (node.left, *node.comparators))
                    assert "token" not in operands.lower(), f"{source.name}: {operands}"


def test_engine_listens_on_loopback_only_by_default(engine, recorder):
    with recorder.case("security"):
        parser = argparse.ArgumentParser()
        add_serve_args(parser.add_subparsers())
        assert parser.parse_args(["serve"]).host == "127.0.0.1"
        listening = [line.split()[1] for table in ("/proc/net/tcp", "/proc/net/tcp6")
                     for line in Path(table).read_text().splitlines()[1:]
                     if line.split()[3] == "0A" and int(line.split()[1].rsplit(":", 1)[1], 16) == engine.port]
        assert listening == [f"0100007F:{engine.port:04X}"]


def test_binding_to_all_interfaces_logs_a_loud_warning(tmp_path, recorder):
    with recorder.case("security"), start_engine(tmp_path, "--host", "0.0.0.0") as exposed:
        warning = next(line for line in exposed.log().splitlines() if "event=engine.exposed" in line)
        assert "level=warning" in warning and "anyone who can reach port" in warning


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "style.safetensors"])
def test_a_preset_engine_takes_no_lora_files(engine, recorder, path):
    async def submit():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"
            await ws.send_json({"type": "submit", "id": "l", "task": "t2va",
                                "params": {"prompt": "x", "loras": [[path, 1.0]]}})
            return await next_control(ws)

    with recorder.case("security"):
        reply = asyncio.run(submit())
        assert reply["type"] == "error" and reply["code"] == "invalid_request" and reply["id"] == "l"
        assert "no models folder" in reply["message"] and "LoRA" in reply["message"]


@pytest.fixture(scope="module")
def models_runner(tmp_path_factory):
    """A one-rank job runner whose pipeline reads LoRAs inside `models/` only (as `--models DIR` sets it), and
    an outside folder with a file a request might try to reach."""
    root = tmp_path_factory.mktemp("confined")
    (root / "models" / "loras").mkdir(parents=True)
    (root / "outside").mkdir()
    (root / "outside" / "secret.safetensors").write_bytes(b"not for requests")
    (root / "models" / "loras" / "inside.safetensors").write_bytes(b"not a LoRA either")
    (root / "models" / "loras" / "escape.safetensors").symlink_to(root / "outside" / "secret.safetensors")
    (root / "models" / "loras" / "alias.safetensors").symlink_to(root / "models" / "loras" / "inside.safetensors")
    pipeline = H3Pipeline.from_preset("tiny", lora_roots=[root / "models"])
    return root, JobRunner(RankContext(0, 1, torch.device("cpu")), pipeline)


@pytest.mark.parametrize("lora, refused", [
    ("../outside/secret.safetensors", True), ("loras/../../outside/secret.safetensors", True),
    ("{root}/outside/secret.safetensors", True), ("loras/escape.safetensors", True),
    ("loras/inside.safetensors", False), ("loras/alias.safetensors", False),
    ("{root}/models/loras/inside.safetensors", False),
])
def test_lora_paths_resolve_inside_the_models_folder_only(models_runner, recorder, lora, refused):
    root, runner = models_runner
    spec = JobSpec("j", "t2va", {"prompt": "x", "steps": 2, "width": 32, "height": 32,
                                 "loras": [[lora.format(root=root), 1.0]]})
    with recorder.case("security"):
        with pytest.raises(ValueError) as failure:
            runner.run(spec)
        state, code, message = describe_failure(failure.value)
        assert (state, code) == ("failed", "invalid_request")
        if refused:
            assert "outside the models directory" in message
        else:  # inside: resolved and read (and refused as no LoRA: these files hold no tensors)
            assert "cannot read as safetensors" in message


class RunsCode:
    """A pickle payload: unpickling it runs Python code (here: creating a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_checkpoints_load_weights_only_and_a_pickle_payload_never_runs(tmp_path, recorder):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "seedvr2_ema_3b.pth"
    torch.save({"weight": RunsCode(marker)}, evil)
    with open(tmp_path / "check.pkl", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    with open(tmp_path / "check.pkl", "rb") as f:
        pickle.load(f)  # the payload is live: an unrestricted unpickle runs it
    assert marker.exists()
    marker.unlink()

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "model.safetensors").write_bytes(evil.read_bytes())
    loaders = [  # SeedVR2 reads .pth weights-only; H3 checkpoints and LoRAs are safetensors only
        (lambda: load_nadit(evil), "weights-only"), (lambda: load_vae(evil), "weights-only"),
        (lambda: load_text_embedding(evil), "weights-only"),
        (lambda: load_dit(tmp_path / "transformer"), "not a safetensors file"),
        (lambda: load_lora(evil, torch.nn.Linear(2, 2)), "cannot read as safetensors")]
    for load, words in loaders:
        with recorder.case("security"):
            with pytest.raises(ValueError, match=words):
                load()
            assert not marker.exists()


SIZE_CAPS = {  # what breaks which limit -> (submit params, tensors, task, error code, words of the message)
    "control message": ({"prompt": "x" * (300 * 1024)}, [], "t2va", "too_large", "262144 bytes"),
    "tensor bytes": ({"prompt": "x"}, [("first_frame", np.zeros((1024, 1024, 3), np.uint8))], "fl2va", "too_large",
                     "1.0 MiB"),
    "number of tensors": ({"prompt": "x"}, [(f"t{i}", np.zeros(1, np.uint8)) for i in range(17)], "fl2va",
                          "too_large", "at most 16 tensors"),
    "prompt length": ({"prompt": "x" * 8001}, [], "t2va", "invalid_request", "8000"),
    "steps": ({"prompt": "x", "steps": 1001}, [], "t2va", "invalid_request", "'steps'"),
    "seconds": ({"prompt": "x", "seconds": 601}, [], "t2va", "invalid_request", "'seconds'"),
    "canvas": ({"prompt": "x", "width": 9000, "height": 64}, [], "t2va", "invalid_request", "'width'"),
    "image side": ({"prompt": "x"}, [("first_frame", np.zeros((8, 8, 3), np.uint8))], "fl2va", "invalid_request",
                   "16 to 8192"),
    "number of LoRAs": ({"prompt": "x", "loras": [["a.safetensors", 1.0]] * 17}, [], "t2va", "invalid_request",
                        "at most 16"),
}


@pytest.mark.parametrize("limit", SIZE_CAPS)
def test_every_input_has_a_size_cap_with_a_clear_error(engine, recorder, limit):
    params, tensors, task, code, words = SIZE_CAPS[limit]

    async def submit():
        async with aiohttp.ClientSession() as session:
            ws = await raw_ws(session, engine)
            assert (await next_control(ws))["type"] == "welcome"
            await ws.send_str(json.dumps({"type": "submit", "id": "cap", "task": task, "params": params,
                                          "tensors": [name for name, _ in tensors]}))
            for name, array in tensors:
                await ws.send_bytes(protocol.encode_tensor(name, array))
            return await next_control(ws)

    with recorder.case("security"):
        reply = asyncio.run(asyncio.wait_for(submit(), 30))
        assert reply["type"] == "error" and reply["code"] == code, reply
        assert any(word in reply["message"] for word in words.split("|")), reply["message"]
        assert serving(engine)
