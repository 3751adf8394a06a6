"""The denoising loop shared by every H3 task: Euler over the two shifted schedules, per-row timesteps.

Generated rows are `Target`s. A plain target starts from noise and is fully regenerated. An edited target also
carries its clean source rows, an anchor (the source noised to the condition level), a per-row model mask q
(quantised) and a per-feature restore mask r: the model sees lerp(anchor, x, q) at timestep min(1 - q*sigma, cap),
and after each step x0 = lerp(clean, x0_pred, r), so r = 0 cells come back bit-identical to the source and an
all-ones mask is exactly plain generation. Condition rows (keyframes, extension guides) are frozen.

The released DiTs are guidance-distilled: one forward a step (specs/h3.md §5.2). A DiT trained with caption dropout
(the embedded default) may name a classifier-free guidance scale in its file; `guided` then adds the zeroed
prompt's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.models.h3 import layout as L
from engine.models.h3.dit import H3DiT
from engine.models.h3.schedule import AUDIO_SHIFT, VIDEO_SHIFT, euler_blend, sigmas


@dataclass
class Target:
    state: torch.Tensor  # [1, N, C] the sample x_t, initially noise
    cap: float = 1.0  # highest timestep a row may take (0.999 for video: the condition level)
    clean: torch.Tensor | None = None  # edits: source rows [1, N, C]
    anchor: torch.Tensor | None = None  # edits: the model input where q = 0
    model_mask: torch.Tensor | None = None  # edits: q [N], quantised to 1/256
    restore: torch.Tensor | None = None  # edits: r [N, C]

    def timesteps(self, sigma: float) -> float | torch.Tensor:
        if self.model_mask is None:
            return float(1 - torch.tensor(sigma, dtype=torch.float32))
        return torch.clamp(1 - self.model_mask * torch.tensor(sigma, dtype=torch.float32), max=self.cap)

    def model_input(self) -> torch.Tensor:
        if self.model_mask is None:
            return self.state
        return torch.lerp(self.anchor, self.state, self.model_mask[None, :, None].to(self.state))

    def x0(self, x_in: torch.Tensor, velocity: torch.Tensor, t) -> torch.Tensor:
        """Clean estimate from the data-ward velocity, sigma taken from the fp32 timestep (as the reference)."""
        sigma = 1 - torch.as_tensor(t, dtype=torch.float32).to(x_in.device)
        if sigma.ndim:
            sigma = sigma[None, :, None]
        x0 = x_in.float() + sigma * velocity.float()
        if self.restore is not None:
            x0 = torch.lerp(self.clean.float(), x0, self.restore[None].to(x0))
        return x0


def guided(dit: H3DiT, scale: float, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, *rows,
           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's (video, audio) velocities guided by `scale`: v_u + scale (v_c - v_u), v_u the prompt's hidden
    states zeroed (the unconditional branch caption dropout teaches; the layout, and so every row's position,
    stays the prompt's). Two forwards in turn, so every path (sequence parallel, VSA, the AdaLN cache, streaming)
    runs as in one; scale 1 is the one forward."""
    v_c, a_c = dit(video, audio, text, *rows, **kwargs)
    if scale == 1:
        return v_c, a_c
    v_u, a_u = dit(video, audio, torch.zeros_like(text), *rows, **kwargs)
    return torch.lerp(v_u.float(), v_c.float(), scale), torch.lerp(a_u.float(), a_c.float(), scale)


def denoise(dit: H3DiT, layout: L.PackedLayout, text: torch.Tensor, video: Target, audio: Target, steps: int,
            cond_video: torch.Tensor | None = None, cond_audio: torch.Tensor | None = None,
            on_step: Callable[[int, int, torch.Tensor], None] | None = None,
            modulations: Callable | None = None, start: int = 0,
            video_shift: float = VIDEO_SHIFT, guidance: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the schedule from grid point `start` (a partial re-noise starts later); returns the final video and
    audio target rows. `on_step(step, total, video_x0_rows)`. `modulations(timestep)` returns the DiT's AdaLN
    tables (a cache) or None. `video_shift`: the video schedule's shift (the release's 12 unless the weights were
    trained for another); `guidance`: the `guided` scale."""
    device = video.state.device
    cond_video = video.state[:, :0] if cond_video is None else cond_video
    cond_audio = audio.state[:, :0] if cond_audio is None else cond_audio
    sig_v, sig_a = sigmas(steps, video_shift), sigmas(steps, AUDIO_SHIFT)
    last = min(len(sig_v), len(sig_a)) - 1
    total = last - start
    for i in range(start, last):
        t_v, t_a = video.timesteps(float(sig_v[i])), audio.timesteps(float(sig_a[i]))
        t_text = float(1 - sig_v[i])
        timestep, idx = L.row_timesteps(layout, t_v, t_a, t_text=t_text)
        timestep, idx = timestep.to(device), idx.to(device)
        v_in, a_in = video.model_input(), audio.model_input()
        v_out, a_out = guided(dit, guidance, torch.cat([cond_video, v_in], dim=1),
                              torch.cat([cond_audio, a_in], dim=1), text, timestep, idx, layout.token_tags,
                              layout.position_ids, layout.video_indices, layout.audio_indices, layout.text_indices,
                              modulations=modulations(timestep) if modulations else None)
        v_x0 = video.x0(v_in, v_out[:, cond_video.shape[1]:], t_v)
        a_x0 = audio.x0(a_in, a_out[:, cond_audio.shape[1]:], t_a)
        if on_step is not None:
            on_step(i + 1 - start, total, v_x0)
        video.state = euler_blend(video.state, v_x0, float(sig_v[i]), float(sig_v[i + 1]))
        audio.state = euler_blend(audio.state, a_x0, float(sig_a[i]), float(sig_a[i + 1]))
    return video.state, audio.state
