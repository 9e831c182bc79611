"""Mistral 3's multimodal projector: Pixtral's patch states into the language model's tokens.

(sum rows*cols, vision hidden) of several images -> (sum rows*cols / merge**2, text hidden):

- ``norm``: RMSNorm (the text model's eps);
- ``patch_merger``: each image's patch states, laid out on its rows x cols grid, are cut into
  merge x merge windows (row-major), each window's states concatenated channel-major as
  PyTorch's ``unfold`` lays them out ((C, ki, kj) flattened), then ``merging_layer`` (a Linear
  without bias) back to the vision width;
- ``linear_1`` -> activation (``projector_hidden_act``) -> ``linear_2``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..layers import RMSNorm, activation


class PatchMerger(nn.Module):
    def __init__(self, vision_hidden: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(vision_hidden * merge * merge, vision_hidden, bias=False)

    def __call__(self, states: mx.array, grids: list[tuple[int, int]]) -> mx.array:
        m, D = self.merge, states.shape[-1]
        out, start = [], 0
        for rows, cols in grids:
            x = states[start : start + rows * cols].reshape(rows, cols, D)
            start += rows * cols
            r, c = rows // m, cols // m  # unfold drops a ragged edge
            x = x[: r * m, : c * m].reshape(r, m, c, m, D).transpose(0, 2, 4, 1, 3)
            out.append(x.reshape(r * c, D * m * m))  # (windows, (C, ki, kj))
        return self.merging_layer(mx.concatenate(out, axis=0))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(
        self,
        vision_hidden: int,
        text_hidden: int,
        merge: int,
        *,
        act: str = "gelu",
        bias: bool = False,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.norm = RMSNorm(vision_hidden, eps=eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = activation(act, "config.json projector_hidden_act")
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def __call__(self, states: mx.array, grids: list[tuple[int, int]]) -> mx.array:
        x = self.patch_merger(self.norm(states), grids)
        return self.linear_2(self.act(self.linear_1(x)))  # (tokens, text hidden)
