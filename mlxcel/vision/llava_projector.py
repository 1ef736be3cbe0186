"""LLaVA's multimodal projector (transformers' `LlavaMultiModalProjector`, LLaVA-NeXT's too):
linear_1 -> projector_hidden_act -> linear_2, from the CLIP tower's (concatenated) feature layers
to the language model's width."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from mlxcel.vision import clip_vit


class MultiModalProjector(nn.Module):
    def __init__(self, in_dims: int, dims: int, activation: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_dims, dims, bias=bias)
        self.act = clip_vit.make_activation(activation)
        self.linear_2 = nn.Linear(dims, dims, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(x)))
