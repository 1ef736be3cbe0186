"""Mistral: the Llama architecture with sliding-window attention on every layer (Mistral 7B
v0.1: 4096 positions); later releases set sliding_window to null and are plain Llama."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models import llama
from mlxcel.models.rotating_cache import SlidingWindowLayers

REQUIRED_KEYS = llama.REQUIRED_KEYS


@dataclass
class ModelArgs(llama.ModelArgs):
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        return super().from_config(config, **{"sliding_window": config.get("sliding_window"), **overrides})


class Model(SlidingWindowLayers, llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layer_windows = [args.sliding_window] * args.num_hidden_layers
