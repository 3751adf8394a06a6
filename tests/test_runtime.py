"""Multi-rank runtime: ranks launched through torchrun agree on every job, every cancel and every failure."""

import asyncio
import json
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.models.h3.request import Cancelled, StepEvent
from engine.runtime.agreement import PeerFailed
from engine.runtime.jobs import JobRunner, JobSpec, follower_loop
from engine.runtime.launch import torchrun_argv
from engine.runtime.ranks import IDLE_WAIT, RankContext
from engine_fixture import start_engine
from nodes.client import EngineError

JOB = {"prompt": "two ranks, one answer", "steps": 3, "seed": 7, "width": 64, "height": 64}
# A ref2va job: both ranks swap to the Ref2VA partition, and back for the t2va jobs after it.
REF2VA = ({**JOB, "references": [{"kind": "image"}, {"kind": "audio", "sample_rate": 16000}]},
          {"ref0_image": np.full((48, 40, 3), 200, np.uint8), "ref1_audio": np.full((1, 8000), 0.1, np.float32)})
# torchrun gives each of N > 1 ranks one thread; CPU float results depend on the thread count, so the
# one-rank engine gets one thread too.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_two_gloo_ranks_give_the_one_rank_result_and_agree_on_cancel(tmp_path):
    with start_engine(tmp_path / "one", env=ONE_THREAD) as engine:
        one = asyncio.run(engine.client().run("t2va", JOB))
        one_ref = asyncio.run(engine.client().run("ref2va", *REF2VA))
    with start_engine(tmp_path / "two", "--gpus", "2") as engine:
        client = engine.client()
        status = asyncio.run(client.status())
        assert status["engine"]["ranks"] == 2 and status["engine"]["backend"] == "gloo"
        two = asyncio.run(client.run("t2va", JOB))
        two_ref = asyncio.run(client.run("ref2va", *REF2VA))
        # Two ranks split the sequence (Ulysses): the same result up to float rounding of the reduction order.
        for a, b in ((two, one), (two_ref, one_ref)):
            frames_a, frames_b = (torch.from_numpy(r.frames.copy()).float() for r in (a, b))
            assert (frames_a - frames_b).abs().max() <= 2 and (frames_a - frames_b).abs().mean() < 0.05
            assert torch.allclose(torch.from_numpy(a.audio.copy()), torch.from_numpy(b.audio.copy()), atol=1e-3)
        assert not np.array_equal(one.frames, one_ref.frames)
        assert status["models"]["parallel"] == "ulysses x2"

        async def cancel_then_next():
            cancel = asyncio.Event()
            with pytest.raises(EngineError) as err:
                await client.run("t2va", {**JOB, "steps": 1000}, cancel=cancel,
                                 on_progress=lambda e: e.stage == "denoising" and cancel.set())
            assert err.value.code == "cancelled"
            # Had a rank missed the cancel, it would still be denoising and this job would hang.
            return await asyncio.wait_for(client.run("t2va", {**JOB, "seed": 8}), 120)

        assert asyncio.run(cancel_then_next()).frames.shape == one.frames.shape
        assert "rank=1" in engine.log()


class ScriptedPipeline:
    """Stands in for H3Pipeline in the agreement test: 5 steps; the request's seed says which rank fails at
    which step (rank * 10 + step; 0: none). Records what each step boundary raised."""

    def __init__(self, rank):
        self.rank, self.outcomes = rank, []

    def generate(self, request, on_step):
        fail_rank, fail_step = divmod(request.seed, 10)
        try:
            for step in range(1, 6):
                if request.seed and self.rank == fail_rank and step == fail_step:
                    raise RuntimeError(f"rank {self.rank} broke at step {step}")
                on_step(StepEvent(step, 5, torch.zeros(1, 24, 1, 1, 1)))
        except Exception as exc:
            self.outcomes.append(f"{type(exc).__name__}@{step}")
            raise
        self.outcomes.append("done")
        return "done"


def _agreement_rank(rank, store_path, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    ctx = RankContext(rank, 2, torch.device("cpu"), dist.group.WORLD, dist.new_group(backend="gloo",
                                                                                     timeout=IDLE_WAIT))
    pipeline = ScriptedPipeline(rank)
    runner = JobRunner(ctx, pipeline)
    if rank == 0:
        for seed, cancel_now in ((13, False), (2, False), (0, True), (0, False)):
            cancel = threading.Event()
            if cancel_now:
                cancel.set()
            try:
                runner.run(JobSpec(f"job{seed}", "t2va", {"prompt": "x", "seed": seed}), cancel)
            except (Cancelled, PeerFailed, RuntimeError):
                pass
        runner.shutdown()
    else:
        follower_loop(runner)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(pipeline.outcomes))
    dist.destroy_process_group()


def test_ranks_agree_when_one_fails_or_a_cancel_arrives(tmp_path):
    mp.spawn(_agreement_rank, args=(str(tmp_path / "store"), tmp_path), nprocs=2)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # job 13: rank 1 fails at step 3 -> rank 0 stops at its step-3 boundary; job 2: rank 0 fails at step 2;
    # cancel: both stop at step 1; then a clean job runs to the end on both.
    assert rank0 == ["PeerFailed@3", "RuntimeError@2", "Cancelled@1", "done"]
    assert rank1 == ["RuntimeError@3", "PeerFailed@2", "Cancelled@1", "done"]


def test_torchrun_command_line():
    assert torchrun_argv(["serve", "--preset", "tiny", "--gpus", "2"], 2) == [
        "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
        "-m", "engine", "serve", "--preset", "tiny", "--gpus", "2", "--rank-worker"]
    multi = torchrun_argv(["serve"], 8, nnodes=2, rdzv_endpoint="head:29400")
    assert multi[:6] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400"]
    with pytest.raises(SystemExit):
        torchrun_argv(["serve"], 8, nnodes=2)
