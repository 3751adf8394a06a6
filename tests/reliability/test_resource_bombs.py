"""Resource bombs: small requests that ask for huge work (a frame rate that turns 16 frames into hours, a 20 kB
MP4 that decodes to gigabytes, a canvas or step count past the preset's). Each is refused at submit, from its
parameters and its container header, in under a second and without the engine's RSS growing by 100 MB; a normal
job runs after."""

import asyncio
import functools
import io

import av
import numpy as np
import pytest

from engine import protocol
from engine.io.video import read_video
from nodes.client import EngineError

from .helpers import Footprint, normal_job_succeeds, serving

MB = 2**20


@functools.lru_cache(maxsize=None)
def black_mp4(frames: int, width: int, height: int) -> np.ndarray:
    """A tiny H.264 file of black frames (they compress to almost nothing)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51"}
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return np.frombuffer(buf.getvalue(), np.uint8)


def tiny_frames(count=1):
    return np.zeros((count, 16, 16, 3), np.uint8)


BOMBS = {
    # kind: (task, params, tensors, code, words in the message)
    "fps_0.001": ("extend", {"prompt": "more", "seconds": 5, "source_fps": 0.001}, lambda: {
        "source_frames": tiny_frames()}, "too_large", "sources of up to 600 s"),
    "fps_0.01": ("extend", {"prompt": "more", "seconds": 5, "source_fps": 0.01}, lambda: {
        "source_frames": tiny_frames(16)}, "too_large", "Check the frame rate"),
    "fps_1e-300": ("extend", {"prompt": "more", "seconds": 5, "source_fps": 1e-300}, lambda: {
        "source_frames": tiny_frames(16)}, "too_large", "source_fps"),
    "mp4_decodes_to_gigabytes": ("upscale", {"scale": 4}, lambda: {"source_mp4": black_mp4(480, 640, 360)},
                                 "too_large", "GB of video per job"),
    "mp4_512_to_1": ("upscale", {"scale": 1}, lambda: {"source_mp4": black_mp4(2, 8192, 16)}, "invalid_request",
                     "64:1"),
    "mp4_side_past_8192": ("upscale", {"scale": 1}, lambda: {"source_mp4": black_mp4(2, 8208, 16)},
                           "invalid_request", "16 to 8192 pixels per side"),
    "canvas_past_preset": ("t2va", {"prompt": "big", "seconds": 15, "width": 1344, "height": 768, "steps": 1000},
                           dict, "too_large", "this engine's canvas of 28672 pixels"),
    "steps_past_preset": ("t2va", {"prompt": "long", "seconds": 15, "width": 224, "height": 128, "steps": 1000},
                          dict, "too_large", "at most 160 steps fit"),
    "edit_source_too_long": ("edit", {"prompt": "x", "source_fps": 1.0}, lambda: {
        "source_frames": tiny_frames(20), "mask": np.ones((16, 16), np.uint8)}, "invalid_request", "5 to 15 s"),
    "upscale_past_preset": ("upscale", {"resolution": "4K"}, lambda: {"source_frames": tiny_frames(2)},
                            "too_large", "upscale limit"),
}


@pytest.mark.parametrize("kind", BOMBS)
def test_a_bomb_is_refused_at_submit_quickly_without_memory(engine, recorder, kind):
    task, params, tensors, code, words = BOMBS[kind]
    tensors = tensors()
    client = engine.client()
    with recorder.case("bombs", kind, engine):
        with Footprint(engine) as footprint, pytest.raises(EngineError) as err:
            asyncio.run(asyncio.wait_for(client.run(task, params, tensors), 30))
        assert err.value.code == code and words in err.value.message, err.value.message
        assert footprint.seconds < 1.0, footprint.seconds
        assert footprint.growth < 100 * MB, footprint.growth / MB
        assert footprint.fds_after <= footprint.fds_before + 2
        assert serving(engine)


def test_a_normal_job_runs_after_the_bombs(engine, recorder):
    with recorder.case("bombs", "normal_job_after", engine):
        normal_job_succeeds(engine)


def test_a_header_that_understates_the_stream_stops_at_the_decode_budget(recorder):
    with recorder.case("bombs", "decode_past_budget"):
        data = black_mp4(48, 64, 64).tobytes()
        assert read_video(data, max_bytes=48 * 64 * 64 * 3)[0].shape == (48, 64, 64, 3)
        with pytest.raises(ValueError, match="decode to more than"):
            read_video(data, max_bytes=47 * 64 * 64 * 3)


def test_limits_are_announced_in_status(engine):
    limits = asyncio.run(engine.client().status())["limits"]
    assert limits["max_canvas_pixels"] == 128 * 224 and limits["max_video_bytes"] == protocol.MAX_VIDEO_BYTES
    assert protocol.Limits.from_dict(limits).max_step_work == 20 * 8 * 362 * 128 * 224


def test_a_stored_source_is_costed_from_its_frames_without_a_decode(recorder):
    from engine.models.h3.pipeline import TINY_CANVAS
    from engine.models.h3.request import Source
    from engine.server.cost import check_cost, preset_limits

    stored = Source(np.zeros((362, 128, 224, 3), np.uint8), 24.0, None, 32000)
    limits = preset_limits(protocol.Limits(), "tiny")
    with recorder.case("bombs", "stored_source_upscale"):
        with pytest.raises(protocol.ProtocolError, match=r"from 224x128 at most x12\.09 fits"):
            check_cost("upscale", {"resolution": "4K"}, {}, stored, limits, TINY_CANVAS)
        check_cost("upscale", {"scale": 2.0}, {}, stored, limits, TINY_CANVAS)
    with recorder.case("bombs", "stored_source_extend"):
        small = protocol.Limits(max_video_bytes=2**30, max_step_work=limits.max_step_work)
        with pytest.raises(protocol.ProtocolError, match=r"extended clip \(615\.1 s at 224x128\) would be 1\.18 GB"):
            check_cost("extend", {"prompt": "x", "seconds": 600}, {}, stored, small, TINY_CANVAS)
        check_cost("extend", {"prompt": "x", "seconds": 60}, {}, stored, small, TINY_CANVAS)
