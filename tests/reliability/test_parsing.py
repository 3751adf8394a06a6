"""Parsing: each input a careless or hostile client may send gets the standard behaviour. Ranges by RFC 9110
(numbers of any length, a zero-length suffix: 416, never a 500), the auth scheme case-insensitive, job ids
bounded (neither echoed nor logged in full), strict booleans, Unicode checked at submit, source audio shape and
NaN refused with accurate messages, and the token file: too large, a directory, a symbolic link (its target never
chmod'ed), readable by others (tightened, with a warning that it may have leaked)."""

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys

import aiohttp
import numpy as np
import pytest

from engine import protocol
from engine.server.auth import load_or_create_token
from engine_fixture import REPO
from test_server import http_get, next_control, raw_ws

from .helpers import Footprint, normal_job_succeeds, serving


@pytest.fixture(scope="module")
def result_job(engine):
    result = asyncio.run(asyncio.wait_for(engine.client().run("t2va", {
        "prompt": "ranged", "steps": 2, "width": 32, "height": 32}, mp4=True), 120))
    return result.job, len(result.mp4)


RANGES = {
    # kind: (Range header, status, Content-Range for a body of `size` bytes)
    "range_huge_first": ("bytes=" + "9" * 5000 + "-", 416, "bytes */{size}"),
    "range_huge_last": ("bytes=10-" + "9" * 5000, 206, "bytes 10-{last}/{size}"),
    "range_huge_suffix": ("bytes=-" + "9" * 5000, 200, None),
    "range_suffix_zero": ("bytes=-0", 416, "bytes */{size}"),
    "range_leading_zeros": ("bytes=" + "0" * 40 + "1-" + "0" * 40 + "2", 206, "bytes 1-2/{size}"),
}


@pytest.mark.parametrize("kind", RANGES)
def test_ranges_follow_rfc_9110(engine, recorder, result_job, kind):
    header, status, content_range = RANGES[kind]
    job, size = result_job

    async def get():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{engine.http_url}/v1/results/{job}.mp4", headers={
                    "Authorization": f"Bearer {engine.token}", "Range": header}) as response:
                return response.status, response.headers.get("Content-Range"), len(await response.read())

    with recorder.case("parsing", kind, engine):
        got, got_range, length = asyncio.run(get())
        assert got == status, (got, got_range)
        if content_range:
            assert got_range == content_range.format(size=size, last=size - 1)
        assert status != 206 or length == int(got_range.split()[1].split("/")[0].split("-")[1]) - int(
            got_range.split()[1].split("-")[0]) + 1
        assert "Traceback" not in engine.log()


def test_the_bearer_scheme_is_case_insensitive(engine, recorder):
    for scheme in ("bearer", "BEARER", "Bearer"):
        with recorder.case("parsing", "bearer_case", engine):
            assert http_get(engine, "/v1/status", None)[0] == 401
            request_headers = {"Authorization": f"{scheme} {engine.token}"}
            import urllib.request

            with urllib.request.urlopen(urllib.request.Request(engine.http_url + "/v1/status",
                                                               headers=request_headers), timeout=10) as response:
                assert response.status == 200


async def exchange(engine, *messages, text=None):
    """The reply to each message (or to one raw text frame) on a fresh connection."""
    async with aiohttp.ClientSession() as session:
        ws = await raw_ws(session, engine)
        assert (await next_control(ws))["type"] == "welcome"
        replies = []
        for msg in messages:
            await ws.send_json(msg)
            replies.append(await next_control(ws))
        if text is not None:
            await ws.send_str(text)
            replies.append(await next_control(ws))
        return replies


def test_long_job_ids_are_neither_echoed_nor_logged_in_full(engine, recorder):
    long_id = "f" * 100_000
    with recorder.case("parsing", "job_id_100k_chars", engine):
        cancel, attach = asyncio.run(exchange(engine, {"type": "cancel", "id": "c", "job": long_id},
                                              {"type": "attach", "id": "a", "job": long_id}))
        for reply in (cancel, attach):
            assert reply["code"] == "unknown_job" and len(reply["message"]) < 200, reply
            assert "not a job id" in reply["message"]
        assert long_id[:1000] not in engine.log()
        code, body, _ = http_get(engine, f"/v1/results/{'f' * 4000}.mp4", engine.token)
        assert code == 404 and len(body) < 300


@pytest.mark.parametrize("value", ["false", 0, "true", None])
def test_flags_are_strict_booleans(engine, recorder, value):
    with recorder.case("parsing", "mp4_not_a_boolean", engine):
        (reply,) = asyncio.run(exchange(engine, {"type": "submit", "id": "s", "task": "t2va", "mp4": value,
                                                 "params": {"prompt": "x", "width": 32, "height": 32}}))
        if value is None:  # JSON null: the field left out
            assert reply["type"] == "accepted"
            (ended,) = asyncio.run(exchange(engine, {"type": "attach", "id": "a", "job": reply["job"]}))
            assert ended["type"] in ("accepted", "result")
        else:
            assert reply["code"] == "invalid_request" and "'mp4' must be true or false" in reply["message"]


def test_a_lone_surrogate_is_refused_at_submit(engine, recorder):
    text = '{"type":"submit","id":"u","task":"t2va","params":{"prompt":"a cat \\ud800 sings","steps":2}}'
    with recorder.case("parsing", "lone_surrogate", engine):
        (reply,) = asyncio.run(exchange(engine, text=text))
        assert reply["code"] == "invalid_request" and "lone UTF-16 surrogate" in reply["message"], reply
        assert "position 6" in reply["message"] and serving(engine)


SOURCE = np.zeros((124, 32, 32, 3), np.uint8)
AUDIO = {
    "audio_no_samples": (np.zeros((2, 0), np.float32), "no samples"),
    "audio_nan": (np.array([[0.0, np.nan, 0.1], [0.0, 0.0, np.inf]], np.float32), "2 sample(s) that are NaN"),
}


@pytest.mark.parametrize("kind", AUDIO)
def test_source_audio_shape_and_nan_get_accurate_messages(engine, recorder, kind):
    audio, words = AUDIO[kind]
    from nodes.client import EngineError

    with recorder.case("parsing", kind, engine):
        with Footprint(engine) as footprint, pytest.raises(EngineError) as err:
            asyncio.run(engine.client().run("extend", {"prompt": "on", "seconds": 5, "source_sample_rate": 32000},
                                            {"source_frames": SOURCE, "source_audio": audio}))
        assert err.value.code == "invalid_request" and words in err.value.message, err.value.message
        assert footprint.growth < 100 * 2**20


def test_a_normal_job_runs_after_the_parsing_cases(engine, recorder):
    with recorder.case("parsing", "normal_job_after", engine):
        normal_job_succeeds(engine)


# ---- the token file --------------------------------------------------------------------------------------------


def refused(path) -> str:
    with pytest.raises(SystemExit) as exc:
        load_or_create_token(path)
    return str(exc.value)


def test_token_file_too_large_or_not_a_token_is_refused(tmp_path, recorder):
    with recorder.case("parsing", "token_file_1_mb"):
        (tmp_path / "big").write_text("x" * 2**20)
        os.chmod(tmp_path / "big", 0o600)
        assert "at most 512 printable ASCII characters" in refused(tmp_path / "big")
    with recorder.case("parsing", "token_file_binary"):
        (tmp_path / "bin").write_bytes(b"\xff\xfe token")
        os.chmod(tmp_path / "bin", 0o600)
        assert "does not hold a token" in refused(tmp_path / "bin")


def test_token_file_that_is_a_directory_is_refused_without_a_traceback(tmp_path, recorder):
    with recorder.case("parsing", "token_file_directory"):
        (tmp_path / "dir").mkdir()
        assert "is a directory" in refused(tmp_path / "dir")
        run = subprocess.run([sys.executable, "-m", "engine", "serve", "--preset", "tiny", "--device", "cpu",
                              "--port", "9", "--token-file", str(tmp_path / "dir")], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode != 0 and "is a directory" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_symlinked_token_file_is_refused_and_its_target_left_alone(tmp_path, recorder):
    with recorder.case("parsing", "token_file_symlink"):
        target = tmp_path / "elsewhere"
        target.write_text("secret-token\n")
        os.chmod(target, 0o644)
        (tmp_path / "link").symlink_to(target)
        assert "symbolic link" in refused(tmp_path / "link")
        assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_token_file_readable_by_others_is_tightened_with_a_warning(tmp_path, recorder, caplog):
    with recorder.case("parsing", "token_file_world_readable"):
        path = tmp_path / "token"
        path.write_text("shared-token\n")
        os.chmod(path, 0o644)
        logger = logging.getLogger("h3forge")
        logger.addHandler(caplog.handler)
        try:
            assert load_or_create_token(path) == "shared-token"
        finally:
            logger.removeHandler(caplog.handler)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        warning = next(r for r in caplog.records if r.fields["event"] == "token.permissions_tightened")
        assert warning.levelno == logging.WARNING and "may have leaked" in warning.fields["warning"]
        assert load_or_create_token(path) == "shared-token"  # 0600 now: read quietly
