"""Qwen2 / Qwen2.5: the Llama architecture with biases on the Q/K/V projections (not on O)."""

from __future__ import annotations

from mlxcel.models import llama

REQUIRED_KEYS = llama.REQUIRED_KEYS
Model = llama.Model


class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_config(cls, config: dict, **overrides) -> llama.ModelArgs:
        overrides = {"attention_bias": True, "o_proj_bias": False, **overrides}
        return llama.ModelArgs.from_config(config, **overrides)
