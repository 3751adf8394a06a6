"""Every long phase of a job reports progress and is a cancel point: the boundaries each phase emits (counted
against the chunks that really ran), two gloo ranks stopping together inside the SeedVR2 VAE, and a real engine
cancelled or shut down (SIGTERM) during a VAE phase and during a SeedVR2 batch."""

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.io.video import encode_mp4_bytes
from engine.models.h3.pipeline import Canvas, H3Pipeline
from engine.models.h3.request import Cancelled, EditRequest, Source, StepEvent
from engine.models.phases import PhaseEvent
from engine.models.seedvr2.pipeline import SeedVR2Pipeline
from engine.runtime.jobs import JobRunner, JobSpec, ModelSource, decode_source, follower_loop
from engine.runtime.ranks import IDLE_WAIT, RankContext
from engine_fixture import start_engine
from nodes.client import EngineError

CANCEL_WITHIN_S = 5.0
EXIT_WITHIN_S = 10.0


def frames(count, height, width, seed=0):
    return torch.randint(0, 256, (count, height, width, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def calls(module) -> Counter:
    """Counts the module's forward calls (under the key "n") while the hook is registered."""
    seen = Counter()
    module.register_forward_hook(lambda *_: seen.update(["n"]))
    return seen


def items(module) -> Counter:
    """Counts the batch items of the module's forward calls (under the key "n") while the hook is registered."""
    seen = Counter()
    module.register_forward_hook(lambda _, args, __: seen.update(n=args[0].shape[0]))
    return seen


def phases(events):
    """[(stage, detail, [done, ...]), ...]: consecutive PhaseEvents of one phase grouped (a phase restarts at 0)."""
    out = []
    for e in events:
        if isinstance(e, PhaseEvent):
            if e.done == 0 or not out or out[-1][0] != e.stage:
                out.append((e.stage, e.detail, e.total, []))
            out[-1][3].append(e.done)
    return out


# ---- the boundaries of one job, counted ----------------------------------------------------------------------------


def test_an_edit_reports_every_chunk_of_every_phase():
    pipe = H3Pipeline.from_preset("tiny")
    pipe.canvas = Canvas(short_edge=32, max_pixels=32 * 32, default_steps=3)  # small, so it runs in seconds
    pipe.encode_mp4 = False
    # The fast VAE path batches every tile of every clip; on this one-tile canvas a batch item is a clip.
    encoder_clips, decoder_clips = items(pipe.video_vae.fast_encoder()), items(pipe.video_vae.fast_decoder())
    source = Source(frames(124, 48, 48), audio=np.zeros((2, 5 * 32000), np.float32))
    events = []
    result = pipe.edit(EditRequest(source, np.ones((48, 48), np.float32), prompt="a ball"), on_step=events.append)
    assert result.frames.shape == (124, 32, 32, 3)

    got = phases(events)
    assert [(stage, detail) for stage, detail, _, _ in got] == [
        ("reading source", "resizing to 32x32"), ("encoding", "video"), ("encoding", "sound"), ("denoising", None),
        ("decoding", "sound")]
    for stage, _, total, done in got:  # each phase starts at 0 and counts every chunk up to its total
        assert done == list(range(total + 1 if stage != "denoising" else 1)), stage
    assert got[0][2] == 4  # 124 frames resized 32 at a time
    assert got[1][2] == encoder_clips["n"] == 8  # one boundary per 17-frame VAE clip that ran
    # The sound, then every video chunk: 7 VAE clips decode 8 chunks (the last clip's tail is the last 5 frames).
    assert got[4][2] == 1 + decoder_clips["n"] + 1 == 9
    assert {e.detail for e in events if isinstance(e, PhaseEvent) and e.stage == "decoding" and e.done} == {"video"}
    assert [e.step for e in events if isinstance(e, StepEvent)] == [1, 2]


def test_an_upscale_reports_every_vae_chunk_and_tile():
    pipe = SeedVR2Pipeline.from_preset("tiny")
    pipe.vae.tile_size, pipe.vae.tile_overlap = 24, 8  # tiles too, at a small size
    encodes, decodes = calls(pipe.vae.encoder), calls(pipe.vae.decoder)
    events, notes = [], []
    out = pipe.upscale(frames(21, 16, 16), scale=2, batch_frames=13, overlap_frames=5, on_step=events.append,
                       notes=notes)
    assert out.shape == (21, 32, 32, 3) and notes == []
    (stage, _, total, done), = phases(events)
    assert stage == "upscaling" and done == list(range(total + 1))
    parts = Counter(e.detail for e in events if e.done)
    assert parts["VAE encode"] * 4 == encodes["n"] == 3 * 4  # the clip's chunks (9, 8, 4 frames) x 4 tiles of 32x32
    assert parts["VAE decode"] * 4 == decodes["n"] == 3 * 4  # its 6 latents' chunks (3, 2, 1) x 4 tiles
    assert parts["batch 1/2: DiT"] == parts["batch 2/2: DiT"] == 1  # latents 0-3 and 2-5
    assert [e.preview.shape for e in events if e.preview is not None] == [(32, 32, 3)] * 3  # one per decode chunk


def test_the_tiny_preset_maps_named_resolutions_to_small_sizes_and_bounds_the_area():
    pipe = SeedVR2Pipeline.from_preset("tiny")
    notes = []
    assert pipe.output_size(128, 224, None, None, None, "1080p", notes) == (144, 252)
    assert notes == ["tiny preset: 1080p means a 144-px short edge (252x144) so it runs quickly on a CPU; real "
                     "SeedVR2 weights upscale to 1080 px"]
    notes.clear()
    assert pipe.output_size(128, 224, None, None, None, "4K", notes) == (224, 392)
    notes.clear()
    assert pipe.output_size(128, 224, 1080, 1920, None, None, notes) == (252, 450)
    assert notes == ["tiny preset: 1920x1080 is over its 114688-pixel bound (the embedded weights are for CPU "
                     "demos), so the output is 450x252; real SeedVR2 weights keep the asked size"]
    assert pipe.output_size(128, 224, None, None, 8.0, None, []) == (256, 448)  # a scale too
    notes.clear()
    out = pipe.upscale(frames(1, 16, 28), resolution="1080p", color_fix="none", notes=notes)
    assert out.shape == (1, 144, 252, 3) and "1080p means a 144-px short edge" in notes[0]


def test_reading_a_video_file_reports_every_16_frames():
    data = encode_mp4_bytes(frames(40, 32, 32).numpy(), 24)
    events = []
    source = decode_source(np.frombuffer(data, np.uint8), events.append)
    assert source.frames.shape == (40, 32, 32, 3)
    assert [(e.stage, e.done, e.total) for e in events] == [("reading source", 0, 0), ("reading source", 16, 40),
                                                            ("reading source", 32, 40)]


# ---- two gloo ranks stop together inside the parallel SeedVR2 VAE ---------------------------------------------------


UPSCALE = {"width": 48, "height": 48, "color_fix": "none"}


def _cancel_rank(rank, store, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = RankContext(rank, 2, torch.device("cpu"), dist.group.WORLD, dist.new_group(backend="gloo",
                                                                                     timeout=IDLE_WAIT))
    runner = JobRunner(ctx, None, ModelSource(preset="tiny"))
    clip = {"source_frames": frames(25, 32, 32).numpy()}  # 2 rounds of 2 chunks in the VAE encode and decode
    outcomes = []
    if rank == 0:
        for part in ("VAE encode", "VAE decode", None):  # cancel after the first round of that part; None: none
            cancel = threading.Event()

            def on_step(event, part=part, cancel=cancel):  # the cancel counts from the next boundary
                if part and (event.detail or "").endswith(part) and event.done >= 1:
                    cancel.set()

            try:
                out = runner.run(JobSpec(f"job-{part}", "upscale", UPSCALE, clip), cancel, on_step)
                outcomes.append(f"done {tuple(out.frames.shape)}")
            except Cancelled as exc:
                outcomes.append(str(exc))
        runner.shutdown()
    else:
        def run(spec):  # the follower's own view of each job
            try:
                out = JobRunner.run(runner, spec)
                outcomes.append(f"done {tuple(out.frames.shape)}")
                return out
            except Cancelled as exc:
                outcomes.append(str(exc))
                raise

        runner.run = run
        follower_loop(runner)
        del runner.run  # runner -> run -> runner: a cycle that kept the process groups alive into interpreter exit
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def test_two_ranks_stop_at_the_same_vae_boundary_and_run_the_next_job(tmp_path):
    mp.spawn(_cancel_rank, args=(str(tmp_path / "store"), tmp_path), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # the same boundary on both ranks, then the same clean job
    assert rank0[0].startswith("Cancelled while upscaling (VAE encode), at 2 of ")
    assert rank0[1].startswith("Cancelled while upscaling (VAE decode), at ")
    assert rank0[2] == "done (25, 48, 48, 3)"


# ---- a real engine: cancel and SIGTERM during a VAE phase and during a SeedVR2 batch ---------------------------------

SIDE = 128  # the tiny preset's 1:1 canvas: an edit source on it is not resized
EDIT = ("edit", {"preset": "remove", "steps": 2},
        {"source_frames": frames(124, SIDE, SIDE).numpy(), "mask": np.full((SIDE, SIDE), 255, np.uint8)})
UPSCALE_JOB = ("upscale", {"width": 192, "height": 192, "color_fix": "none"},
               {"source_frames": frames(65, 96, 96).numpy()})


def in_phase(stage, event):
    return event.stage == stage and event.step >= 1 and event.total > event.step


async def stop_during(client, job, stage, stop, cancel=None):
    """Runs `job`, calls `stop()` at its first boundary of `stage` past the first chunk; returns (the error, when
    `stop` was called (time.monotonic), the seconds from then to the error, the progress events)."""
    task, params, tensors = job
    events, stopped_at = [], []

    def on_progress(event):
        events.append(event)
        if not stopped_at and in_phase(stage, event):
            stopped_at.append(time.monotonic())
            stop()

    with pytest.raises(EngineError) as err:
        await client.run(task, params, tensors, on_progress=on_progress, cancel=cancel, timeout=120)
    assert stopped_at, f"the job never reached {stage}: {[(e.stage, e.step, e.total) for e in events]}"
    return err.value, stopped_at[0], time.monotonic() - stopped_at[0], events


@pytest.mark.parametrize("job, stage", [(EDIT, "encoding"), (UPSCALE_JOB, "upscaling")])
def test_a_cancel_during_a_phase_ends_the_job_and_the_engine_serves_the_next(engine, job, stage):
    async def scenario():
        client, cancel = engine.client(), asyncio.Event()
        error, _, latency, events = await stop_during(client, job, stage, cancel.set, cancel)
        assert error.code == "cancelled" and f"while {stage}" in error.message
        assert latency < CANCEL_WITHIN_S, f"the cancel took {latency:.1f} s"
        shown = [e for e in events if e.stage == stage]
        assert shown[0].step == 0 and len({e.total for e in shown}) == 1 and shown[0].total > 1
        assert events[0].stage == "starting" and events[1].stage in (stage, "loading")  # the first phase at once
        status = await client.status()
        assert status["recent"][0]["state"] == "cancelled" and status["running"] is None
        return await client.run("upscale", {"width": 32, "height": 32}, {"source_frames": frames(5, 16, 16).numpy()})

    assert asyncio.run(scenario()).frames.shape == (5, 32, 32, 3)


@pytest.mark.parametrize("job, stage", [(EDIT, "encoding"), (UPSCALE_JOB, "upscaling")])
def test_sigterm_during_a_phase_ends_the_job_and_the_engine_exits(tmp_path, job, stage):
    with start_engine(tmp_path) as engine:
        error, killed_at, _, _ = asyncio.run(stop_during(engine.client(), job, stage,
                                                         lambda: os.kill(engine.process.pid, signal.SIGTERM)))
        engine.process.wait(timeout=EXIT_WITHIN_S + 5)
        exited = time.monotonic() - killed_at
        assert "shut down" in error.message, error.message
        assert exited < EXIT_WITHIN_S, f"the engine took {exited:.1f} s to exit after SIGTERM"
        assert engine.process.returncode == 0, engine.log()[-2000:]
