"""H3Forge ComfyUI nodes: thin V1 nodes that run jobs on the H3Forge engine through nodes/client.py."""

from .engine_node import H3ForgeEngine
from .preview import H3ForgePreview
from .t2v import H3ForgeTextToVideo

NODE_CLASS_MAPPINGS = {
    "H3ForgeEngine": H3ForgeEngine,
    "H3ForgeTextToVideo": H3ForgeTextToVideo,
    "H3ForgePreview": H3ForgePreview,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "H3ForgeEngine": "H3Forge Engine",
    "H3ForgeTextToVideo": "H3Forge Text to Video (+ audio)",
    "H3ForgePreview": "H3Forge Preview",
}
