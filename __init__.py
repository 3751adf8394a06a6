"""H3Forge for ComfyUI: MiniMax-H3 text-to-video with audio on the bundled (or a remote) H3Forge engine.

Only the light node layer is imported here; the engine runs in its own process.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from .nodes.comfy_compat import add_route
from .nodes.engine_node import status_route

WEB_DIRECTORY = "./web"

add_route("get", "/h3forge/status", status_route)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
