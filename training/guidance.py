"""Classifier-free guidance for the embedded default, and the teacher its guidance-distilled DiT learns from.

The released H3 DiTs are guidance-distilled: one forward per step, no negative prompt (specs/h3.md §5.2), so the
engine never runs two branches. The toy DiT gets there the same way: it first learns the unconditional branch by
caption dropout (the prompt's hidden states zeroed for a share of the clips: the layout, and so every row
position, stays the prompt's), then a student learns to give in one forward what the guided teacher gives in two,
v_u + w (v_c - v_u). `GuidedDiT` is that teacher as a drop-in DiT, so a pipeline can also sample with it
(benchmarks/toy_eval.py --guidance) and show what the distillation aims at.
"""

from __future__ import annotations

import torch
from torch import nn


def guided(dit: nn.Module, scale: float, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, *layout,
           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's (video, audio) outputs guided by `scale`: the prompt and the zeroed prompt as one batch of 2B."""
    two = (torch.cat([video, video]), torch.cat([audio, audio]), torch.cat([text, torch.zeros_like(text)]))
    v, a = dit(*two, *layout, **kwargs)
    (v_c, v_u), (a_c, a_u) = v.float().chunk(2), a.float().chunk(2)
    return torch.lerp(v_u, v_c, scale), torch.lerp(a_u, a_c, scale)


class GuidedDiT(nn.Module):
    """A DiT that answers every call with its guided output (two branches per step)."""

    def __init__(self, dit: nn.Module, scale: float):
        super().__init__()
        self.dit, self.scale = dit, scale

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # config, blocks, ...: the pipeline and the AdaLN cache read the DiT's own
            return getattr(self.dit, name)

    def forward(self, video, audio, text, *layout, **kwargs):
        v, a = guided(self.dit, self.scale, video, audio, text, *layout, **kwargs)
        return v.to(video.dtype), a.to(audio.dtype)
