"""The few ComfyUI APIs the nodes use, imported from ComfyUI when the pack runs inside it.

Outside ComfyUI (the pack's own tests, `python -c "import ..."`) small stand-ins with the same call
surface take their place, so the node functions can run end to end. Inside ComfyUI only the real
modules are used. Nothing here imports torch at module import time.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Any

try:
    import comfy.model_management as _mm
    import comfy.utils as _cu
    import folder_paths as _fp
except ImportError:
    IN_COMFYUI = False
else:
    IN_COMFYUI = True

if IN_COMFYUI:
    try:
        from comfy_api.latest import InputImpl, Types
    except ImportError as exc:  # ComfyUI from before the VIDEO type
        raise ImportError("H3Forge needs a ComfyUI with comfy_api.latest (native VIDEO/AUDIO types); "
                          "please update ComfyUI") from exc
    from server import PromptServer

    ProgressBar = _cu.ProgressBar
    InterruptProcessingException = _mm.InterruptProcessingException
    processing_interrupted = _mm.processing_interrupted
    throw_exception_if_processing_interrupted = _mm.throw_exception_if_processing_interrupted
    get_temp_directory = _fp.get_temp_directory
    get_input_directory = _fp.get_input_directory
    VideoFromComponents = InputImpl.VideoFromComponents
    VideoFromFile = InputImpl.VideoFromFile
    VideoComponents = Types.VideoComponents
    VideoContainer = Types.VideoContainer
    VideoCodec = Types.VideoCodec

    def send_progress_text(text: str, node_id: str | None) -> None:
        if node_id is not None and PromptServer.instance is not None:
            PromptServer.instance.send_progress_text(text, node_id)

    def add_route(method: str, path: str, handler) -> None:
        """Registers an aiohttp handler on ComfyUI's server (served under / and /api)."""
        getattr(PromptServer.instance.routes, method)(path)(handler)

else:
    class InterruptProcessingException(Exception):
        """Stand-in for comfy.model_management.InterruptProcessingException."""

    _interrupt = False
    _interrupt_lock = threading.RLock()

    def interrupt_current_processing(value: bool = True) -> None:
        global _interrupt
        with _interrupt_lock:
            _interrupt = value

    def processing_interrupted() -> bool:
        with _interrupt_lock:
            return _interrupt

    def throw_exception_if_processing_interrupted() -> None:
        global _interrupt
        with _interrupt_lock:
            if _interrupt:
                _interrupt = False
                raise InterruptProcessingException()

    class ProgressBar:
        """Records every update; like ComfyUI's global progress hook it raises on a pending interrupt."""

        created: list["ProgressBar"] = []

        def __init__(self, total, node_id=None):
            self.total = total
            self.current = 0
            self.node_id = node_id
            self.updates: list[tuple[int, int, Any]] = []
            ProgressBar.created.append(self)

        def update_absolute(self, value, total=None, preview=None):
            if total is not None:
                self.total = total
            self.current = min(value, self.total)
            self.updates.append((self.current, self.total, preview))
            throw_exception_if_processing_interrupted()

        def update(self, value):
            self.update_absolute(self.current + value)

    progress_texts: list[tuple[str | None, str]] = []

    def send_progress_text(text: str, node_id: str | None) -> None:
        progress_texts.append((node_id, text))

    def add_route(method: str, path: str, handler) -> None:
        """No server outside ComfyUI."""

    def get_temp_directory() -> str:
        path = os.path.join(tempfile.gettempdir(), "h3forge-comfy-temp")
        os.makedirs(path, exist_ok=True)
        return path

    class VideoContainer(str, Enum):
        AUTO = "auto"
        MP4 = "mp4"

    class VideoCodec(str, Enum):
        AUTO = "auto"
        H264 = "h264"

    @dataclass
    class VideoComponents:
        images: Any  # torch float [F, H, W, 3] in 0..1
        frame_rate: Fraction
        audio: dict | None = None  # {"waveform": [1, C, S], "sample_rate": int}
        metadata: dict | None = None

    class VideoFromComponents:
        """Stand-in for comfy_api's VideoFromComponents: holds the components, saves an MP4."""

        def __init__(self, components: VideoComponents):
            self._components = components

        def get_components(self) -> VideoComponents:
            return self._components

        def get_frame_rate(self) -> Fraction:
            return self._components.frame_rate

        def get_frame_count(self) -> int:
            return int(self._components.images.shape[0])

        def get_dimensions(self) -> tuple[int, int]:
            return int(self._components.images.shape[2]), int(self._components.images.shape[1])

        def save_to(self, path, format=VideoContainer.AUTO, codec=VideoCodec.AUTO, metadata=None):
            from .preview import write_mp4

            write_mp4(path, self._components)

    class VideoFromFile:
        """Stand-in for comfy_api's VideoFromFile (what Load Video gives): a file path or BytesIO, decoded on
        request as ComfyUI decodes it (frames / 255 in float32, the stream's average rate)."""

        def __init__(self, file):
            self.__file = file

        def get_stream_source(self):
            if hasattr(self.__file, "seek"):
                self.__file.seek(0)
            return self.__file

        def get_components(self) -> VideoComponents:
            import av
            import numpy as np
            import torch

            with av.open(self.get_stream_source(), mode="r") as container:
                images = torch.stack([torch.from_numpy(frame.to_ndarray(format="rgb24")) / 255.0
                                      for frame in container.decode(video=0)])
                rate = Fraction(container.streams.video[0].average_rate)
                container.seek(0)
                sound = [frame.to_ndarray() for frame in container.decode(audio=0)] if container.streams.audio else []
                audio = None
                if sound:
                    audio = {"waveform": torch.from_numpy(np.concatenate(sound, axis=1))[None],
                             "sample_rate": int(container.streams.audio[0].sample_rate)}
            return VideoComponents(images=images, frame_rate=rate, audio=audio)

        def _header(self):
            import av

            with av.open(self.get_stream_source(), mode="r") as container:
                stream = container.streams.video[0]
                return Fraction(stream.average_rate), int(stream.frames), (stream.width, stream.height)

        def get_frame_rate(self) -> Fraction:
            return self._header()[0]

        def get_frame_count(self) -> int:
            return self._header()[1]

        def get_dimensions(self) -> tuple[int, int]:
            return self._header()[2]
