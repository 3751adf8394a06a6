"""H3Forge ComfyUI nodes: thin V1 nodes that run jobs on the H3Forge engine through nodes/client.py."""

from .edit import H3ForgeMaskedEdit
from .engine_node import H3ForgeEngine
from .extend import H3ForgeExtendVideo
from .lora import H3ForgeLora
from .masks import (H3ForgeMaskFeather, H3ForgeMaskFrameRange, H3ForgeMaskGrow, H3ForgeMaskPreview,
                    H3ForgeMaskTrackBox)
from .preview import H3ForgePreview
from .references import H3ForgeReferences
from .t2v import H3ForgeTextToVideo
from .upscale import H3ForgeUpscale

NODE_CLASS_MAPPINGS = {
    "H3ForgeEngine": H3ForgeEngine,
    "H3ForgeTextToVideo": H3ForgeTextToVideo,
    "H3ForgeReferences": H3ForgeReferences,
    "H3ForgeMaskedEdit": H3ForgeMaskedEdit,
    "H3ForgeExtendVideo": H3ForgeExtendVideo,
    "H3ForgeLora": H3ForgeLora,
    "H3ForgeMaskPreview": H3ForgeMaskPreview,
    "H3ForgeMaskFrameRange": H3ForgeMaskFrameRange,
    "H3ForgeMaskTrackBox": H3ForgeMaskTrackBox,
    "H3ForgeMaskGrow": H3ForgeMaskGrow,
    "H3ForgeMaskFeather": H3ForgeMaskFeather,
    "H3ForgeUpscale": H3ForgeUpscale,
    "H3ForgePreview": H3ForgePreview,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "H3ForgeEngine": "H3Forge Engine",
    "H3ForgeTextToVideo": "H3Forge Text to Video (+ audio)",
    "H3ForgeReferences": "H3Forge References",
    "H3ForgeMaskedEdit": "H3Forge Masked Edit",
    "H3ForgeExtendVideo": "H3Forge Extend Video",
    "H3ForgeLora": "H3Forge LoRA",
    "H3ForgeMaskPreview": "H3Forge Mask Preview",
    "H3ForgeMaskFrameRange": "H3Forge Mask Frame Range",
    "H3ForgeMaskTrackBox": "H3Forge Mask Track Box",
    "H3ForgeMaskGrow": "H3Forge Mask Grow",
    "H3ForgeMaskFeather": "H3Forge Mask Feather",
    "H3ForgeUpscale": "H3Forge Upscale (SeedVR2 / H3 refine)",
    "H3ForgePreview": "H3Forge Preview",
}
