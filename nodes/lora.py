"""H3Forge LoRA node: a LoRA file from ComfyUI's `loras` folders (or from what the engine lists) and its strength,
chainable; the generation nodes take the chain as their `loras` input."""

from __future__ import annotations

import os

from . import engine_node, model_files
from .client import protocol

LORAS_TYPE = "H3FORGE_LORAS"
LORAS_INPUT = (LORAS_TYPE, {"tooltip": "LoRAs chosen with H3Forge LoRA nodes (several in a chain), applied "
                                       "before any in lora_list."})


def lora_choices() -> list[str]:
    """ComfyUI's own LoRA files, then those the configured engine lists that ComfyUI lacks (a remote engine's)."""
    names = model_files.choices("loras")
    settings = engine_node.last_settings()
    token = settings.get("token") or os.environ.get("H3FORGE_TOKEN") or protocol.read_token() or ""
    remote = model_files.remote_choices_cached(settings["url"], token)["loras"]
    return names + sorted(set(remote) - set(names))


class H3ForgeLora:
    DESCRIPTION = ("Applies a LoRA to the H3Forge generation it is connected to. Chain several: each adds its "
                   "LoRA to those before it. The file is read by the engine: from ComfyUI's loras folders for an "
                   "engine this ComfyUI starts, or from the engine's own models folder (listed too).")
    CATEGORY = "H3Forge"
    FUNCTION = "chain"
    RETURN_TYPES = (LORAS_TYPE,)
    RETURN_NAMES = ("loras",)
    OUTPUT_TOOLTIPS = ("The LoRAs so far; connect to `loras` of a generation node or of another H3Forge LoRA.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_name": (lora_choices(), {"tooltip": "LoRA file (.safetensors) trained for MiniMax-H3 FL2VA; "
                              "one trained on the full model also fits a pruned one where its layers exist."}),
                "strength": ("FLOAT", {"default": 1.0, "min": -4.0, "max": 4.0, "step": 0.05, "tooltip":
                             "How strongly the LoRA applies (1.0 = as trained; 0 leaves it out)."}),
            },
            "optional": {"loras": LORAS_INPUT},
        }

    def chain(self, lora_name, strength, loras=None):
        chained = [list(entry) for entry in (loras or [])]
        if strength != 0:
            chained.append([lora_name, float(strength)])
        return (chained,)
