"""H3Forge Engine node (where the engine is, how to start it) and the connection helpers the other nodes share."""

from __future__ import annotations

import asyncio
import os

from . import launcher, model_files
from .client import EngineClient, EngineError, protocol

ENGINE_TYPE = "H3FORGE_ENGINE"
DEVICES = ["auto", "cpu", "cuda"]
PRESETS = ["toy", "tiny"]
ATTENTION = list(protocol.ATTENTION_CHOICES)
# Share of video blocks each video query block skips (VSA); None: what the engine was started with.
SPARSE_ATTENTION = {"engine default": None, "off (dense)": 0.0, "75%": 0.75, "87.5%": 0.875, "90%": 0.9, "95%": 0.95}

NO_FILE, AUTO_FILE = "none", "auto"
# Engine node inputs that pick Comfy-Org single files: (input, ComfyUI folder, kind `auto` looks for).
FILE_INPUTS = (("diffusion_model", "diffusion_models", "dit"), ("text_encoder", "text_encoders", "text_encoder"),
               ("video_vae", "vae", "video_vae"), ("audio_vae", "vae", "audio_vae"))

# Error codes whose message is about what the artist asked for (fix the inputs), not about the engine.
_INPUT_ERROR_CODES = {"invalid_request", "too_large"}
# Error codes of a failure inside the engine, whose log tells more.
_ENGINE_FAULT_CODES = {"internal", "rank_lost"}
# Error codes of a lost or unanswered connection. A bundled engine that closes connections as it exits (e.g. after
# failing to load its models) is still tearing down when the client gives up: its exit code and log tail are worth
# waiting for, up to a little past its 9 s shutdown deadline.
_CONNECTION_CODES = {"unreachable", "disconnected"}
EXIT_REPORT_WAIT_S = 10.0

_last_settings: dict | None = None


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def default_settings() -> dict:
    """Engine settings when no H3Forge Engine node is connected: H3FORGE_URL, _TOKEN, _AUTO_LAUNCH, _MODELS."""
    return {
        "url": os.environ.get("H3FORGE_URL") or protocol.DEFAULT_URL,
        "token": os.environ.get("H3FORGE_TOKEN", ""),
        "auto_launch": _env_flag("H3FORGE_AUTO_LAUNCH", True),
        "preset": "toy",
        "models_dir": os.environ.get("H3FORGE_MODELS", ""),
        "device": "auto",
        "gpus": 1,
        "attention": "auto",
        "sparse_attention": "engine default",
    }


def speed_params(settings: dict | None) -> dict:
    """The H3 job params for the engine node's speed options; none where they leave the engine's own."""
    settings = settings or default_settings()
    params = {}
    if settings.get("attention", "auto") != "auto":
        params["attention"] = settings["attention"]
    sparsity = SPARSE_ATTENTION.get(settings.get("sparse_attention", "engine default"))
    if sparsity is not None:
        params["vsa_sparsity"] = sparsity
    return params


def client_for(settings: dict, connect_timeout: float = 5.0) -> EngineClient:
    """A client with the node's token, else $H3FORGE_TOKEN, else the engine's token file on this machine
    ($H3FORGE_TOKEN_FILE or ~/.h3forge/token; auto-launched engines write theirs there too)."""
    token = settings.get("token") or os.environ.get("H3FORGE_TOKEN") or None
    return EngineClient(settings["url"], token=token, connect_timeout=connect_timeout)


async def connect(settings: dict | None) -> EngineClient:
    """A client for the configured engine, starting the bundled one first when needed and allowed."""
    global _last_settings
    settings = settings or default_settings()
    _last_settings = settings
    await launcher.ensure_engine(settings)
    return client_for(settings)


def last_settings() -> dict:
    """The engine the nodes talked to most recently (for the status route), else the defaults."""
    return _last_settings or default_settings()


async def readable_error(error: EngineError, url: str) -> Exception:
    """The exception ComfyUI shows for an engine error: the engine's message, written for an artist, and
    the log tail when the bundled engine died under the job (or where its log is, for an engine fault)."""
    kind = ValueError if error.code in _INPUT_ERROR_CODES else RuntimeError
    wait = EXIT_REPORT_WAIT_S if error.code in _CONNECTION_CODES else 0.0
    report = await asyncio.to_thread(launcher.exit_report, url, wait)
    if report is None and error.code in _ENGINE_FAULT_CODES:
        log = launcher.log_file(launcher.host_port(url)[1])
        report = f"The engine's log ({log}) says more." if log.is_file() else None
    return kind(f"H3Forge: {error.message}" + (f"\n{report}" if report else ""))


class H3ForgeEngine:
    DESCRIPTION = ("Where the H3Forge engine runs and how to start it. Connect to the generation nodes; "
                   "without it they use ws://127.0.0.1:8190 (or the H3FORGE_URL / H3FORGE_TOKEN / "
                   "H3FORGE_AUTO_LAUNCH / H3FORGE_MODELS environment variables) and start the bundled engine.")
    CATEGORY = "H3Forge"
    FUNCTION = "configure"
    RETURN_TYPES = (ENGINE_TYPE,)
    RETURN_NAMES = ("engine",)
    OUTPUT_TOOLTIPS = ("Engine settings for the H3Forge generation nodes.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "url": ("STRING", {"default": protocol.DEFAULT_URL, "tooltip":
                        "WebSocket address of the engine, ws://host:port. A remote GPU host works too "
                        "(start it there with `python -m engine serve --host 0.0.0.0 ...`)."}),
                "token": ("STRING", {"default": "", "tooltip":
                          "Access token of the engine. Leave empty to use the token file the engine wrote "
                          "on this machine (~/.h3forge/token, or $H3FORGE_TOKEN_FILE)."}),
                "auto_launch": ("BOOLEAN", {"default": True, "tooltip":
                                "If no engine answers at a local URL, start the bundled engine and keep "
                                "it running for later prompts."}),
                "preset": (PRESETS, {"default": "toy", "tooltip":
                           "Weights for an auto-launched engine when models_dir is empty: toy = the small "
                           "built-in model trained on a toy world of shapes, backgrounds and hums (no downloads, "
                           "runs on a CPU; prompts like 'a red ball moves right on green grass under a blue sky, "
                           "humming'); tiny = the same architecture with random weights (tests)."}),
                "models_dir": ("STRING", {"default": "", "tooltip":
                               "Folder with the real MiniMax-H3 checkpoints for an auto-launched engine "
                               "(overrides preset). LoRA paths are resolved inside it."}),
                "device": (DEVICES, {"default": "auto", "tooltip":
                           "Device of an auto-launched engine: auto picks CUDA when available."}),
                "gpus": ("INT", {"default": 1, "min": 1, "max": 8, "tooltip":
                         "Number of GPUs an auto-launched engine splits each job over."}),
                "attention": (ATTENTION, {"default": "auto", "tooltip":
                              "Attention kernel for the H3 jobs of these nodes: auto = the engine's choice "
                              "(FA3 on Hopper GPUs, else cuDNN; SDPA on a CPU). A kernel the engine's device "
                              "lacks fails the job with the list it has."}),
                "sparse_attention": (list(SPARSE_ATTENTION), {"default": "engine default", "tooltip":
                                     "Video sparse attention (VSA) for the H3 jobs of these nodes: the share of "
                                     "video blocks each video block skips. At 87.5% a step is ~1.6x faster than "
                                     "dense at 5 s and ~2.2x at 15 s on an H200, with small changes to the "
                                     "picture; off = dense attention, exactly; engine default = what the engine "
                                     "was started with (--vsa-sparsity, else off)."}),
            },
            "optional": {
                "diffusion_model": ([NO_FILE] + model_files.choices("diffusion_models"), {"default": NO_FILE,
                                    "tooltip": "MiniMax-H3 DiT file from ComfyUI's diffusion_models folder (bf16, "
                                    "pruned, fp8_scaled or int8_convrot; the pruned int8 / fp8 files fit 24-48 GB "
                                    "GPUs) for an auto-launched engine. none = models_dir, else preset. A remote "
                                    "engine runs the files it was started with."}),
                "text_encoder": ([AUTO_FILE] + model_files.choices("text_encoders"), {"default": AUTO_FILE,
                                 "tooltip": "Qwen3-VL text encoder file (text_encoders folder) that goes with the "
                                 "DiT; auto = the one there (bf16 first, then int8_convrot, nvfp4_awq)."}),
                "video_vae": ([AUTO_FILE] + model_files.choices("vae"), {"default": AUTO_FILE, "tooltip":
                              "MiniMax-H3 video VAE file (vae folder); auto = the video VAE there."}),
                "audio_vae": ([AUTO_FILE] + model_files.choices("vae"), {"default": AUTO_FILE, "tooltip":
                              "MiniMax-H3 audio VAE file (vae folder); auto = the audio VAE there."}),
                "tokenizer_dir": ("STRING", {"default": "", "tooltip":
                                  "Folder with the tokenizer the text-encoder files lack: empty = ComfyUI's own "
                                  "Qwen tokenizer (comfy/text_encoders/qwen25_tokenizer), or the tokenizer/ "
                                  "folder of the MiniMax-H3 release."}),
            },
        }

    def configure(self, url, token, auto_launch, preset, models_dir, device, gpus, attention, sparse_attention,
                  diffusion_model=NO_FILE, text_encoder=AUTO_FILE, video_vae=AUTO_FILE, audio_vae=AUTO_FILE,
                  tokenizer_dir=""):
        launcher.host_port(url.strip())  # rejects a malformed URL here, with the node highlighted
        settings = {"url": url.strip(), "token": token.strip(), "auto_launch": bool(auto_launch), "preset": preset,
                    "models_dir": models_dir.strip(), "device": device, "gpus": int(gpus), "attention": attention,
                    "sparse_attention": sparse_attention}
        if diffusion_model != NO_FILE:
            settings["files"] = chosen_files(diffusion_model, text_encoder, video_vae, audio_vae, tokenizer_dir)
        return (settings,)


def chosen_files(diffusion_model: str, text_encoder: str, video_vae: str, audio_vae: str, tokenizer_dir: str) -> dict:
    """{engine file flag role: full path} for the chosen Comfy-Org files, `auto` ones picked by their headers."""
    picked = dict(zip((name for name, _, _ in FILE_INPUTS), (diffusion_model, text_encoder, video_vae, audio_vae)))
    files = {}
    try:
        for name, folder, kind in FILE_INPUTS:
            choice = picked[name]
            if choice == AUTO_FILE:
                choice = model_files.auto_choice(folder, kind)
            files[kind] = str(model_files.full_path(folder, choice))
    except model_files.ModelFileError as e:
        raise ValueError(f"H3Forge: {e}") from None
    tokenizer = tokenizer_dir.strip() or model_files.comfy_tokenizer_dir()
    if tokenizer:
        files["tokenizer_dir"] = str(tokenizer)
    return files


async def status_route(request):
    """GET /h3forge/status for the web extension: the engine's /v1/status, or why it cannot be reached."""
    from aiohttp import web

    settings = last_settings()
    url = settings["url"]
    reply = {"url": url, "auto_launch": bool(settings.get("auto_launch")),
             "launched": launcher.launched(url) is not None}
    try:
        status = await client_for(settings, connect_timeout=2.0).status()
    except EngineError as error:
        return web.json_response({**reply, "connected": False, "error": error.message})
    return web.json_response({**reply, "connected": True, "status": status})
