"""Prompt-embedding cache: repeated prompts (and keyframe images) skip the 32 B conditioner.

Keyed by the prompt text and the bytes of its images; values live in host memory so the conditioner can be
offloaded (or never loaded) while the DiT owns the GPU. LRU, bounded in bytes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch


def prompt_key(prompt: str, images=()) -> str:
    h = hashlib.sha256(prompt.encode())
    for image in images:
        image = np.ascontiguousarray(image)
        h.update(repr((image.shape, str(image.dtype))).encode())
        h.update(image.tobytes())
    return h.hexdigest()


class PromptCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() + g.numel() * g.element_size() for t, g in self.entries.values())

    def get(self, key: str):
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        return None

    def put(self, key: str, text: torch.Tensor, tags: torch.Tensor) -> None:
        self.entries[key] = (text.detach().cpu(), tags.detach().cpu())
        while self.nbytes > self.max_bytes and len(self.entries) > 1:
            self.entries.popitem(last=False)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self.entries), "bytes": self.nbytes}
