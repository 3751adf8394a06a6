"""engine.protocol: tensor frames, control messages, limits, task specs; importable without torch."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine import protocol
from engine.protocol import Limits, ProtocolError

LIMITS = Limits(max_control_bytes=1024, max_tensor_bytes=4096, max_tensors=2)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(st.sampled_from([np.uint8, np.int32, np.int64, np.float16, np.float32]),
                  hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)),
       st.text(min_size=1, max_size=20))
def test_tensor_round_trip(array, name):
    got_name, got = protocol.decode_tensor(protocol.encode_tensor(name, array), Limits())
    assert got_name == name and got.dtype == array.dtype and got.shape == array.shape
    assert got.tobytes() == array.tobytes()


def test_big_endian_and_strided_input_arrive_little_endian_and_equal():
    array = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    _, got = protocol.decode_tensor(protocol.encode_tensor("x", array))
    assert got.dtype == np.dtype("<f4") and np.array_equal(got, array)


def frame(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<4sI", protocol.FRAME_MAGIC, len(raw)) + raw + payload


@pytest.mark.parametrize("data, code", [
    (b"H3", "bad_tensor"),
    (b"XXXX" + bytes(8), "bad_tensor"),
    (struct.pack("<4sI", protocol.FRAME_MAGIC, 10**6) + b"{}", "bad_tensor"),
    (frame({"name": "a"}, b""), "bad_tensor"),
    (frame({"name": "a", "dtype": "uint8", "shape": [4, 4]}, bytes(15)), "bad_tensor"),  # lying shape
    (frame({"name": "a", "dtype": "uint8", "shape": [-1]}, b""), "bad_tensor"),
    (frame({"name": "a", "dtype": "float64", "shape": [1]}, bytes(8)), "bad_tensor"),  # not allowed
    (frame({"name": "a", "dtype": "object", "shape": [1]}, bytes(8)), "bad_tensor"),
    (frame({"name": "a", "dtype": "uint8", "shape": [10**6, 10**6]}, b""), "too_large"),
    (frame({"name": "a", "dtype": "uint8", "shape": [8192]}, bytes(8192)), "too_large"),
])
def test_bad_tensor_frames_are_refused(data, code):
    with pytest.raises(ProtocolError) as err:
        protocol.decode_tensor(data, LIMITS)
    assert err.value.code == code


@pytest.mark.parametrize("text, code", [
    ("{not json", "bad_message"),
    ("[1, 2]", "bad_message"),
    ('{"id": 1}', "bad_message"),
    ('{"type": "launch_missiles"}', "bad_message"),
    ('{"type": "status", "pad": "' + "x" * 2000 + '"}', "too_large"),
])
def test_bad_control_messages_are_refused(text, code):
    with pytest.raises(ProtocolError) as err:
        protocol.decode_control(text, LIMITS)
    assert err.value.code == code


def test_control_round_trip_and_following_frames():
    msg = {"type": "submit", "id": "a", "task": "t2va", "params": {"prompt": "x"}, "tensors": ["first_frame"]}
    assert protocol.decode_control(protocol.encode_control(msg), LIMITS) == msg
    assert protocol.frames_following(msg) == ["first_frame"]
    assert protocol.frames_following({"type": "progress", "has_preview": True}) == ["preview"]
    assert protocol.frames_following({"type": "progress", "has_preview": False}) == []
    chunk = {"type": "result_chunk", "job": "j", "start": 17, "stop": 34, "total": 124, "tensors": ["frames"]}
    assert protocol.frames_following(protocol.decode_control(protocol.encode_control(chunk),
                                                             types=protocol.ENGINE_TYPES)) == ["frames"]
    assert protocol.decode_control('{"type": "welcome"}', types=protocol.ENGINE_TYPES)["type"] == "welcome"


def test_limits_travel_in_welcome():
    assert Limits.from_dict(json.loads(json.dumps(LIMITS.to_dict()))) == LIMITS


IMAGE = np.zeros((64, 96, 3), np.uint8)


def test_valid_specs_pass_with_normalised_values():
    params = {"prompt": "a fox", "seconds": 5, "aspect": " 16 : 9 ", "steps": 8, "seed": 3,
              "loras": [["turbo.safetensors", 1], {"path": "style.safetensors", "scale": 0.5}]}
    assert protocol.validate_task("t2va", params, {}) == {
        "prompt": "a fox", "seconds": 5.0, "aspect": "16:9", "steps": 8, "seed": 3,
        "loras": [["turbo.safetensors", 1.0], ["style.safetensors", 0.5]]}
    assert protocol.validate_task("fl2va", {"prompt": "x", "width": 256, "height": 128},
                                  {"last_frame": IMAGE})["width"] == 256
    assert protocol.validate_task("t2va", {"prompt": "x", "attention": " FA3", "vsa_sparsity": 0.875}, {}) == {
        "prompt": "x", "attention": "fa3", "vsa_sparsity": 0.875}


@pytest.mark.parametrize("task, params, tensors, words", [
    ("t2v", {"prompt": "x"}, {}, "Unknown task"),
    ("t2va", {}, {}, "prompt is required"),
    ("t2va", {"prompt": "   "}, {}, "prompt is empty"),
    ("t2va", {"prompt": "x", "seconds": "five"}, {}, "'seconds' must be a number"),
    ("t2va", {"prompt": "x", "seconds": -1}, {}, "more than 0"),
    ("t2va", {"prompt": "x", "seconds": True}, {}, "must be a number"),
    ("t2va", {"prompt": "x", "steps": 2.5}, {}, "whole number"),
    ("t2va", {"prompt": "x", "width": 256}, {}, "both width and height"),
    ("t2va", {"prompt": "x", "aspect": "wide"}, {}, "16:9"),
    ("t2va", {"prompt": "x", "seeed": 1}, {}, "unknown parameter"),
    ("t2va", {"prompt": "x", "loras": [["a.safetensors"]]}, {}, "LoRA needs a file path"),
    ("t2va", {"prompt": "x"}, {"first_frame": IMAGE}, "no input images"),
    ("fl2va", {"prompt": "x"}, {}, "first frame, a last frame, or both"),
    ("fl2va", {"prompt": "x"}, {"first_frame": IMAGE[..., :2]}, "uint8 [H, W, 3]"),
    ("fl2va", {"prompt": "x"}, {"first_frame": IMAGE.astype(np.float32)}, "uint8 [H, W, 3]"),
    ("fl2va", {"prompt": "x"}, {"first_frame": IMAGE[:8]}, "16 to"),
    ("t2va", ["prompt"], {}, "must be an object"),
    ("t2va", {"prompt": "x", "attention": "fa4"}, {}, "'attention' must be one of auto, fa3, cudnn, flex, sdpa"),
    ("t2va", {"prompt": "x", "vsa_sparsity": 1.0}, {}, "vsa_sparsity"),
    ("upscale", {"source_job": "0" * 32, "attention": "fa3"}, {}, "unknown parameter"),
])
def test_invalid_specs_get_artist_readable_errors(task, params, tensors, words):
    with pytest.raises(ProtocolError) as err:
        protocol.validate_task(task, params, tensors)
    assert err.value.code == "invalid_request" and words in err.value.message


def test_protocol_and_client_import_without_torch(tmp_path):
    code = ("import sys; import engine.protocol, nodes.client; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')]; "
            "assert not heavy, heavy; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(protocol.__file__).rsplit("/engine/", 1)[0])
    assert out.stdout.strip() == "ok", out.stderr


def test_token_file_location(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.TOKEN_FILE_ENV, str(tmp_path / "t"))
    assert protocol.default_token_file() == tmp_path / "t"
    assert protocol.read_token() is None
    (tmp_path / "t").write_text("secret\n")
    assert protocol.read_token() == "secret"


def test_deflated_tensors_round_trip_and_inflate_no_further_than_declared():
    mask = np.zeros((124, 768, 1344), np.uint8)
    mask[:, 300:500, 400:600] = 255
    frame = protocol.encode_tensor("mask", mask, deflate=True)
    assert len(frame) < mask.nbytes / 100
    name, back = protocol.decode_tensor(frame, protocol.Limits())
    assert name == "mask" and np.array_equal(back, mask)
    bomb = protocol.encode_tensor("mask", np.zeros((4096, 4096), np.uint8), deflate=True)
    header_len = protocol._PREFIX.unpack_from(bomb)[1]
    small = json.dumps({"name": "mask", "dtype": "uint8", "shape": [16, 16], "deflate": True}).encode()
    forged = protocol._PREFIX.pack(protocol.FRAME_MAGIC, len(small)) + small + bomb[protocol._PREFIX.size + header_len:]
    with pytest.raises(protocol.ProtocolError, match="inflates to more than"):
        protocol.decode_tensor(forged, protocol.Limits())


def test_limits_from_an_older_engine_keep_the_defaults_of_what_it_does_not_announce():
    old = {"max_control_bytes": 1024, "max_tensor_bytes": 4096, "max_tensors": 2, "dtypes": ["uint8"]}
    limits = Limits.from_dict(old)
    assert limits.max_tensors == 2 and limits.dtypes == ("uint8",)
    assert limits.max_messages_per_s == Limits().max_messages_per_s
    assert Limits.from_dict({**Limits().to_dict(), "unknown_future_field": 1}) == Limits()


def test_job_ids_flags_and_counts_are_checked_and_echoed_only_in_part():
    assert protocol.job_id("0" * 32) == "0" * 32
    for bad in ("f" * 100_000, "A" * 32, 7, None, ["x"]):
        with pytest.raises(ProtocolError) as err:
            protocol.job_id(bad)
        assert err.value.code == "unknown_job" and len(err.value.message) < 160
    assert protocol.flag_field({}, "mp4") is False and protocol.flag_field({"mp4": None}, "mp4") is False
    assert protocol.flag_field({"mp4": True}, "mp4") is True
    for bad in ("false", "true", 0, 1, []):
        with pytest.raises(ProtocolError, match="'mp4' must be true or false"):
            protocol.flag_field({"mp4": bad}, "mp4")
    assert protocol.count_field({}, "frames") == 0 and protocol.count_field({"frames": 17}, "frames") == 17
    for bad in (-1, 1.5, "17", True, [17]):
        with pytest.raises(ProtocolError, match="'frames' must be a whole number"):
            protocol.count_field({"frames": bad}, "frames")


@pytest.mark.parametrize("params", [
    {"prompt": "a \ud800 b"},
    {"prompt": "ok", "loras": [["dir/\udc00.safetensors", 1.0]]},
    {"prompt": "ok", "\ud83d": 1},
])
def test_lone_surrogates_anywhere_in_params_are_refused(params):
    with pytest.raises(ProtocolError, match="lone UTF-16 surrogate") as err:
        protocol.validate_task("t2va", params, {})
    assert err.value.code == "invalid_request"


def test_valid_astral_characters_pass():
    assert protocol.validate_task("t2va", {"prompt": "a cat \U0001F431 sings"}, {})["prompt"].endswith("sings")


@pytest.mark.parametrize("audio, words", [
    (np.zeros((2, 0), np.float32), "no samples"),
    (np.full((1, 4), np.nan, np.float32), "4 sample(s) that are NaN or infinite (the first in channel 0 at sample 0)"),
    (np.array([[0, 0], [0, -np.inf]], np.float32), "channel 1 at sample 1"),
])
def test_source_audio_without_samples_or_with_nan_is_refused_with_what_is_wrong(audio, words):
    tensors = {"source_frames": np.zeros((24, 16, 16, 3), np.uint8), "source_audio": audio}
    with pytest.raises(ProtocolError) as err:
        protocol.validate_task("extend", {"prompt": "x", "seconds": 5, "source_sample_rate": 32000}, tensors)
    assert words in err.value.message
