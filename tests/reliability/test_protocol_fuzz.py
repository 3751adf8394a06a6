"""Protocol fuzzing with hypothesis, bounded in time: random and mutated control messages, messages around the size
limit, lying tensor headers, wrong dtypes and shapes for task tensors, truncated frames, and abuse of the handshake.
Each example is followed by a status request that must be answered on the same connection; after each batch the
engine answers /v1/health, and at the end a real job still succeeds. A submit that happens to be valid is
cancelled as soon as it is accepted."""

import asyncio
import json
import math

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import protocol
from engine.server.connection import RateLimit
from test_server import next_control, raw_ws

from .helpers import RawWebSocket, serving

# The fuzzing keeps to the welcome's message rate: at the default 50 a second it spent ~50 s of its ~60 waiting.
ENGINE_ARGS = ["--max-tensor-mb", "1", "--max-messages-per-s", "2000"]
LIMITS = protocol.Limits(max_tensor_bytes=2**20)
ERROR_CODES = {"bad_message", "bad_tensor", "too_large", "invalid_request", "unknown_job", "queue_full", "auth",
               "version"}
FUZZ = settings(max_examples=200, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

PARAM_NAMES = sorted({name for spec in protocol.TASK_SPECS.values() for name in spec.params})
TENSOR_NAMES = sorted({name for spec in protocol.TASK_SPECS.values() for name in spec.tensors})

leaves = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
          | st.text(max_size=30))
junk = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=16)
params = st.dictionaries(st.sampled_from(PARAM_NAMES) | st.text(max_size=8), junk, max_size=6)
control = st.fixed_dictionaries(
    {"type": st.sampled_from(sorted(protocol.CLIENT_TYPES - {"hello"})) | st.text(max_size=10)},
    optional={"id": junk, "job": junk, "task": st.sampled_from(protocol.TASKS) | junk, "params": params | junk,
              "tensors": st.lists(st.sampled_from(TENSOR_NAMES) | st.text(max_size=8), max_size=3) | junk,
              "mp4": junk})
VALID_SUBMIT = protocol.encode_control({"type": "submit", "id": "m", "task": "t2va", "params": {
    "prompt": "x", "steps": 2, "width": 64, "height": 64}})


class Wire:
    """One authenticated WebSocket kept across examples, on an event loop of its own."""

    def __init__(self, engine):
        self.engine, self.loop, self.ws, self.pings = engine, asyncio.new_event_loop(), None, 0
        self.session = self.loop.run_until_complete(self._session())

    @staticmethod
    async def _session():  # created inside the loop it will run on
        return aiohttp.ClientSession()

    def close(self):
        self.loop.run_until_complete(self.session.close())
        self.loop.close()

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

    def exchange(self, *items: str | bytes) -> list[dict]:
        return self.run(self._exchange(items))

    async def _exchange(self, items) -> list[dict]:
        """Sends the items, then a status request; the engine's replies to them up to its answer (the progress and
        endings of jobs accepted earlier, and cancelled, are left out). Raises when the engine closed the
        connection."""
        if self.ws is None or self.ws.closed:
            self.ws = await raw_ws(self.session, self.engine)
            welcome = await next_control(self.ws)
            assert welcome["type"] == "welcome"
            limits = protocol.Limits.from_dict(welcome["limits"])  # kept to, with a margin, as a client should
            self.rate = RateLimit(limits.max_messages_per_s * 0.8, limits.message_burst // 2)
        for item in items:
            await self.pace()
            await (self.ws.send_bytes(item) if isinstance(item, bytes) else self.ws.send_str(item))
        self.pings += 1
        ping = f"ping-{self.pings}"
        await self.pace()
        await self.ws.send_json({"type": "status", "id": ping})
        replies = []
        while (msg := await next_control(self.ws))["type"] != "status" or msg.get("id") != ping:
            assert msg["type"] != "closed", f"the engine closed the connection ({msg['code']}) after {replies}"
            if msg["type"] == "accepted":
                await self.pace()
                await self.ws.send_json({"type": "cancel", "id": "c", "job": msg["job"]})
            if msg["type"] == "accepted" or "job" not in msg:
                replies.append(msg)
        return replies

    async def pace(self) -> None:
        while not self.rate.take():
            await asyncio.sleep(1 / self.rate.rate)


@pytest.fixture(scope="module")
def wire(engine):
    wire = Wire(engine)
    yield wire
    wire.close()


@pytest.fixture(autouse=True)
def engine_still_serving(engine):
    """After each batch of examples the engine answers /v1/health."""
    yield
    assert serving(engine)


def check_replies(replies: list[dict], expect_error: bool = True) -> None:
    for msg in replies:
        assert msg["type"] in protocol.ENGINE_TYPES
        if msg["type"] == "error":
            assert msg["code"] in ERROR_CODES and isinstance(msg["message"], str) and msg["message"]
    if expect_error:
        assert any(msg["type"] in ("error", "accepted") for msg in replies), replies


def tensor_frame(header: dict, payload: bytes, magic: bytes = protocol.FRAME_MAGIC,
                 header_len: int | None = None) -> bytes:
    encoded = json.dumps(header).encode()
    length = len(encoded) if header_len is None else header_len
    return magic + length.to_bytes(4, "little") + encoded + payload


def submit_announcing(names: list[str], task: str = "fl2va") -> str:
    return protocol.encode_control({"type": "submit", "id": "t", "task": task, "params": {"prompt": "x"},
                                    "tensors": names})


@FUZZ
@given(message=control | junk | st.text(max_size=200))
def test_random_control_messages_get_answers_and_the_connection_stays(wire, recorder, message):
    with recorder.case("fuzzing"):
        text = message if isinstance(message, str) else json.dumps(message)
        check_replies(wire.exchange(text), expect_error=False)


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from("idr"), st.integers(0, len(VALID_SUBMIT)), st.characters()),
                      min_size=1, max_size=8))
def test_mutated_submits_are_refused_or_run(wire, recorder, edits):
    text = VALID_SUBMIT
    for kind, at, char in edits:
        at = min(at, len(text))
        text = {"i": text[:at] + char + text[at:], "d": text[:at] + text[at + 1:],
                "r": text[:at] + char + text[at + 1:]}[kind]
    with recorder.case("fuzzing"):
        check_replies(wire.exchange(text), expect_error=False)


@settings(FUZZ, max_examples=30)
@given(size=st.integers(LIMITS.max_control_bytes - 200, LIMITS.max_control_bytes + 200),
       pad=st.sampled_from(["x", "\u00e9", "\U0001f600"]))
def test_control_messages_around_the_size_limit(wire, recorder, size, pad):
    text = protocol.encode_control({"type": "status", "id": "big", "pad": ""})
    text = text.replace('"pad":""', '"pad":"' + pad * max(0, (size - len(text.encode())) // len(pad.encode())) + '"')
    with recorder.case("fuzzing"):
        replies = wire.exchange(text)
        if len(text.encode()) > LIMITS.max_control_bytes:
            assert [(r["type"], r["code"]) for r in replies] == [("error", "too_large")]
        else:
            assert [(r["type"], r["id"]) for r in replies] == [("status", "big")]


headers = st.fixed_dictionaries(
    {"name": st.sampled_from(["first_frame", "last_frame"]) | junk
     | st.text("x", min_size=protocol.MAX_FRAME_HEADER_BYTES - 64, max_size=protocol.MAX_FRAME_HEADER_BYTES + 64),
     "dtype": st.sampled_from([*LIMITS.dtypes, "float64", "bool", "object", "<U8", "complex64", "V3", ""]) | junk,
     "shape": st.lists(st.integers(-2**63, 2**64), max_size=5) | st.lists(st.integers(0, 64), max_size=4) | junk})


@FUZZ
@given(header=headers | junk, payload=st.binary(max_size=4096), magic=st.just(protocol.FRAME_MAGIC) | st.binary(
    min_size=4, max_size=4), header_len=st.none() | st.integers(0, 2**32 - 1), announced=st.booleans())
def test_lying_tensor_headers_are_refused(wire, recorder, header, payload, magic, header_len, announced):
    frame = tensor_frame(header, payload, magic, header_len)
    with recorder.case("fuzzing"):
        check_replies(wire.exchange(*([submit_announcing(["first_frame"])] if announced else []), frame))


arrays = st.tuples(st.sampled_from(LIMITS.dtypes), st.lists(st.integers(0, 40), max_size=4)).filter(
    lambda a: math.prod(a[1]) * np.dtype(a[0]).itemsize <= 4 * 2**20)  # past ~9 MiB the transport closes (below)


@FUZZ
@given(task=st.sampled_from(protocol.TASKS),
       tensors=st.dictionaries(st.sampled_from(TENSOR_NAMES) | st.text(max_size=8), arrays, max_size=3))
def test_task_tensors_of_wrong_dtype_or_shape_are_refused(wire, recorder, task, tensors):
    frames = [protocol.encode_tensor(name, np.zeros(shape, dtype)) for name, (dtype, shape) in tensors.items()]
    with recorder.case("fuzzing"):
        check_replies(wire.exchange(submit_announcing(list(tensors), task), *frames))


FIRST_FRAME = protocol.encode_tensor("first_frame", np.zeros((32, 32, 3), np.uint8))


@settings(FUZZ, max_examples=60)
@given(cut=st.integers(0, len(FIRST_FRAME) - 1))
def test_truncated_tensor_frames_are_refused(wire, recorder, cut):
    with recorder.case("fuzzing"):
        replies = wire.exchange(submit_announcing(["first_frame"]), FIRST_FRAME[:cut])
        assert [(r["type"], r["code"]) for r in replies] == [("error", "bad_tensor")]


hellos = st.fixed_dictionaries({"type": st.just("hello")}, optional={
    "id": junk, "version": st.just(protocol.PROTOCOL_VERSION) | junk, "token": st.just("TOKEN") | junk})


@settings(FUZZ, max_examples=40)
@given(first=hellos | control | st.binary(max_size=64) | st.text(max_size=64), second=hellos)
@example(first=b"\x00binary before hello", second={"type": "hello"})
@example(first={"type": "hello", "version": protocol.PROTOCOL_VERSION, "token": "TOKEN"},
         second={"type": "hello", "version": protocol.PROTOCOL_VERSION, "token": "TOKEN"})
def test_handshake_abuse_is_refused_and_hello_twice_is_an_error(engine, wire, recorder, first, second):
    """Only a hello with the right token and version opens a connection; anything else first is refused and closed;
    a second hello is an error on a connection that stays usable."""
    token = engine.token

    def encode(message):
        if isinstance(message, dict):
            return json.dumps({k: token if v == "TOKEN" else v for k, v in message.items()})
        return message

    async def handshake():
        ws = await raw_ws(wire.session, engine, hello=False)
        try:
            await (ws.send_bytes(first) if isinstance(first, bytes) else ws.send_str(encode(first)))
            reply = await next_control(ws)
            if reply["type"] != "welcome":
                return reply, await next_control(ws), None
            await ws.send_str(encode(second))
            again = await next_control(ws)
            await ws.send_json({"type": "status", "id": "still"})
            return reply, again, await next_control(ws)
        finally:
            await ws.close()

    with recorder.case("fuzzing"):
        reply, after, status = wire.run(handshake())
        opens = (isinstance(first, dict) and first.get("type") == "hello" and first.get("token") == "TOKEN"
                 and first.get("version") == protocol.PROTOCOL_VERSION)
        if opens:
            assert reply["type"] == "welcome" and after["code"] == "bad_message" and "once" in after["message"]
            assert status["type"] == "status" and status["id"] == "still"
        else:
            assert reply["type"] == "error" and reply["code"] in ERROR_CODES and after["type"] == "closed"


def test_frame_past_the_transport_limit_closes_only_that_connection(engine, wire, recorder):
    async def oversized():
        ws = await RawWebSocket.connect(engine.port, engine.token)
        await ws.send_partial_binary(bytes(LIMITS.max_tensor_bytes + 9 * 2**20), 0)  # past the 8 MiB of slack
        return await ws.next_control()

    with recorder.case("fuzzing"):
        assert wire.run(oversized()) == {"type": "closed", "code": aiohttp.WSCloseCode.MESSAGE_TOO_BIG}
        check_replies(wire.exchange(), expect_error=False)


def test_a_real_job_succeeds_after_the_fuzzing(engine, recorder):
    with recorder.case("fuzzing"):
        result = asyncio.run(asyncio.wait_for(engine.client().run(
            "t2va", {"prompt": "after the storm", "steps": 2, "width": 64, "height": 64}), 120))
        assert result.frames.shape == (124, 64, 64, 3)


def test_the_welcome_announces_the_operators_message_rate(wire):
    wire.exchange()
    assert wire.rate.rate == 0.8 * 2000
