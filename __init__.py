"""H3Forge for ComfyUI: MiniMax-H3 video with audio (text to video, masked edit, extension) on the bundled (or a
remote) H3Forge engine, plus the video mask helpers those jobs need.

Only the light node layer is imported here; the engine runs in its own process.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, comfy_compat, example_inputs
from .nodes.engine_node import status_route

WEB_DIRECTORY = "./web"

comfy_compat.add_route("get", "/h3forge/status", status_route)
if comfy_compat.IN_COMFYUI:
    try:
        example_inputs.install(comfy_compat.get_input_directory())
    except OSError as error:
        print(f"H3Forge: could not copy the example inputs into ComfyUI's input folder ({error})")

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
