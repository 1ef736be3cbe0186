"""GGUF files: llama.cpp's tensor names and metadata mapped onto our model families.

MLX reads GGUF itself (`mx.load(..., return_metadata=True)`): Q4_0, Q4_1 and Q8_0 tensors
arrive as MLX affine-quantized triples (weight, scales, biases; group size 32), other
tensors as float arrays. llama.cpp stores Q and K permuted for interleaved ("traditional")
RoPE, so GGUF models run with `rope_traditional=True` instead of un-permuting the weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.errors import MlxcelError

GGUF_GROUP_SIZE = 32

# GGUF architecture name -> our family. llama.cpp's converter permutes Q/K rows only for the
# llama architecture (it runs interleaved RoPE there); qwen2 keeps HF's layout (NEOX RoPE).
SUPPORTED_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}
INTERLEAVED_ROPE_ARCHS = {"llama"}

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file's tensors and metadata; a truncated or foreign file is a clear error."""
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises plain ValueError/RuntimeError with gguflib's message
        raise MlxcelError(f"cannot read GGUF file {path}: {exc} (is the file complete and a GGUF model?)") from exc


def read_metadata_value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """Scalars arrive as 0-d mx.arrays; return Python values."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def make_config_from_gguf(metadata: dict[str, Any], path: Path) -> tuple[str, dict]:
    """Translate GGUF metadata into an HF-style config dict for the family's ModelArgs
    (plus `rope_traditional`, which only GGUF files set)."""
    arch = read_metadata_value(metadata, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        supported = ", ".join(sorted(SUPPORTED_GGUF_ARCHS))
        raise MlxcelError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {supported})")
    family = SUPPORTED_GGUF_ARCHS[arch]

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        value = read_metadata_value(metadata, f"{arch}.{key}", default)
        if value is None and required:
            raise MlxcelError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    tokens = metadata.get("tokenizer.ggml.tokens")
    hidden = get("embedding_length")
    heads = get("attention.head_count")
    config = {
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "intermediate_size": get("feed_forward_length"),
        "vocab_size": get("vocab_size", None, required=False) or (len(tokens) if tokens else None),
        "head_dim": get("attention.key_length", None, required=False) or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "eos_token_id": read_metadata_value(metadata, "tokenizer.ggml.eos_token_id"),
        "rope_traditional": arch in INTERLEAVED_ROPE_ARCHS,
    }
    if config["vocab_size"] is None:
        raise MlxcelError(f"{path}: GGUF metadata gives no vocabulary size")
    return family, config


def rename_gguf_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """llama.cpp names (blk.3.attn_q.scales) -> ours (model.layers.3.self_attn.q_proj.scales)."""
    renamed = {}
    for name, value in weights.items():
        match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)", name)
        if match is None or match.group(2) not in _TENSOR_NAMES:
            raise MlxcelError(f"unexpected tensor {name!r} in GGUF file")
        layer, base, kind = match.groups()
        prefix = f"model.layers.{layer}." if layer is not None else ""
        renamed[f"{prefix}{_TENSOR_NAMES[base]}.{kind}"] = value
    return renamed


def read_quantized_bits(weights: dict[str, mx.array], prefix: str) -> int:
    """Bits per weight of a quantized layer, from its packed width and its group count."""
    in_features = weights[f"{prefix}.scales"].shape[-1] * GGUF_GROUP_SIZE
    return weights[f"{prefix}.weight"].shape[-1] * 32 // in_features
