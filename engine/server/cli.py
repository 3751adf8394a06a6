"""`python -m engine serve`: the engine service. `add_serve_args` registers the subcommand, `run_serve` runs it.

    python -m engine serve [--preset toy | --models DIR] [--host 127.0.0.1] [--port 8190] [--gpus N] [--tp T]
                           [--device auto|cuda|cpu] [--token-file F] ...
    python -m engine serve --models ComfyUI/models --dit minimax_h3_fl2va_pruned_int8_convrot.safetensors \
        --text-encoder qwen3vl_32b_minimax_h3_int8_convrot.safetensors \
        --video-vae minimax_h3_video_vae_fp16.safetensors --audio-vae minimax_h3_audio_vae_fp32.safetensors \
        --tokenizer-dir ComfyUI/comfy/text_encoders/qwen25_tokenizer

With --gpus N (> 1) this process becomes torchrun's agent and starts N ranks running this same command line;
rank 0 serves, the others follow (engine.runtime). With --tp T the DiT's weights are split over groups of T
GPUs and the N/T groups split the sequence (engine/parallel/mesh.py); without it the memory planner picks T. The token file (default $H3FORGE_TOKEN_FILE or
~/.h3forge/token) is created with a random token and mode 0600 on first start; clients on the same host read it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

from engine import protocol
from engine.runtime.launch import RANK_WORKER_FLAG, launch_ranks


def add_serve_args(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the engine service (WebSocket API, job queue, dashboard)",
        description="Run the H3Forge engine: the WebSocket API the ComfyUI nodes talk to, a job queue, and a "
                    "dashboard at http://HOST:PORT/?token=...")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=("toy", "tiny"),
                     help="embedded weights, no files needed: toy (trained on the toy world; the default when no "
                          "models directory is given) or tiny (random, for tests)")
    src.add_argument("--models", metavar="DIR", default=os.environ.get("H3FORGE_MODELS"),
                     help="models directory with real checkpoints (default: $H3FORGE_MODELS)")
    files = p.add_argument_group(
        "Comfy-Org single files", "names inside the models folder's diffusion_models/, text_encoders/, vae/ (or a "
        "--model-path of that folder), or absolute paths inside one of them")
    for flag, folder, what in FILE_ARGS:
        files.add_argument(flag, metavar="FILE", help=f"{what} ({folder}/)")
    files.add_argument("--ref-dit", metavar="FILE",
                       help="the Ref2VA DiT (diffusion_models/), loaded on the first ref2va job; default: the "
                            "minimax_h3_ref2va_* file beside a --dit named *fl2va*, if there is one")
    files.add_argument("--tokenizer-dir", metavar="DIR", help="tokenizer the released text-encoder files lack: the "
                       "tokenizer/ of the MiniMax-H3 release, or ComfyUI's comfy/text_encoders/qwen25_tokenizer")
    files.add_argument("--model-path", metavar="FOLDER=DIR", action="append", default=[], type=_model_path,
                       help="one more directory for a model folder (diffusion_models, text_encoders, vae, loras), "
                            "as ComfyUI's extra_model_paths.yaml adds; repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=protocol.DEFAULT_PORT)
    p.add_argument("--gpus", type=int, default=1, help="ranks per node, one GPU each (CPU ranks with --device cpu)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the engine (run the same command on each)")
    p.add_argument("--tp", type=int, metavar="T",
                   help="tensor parallelism: T consecutive GPUs share one copy of the DiT's weights (1, 2, 4 or 8 for "
                        "MiniMax-H3; T must divide the GPUs), the GPUs/T groups split the sequence (Ulysses); "
                        "default: the memory planner's choice (the smallest T whose plan fits best; 1 without a GPU)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun rendezvous endpoint, for --nnodes > 1")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when a GPU is visible (NCCL between ranks), else CPU (gloo)")
    p.add_argument("--token-file", type=Path, help="file holding the access token, created on first start "
                                                   "(default: $H3FORGE_TOKEN_FILE or ~/.h3forge/token)")
    p.add_argument("--max-queue", type=int, default=32, help="jobs waiting at most (default 32)")
    p.add_argument("--max-tensor-mb", type=float, default=256, help="largest input tensor a client may send")
    p.add_argument("--max-messages-per-s", type=_positive, default=protocol.Limits.max_messages_per_s,
                   help="messages (control and tensor frames) a connection may send a second on average, in bursts "
                        f"of up to {protocol.Limits.message_burst}; past it the connection is closed "
                        f"(default {protocol.Limits.max_messages_per_s:g})")
    p.add_argument("--result-ttl-min", type=float, default=60, help="how long finished results are kept")
    p.add_argument("--result-cache-gb", type=float, default=4, help="memory for kept results; oldest go first")
    p.add_argument("--max-results", type=int, default=1000, help="results (and failed jobs) kept at most")
    p.add_argument("--failed-ttl-min", type=float, default=5,
                   help="how long failed and cancelled jobs are kept (for a client that reattaches)")
    p.add_argument("--client-timeout-s", type=float, default=10,
                   help="time a client has for its HTTP request headers and for its WebSocket hello")
    p.add_argument("--max-connections", type=int, default=512,
                   help="TCP connections at once (fewer when the file-descriptor limit, ulimit -n, is low)")
    p.add_argument("--memory-cap-gb", type=float, default=_env_float("H3FORGE_MEMORY_CAP_GB"),
                   help="refuse (as out of memory) a generation whose estimated working memory is over this, before "
                        "it runs (default: $H3FORGE_MEMORY_CAP_GB, else no cap)")
    p.add_argument("--attention", choices=("auto", "fa3", "cudnn", "flex", "sdpa"), default="auto",
                   help="attention kernel (auto: FA3 on Hopper when installed, else cuDNN on CUDA, SDPA on CPU)")
    p.add_argument("--dit-precision", choices=("auto", "bf16", "fp8", "int8"), default="auto",
                   help="quantize the DiT's block GEMMs at load: fp8 (per-tensor scale) or int8 ConvRot W8A8, half "
                        "the DiT's memory; bf16: as stored; auto (default): as stored when it fits the GPU, else the "
                        "memory planner's choice (as stored on a CPU)")
    p.add_argument("--text-encoder-precision", choices=("bf16", "fp8", "int8"), default="bf16",
                   help="store the text encoder's decoder GEMMs in fp8 or int8 ConvRot, dequantized per layer as "
                        "they run (half its memory; default bf16: as stored)")
    p.add_argument("--vae-precision", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: the H3 video VAE's decoder GEMMs and encoder convolutions in float8 (one H200, 5 s "
                        "1344x768: decode 3.5 -> 2.3 s, encode 3.3 -> 2.2 s; frames ~46 dB from bf16's). "
                        "Default bf16")
    p.add_argument("--resident-blocks", type=int, default=0, metavar="K",
                   help="stream the DiT from (pinned) host memory: its blocks, refiner blocks and AdaLN projections "
                        "wait there, at most K of them on the GPU at a time, each copied in while the one before "
                        "runs (output unchanged; both partitions). 0 (default): the memory planner decides "
                        "on a GPU (all on the GPU when they fit), all resident on a CPU")
    p.add_argument("--gpu-memory", type=float, metavar="GB",
                   help="plan for this much memory per GPU (GiB) instead of the GPU's own, e.g. to leave room for "
                        "other programs; on a CPU engine it turns the memory planner on (for tests)")
    p.add_argument("--host-memory", type=float, metavar="GB",
                   help="host memory the plan may use for streamed weights (GiB, shared by the ranks on this "
                        "host; default: what the host has available)")
    p.add_argument("--vsa-sparsity", type=float, default=0.0, metavar="S",
                   help="H3 video sparse attention: fraction of video cubes skipped, e.g. 0.875 (0: dense)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--log-file", type=Path, help="write the log to this file, rotated at 10 MB with 3 older files "
                                                 "kept (other ranks: FILE.rankN); default: stderr")
    p.add_argument(RANK_WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run_serve)


FILE_ARGS = (("--dit", "diffusion_models", "the DiT: bf16, pruned, fp8_scaled or int8_convrot"),
             ("--text-encoder", "text_encoders", "the Qwen3-VL text encoder: bf16, int8_convrot or nvfp4_awq"),
             ("--video-vae", "vae", "the video VAE"), ("--audio-vae", "vae", "the audio VAE"))


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return number


def _model_path(value: str) -> tuple[str, str]:
    folder, sep, directory = value.partition("=")
    if not sep or not directory:
        raise argparse.ArgumentTypeError(f"--model-path wants FOLDER=DIR (e.g. loras=/data/loras), got {value!r}")
    return folder, directory


def model_source(args: argparse.Namespace, **options):
    """What the engine loads: a preset, a models folder (official / diffusers layout), or Comfy-Org single files
    resolved inside the model roots. SystemExit with what to change when the choice cannot work."""
    from engine.models.h3.model_files import ModelFileError
    from engine.runtime.jobs import ModelSource

    chosen = {flag: getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in FILE_ARGS}
    if not any(chosen.values()):
        if args.ref_dit:
            raise SystemExit("--ref-dit goes with the single files (--dit, --text-encoder, --video-vae, --audio-vae); "
                             "a models folder brings its own Ref2VA/ (or transformer_ref/).")
        if args.tokenizer_dir:
            raise SystemExit("--tokenizer-dir goes with the single files (--dit, --text-encoder, --video-vae, "
                             "--audio-vae).")
        source = ModelSource(preset=args.preset or (None if args.models else "toy"), models_dir=args.models,
                             model_paths=tuple(args.model_path), **options)
        source.roots()  # an unknown --model-path folder fails here
        return source
    if args.preset:
        raise SystemExit("--preset serves embedded weights; give it or single files (--dit ...), not both.")
    missing = [flag for flag, value in chosen.items() if not value]
    if missing:
        raise SystemExit(f"Single files need all four of --dit, --text-encoder, --video-vae and --audio-vae; "
                         f"missing {', '.join(missing)}.")
    source = ModelSource(models_dir=args.models, model_paths=tuple(args.model_path), **options)
    try:
        roots = source.roots()
        files = tuple((flag[2:].replace("-", "_"), str(roots.resolve(folder, chosen[flag])))
                      for flag, folder, _ in FILE_ARGS)
    except ModelFileError as e:
        raise SystemExit(f"H3Forge engine: {e}") from None
    if args.ref_dit:
        try:
            files += (("ref_dit", str(roots.resolve("diffusion_models", args.ref_dit))),)
        except ModelFileError as e:
            raise SystemExit(f"H3Forge engine: {e}") from None
    if args.tokenizer_dir:
        if not Path(args.tokenizer_dir).expanduser().is_dir():
            raise SystemExit(f"--tokenizer-dir {args.tokenizer_dir}: no such folder.")
        files += (("tokenizer_dir", str(Path(args.tokenizer_dir).expanduser().resolve())),)
    return ModelSource(models_dir=args.models, model_paths=tuple(args.model_path), files=files, **options)


def _env_float(name: str) -> float | None:
    value = os.environ.get(name, "").strip()
    return float(value) if value else None


def run_serve(args: argparse.Namespace) -> int:
    if args.gpus < 1 or args.nnodes < 1 or (args.tp is not None and args.tp < 1):
        raise SystemExit("--gpus, --nnodes and --tp must be at least 1.")
    if (args.gpus > 1 or args.nnodes > 1) and not args.rank_worker:
        return launch_ranks(serve_argv(), args.gpus, args.nnodes, args.rdzv_endpoint)

    from engine.runtime.jobs import JobRunner, follower_loop, load_pipeline
    from engine.runtime.log import log_event, setup_logging
    from engine.runtime.ranks import close_ranks, init_ranks

    ctx = init_ranks(args.device)
    setup_logging(ctx.rank, args.log_level, args.log_file)
    signal.signal(signal.SIGHUP, lambda *_: ignore_hangup())  # a closed terminal must not end a serving engine
    if not 0 <= args.vsa_sparsity < 1:
        raise SystemExit("--vsa-sparsity must be at least 0 and below 1 (e.g. 0.875).")
    if args.resident_blocks < 0:
        raise SystemExit("--resident-blocks must be 0 (every block resident) or more.")
    if any(v is not None and v <= 0 for v in (args.gpu_memory, args.host_memory)):
        raise SystemExit("--gpu-memory and --host-memory are sizes in GiB, above 0.")
    options = dict(attention=None if args.attention == "auto" else args.attention, vsa_sparsity=args.vsa_sparsity,
                   dit_precision=args.dit_precision, resident_blocks=args.resident_blocks,
                   text_encoder_precision=args.text_encoder_precision, vae_precision=args.vae_precision,
                   gpu_memory_gb=args.gpu_memory,
                   host_memory_gb=args.host_memory, tp=args.tp)
    source = model_source(args, **options)
    if source.preset and not args.preset:
        log_event("engine.default_preset", note="no --models or $H3FORGE_MODELS: serving the toy preset "
                                                "(the embedded default, trained on the toy world)")
    try:
        if ctx.rank == 0:
            return asyncio.run(serve(args, ctx, source))
        follower_loop(JobRunner(ctx, load_pipeline(source, ctx), source))
        return 0
    finally:
        close_ranks(ctx)


def serve_argv() -> list[str]:
    """This process's `serve ...` arguments, for the ranks to run the same command."""
    argv = sys.argv[1:]
    if "serve" not in argv:
        raise SystemExit("--gpus > 1 relaunches this command through torchrun: start it as `python -m engine serve`.")
    return argv


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(args: argparse.Namespace, ctx, source) -> int:
    from aiohttp import WSCloseCode, web

    from engine.runtime.jobs import JobRunner, load_pipeline
    from engine.runtime.log import log_event
    from engine.server.app import EngineService, make_app
    from engine.server.auth import load_or_create_token
    from engine.server.cost import preset_canvas, preset_limits
    from engine.server.guard import ACCEPT_BACKLOG, BODY_TIMEOUT_S, ConnectionGuard, connection_cap
    from engine.server.scheduler import Scheduler
    from engine.server.store import ResultStore

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(ThrottledExceptionLog())
    token_file = (args.token_file or protocol.default_token_file()).expanduser()
    store = ResultStore(ttl_s=args.result_ttl_min * 60, max_bytes=int(args.result_cache_gb * 2**30),
                        max_entries=args.max_results, failed_ttl_s=args.failed_ttl_min * 60)
    scheduler = Scheduler(lambda: JobRunner(ctx, load_pipeline(source, ctx), source), store, max_queue=args.max_queue,
                          memory_cap_bytes=None if args.memory_cap_gb is None else int(args.memory_cap_gb * 2**30))
    limits = preset_limits(protocol.Limits(max_tensor_bytes=int(args.max_tensor_mb * 2**20),
                                           max_messages_per_s=args.max_messages_per_s,
                                           hello_timeout_s=args.client_timeout_s), source.embedded())
    service = EngineService(ctx, source, load_or_create_token(token_file), limits, scheduler, store,
                            preset_canvas(source.embedded()), max_connections=connection_cap(args.max_connections))
    app = make_app(service)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=args.client_timeout_s,
                           lingering_time=BODY_TIMEOUT_S, shutdown_timeout=1.0)
    await runner.setup()
    app["guard"] = guard = ConnectionGuard(runner.server, service.max_connections)
    try:
        listener = await loop.create_server(guard, args.host, args.port, backlog=ACCEPT_BACKLOG)
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"H3Forge engine: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}). "
                         f"Is another engine running there? Pick another --port.") from None
    if not is_loopback(args.host):
        log_event("engine.exposed", logging.WARNING, host=args.host, warning=(
            f"listening on {args.host}, not only this machine: anyone who can reach port {args.port} and has the "
            f"token can run jobs. Keep the token file secret; use a firewall or a TLS proxy on untrusted networks."))
    shown = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    log_event("engine.listening", url=f"ws://{shown}:{args.port}/v1/ws", token_file=str(token_file),
              source=source.describe(), device=str(ctx.device), ranks=ctx.world_size,
              max_connections=service.max_connections)
    print(f"H3Forge engine dashboard: http://{shown}:{args.port}/?token={service.token}", file=sys.stderr, flush=True)

    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        log_event("engine.signal", signal=sig.name, action="shutting down" if not stop.is_set() else "already")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, ignore_hangup)
    work = asyncio.create_task(scheduler.run())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if work.done() and work.exception() is not None:
            raise SystemExit(f"H3Forge engine: could not load the models ({work.exception()}).")
        return 0
    finally:
        exit_deadline(SHUTDOWN_S)
        log_event("engine.stopping", deadline_s=SHUTDOWN_S)
        listener.close()  # no new connections
        closing = asyncio.create_task(scheduler.close())  # the running job stops at its next boundary
        await asyncio.wait({closing}, timeout=SHUTDOWN_S - 3)  # its clients get "the engine is shutting down"
        connections = list(service.connections)
        await asyncio.gather(*(c.flush(0.5) for c in connections))
        await asyncio.gather(*(c.close(WSCloseCode.GOING_AWAY, "shutting_down", "the engine is shutting down")
                               for c in connections))
        work.cancel()
        stopping.cancel()
        await runner.cleanup()
        log_event("engine.stopped", clients_closed=len(connections), job_ended=closing.done())
        if not closing.done():  # a job that would not stop at a boundary in time: nothing is left to wait for
            logging.shutdown()
            os._exit(0)


def ignore_hangup() -> None:
    from engine.runtime.log import log_event

    log_event("engine.signal", signal="SIGHUP", action="ignored (stop the engine with SIGTERM or Ctrl-C)")


SHUTDOWN_S = 9.0  # SIGTERM to exit, whatever the clients and the running job do


def exit_deadline(seconds: float) -> None:
    """Ends the process `seconds` from now if the shutdown has not finished by then."""
    import threading

    def expire():
        from engine.runtime.log import log_event

        log_event("engine.exit_forced", logging.ERROR, after_s=seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


class ThrottledExceptionLog:
    """The event loop's exception handler: errors it cannot hand to any task (e.g. `accept()` out of file
    descriptors) are logged once a second at most per kind, with how many there were meanwhile."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        import time

        from engine.runtime.log import log_event

        message = str(context.get("message", "unhandled error"))
        now = time.monotonic()
        if now - self.last.get(message, -self.interval_s) < self.interval_s:
            self.suppressed[message] = self.suppressed.get(message, 0) + 1
            return
        self.last[message] = now
        exc = context.get("exception")
        log_event("loop.error", logging.ERROR, message=message, error=f"{type(exc).__name__}: {exc}" if exc else None,
                  repeats=self.suppressed.pop(message, 0))
