"""`serve --gpus N`: start N engine ranks per node through PyTorch's own launcher (torch.distributed.run).

Every rank re-runs the same `python -m engine serve ...` command line with `--rank-worker` added; torchrun sets
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR for `engine.runtime.ranks.init_ranks`. One node uses torchrun's
standalone rendezvous; more nodes pass `--nnodes M --rdzv-endpoint host:port` (torchrun's c10d rendezvous) and
run the same command on every node; rank 0 (on whichever node it lands) serves.
"""

from __future__ import annotations

import os
import signal
import sys

RANK_WORKER_FLAG = "--rank-worker"


def torchrun_argv(serve_argv: list[str], gpus: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    if rdzv_endpoint:
        rendezvous = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    elif nnodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:
        raise SystemExit("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node).")
    return [*rendezvous, "--nproc-per-node", str(gpus), "--max-restarts", "0",
            "-m", "engine", *serve_argv, RANK_WORKER_FLAG]


def launch_ranks(serve_argv: list[str], gpus: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> int:
    """Runs torchrun in this process until every rank has exited; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # A closed terminal (SIGHUP) must not end a serving engine: torchrun would stop the ranks on it, so it handles
    # only the stopping signals, and this process logs a hangup and goes on (the ranks do the same).
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGQUIT")
    signal.signal(signal.SIGHUP, lambda *_: print("H3Forge engine: SIGHUP ignored (stop the engine with SIGTERM or "
                                                  "Ctrl-C)", file=sys.stderr, flush=True))
    try:
        torchrun(torchrun_argv(serve_argv, gpus, nnodes, rdzv_endpoint))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"H3Forge engine stopped: rank {rank} exited with status {failure.exitcode} (its log is above).",
              file=sys.stderr)
        return 1
    except SignalException:  # SIGTERM/SIGINT: torchrun has already stopped the ranks
        return 0
    return 0
