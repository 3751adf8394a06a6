"""The embedded default's text encoder, taught to spell: its hidden states made to carry what a caption names.

The tiny Qwen3-VL reads bytes (one token per character) through 2 layers 32 wide. Drawn at random and frozen, it
leaves a word such as "blue" smeared over four tokens mixed with their neighbours, and the DiT never learned to read
the colour or the motion from it (20 held-out captions: colour 0.20, motion 0.25, about chance; the background, a
long phrase, 1.00). A single attention readout finds the first object's colour in 0.83 of those hidden states,
after training it on 3000 captions; after this stage trains the encoder with it, in 1.00.

`train_text_encoder` trains the token embeddings and the decoder layers (the vision tower stays as it is) so that
`SceneReadout`, one learned query per attribute attending over the prompt's hidden states, names every attribute of
the caption's scene (`attributes`). The readout is thrown away; a DiT trained on the new hidden states reads them
with its own attention. A penalty keeps the hidden states at unit RMS (`text_at_unit_scale`'s reason).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.captions import caption
from training.toy_scene import BACKGROUNDS, COLOURS, MOTIONS, SHAPES, SIZES, Scene, sample_scene

# What a caption names, and how many values each takes (the second object's: 0 when there is none).
ATTRIBUTES = {"colour": len(COLOURS), "shape": len(SHAPES), "size": len(SIZES), "motion": len(MOTIONS),
              "second colour": len(COLOURS) + 1, "second shape": len(SHAPES) + 1, "second size": len(SIZES) + 1,
              "second motion": len(MOTIONS) + 1, "background": len(BACKGROUNDS), "humming": 2, "rain": 2}
POOL = 8192  # training captions drawn once, grouped by token count
LR = 3e-3


def attributes(scene: Scene) -> list[int]:
    """The class of each of ATTRIBUTES for a scene."""
    first, *rest = scene.objects

    def named(obj):
        return [list(COLOURS).index(obj.colour), SHAPES.index(obj.shape), list(SIZES).index(obj.size),
                MOTIONS.index(obj.motion)]

    second = [i + 1 for i in named(rest[0])] if rest else [0, 0, 0, 0]
    return [*named(first), *second, list(BACKGROUNDS).index(scene.background), int(scene.humming), int(scene.rain)]


class SceneReadout(nn.Module):
    """One learned query per attribute, `heads` heads, attending over a prompt's hidden states; a linear layer per
    attribute on what its query gathers."""

    def __init__(self, width: int, heads: int = 4, head_dim: int = 16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.queries = nn.Parameter(torch.randn(len(ATTRIBUTES), heads, head_dim))
        self.keys, self.values = nn.Linear(width, heads * head_dim), nn.Linear(width, heads * head_dim)
        self.classes = nn.ModuleList(nn.Linear(heads * head_dim, n) for n in ATTRIBUTES.values())

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [B, N, width] -> logits [B, classes] per attribute."""
        b, n, _ = hidden.shape
        k = self.keys(hidden).view(b, n, self.heads, self.head_dim)
        v = self.values(hidden).view(b, n, self.heads, self.head_dim)
        weights = torch.einsum("ahc,bnhc->banh", self.queries, k).mul(self.head_dim ** -0.5).softmax(2)
        gathered = torch.einsum("banh,bnhc->bahc", weights, v).flatten(2)
        return [head(gathered[:, i]) for i, head in enumerate(self.classes)]


def _captions(conditioner, seeds, width: int, height: int) -> dict[int, tuple[list[list[int]], torch.Tensor]]:
    """Token rows and attribute classes of the scenes drawn from `seeds`, grouped by token count."""
    groups: dict[int, tuple[list, list]] = {}
    for seed in seeds:
        scene = sample_scene(int(seed), width, height)
        ids = conditioner._prompt_ids(caption(scene))
        rows, classes = groups.setdefault(len(ids), ([], []))
        rows.append(ids)
        classes.append(attributes(scene))
    return {n: (rows, torch.tensor(classes)) for n, (rows, classes) in groups.items()}


def _loss(conditioner, readout: SceneReadout, rows: list[list[int]], classes: torch.Tensor
          ) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy of the readout over every attribute + the RMS penalty, and each attribute's accuracy."""
    hidden, _ = conditioner._forward(rows, [1] * len(rows[0]), {})
    hidden = hidden.float()
    logits = readout(hidden)
    classes = classes.to(hidden.device)
    loss = sum(F.cross_entropy(x, classes[:, i]) for i, x in enumerate(logits))
    loss = loss + (hidden.pow(2).mean().sqrt() - 1) ** 2
    return loss, [float((x.argmax(-1) == classes[:, i]).float().mean()) for i, x in enumerate(logits)]


def train_text_encoder(conditioner, budget_s: float, batch: int, log, rng, eval_seed: int, width: int, height: int,
                       max_steps: int | None = None) -> None:
    """Train the conditioner's token embeddings and decoder layers for `budget_s` (or `max_steps` steps on one
    batch: the loss must fall), logging the loss and the held-out readout's accuracy per attribute."""
    model = conditioner.model.model.language_model
    device = conditioner.model.device
    pool = _captions(conditioner, rng.integers(0, 1 << 31, size=2 * batch if max_steps else POOL), width, height)
    held_out = _captions(conditioner, range(eval_seed, eval_seed + (4 if max_steps else 512)), width, height)
    lengths = np.array(list(pool))
    sizes = np.array([len(pool[n][0]) for n in lengths], dtype=float)
    readout = SceneReadout(conditioner.hidden_size).to(device)
    params = [*model.parameters(), *readout.parameters()]
    model.float().train().requires_grad_(True)
    opt = torch.optim.Adam(params, lr=LR)
    every, end, step = 1 if max_steps else 100, time.monotonic() + budget_s, 0
    while time.monotonic() < end and (max_steps is None or step < max_steps):
        length = int(lengths[sizes.argmax()]) if max_steps else int(rng.choice(lengths, p=sizes / sizes.sum()))
        rows, classes = pool[length]
        picks = np.arange(min(batch, len(rows))) if max_steps else rng.integers(len(rows), size=batch)
        loss, _ = _loss(conditioner, readout, [rows[i] for i in picks], classes[picks])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % every == 0:
            log("text", step, max_steps, loss=loss.item())
    model.eval().requires_grad_(False)
    with torch.no_grad():
        for p in params:  # rounded as the bf16 file keeps them, so the DiT trains on the hidden states it will get
            p.copy_(p.bfloat16())
        scores = [(len(rows), _loss(conditioner, readout, rows, classes)[1]) for rows, classes in held_out.values()]
    total = sum(n for n, _ in scores)
    log("text_eval", step, None, **{f"{name}_acc": round(sum(n * acc[i] for n, acc in scores) / total, 4)
                                    for i, name in enumerate(ATTRIBUTES)})
