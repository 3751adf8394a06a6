"""H3Forge Preview: writes a VIDEO (with its audio) to an MP4 in ComfyUI's temp folder and plays it in the node."""

from __future__ import annotations

import asyncio
import os
import uuid
from fractions import Fraction

from . import comfy_compat as comfy


def write_mp4(path: str, components) -> None:
    """H.264 + AAC MP4 from video components (images float [F,H,W,3] 0..1, audio dict or None, frame_rate)."""
    import av
    import numpy as np

    images, audio = components.images, components.audio
    frame_rate = Fraction(components.frame_rate).limit_denominator(1001)
    with av.open(path, mode="w", format="mp4") as out:
        video = out.add_stream("h264", rate=frame_rate)
        video.height, video.width = int(images.shape[1]), int(images.shape[2])
        video.pix_fmt = "yuv420p"
        sound = out.add_stream("aac", rate=int(audio["sample_rate"])) if audio is not None else None

        for image in images:
            rgb = (image[..., :3].clamp(0, 1) * 255).round().byte().cpu().numpy()
            out.mux(video.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(video.encode(None))

        if sound is not None:
            waveform = audio["waveform"][0, :2].float().cpu().numpy()  # [C, S]
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform.T).reshape(1, -1), format="flt",
                                               layout="mono" if waveform.shape[0] == 1 else "stereo")
            frame.sample_rate = sound.rate
            frame.pts = 0
            out.mux(sound.encode(frame))
            out.mux(sound.encode(None))


def save_mp4(video, path: str) -> None:
    if hasattr(video, "save_to"):
        video.save_to(path, format=comfy.VideoContainer.MP4, codec=comfy.VideoCodec.H264)
    else:
        write_mp4(path, video.get_components())


class H3ForgePreview:
    DESCRIPTION = "Plays a video with its audio in the node. The MP4 goes to ComfyUI's temp folder (not kept)."
    CATEGORY = "H3Forge"
    FUNCTION = "preview"
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"video": ("VIDEO", {"tooltip": "The video to play, e.g. from H3Forge Text to Video."})}}

    async def preview(self, video):
        folder = comfy.get_temp_directory()
        os.makedirs(folder, exist_ok=True)
        filename = f"H3Forge_preview_{uuid.uuid4().hex[:12]}.mp4"
        path = os.path.join(folder, filename)
        await asyncio.to_thread(save_mp4, video, path)  # encoding off ComfyUI's event loop
        result = {"filename": filename, "subfolder": "", "type": "temp", "format": "video/h264-mp4"}
        return {"ui": {"images": [result], "animated": (True,)}}
