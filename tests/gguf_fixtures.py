"""What the GGUF writer tests share: llama.cpp's tensor names and Q/K permutation for dense
checkpoints, their prompt, and random quantized blocks with finite scales."""

from __future__ import annotations

import numpy as np

PROMPT = [(13 * i + 5) % 300 + 3 for i in range(40)]
TENSOR_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# byte offsets of each block's fp16 scales (random bytes there could be inf/nan)
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def permute_for_llama_cpp(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half layout -> interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{TENSOR_NAMES[module]}.{kind}"


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw quantized rows [rows, bytes per row] with finite fp16 scales."""
    import gguf  # the callers importorskip it first

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for start in FP16_FIELDS[type_name]:
        raw[..., start : start + 2] = (
            rng.normal(0, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(rows, -1)
