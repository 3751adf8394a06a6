"""The wire protocol between the ComfyUI nodes and the engine (ARCHITECTURE.md §4). Imports no torch.

Transport: one WebSocket at `/v1/ws`. Control messages are JSON text frames, each an object with `type`
and (for requests and their replies) `id`. Tensors travel as binary frames right after the control message
that announces them by name:

    FRAME_MAGIC (4 bytes) | header length (uint32 LE) | JSON header {name, dtype, shape} | raw little-endian data

Client -> engine:
    hello   {id, version, token}
    submit  {id, task, params, tensors: [names], mp4: bool}     + one binary frame per name, in order (tasks: see
                                                                   "task specs" below)
    cancel  {id, job}
    attach  {id, job, mp4, frames}                               frames = how many of the job's frames the client
                                                                   holds (from result_chunks; absent: 0)
    status  {id}
Engine -> client:
    welcome      {id, version, limits, engine}
    accepted     {id, job, position}                             position = jobs ahead of this one
    progress     {job, stage, step, total, eta_s, has_preview, position?, detail?}  + one JPEG frame ("preview",
                 uint8 [N]); stage: queued | starting | denoising | decoding | upscaling; detail: e.g. "window 2/4"
    result_chunk {job, start, stop, total, tensors: ["frames"]}  + frames uint8 [stop - start, H, W, 3]: the result's
                                                                   frames [start, stop) of `total`, as they decode
    result       {id?, job, start, meta, tensors: [names]}       + frames uint8 [F - start, H, W, 3] (absent when
                                                                   start = F), audio float32 [C,S] (absent for a
                                                                   silent clip), mp4 uint8 [N]
    status       {id, ...}                                       same body as GET /v1/status
    error        {id?, job?, code, message}                      the message is written for an artist

Result frames go out once each, in order: every task streams them in result_chunks as they become final (t2va,
fl2va, ref2va, edit and refine as the VAE decodes them, extend its source's frames and then each window's as they
decode, upscale batch by batch), and the result carries the frames from `start` on, those the connection has not
had. A client that reconnects attaches with the count it holds and gets the rest.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
DEFAULT_PORT = 8190
DEFAULT_URL = f"ws://127.0.0.1:{DEFAULT_PORT}"
TOKEN_FILE_ENV = "H3FORGE_TOKEN_FILE"

CLIENT_TYPES = frozenset({"hello", "submit", "cancel", "attach", "status"})
ENGINE_TYPES = frozenset({"welcome", "accepted", "progress", "result_chunk", "result", "status", "error"})

FRAME_MAGIC = b"H3TF"
_PREFIX = struct.Struct("<4sI")
MAX_FRAME_HEADER_BYTES = 4096
# What a client accepts from an engine it authenticated: results are large (15 s at 1344x768 is 1.1 GB of uint8).
# One WebSocket message holds at most 4 GiB (aiohttp's limit).
MAX_RESULT_TENSOR_BYTES = 2**32 - 1
# The largest video (uint8 frames) an engine decodes, resamples or makes for one job: one result frame's worth.
MAX_VIDEO_BYTES = MAX_RESULT_TENSOR_BYTES
MAX_SOURCE_SECONDS = 600.0  # a source clip, after its frame rate is applied

IMAGE_TENSORS = ("first_frame", "last_frame")
MAX_REFERENCES = 12  # ref2va (the engine checks the per-kind limits: 9 images, 3 videos, 3 sounds)
REFERENCE_TENSORS = tuple(f"ref{i}_{part}" for i in range(MAX_REFERENCES) for part in ("image", "frames", "audio"))
REFERENCE_KINDS = ("image", "video", "audio")
REFERENCE_SIZES = ("diffusers", "match", "max")


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
    max_tensors: int = 16  # ref2va: 12 references and the soundtracks of up to 3 videos
    dtypes: tuple[str, ...] = ("uint8", "int32", "int64", "float16", "float32")
    # per connection: messages (control and tensor frames) a second on average, in bursts of up to `message_burst`;
    # replies waiting for a client that does not read them, before it is disconnected
    max_messages_per_s: float = 50.0
    message_burst: int = 200
    max_pending_replies: int = 256
    hello_timeout_s: float = 10.0
    # the work one job may ask for, checked at submit from its parameters and its source's headers
    max_video_bytes: int = MAX_VIDEO_BYTES  # uint8 frames decoded, resampled or made (frames x height x width x 3)
    max_source_seconds: float = MAX_SOURCE_SECONDS
    max_canvas_pixels: int = 768 * 1344  # H3 canvas of this engine's weights (the tiny preset's is smaller)
    max_step_work: int = 1000 * 362 * 768 * 1344  # H3 steps x frames x canvas pixels of one window
    max_upscale_pixels: int = 3840 * 2160  # SeedVR2 output pixels per frame

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtypes"] = list(self.dtypes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Limits":
        """An engine's announced limits; fields an older engine does not announce keep their defaults."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "dtypes": tuple(d["dtypes"])})


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
    if msg["type"] in ("submit", "result_chunk", "result"):
        return list(msg.get("tensors") or [])
    if msg["type"] == "progress" and msg.get("has_preview"):
        return ["preview"]
    return []


# ---- tensor frames ---------------------------------------------------------------------------------------


def encode_tensor(name: str, array, deflate: bool = False) -> bytes:
    """One binary frame: prefix, JSON header, the array's bytes (zlib-compressed with `deflate`: masks shrink a
    hundredfold, and a 15 s per-frame mask at 1344x768 would not fit the tensor limit otherwise)."""
    import numpy as np

    array = np.asarray(array)
    array = array.astype(array.dtype.newbyteorder("<"), copy=False)  # tobytes() below writes C order
    fields = {"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}
    payload = array.tobytes()
    if deflate:
        fields["deflate"], payload = True, zlib.compress(payload, 1)
    header = json.dumps(fields).encode()
    return _PREFIX.pack(FRAME_MAGIC, len(header)) + header + payload


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
    if header.get("deflate") is True:  # inflated no further than the declared size (a zip bomb stops there)
        inflater = zlib.decompressobj()
        try:
            payload = inflater.decompress(payload, nbytes + 1)
        except zlib.error:
            raise ProtocolError("bad_tensor", f"Tensor {name!r} is not valid deflate data.") from None
        if not inflater.eof:
            raise ProtocolError("bad_tensor", f"Tensor {name!r} inflates to more than its declared {dtype_name} "
                                              f"{shape} ({nbytes} bytes).")
    if len(payload) != nbytes:
        raise ProtocolError("bad_tensor", f"Tensor {name!r} declares {dtype_name} {shape} ({nbytes} bytes) but the "
                                          f"frame carries {len(payload)} bytes.")
    return name, np.frombuffer(payload, dtype=dtype).reshape(shape)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- task specs ------------------------------------------------------------------------------------------
#
# t2va / fl2va: prompt, seconds, width + height or aspect, steps, seed, loras; fl2va takes first_frame and/or
#   last_frame (uint8 [H, W, 3]).
# ref2va: the t2va params plus references, a list in the order the model reads them, entry i one of
#   {"kind": "image"} with tensor ref{i}_image (uint8 [H, W, 3]),
#   {"kind": "video", "fps": 24.0, "sample_rate": 32000} with tensor ref{i}_frames (uint8 [F, H, W, 3]) and
#   optionally ref{i}_audio (its soundtrack, float32 [C, S]),
#   {"kind": "audio", "sample_rate": 32000} with tensor ref{i}_audio;
#   and ref_size (image references: diffusers, match or max).
# edit, extend, refine, upscale start from ONE source:
#   tensor source_mp4 (uint8 [N]: a video file's bytes, decoded by the engine, sound included), or
#   tensor source_frames (uint8 [F, H, W, 3]) with param source_fps (default 24) and optionally tensor
#   source_audio (float32 [C, S]) with param source_sample_rate, or
#   param source_job: the id of an earlier job in the engine's result store (frames, sound and latents reused).
# edit: tensor mask (uint8 0..255 or float32 0..1, [H, W] or [F, H, W]); prompt, preset, strength, audio_mask.
# extend: prompt or prompts (one per window), seconds (to add), overlap_latents, window_seconds.
# refine: prompt, scale (1.5 or 2), strength.
# upscale (SeedVR2): model, one of resolution / width and/or height / scale, color_fix, seed, batch_frames,
#   overlap_frames, tiling.
# Every H3 task (not upscale) also takes the speed options of this one job, else the engine's: attention (a backend
#   name, or auto) and vsa_sparsity (0 = dense attention, e.g. 0.875 = each video query cube attends to 1/8 of them).

_ASPECT = re.compile(r"^\s*(\d+(\.\d+)?)\s*:\s*(\d+(\.\d+)?)\s*$")
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_PROMPT_CHARS = 8000
MAX_LORAS = 16
MAX_WINDOWS = 64
EDIT_PRESETS = ("remove", "replace", "repaint")
REFINE_SCALES = (1.5, 2.0)
UPSCALE_MODELS = ("3b", "7b")
UPSCALE_RESOLUTIONS = ("720p", "1080p", "1440p", "2K", "2160p", "4K")
COLOR_FIXES = ("wavelet", "lab", "none")
SOURCE_TENSORS = ("source_mp4", "source_frames", "source_audio")


def _invalid(message: str):
    raise ProtocolError("invalid_request", message)


def shown(value: Any, limit: int = 40) -> str:
    """`value` as an artist sees it in a message or a log line: repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def job_id(value: Any) -> str:
    """A job id from a cancel or attach; anything that is not one is an unknown job, echoed only in part."""
    if not isinstance(value, str) or not _JOB_ID.match(value):
        raise ProtocolError("unknown_job", f"{shown(value)} is not a job id (an engine's job ids are 32 hex "
                                           f"characters, from its `accepted` reply).")
    return value


def flag_field(msg: dict, key: str) -> bool:
    """A true/false field of a control message (absent or null: false); "false" or 0 is refused, not read as
    true."""
    value = msg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError("invalid_request", f"'{key}' must be true or false, got {shown(value)}.")
    return value


def count_field(msg: dict, key: str) -> int:
    """A count in a control message (absent or null: 0); anything but a whole number of at least 0 is refused."""
    value = msg.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError("invalid_request", f"'{key}' must be a whole number of at least 0, got {shown(value)}.")
    return value


def _check_unicode(task: str, key: str, value: Any) -> None:
    """Strings must be valid Unicode: JSON lets a lone UTF-16 surrogate (\\ud800) through, UTF-8 does not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            _invalid(f"{task}: '{key}' holds an invalid character (a lone UTF-16 surrogate, "
                     f"U+{ord(value[exc.start]):04X}, at position {exc.start}); remove it or paste the text again.")
    elif isinstance(value, list):
        for item in value:
            _check_unicode(task, key, item)
    elif isinstance(value, dict):
        for k, item in value.items():
            _check_unicode(task, key, k)
            _check_unicode(task, key, item)


def _number(task, key, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _invalid(f"{task}: '{key}' must be a number, got {value!r:.60}.")
    if not lo < value <= hi:
        _invalid(f"{task}: '{key}' must be more than {lo:g} and at most {hi:g}, got {value:g}.")
    return float(value)


def _between(task, key, value, lo, hi):
    value = _number(task, key, value, -math.inf, math.inf)
    if not lo <= value <= hi:
        _invalid(f"{task}: '{key}' must be from {lo:g} to {hi:g}, got {value:g}.")
    return value


def _integer(task, key, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        _invalid(f"{task}: '{key}' must be a whole number, got {value!r:.60}.")
    if not lo <= value <= hi:
        _invalid(f"{task}: '{key}' must be between {lo} and {hi}, got {value}.")
    return value


def _choice(options):
    def check(task, key, value):
        for option in options:
            if value == option or (isinstance(value, str) and value.strip().lower() == str(option).lower()):
                return option
        _invalid(f"{task}: '{key}' must be one of {', '.join(map(str, options))}; got {value!r:.60}.")
    return check


def _flag(task, key, value):
    if not isinstance(value, bool):
        _invalid(f"{task}: '{key}' must be true or false, got {value!r:.60}.")
    return value


def _prompt(task, key, value):
    if not isinstance(value, str) or not value.strip():
        _invalid(f"{task}: the prompt is empty; describe the video (and its sound).")
    if len(value) > MAX_PROMPT_CHARS:
        _invalid(f"{task}: the prompt has {len(value)} characters; the most is {MAX_PROMPT_CHARS}.")
    return value


def _prompts(task, key, value):
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_WINDOWS:
        _invalid(f"{task}: 'prompts' must be a list of 1 to {MAX_WINDOWS} prompts, one per window.")
    return [_prompt(task, key, item) for item in value]


def _aspect(task, key, value):
    m = _ASPECT.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0 or float(m.group(3)) <= 0:
        _invalid(f"{task}: 'aspect' must look like \"16:9\", got {value!r:.60}.")
    return f"{m.group(1)}:{m.group(3)}"


def _loras(task, key, value):
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        _invalid(f"{task}: 'loras' must be a list of at most {MAX_LORAS} [path, scale] pairs.")
    out = []
    for item in value:
        path, scale = (item.get("path"), item.get("scale", 1.0)) if isinstance(item, dict) else (
            item if isinstance(item, list) and len(item) == 2 else (None, None))
        if not isinstance(path, str) or not path:
            _invalid(f"{task}: each LoRA needs a file path, got {item!r:.80}.")
        out.append([path, _number(task, f"scale of LoRA {path}", scale, -100.0, 100.0)])
    return out


def _job(task, key, value):
    if not isinstance(value, str) or not _JOB_ID.match(value.strip()):
        _invalid(f"{task}: 'source_job' must be the job id of an earlier result (32 hex characters), "
                 f"got {value!r:.60}.")
    return value.strip()


def _overlap(task, key, value):
    value = _integer(task, key, value, 2, 52)
    if value % 5 != 2:
        _invalid(f"{task}: 'overlap_latents' must be 2, 7, 12, ... (5k + 2 latent frames, so windows line up "
                 f"with the video VAE's chunks), got {value}.")
    return value


def _references(task, key, value):
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_REFERENCES:
        _invalid(f"{task}: '{key}' must be a list of 1 to {MAX_REFERENCES} references, got {shown(value)}.")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or entry.get("kind") not in REFERENCE_KINDS:
            _invalid(f"{task}: reference {i} must be an object with 'kind' one of {', '.join(REFERENCE_KINDS)}; "
                     f"got {shown(entry)}.")
        allowed = {"image": {"kind"}, "video": {"kind", "fps", "sample_rate"}, "audio": {"kind", "sample_rate"}}
        unknown = sorted(set(entry) - allowed[entry["kind"]])
        if unknown:
            _invalid(f"{task}: reference {i} ({entry['kind']}) takes {sorted(allowed[entry['kind']])}, not {unknown}.")
        checked = {"kind": entry["kind"]}
        if "fps" in entry:
            checked["fps"] = _number(task, f"reference {i} fps", entry["fps"], 0.0, 1000.0)
        if "sample_rate" in entry:
            checked["sample_rate"] = _integer(task, f"reference {i} sample_rate", entry["sample_rate"], 1000, 768000)
        out.append(checked)
    return out


def _resolution(task, key, value):
    if isinstance(value, int) and not isinstance(value, bool):
        return _integer(task, key, value, 64, 8192)
    return _choice(UPSCALE_RESOLUTIONS)(task, key, value)


_COMMON = {
    "steps": lambda t, k, v: _integer(t, k, v, 2, 1000),
    "seed": lambda t, k, v: _integer(t, k, v, 0, 2**63 - 1),
    "loras": _loras,
}
ATTENTION_CHOICES = ("auto", "fa3", "cudnn", "flex", "sdpa")  # engine/kernels/attention.py's backends
_SPEED = {
    "attention": _choice(ATTENTION_CHOICES),
    "vsa_sparsity": lambda t, k, v: _number(t, k, v, 0.0, 0.99),
}
_SOURCE = {
    "source_job": _job,
    "source_fps": lambda t, k, v: _number(t, k, v, 0.0, 1000.0),
    "source_sample_rate": lambda t, k, v: _integer(t, k, v, 1000, 768000),
}
_STRENGTH = lambda t, k, v: _number(t, k, v, 0.0, 1.0)  # noqa: E731
_SIDE = lambda t, k, v: _integer(t, k, v, 32, 8192)  # noqa: E731
_GENERATE_PARAMS = {"prompt": _prompt, "seconds": lambda t, k, v: _number(t, k, v, 0.0, 600.0), "width": _SIDE,
                    "height": _SIDE, "aspect": _aspect, **_COMMON, **_SPEED}


def _generate_rules(task, checked, tensors, spec):
    if "prompt" not in checked:
        _invalid(f"{task}: a prompt is required.")
    if ("width" in checked) != ("height" in checked):
        _invalid(f"{task}: give both width and height, or neither (then 'aspect' picks the canvas).")
    present = [name for name in spec.tensors if name in tensors]
    if len(present) < spec.images_required:
        _invalid(f"{task} needs a first frame, a last frame, or both.")
    for name in present:
        _check_image(task, name, tensors[name])


def _ref2va_rules(task, checked, tensors, spec):
    if "prompt" not in checked:
        _invalid(f"{task}: a prompt is required.")
    if "references" not in checked:
        _invalid(f"{task}: 'references' is required: the images, videos and sounds, in the order the model reads "
                 "them.")
    if ("width" in checked) != ("height" in checked):
        _invalid(f"{task}: give both width and height, or neither (then 'aspect' picks the canvas).")
    expected = set()
    for i, ref in enumerate(checked["references"]):
        needed = {"image": [f"ref{i}_image"], "video": [f"ref{i}_frames"], "audio": [f"ref{i}_audio"]}[ref["kind"]]
        optional = [f"ref{i}_audio"] if ref["kind"] == "video" else []
        for name in needed:
            if name not in tensors:
                _invalid(f"{task}: reference {i} is {'an' if ref['kind'] == 'image' else 'a'} {ref['kind']}; send "
                         f"its tensor {name}.")
        expected |= set(needed + optional)
        if ref["kind"] == "image":
            _check_image(task, f"ref{i}_image", tensors[f"ref{i}_image"])
        if ref["kind"] == "video":
            _check_frames(task, f"ref{i}_frames", tensors[f"ref{i}_frames"])
        if f"ref{i}_audio" in tensors and ref["kind"] != "image":
            _check_audio(task, tensors[f"ref{i}_audio"], f"ref{i}_audio")
    extra = sorted(set(tensors) - expected)
    if extra:
        _invalid(f"{task}: tensors {extra} belong to no reference of this kind in 'references'.")


def _edit_rules(task, checked, tensors, spec):
    if "mask" not in tensors:
        _invalid("edit needs a mask: 1 (white) where the video is regenerated, 0 (black) where it is kept.")
    _check_mask(task, tensors["mask"])
    preset = checked.get("preset", "replace")
    if preset != "remove" and "prompt" not in checked:
        _invalid(f"edit: a {preset} edit needs a prompt describing the new content of the masked area.")


def _extend_rules(task, checked, tensors, spec):
    if "seconds" not in checked:
        _invalid("extend: 'seconds' (how many seconds to add) is required.")
    if ("prompt" in checked) == ("prompts" in checked):
        _invalid("extend: give 'prompt', or 'prompts' with one prompt per window (the last one repeats); "
                 "not both and not neither.")


def _refine_rules(task, checked, tensors, spec):
    if "prompt" not in checked:
        _invalid("refine: a prompt is required: describe what the clip shows and sounds like.")


def _upscale_rules(task, checked, tensors, spec):
    sizes = [k for k in ("resolution", "scale") if k in checked] + (
        ["width/height"] if "width" in checked or "height" in checked else [])
    if len(sizes) != 1:
        _invalid(f"upscale: give exactly one of: resolution ({', '.join(UPSCALE_RESOLUTIONS)}), width and/or "
                 f"height, or scale; got {', '.join(sizes) or 'none'}.")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    summary: str
    params: dict  # name -> validator(task, key, value) returning the normalised value
    rules: Any  # (task, checked params, tensors, spec) -> None; raises ProtocolError
    tensors: tuple[str, ...] = ()  # tensor names the task takes
    images_required: int = 0  # fl2va: how many of its image tensors must be present
    source: bool = False  # starts from a source video (SOURCE_TENSORS or source_job)


TASK_SPECS = {spec.name: spec for spec in (
    TaskSpec("t2va", "text to video with audio", _GENERATE_PARAMS, _generate_rules),
    TaskSpec("fl2va", "first and/or last frame to video with audio", _GENERATE_PARAMS, _generate_rules,
             IMAGE_TENSORS, images_required=1),
    TaskSpec("ref2va", "video with audio from ordered reference images, videos and sounds",
             {**_GENERATE_PARAMS, "references": _references, "ref_size": _choice(REFERENCE_SIZES)}, _ref2va_rules,
             REFERENCE_TENSORS),
    TaskSpec("edit", "masked edit: object removal, replacement, repaint",
             {"prompt": _prompt, "preset": _choice(EDIT_PRESETS), "strength": _STRENGTH,
              "audio_mask": lambda t, k, v: _between(t, k, v, 0.0, 1.0), **_COMMON, **_SPEED, **_SOURCE},
             _edit_rules, (*SOURCE_TENSORS, "mask"), source=True),
    TaskSpec("extend", "continue a clip past one window",
             {"prompt": _prompt, "prompts": _prompts, "seconds": lambda t, k, v: _number(t, k, v, 0.0, 600.0),
              "overlap_latents": _overlap, "window_seconds": lambda t, k, v: _between(t, k, v, 5.0, 15.0),
              **_COMMON, **_SPEED, **_SOURCE},
             _extend_rules, SOURCE_TENSORS, source=True),
    TaskSpec("refine", "latent upscale x1.5 / x2 and a second H3 pass",
             {"prompt": _prompt, "scale": _choice(REFINE_SCALES), "strength": _STRENGTH, **_COMMON, **_SPEED,
              **_SOURCE},
             _refine_rules, SOURCE_TENSORS, source=True),
    TaskSpec("upscale", "SeedVR2 restoration to 1080p and beyond",
             {"model": _choice(UPSCALE_MODELS), "resolution": _resolution, "width": _SIDE, "height": _SIDE,
              "scale": lambda t, k, v: _number(t, k, v, 0.0, 16.0), "color_fix": _choice(COLOR_FIXES),
              "seed": _COMMON["seed"], "batch_frames": lambda t, k, v: _integer(t, k, v, 1, 100000),
              "overlap_frames": lambda t, k, v: _integer(t, k, v, 0, 64), "tiling": _flag, **_SOURCE},
             _upscale_rules, SOURCE_TENSORS, source=True),
)}
TASKS = tuple(TASK_SPECS)


def validate_task(task: Any, params: Any, tensors: dict) -> dict:
    """Checks a submit's task, params and tensors against the task's rules; returns the params with their
    defaults left to the pipeline (only given keys). Deeper model rules (canvas, duration) are the pipeline's."""
    if not isinstance(task, str) or task not in TASK_SPECS:  # `[] in dict` would raise TypeError
        _invalid(f"Unknown task {task!r}; this engine runs {', '.join(TASKS)}.")
    spec = TASK_SPECS[task]
    if not isinstance(params, dict):
        _invalid(f"{task}: 'params' must be an object.")
    for key, value in params.items():
        _check_unicode(task, "parameter name" if not isinstance(key, str) else key, key)
        _check_unicode(task, key, value)
    unknown = sorted(set(params) - set(spec.params))
    if unknown:
        _invalid(f"{task}: unknown parameter(s) {[shown(k) for k in unknown[:8]]}; {task} takes "
                 f"{sorted(spec.params)}.")
    checked = {key: spec.params[key](task, key, value) for key, value in params.items() if value is not None}
    extra = sorted(set(tensors) - set(spec.tensors))
    if extra:
        _invalid(f"{task} takes {f'only {list(spec.tensors)}' if spec.tensors else 'no input images'}, got {extra}.")
    if spec.source:
        _source_rules(task, checked, tensors)
    spec.rules(task, checked, tensors, spec)
    return checked


def _source_rules(task: str, checked: dict, tensors: dict) -> None:
    given = ["source_job"] * ("source_job" in checked) + [n for n in ("source_mp4", "source_frames") if n in tensors]
    if len(given) != 1:
        _invalid(f"{task} needs exactly one source video: its file bytes (source_mp4), its frames (source_frames, "
                 f"with optional source_audio), or an earlier job's id (source_job); got {given or 'none'}.")
    if "source_frames" in tensors:
        _check_frames(task, "source_frames", tensors["source_frames"])
    elif "source_fps" in checked:
        _invalid(f"{task}: source_fps goes with source_frames only (a video file and a stored job carry their own "
                 f"frame rate).")
    if "source_audio" in tensors:
        if "source_frames" not in tensors:
            _invalid(f"{task}: source_audio goes with source_frames only.")
        _check_audio(task, tensors["source_audio"])
        if "source_sample_rate" not in checked:
            _invalid(f"{task}: give source_sample_rate with source_audio.")
    elif "source_sample_rate" in checked:
        _invalid(f"{task}: source_sample_rate goes with source_audio only.")
    if "source_mp4" in tensors:
        array = tensors["source_mp4"]
        if array.dtype.name != "uint8" or array.ndim != 1 or array.shape[0] == 0:
            _invalid(f"{task}: source_mp4 must be the video file's bytes, uint8 [N]; got {array.dtype.name} "
                     f"{list(array.shape)}.")


def _check_image(task: str, name: str, array) -> None:
    shape = tuple(array.shape)
    if array.dtype.name != "uint8" or len(shape) != 3 or shape[2] != 3:
        _invalid(f"{task}: {name} must be an RGB image, uint8 [H, W, 3]; got {array.dtype.name} {list(shape)}.")
    if not (16 <= shape[0] <= 8192 and 16 <= shape[1] <= 8192):
        _invalid(f"{task}: {name} is {shape[1]}x{shape[0]}; images must be 16 to 8192 pixels per side.")


def _check_frames(task: str, name: str, array) -> None:
    shape = tuple(array.shape)
    if array.dtype.name != "uint8" or len(shape) != 4 or shape[3] != 3 or shape[0] < 1:
        _invalid(f"{task}: {name} must be RGB frames, uint8 [F, H, W, 3]; got {array.dtype.name} {list(shape)}.")
    if not (16 <= shape[1] <= 8192 and 16 <= shape[2] <= 8192):
        _invalid(f"{task}: {name} are {shape[2]}x{shape[1]}; frames must be 16 to 8192 pixels per side.")


def _check_audio(task: str, array, name: str = "source_audio") -> None:
    import numpy as np

    if array.dtype.name != "float32" or array.ndim != 2 or array.shape[0] not in (1, 2):
        _invalid(f"{task}: {name} must be mono or stereo float32 samples [C, S]; got {array.dtype.name} "
                 f"{list(array.shape)}.")
    if array.shape[1] == 0:
        _invalid(f"{task}: {name} has {array.shape[0]} channel(s) but no samples; send the sound's samples, "
                 f"or leave {name} out for silence.")
    bad = ~np.isfinite(array)
    if bad.any():
        channel, sample = (int(i[0]) for i in np.nonzero(bad))
        _invalid(f"{task}: {name} has {int(bad.sum())} sample(s) that are NaN or infinite (the first in "
                 f"channel {channel} at sample {sample}); samples must be finite numbers, normally -1 to 1.")


def _check_mask(task: str, array) -> None:
    shape = tuple(array.shape)
    if array.dtype.name not in ("uint8", "float32") or len(shape) not in (2, 3) or min(shape) < 1:
        _invalid(f"{task}: the mask must be uint8 (0..255) or float32 (0..1), one for all frames [H, W] or one per "
                 f"frame [F, H, W]; got {array.dtype.name} {list(shape)}.")


def mask_mismatch(mask_shape, frames_shape) -> str | None:
    """Why a mask [H, W] / [F, H, W] does not fit a video [F, H, W, 3], or None. Shared by the engine and the
    Mask Preview node. A mask of another size is no mismatch: it is resized to the video."""
    frames = frames_shape[0]
    if len(mask_shape) == 3 and mask_shape[0] not in (1, frames):
        return (f"The mask has {mask_shape[0]} frames but the video has {frames}: give one mask for all frames or "
                f"one per frame.")
    return None
