"""The wire protocol between the ComfyUI nodes and the engine (ARCHITECTURE.md §4). Imports no torch.

Transport: one WebSocket at `/v1/ws`. Control messages are JSON text frames, each an object with `type`
and (for requests and their replies) `id`. Tensors travel as binary frames right after the control message
that announces them by name:

    FRAME_MAGIC (4 bytes) | header length (uint32 LE) | JSON header {name, dtype, shape} | raw little-endian data

Client -> engine:
    hello   {id, version, token}
    submit  {id, task, params, tensors: [names], mp4: bool}     + one binary frame per name, in order
    cancel  {id, job}
    attach  {id, job}
    status  {id}
Engine -> client:
    welcome  {id, version, limits, engine}
    accepted {id, job, position}                                 position = jobs ahead of this one
    progress {job, stage, step, total, eta_s, has_preview, position?}   + one JPEG frame ("preview", uint8 [N])
    result   {id?, job, meta, tensors: [names]}                  + frames uint8 [F,H,W,3], audio float32 [C,S], mp4 uint8 [N]
    status   {id, ...}                                           same body as GET /v1/status
    error    {id?, job?, code, message}                          the message is written for an artist
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
DEFAULT_PORT = 8190
DEFAULT_URL = f"ws://127.0.0.1:{DEFAULT_PORT}"
TOKEN_FILE_ENV = "H3FORGE_TOKEN_FILE"

CLIENT_TYPES = frozenset({"hello", "submit", "cancel", "attach", "status"})
ENGINE_TYPES = frozenset({"welcome", "accepted", "progress", "result", "status", "error"})

FRAME_MAGIC = b"H3TF"
_PREFIX = struct.Struct("<4sI")
MAX_FRAME_HEADER_BYTES = 4096
# What a client accepts from an engine it authenticated: results are large (15 s at 1344x768 is 1.1 GB of uint8).
# One WebSocket message holds at most 4 GiB (aiohttp's limit).
MAX_RESULT_TENSOR_BYTES = 2**32 - 1

TASKS = ("t2va", "fl2va")
IMAGE_TENSORS = ("first_frame", "last_frame")


class ProtocolError(Exception):
    """A message or tensor that breaks the protocol or a task's rules; `message` is shown to the artist."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Bounds the engine enforces on what clients send; announced in `welcome`."""

    max_control_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 2**20
    max_tensors: int = 8
    dtypes: tuple[str, ...] = ("uint8", "int32", "int64", "float16", "float32")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtypes"] = list(self.dtypes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Limits":
        return cls(max_control_bytes=int(d["max_control_bytes"]), max_tensor_bytes=int(d["max_tensor_bytes"]),
                   max_tensors=int(d["max_tensors"]), dtypes=tuple(d["dtypes"]))


def default_token_file() -> Path:
    """Where the engine keeps its token and where a client on the same host finds it: $H3FORGE_TOKEN_FILE,
    else ~/.h3forge/token."""
    return Path(os.environ.get(TOKEN_FILE_ENV) or Path.home() / ".h3forge" / "token").expanduser()


def read_token(path: str | os.PathLike | None = None) -> str | None:
    try:
        return Path(path or default_token_file()).read_text().strip() or None
    except OSError:
        return None


# ---- control messages ------------------------------------------------------------------------------------


def encode_control(msg: dict) -> str:
    return json.dumps(msg, separators=(",", ":"), allow_nan=False)


def decode_control(text: str, limits: Limits | None = None, types: frozenset[str] = CLIENT_TYPES) -> dict:
    if limits is not None and len(text.encode("utf-8")) > limits.max_control_bytes:
        raise ProtocolError("too_large", f"Control message of {len(text)} characters is over the engine's limit of "
                                         f"{limits.max_control_bytes} bytes.")
    try:
        msg = json.loads(text)
    except ValueError as exc:
        raise ProtocolError("bad_message", f"Control message is not valid JSON ({exc}).") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("bad_message", "Control message must be a JSON object with a string 'type'.")
    if msg["type"] not in types:
        raise ProtocolError("bad_message", f"Unknown message type {msg['type']!r}; expected one of {sorted(types)}.")
    return msg


def frames_following(msg: dict) -> list[str]:
    """Names of the binary frames that come right after this control message."""
    if msg["type"] in ("submit", "result"):
        return list(msg.get("tensors") or [])
    if msg["type"] == "progress" and msg.get("has_preview"):
        return ["preview"]
    return []


# ---- tensor frames ---------------------------------------------------------------------------------------


def encode_tensor(name: str, array) -> bytes:
    import numpy as np

    array = np.asarray(array)
    array = array.astype(array.dtype.newbyteorder("<"), copy=False)  # tobytes() below writes C order
    header = json.dumps({"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}).encode()
    return _PREFIX.pack(FRAME_MAGIC, len(header)) + header + array.tobytes()


def decode_tensor(data: bytes, limits: Limits | None = None):
    """(name, read-only numpy array viewing `data`). Raises ProtocolError("bad_tensor" | "too_large")."""
    import numpy as np

    if limits is not None and len(data) > limits.max_tensor_bytes + _PREFIX.size + MAX_FRAME_HEADER_BYTES:
        raise ProtocolError("too_large", f"A tensor frame of {_mib(len(data))} is over the engine's limit of "
                                         f"{_mib(limits.max_tensor_bytes)}.")
    if len(data) < _PREFIX.size:
        raise ProtocolError("bad_tensor", "Binary frame is too short to hold a tensor header.")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ProtocolError("bad_tensor", "Binary frame does not start with the H3Forge tensor magic.")
    if header_len > MAX_FRAME_HEADER_BYTES or _PREFIX.size + header_len > len(data):
        raise ProtocolError("bad_tensor", f"Tensor header length {header_len} does not fit the frame.")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
        name, dtype_name, shape = header["name"], header["dtype"], header["shape"]
    except (ValueError, KeyError, TypeError):
        raise ProtocolError("bad_tensor", "Tensor header must be JSON with name, dtype and shape.") from None
    if not isinstance(name, str) or not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError("bad_tensor", f"Tensor header has a bad name or shape: {header!r:.200}.")
    allowed = limits.dtypes if limits is not None else None
    if not isinstance(dtype_name, str) or (allowed is not None and dtype_name not in allowed):
        raise ProtocolError("bad_tensor", f"Tensor {name!r} has dtype {dtype_name!r}; allowed: {list(allowed or [])}.")
    try:
        dtype = np.dtype(dtype_name).newbyteorder("<")
    except TypeError:
        raise ProtocolError("bad_tensor", f"Tensor {name!r} has an unknown dtype {dtype_name!r}.") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if limits is not None and nbytes > limits.max_tensor_bytes:
        raise ProtocolError("too_large", f"Tensor {name!r} of {_mib(nbytes)} is over the engine's limit of "
                                         f"{_mib(limits.max_tensor_bytes)}.")
    payload = memoryview(data)[_PREFIX.size + header_len:]
    if len(payload) != nbytes:
        raise ProtocolError("bad_tensor", f"Tensor {name!r} declares {dtype_name} {shape} ({nbytes} bytes) but the "
                                          f"frame carries {len(payload)} bytes.")
    return name, np.frombuffer(payload, dtype=dtype).reshape(shape)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- task specs ------------------------------------------------------------------------------------------

_ASPECT = re.compile(r"^\s*(\d+(\.\d+)?)\s*:\s*(\d+(\.\d+)?)\s*$")
MAX_PROMPT_CHARS = 8000
MAX_LORAS = 16


def _number(task, key, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError("invalid_request", f"{task}: '{key}' must be a number, got {value!r:.60}.")
    if not lo < value <= hi:
        raise ProtocolError("invalid_request", f"{task}: '{key}' must be more than {lo:g} and at most {hi:g}, "
                                               f"got {value:g}.")
    return float(value)


def _integer(task, key, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("invalid_request", f"{task}: '{key}' must be a whole number, got {value!r:.60}.")
    if not lo <= value <= hi:
        raise ProtocolError("invalid_request", f"{task}: '{key}' must be between {lo} and {hi}, got {value}.")
    return value


def _prompt(task, key, value):
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError("invalid_request", f"{task}: the prompt is empty; describe the video (and its sound).")
    if len(value) > MAX_PROMPT_CHARS:
        raise ProtocolError("invalid_request", f"{task}: the prompt has {len(value)} characters; the most is "
                                               f"{MAX_PROMPT_CHARS}.")
    return value


def _aspect(task, key, value):
    m = _ASPECT.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0 or float(m.group(3)) <= 0:
        raise ProtocolError("invalid_request", f"{task}: 'aspect' must look like \"16:9\", got {value!r:.60}.")
    return f"{m.group(1)}:{m.group(3)}"


def _loras(task, key, value):
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        raise ProtocolError("invalid_request", f"{task}: 'loras' must be a list of at most {MAX_LORAS} "
                                               f"[path, scale] pairs.")
    out = []
    for item in value:
        path, scale = (item.get("path"), item.get("scale", 1.0)) if isinstance(item, dict) else (
            item if isinstance(item, list) and len(item) == 2 else (None, None))
        if not isinstance(path, str) or not path:
            raise ProtocolError("invalid_request", f"{task}: each LoRA needs a file path, got {item!r:.80}.")
        out.append([path, _number(task, f"scale of LoRA {path}", scale, -100.0, 100.0)])
    return out


_PARAMS = {
    "prompt": lambda t, k, v: _prompt(t, k, v),
    "seconds": lambda t, k, v: _number(t, k, v, 0.0, 600.0),
    "width": lambda t, k, v: _integer(t, k, v, 32, 8192),
    "height": lambda t, k, v: _integer(t, k, v, 32, 8192),
    "aspect": _aspect,
    "steps": lambda t, k, v: _integer(t, k, v, 2, 1000),
    "seed": lambda t, k, v: _integer(t, k, v, 0, 2**63 - 1),
    "loras": _loras,
}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    summary: str
    image_tensors: tuple[str, ...] = ()  # optional uint8 [H, W, 3] images
    images_required: int = 0  # how many of image_tensors must be present


TASK_SPECS = {
    "t2va": TaskSpec("t2va", "text to video with audio"),
    "fl2va": TaskSpec("fl2va", "first and/or last frame to video with audio", IMAGE_TENSORS, 1),
}


def validate_task(task: Any, params: Any, tensors: dict) -> dict:
    """Checks a submit's task, params and tensors against the task's rules; returns the params with their
    defaults left to the pipeline (only given keys). Deeper model rules (canvas, duration) are the pipeline's."""
    if task not in TASK_SPECS:
        raise ProtocolError("invalid_request", f"Unknown task {task!r}; this engine runs {', '.join(TASKS)}.")
    spec = TASK_SPECS[task]
    if not isinstance(params, dict):
        raise ProtocolError("invalid_request", f"{task}: 'params' must be an object.")
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise ProtocolError("invalid_request", f"{task}: unknown parameter(s) {unknown}; known: {sorted(_PARAMS)}.")
    if "prompt" not in params:
        raise ProtocolError("invalid_request", f"{task}: a prompt is required.")
    checked = {key: _PARAMS[key](task, key, value) for key, value in params.items() if value is not None}
    if ("width" in checked) != ("height" in checked):
        raise ProtocolError("invalid_request", f"{task}: give both width and height, or neither (then 'aspect' "
                                               f"picks the canvas).")
    extra = sorted(set(tensors) - set(spec.image_tensors))
    if extra:
        allowed = f"only {list(spec.image_tensors)}" if spec.image_tensors else "no input images"
        raise ProtocolError("invalid_request", f"{task} takes {allowed}, got {extra}.")
    present = [name for name in spec.image_tensors if name in tensors]
    if len(present) < spec.images_required:
        raise ProtocolError("invalid_request", f"{task} needs a first frame, a last frame, or both.")
    for name in present:
        _check_image(task, name, tensors[name])
    return checked


def _check_image(task: str, name: str, array) -> None:
    shape = tuple(array.shape)
    if array.dtype.name != "uint8" or len(shape) != 3 or shape[2] != 3:
        raise ProtocolError("invalid_request", f"{task}: {name} must be an RGB image, uint8 [H, W, 3]; got "
                                               f"{array.dtype.name} {list(shape)}.")
    if not (16 <= shape[0] <= 8192 and 16 <= shape[1] <= 8192):
        raise ProtocolError("invalid_request", f"{task}: {name} is {shape[1]}x{shape[0]}; images must be 16 to "
                                               f"8192 pixels per side.")
