"""Gemma 3 text (model_type gemma3_text): the Gemma 2 block with an RMSNorm on each query and key
head (in place of attention soft-capping), five sliding-window layers per global one by default,
and two RoPE bases: local (10k) on sliding layers, global (1M, optionally linearly scaled) on
global ones.

The multimodal 4B/12B/27B folders (model_type gemma3, Gemma3ForConditionalGeneration) load through
gemma3_vl.py, which builds on this model (text_config unwrapped by normalize_config here)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from mlxcel.models import gemma, gemma2, llama
from mlxcel.models.base import RoPE, read_rope_scaling
from mlxcel.models.rotating_cache import read_layer_windows
from mlxcel.models.text_backbone import rename_language_model

REQUIRED_KEYS = llama.REQUIRED_KEYS

# transformers' Gemma3TextConfig defaults for the keys this family reads: a nested text_config is
# saved as its difference from them (the 4B's omits the head counts, head_dim, vocab_size, ...)
TEXT_CONFIG_DEFAULTS = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}
# keys the composite config owns: where both set them, transformers reads the top-level one
# (generation's eos: [1, 106] on the Hub, with <end_of_turn>; weight tying in transformers 5)
TOP_LEVEL_KEYS = ("eos_token_id", "tie_word_embeddings")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def normalize_config(config: dict) -> dict:
    """A multimodal (model_type gemma3) config as the language model's own; others unchanged."""
    if "text_config" not in config:
        return config
    text = {**TEXT_CONFIG_DEFAULTS, **config["text_config"]}
    text.update({key: config[key] for key in TOP_LEVEL_KEYS if key in config})
    return text


def read_rope_bases(config: dict) -> tuple[float, dict | None, float]:
    """(global base, global scaling, local base). transformers 5 writes rope_parameters per layer
    type; older configs write rope_theta, rope_scaling and rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        return full.get("rope_theta", 1e6), read_rope_scaling({"rope_parameters": full}), local.get("rope_theta", 1e4)
    return config.get("rope_theta", 1e6), read_rope_scaling(config), config.get("rope_local_base_freq", 1e4)


@dataclass
class ModelArgs(gemma2.ModelArgs):
    rope_local_theta: float = 10000.0

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        n = config["num_hidden_layers"]
        pattern = config.get("sliding_window_pattern", 6)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        global_theta, global_scaling, local_theta = read_rope_bases(config)
        values = {
            "rope_theta": global_theta,
            "rope_scaling": global_scaling,
            "rope_local_theta": local_theta,
            "attn_logit_softcapping": None,  # in Gemma 3 configs but unused: the q/k norms replace it
            "layer_windows": read_layer_windows(config, config.get("sliding_window"), default),
        }
        return super().from_config(config, **{**values, **overrides})


class Attention(gemma2.Attention):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__(args)
        self.q_norm = gemma.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = gemma.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        if window is not None:  # local layers: their own base, never scaled
            self.rope = RoPE(self.head_dim, args.rope_local_theta, args.rope_traditional)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project_heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Model(gemma2.Model):
    def make_layers(self, args: ModelArgs) -> list[nn.Module]:
        return [gemma2.TransformerBlock(args, Attention(args, window)) for window in args.layer_windows]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(rename_language_model(weights, VISION_PREFIXES))
