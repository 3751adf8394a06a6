"""edit / extend / refine / upscale over the wire: a real engine process (tiny preset, CPU) driven by the real client.
Sources travel as a video file's bytes, as frames, or as an earlier job's id (the engine's stored result)."""

import asyncio

import aiohttp
import numpy as np
import pytest

from engine import protocol
from engine.io.video import encode_mp4_bytes
from nodes.client import EngineError

STEPS = 3
FRAMES, SAMPLE_RATE = 124, 32000  # 5 s snaps to 124 frames
SIDE = 128  # the tiny preset's 1:1 canvas: sources on it come back pixel for pixel


def run(coro):
    return asyncio.run(coro)


def samples(frames: int) -> int:
    return round(frames / 24 * SAMPLE_RATE)


@pytest.fixture(scope="module")
def clip(engine):
    """A stored 5 s t2va result on the 1:1 canvas."""
    return run(engine.client().run("t2va", {"prompt": "a red kite over a beach, waves and wind", "aspect": "1:1",
                                            "steps": STEPS, "seed": 1}))


def box_mask(dtype=np.uint8):
    mask = np.zeros((SIDE, SIDE), dtype)
    mask[40:90, 30:100] = 255 if dtype == np.uint8 else 1.0
    return mask


def test_extend_from_a_stored_job_keeps_its_frames_and_sound(engine, clip):
    events = []
    params = {"source_job": clip.job, "prompts": ["the kite dives", "the kite climbs again"], "seconds": 8,
              "window_seconds": 5, "steps": STEPS}
    result = run(engine.client().run("extend", params, on_progress=events.append))

    frames = result.frames.shape[0]
    assert result.frames.shape[1:] == (SIDE, SIDE, 3) and frames >= FRAMES + 8 * 24 and (frames - 5) % 17 == 0
    assert np.array_equal(result.frames[:FRAMES], clip.frames)
    assert result.audio.shape == (2, samples(frames))
    assert np.array_equal(result.audio[:, :clip.audio.shape[1]], clip.audio)
    assert any("2 window(s)" in note for note in result.meta["notes"])
    details = {e.detail for e in events if e.stage == "denoising"}
    assert details == {"window 1/2", "window 2/2"}
    assert all(e.eta_s is not None and e.eta_s >= 0 for e in events if e.stage == "denoising")

    # The extension is stored too (with its latents): the next task starts from it.
    mask = np.zeros((frames, SIDE, SIDE), np.uint8)
    mask[FRAMES:, 40:90, 30:100] = 255
    edited = run(engine.client().run("edit", {"source_job": result.job, "prompt": "a gull", "steps": STEPS},
                                     {"mask": mask}))
    assert edited.frames.shape == result.frames.shape


def test_edit_from_mp4_bytes(engine, clip):
    mp4 = np.frombuffer(encode_mp4_bytes(clip.frames, 24, clip.audio, SAMPLE_RATE), dtype=np.uint8)
    result = run(engine.client().run("edit", {"prompt": "a blue balloon", "preset": "replace", "steps": STEPS},
                                     {"source_mp4": mp4, "mask": box_mask()}))
    assert result.frames.shape == (FRAMES, SIDE, SIDE, 3) and result.audio.shape[0] == 2
    assert abs(result.audio.shape[1] - samples(FRAMES)) <= SAMPLE_RATE // 24
    assert result.meta["task"] == "edit" and result.fps == 24


def test_empty_mask_is_refused_and_the_engine_keeps_serving(engine, clip):
    client = engine.client()
    with pytest.raises(EngineError) as err:
        run(client.run("edit", {"source_job": clip.job, "preset": "remove", "steps": STEPS},
                       {"mask": np.zeros((SIDE, SIDE), np.uint8)}))
    assert err.value.code == "invalid_request" and "mask is empty" in err.value.message
    edited = run(client.run("edit", {"source_job": clip.job, "preset": "remove", "steps": STEPS},
                            {"mask": box_mask(np.float32)}))
    assert edited.frames.shape == clip.frames.shape and edited.meta["params"]["preset"] == "remove"


def test_refine_doubles_the_size(engine, clip):
    result = run(engine.client().run("refine", {"source_job": clip.job, "prompt": "a red kite over a beach",
                                                "scale": 2, "strength": 0.5, "steps": STEPS}))
    assert result.frames.shape == (FRAMES, 2 * SIDE, 2 * SIDE, 3)
    assert result.audio.shape == clip.audio.shape  # the soundtrack is kept


def test_upscale_a_stored_job(engine):
    client = engine.client()
    small = run(client.run("t2va", {"prompt": "city lights at night", "width": 32, "height": 32, "steps": STEPS}))
    events, chunks = [], []
    result = run(client.run("upscale", {"source_job": small.job, "width": 48, "height": 48, "batch_frames": 65},
                            on_progress=events.append, on_frames=lambda start, _, f: chunks.append((start, f.copy()))))
    assert result.frames.shape == (FRAMES, 48, 48, 3) and result.fps == 24
    # Every frame streamed once, in order, a VAE decode chunk at a time (9, then 8 each), before the result.
    assert [start for start, _ in chunks] == [0] + list(range(9, FRAMES, 8))
    assert np.array_equal(np.concatenate([f for _, f in chunks]), result.frames)
    assert np.array_equal(result.audio, small.audio)  # the sound comes through untouched
    upscaling = [e for e in events if e.stage == "upscaling"]
    assert [e.detail for e in upscaling if e.detail.endswith("DiT")] == ["batch 1/2: DiT", "batch 2/2: DiT"]
    assert upscaling[-1].step == upscaling[-1].total
    assert any(e.preview_jpeg for e in events if e.stage == "upscaling")
    status = run(client.status())
    assert status["models"]["upscaler"]["model"] == "SeedVR2"


def test_upscale_keeps_the_frame_rate_of_silent_frames(engine):
    frames = np.random.default_rng(0).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    result = run(engine.client().run("upscale", {"scale": 1.5, "source_fps": 30000 / 1001, "color_fix": "lab"},
                                     {"source_frames": frames}))
    assert result.frames.shape == (9, 48, 72, 3) and result.audio is None
    assert abs(result.fps - 30000 / 1001) < 1e-9


def test_unknown_source_job(engine):
    with pytest.raises(EngineError) as err:
        run(engine.client().run("extend", {"source_job": "0" * 32, "prompt": "more", "seconds": 5}))
    assert err.value.code == "unknown_job"
    assert "No such job" in err.value.message and "results are kept 60 minutes" in err.value.message


@pytest.mark.parametrize("task, params, tensors, words", [
    ("edit", {"prompt": "x"}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8)}, "needs a mask"),
    ("edit", {"prompt": "x", "preset": "erase"}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8),
                                                  "mask": np.ones((32, 32), np.uint8)}, "remove, replace, repaint"),
    ("edit", {"preset": "replace"}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8),
                                     "mask": np.ones((32, 32), np.uint8)}, "needs a prompt"),
    ("edit", {"prompt": "x", "strength": 1.5}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8),
                                                "mask": np.ones((32, 32), np.uint8)}, "'strength' must be"),
    ("edit", {"prompt": "x"}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8),
                               "mask": np.ones((32, 32), np.int32)}, "uint8 (0..255) or float32"),
    ("edit", {"prompt": "x"}, {"mask": np.ones((32, 32), np.uint8)}, "exactly one source video"),
    ("extend", {"prompt": "x", "seconds": 5}, {"source_frames": np.zeros((4, 32, 32), np.uint8)}, "uint8 [F, H, W, 3]"),
    ("extend", {"prompt": "x"}, {"source_mp4": np.ones(9, np.uint8)}, "'seconds'"),
    ("extend", {"prompt": "x", "prompts": ["y"], "seconds": 5}, {"source_mp4": np.ones(9, np.uint8)}, "not both"),
    ("extend", {"prompt": "x", "seconds": 5, "overlap_latents": 5}, {"source_mp4": np.ones(9, np.uint8)}, "5k + 2"),
    ("extend", {"prompts": "x", "seconds": 5}, {"source_mp4": np.ones(9, np.uint8)}, "list of 1 to"),
    ("extend", {"prompt": "x", "seconds": 5, "source_fps": 30}, {"source_mp4": np.ones(9, np.uint8)},
     "source_fps goes with source_frames"),
    ("extend", {"prompt": "x", "seconds": 5}, {"source_frames": np.zeros((4, 32, 32, 3), np.uint8),
                                               "source_audio": np.zeros((2, 9), np.float32)}, "source_sample_rate"),
    ("refine", {"source_job": "a" * 32}, {}, "prompt is required"),
    ("refine", {"source_job": "a" * 32, "prompt": "x", "scale": 3}, {}, "1.5, 2.0"),
    ("refine", {"source_job": "not-a-job", "prompt": "x"}, {}, "32 hex characters"),
    ("upscale", {"source_job": "a" * 32}, {}, "exactly one of: resolution"),
    ("upscale", {"source_job": "a" * 32, "resolution": "8K"}, {}, "1080p"),
    ("upscale", {"source_job": "a" * 32, "scale": 2, "width": 64}, {}, "exactly one of"),
    ("upscale", {"source_job": "a" * 32, "scale": 2, "model": "13b"}, {}, "3b, 7b"),
    ("upscale", {"source_job": "a" * 32, "scale": 2, "color_fix": "pink"}, {}, "wavelet, lab, none"),
    ("upscale", {"source_job": "a" * 32, "scale": 2, "prompt": "x"}, {}, "unknown parameter"),
    ("ref2va", {"prompt": "x"}, {}, "'references' is required"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "image"}]}, {}, "send its tensor ref0_image"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "sticker"}]}, {}, "image, video, audio"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "image"}] * 10},
     {f"ref{i}_image": np.zeros((32, 32, 3), np.uint8) for i in range(10)}, "10 reference images given"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "video"}] * 4},
     {f"ref{i}_frames": np.zeros((20, 32, 32, 3), np.uint8) for i in range(4)}, "4 reference videos given"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "audio", "sample_rate": 32000}]},
     {"ref0_audio": np.zeros((2, 99), np.float32)}, "cannot take sound alone"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "image"}]},
     {"ref0_image": np.zeros((32, 32, 3), np.uint8), "ref0_audio": np.zeros((2, 9), np.float32)},
     "belong to no reference"),
    ("ref2va", {"prompt": "x", "references": [{"kind": "image"}], "ref_size": "huge"},
     {"ref0_image": np.zeros((32, 32, 3), np.uint8)}, "diffusers, match, max"),
])
def test_bad_requests_get_readable_errors(engine, task, params, tensors, words):
    """The client checks like the engine does; the raw submit proves the engine refuses it by itself too."""
    with pytest.raises(EngineError) as err:
        run(engine.client().run(task, params, tensors))
    assert err.value.code == "invalid_request" and words in err.value.message

    async def raw():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(engine.url + "/v1/ws", max_msg_size=0) as ws:
                await ws.send_json({"type": "hello", "version": protocol.PROTOCOL_VERSION, "token": engine.token})
                assert (await ws.receive_json())["type"] == "welcome"
                await ws.send_json({"type": "submit", "id": "s", "task": task, "params": params,
                                    "tensors": list(tensors)})
                for name, array in tensors.items():
                    await ws.send_bytes(protocol.encode_tensor(name, array))
                return await ws.receive_json(timeout=30)

    reply = run(raw())
    assert reply["type"] == "error" and reply["code"] == "invalid_request" and words in reply["message"]


@pytest.mark.parametrize("params, tensors, words", [
    ({"prompt": "x"}, {"mask": np.ones((3, SIDE, SIDE), np.uint8)}, "mask has 3 frames but the video has 124"),
    ({"prompt": "x"}, {"mask": np.full((SIDE, SIDE), np.nan, np.float32)}, "NaN"),
])
def test_masks_that_do_not_fit_the_source(engine, clip, params, tensors, words):
    with pytest.raises(EngineError) as err:
        run(engine.client().run("edit", {"source_job": clip.job, "steps": STEPS, **params}, tensors))
    assert err.value.code == "invalid_request" and words in err.value.message


def test_a_mask_of_another_size_is_resized_to_the_source(engine, clip):
    half = box_mask()[::2, ::2]  # drawn at half size
    result = run(engine.client().run("edit", {"source_job": clip.job, "prompt": "a kite", "steps": STEPS, "seed": 1},
                                     {"mask": half}))
    same = run(engine.client().run("edit", {"source_job": clip.job, "prompt": "a kite", "steps": STEPS, "seed": 1},
                                   {"mask": half.repeat(2, 0).repeat(2, 1)}))
    assert "mask 64x64 resized to the video's 128x128" in result.meta["notes"]
    assert np.array_equal(result.frames, same.frames)


def test_a_file_that_is_not_a_video(engine):
    with pytest.raises(EngineError) as err:
        run(engine.client().run("upscale", {"scale": 2}, {"source_mp4": np.frombuffer(b"not a video" * 9, np.uint8)}))
    assert err.value.code == "invalid_request" and "could not be decoded" in err.value.message


def test_ref2va_over_the_wire_swaps_partitions_and_says_so(engine):
    rng = np.random.default_rng(0)
    params = {"prompt": "a red ball rolls, humming", "steps": STEPS, "seed": 2, "aspect": "1:1", "ref_size": "match",
              "references": [{"kind": "image"}, {"kind": "video", "fps": 12.0, "sample_rate": 16000},
                             {"kind": "audio", "sample_rate": SAMPLE_RATE}]}
    tensors = {"ref0_image": rng.integers(0, 256, (90, 70, 3), dtype=np.uint8),
               "ref1_frames": rng.integers(0, 256, (12, 48, 64, 3), dtype=np.uint8),
               "ref1_audio": (rng.standard_normal((1, 16000)) * 0.1).astype(np.float32),
               "ref2_audio": (rng.standard_normal((2, SAMPLE_RATE)) * 0.1).astype(np.float32)}
    events = []
    result = run(engine.client().run("ref2va", params, tensors, on_progress=events.append))
    assert result.frames.shape == (FRAMES, SIDE, SIDE, 3) and result.audio.shape == (2, samples(FRAMES))
    assert any(e.stage == "loading" and e.detail == "Ref2VA DiT" for e in events)
    assert any(e.stage == "encoding" and e.detail == "references" and e.total == 3 for e in events)
    again = run(engine.client().run("ref2va", params, tensors))
    assert np.array_equal(result.frames, again.frames)
    status = run(engine.client().status())
    partitions = status["models"]["partitions"]
    assert partitions["active"] == "ref2va" and partitions["last_swap"]["to"] == "ref2va"
