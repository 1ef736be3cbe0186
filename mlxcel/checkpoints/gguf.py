"""GGUF files: llama.cpp's tensor names and metadata mapped onto our model families.

MLX reads GGUF itself (`mx.load(..., return_metadata=True)`): Q4_0, Q4_1 and Q8_0 tensors
arrive as MLX affine-quantized triples (weight, scales, biases; group size 32), other
tensors as float arrays. Files with other types (the K-quants: Q4_K_M, ...) go through
gguf_reader, which dequantizes every tensor to float32. llama.cpp stores Q and K permuted for
interleaved ("traditional") RoPE, so llama-arch models run with `rope_traditional=True` instead
of un-permuting the weights. llama.cpp adds 1 to Gemma's norm weights (GGML's RMSNorm multiplies
by the weight; Gemma's by 1 + weight): undone here, as our Gemma RMSNorm adds 1 itself.

Mixture-of-experts files: Mixtral is arch `llama` plus `llama.expert_count` and per-layer router
(`ffn_gate_inp`) and stacked-expert tensors (`ffn_{gate,up,down}_exps`, [E, out, in] as our
SwitchLinear holds them); Qwen3-MoE is arch `qwen3moe`. Quantized experts load like any other
tensor: Q4_0/Q4_1/Q8_0 stay packed (QuantizedSwitchLinear), K-quants are dequantized.

Hybrid files (gated-delta linear attention beside full attention; llama.cpp's `qwen35`,
`qwen35moe`, `qwen3next`): the converter (convert_hf_to_gguf.py's Qwen3NextModel and, for Qwen 3.5,
_LinearAttentionVReorderBase) stores A = -exp(A_log) for A_log, the depthwise conv kernel squeezed
to [channels, kernel], the zero-centred norms as 1 + w (as our families keep them: nothing to
undo), Qwen3-Next's in_proj_qkvz split into attn_qkv and attn_gate (its per-key-head groups undone)
and, for Qwen 3.5 where there are more value heads than key heads, the value heads tiled for ggml's
broadcast. All undone here (undo_gated_delta_transforms); the `ssm.*` keys become transformers'
linear_* settings. Mamba-2
hybrids (`nemotron_h`): A stored as -exp(A_log) [H, 1], D as [H, 1], the grouped norm as
[groups, width], the conv kernel squeezed (undo_mamba2_transforms); a layer's kind is read from the
per-layer head_count_kv and feed_forward_length arrays, as llama.cpp reads it.

GLM files (`glm4`, `glm4moe`): the converter keeps transformers' tensors as they are (GLM-4's Q/K rows
already interleaved, GLM-4.5's half-split) and writes rope.dimension_count for the partial RoPE;
GLM-4.5's block_count includes the multi-token-prediction blocks it appends (nextn_predict_layers),
dropped here, and its router's e_score_correction_bias is exp_probs_b.bias.

gpt-oss files (`gpt-oss`): the experts in ggml's MXFP4 blocks, which gguf_reader repacks as MLX's mxfp4
layout bit for bit (kept packed: read_quantization gives nn.quantize the mode); the sinks as
attn_sinks.weight; gate/up already de-interleaved by the converter.

Gemma 4 files (`gemma4`): norms stored as they are (no 1 + w); key_length is the global layers' head
size and key_length_swa the sliding ones'; head_count_kv and feed_forward_length may hold one value
a layer; rope_freqs marks the global layers' rotated pairs (1) and the rest (1e30); a global layer
without attn_v has keys that double as values; gate and up experts come as one tensor, the router's
and experts' scales as `.scale` tensors (undo_gemma4_transforms).

Multi-head latent attention files (`deepseek2`: DeepSeek V2/V3, Kimi K2; `mistral4`): convert_hf_to_gguf.py's
DeepseekV2Model writes kv_b_proj split per head as attn_k_b ([H, R, nope]: mla.py's embed_q as it is) and
attn_v_b ([H, v, R]: unembed_out), the heads' widths as key_length_mla / value_length_mla (key_length and
value_length are the latent's); older files keep attn_kv_b whole and the heads' widths in key_length /
value_length (split here). No Q/K permutation (DeepSeek's RoPE pairs are interleaved already). The router is
read from expert_gating_func (sigmoid: DeepSeek V3's, with exp_probs_b.bias as its correction bias; softmax,
also when the key is absent as llama.cpp takes it: V2's, or Mistral 4's), expert_group_count /
expert_group_used_count, expert_weights_norm / expert_weights_scale; YaRN's mscale_all_dim is
yarn_log_multiplier / 0.1 (the converter's factor) and its rotary mscale the same (as in every released
config; the file keeps one). Mistral 4's query scale by position is attention.temperature_scale where the
file has it, else the released config's 0.1 (the converter writes none; llama.cpp then runs unscaled, the
same below 8192 positions). Multi-token-prediction blocks (nextn_predict_layers) are dropped
(undo_mla_transforms).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.checkpoints import gguf_reader
from mlxcel.errors import MlxcelError

GGUF_GROUP_SIZE = 32

# GGUF architecture name -> our family (Mistral converts as llama). llama.cpp's converter
# permutes Q/K rows only for the llama architecture (interleaved RoPE); the others keep HF's
# layout (NEOX RoPE).
SUPPORTED_GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "phi3": "phi3",
    "qwen3moe": "qwen3_moe",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "nemotron_h": "nemotron_h",
    "gpt-oss": "gpt_oss",
    "olmo2": "olmo2",  # OLMo 3 files too (Olmo3ForCausalLM converts as olmo2): read by their sliding window
    "smollm3": "smollm3",
    "glm4": "glm4",
    "glm4moe": "glm4_moe",
    "llama4": "llama4_text",
    "deepseek2": "deepseek_v3",  # deepseek_v2 where the router is a softmax (make_mla_config)
    "mistral4": "mistral4",
}
# Architectures whose files may carry experts -> the MoE family they load as (llama with
# expert_count > 0 is Mixtral; without it, dense llama)
MOE_FAMILIES = {"llama": "mixtral", "qwen3moe": "qwen3_moe", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
SHARED_EXPERT_ARCHS = {"qwen35moe", "qwen3next"}  # a shared expert beside the routed ones
EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ARCH_EXPERT_TENSORS = {  # gate and up as one tensor
    "gemma4": ("ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps"),
    "mistral4": ("ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps"),
}
# files that run with interleaved RoPE: llama's and SmolLM3's (the converter permuted Q/K for them),
# GLM-4's and Llama 4's (their own layout)
INTERLEAVED_ROPE_ARCHS = {"llama", "glm4", "smollm3", "llama4"}
GEMMA_ARCHS = {"gemma", "gemma2", "gemma3"}  # norm weights stored as 1 + w
GATED_DELTA_ARCHS = {"qwen35", "qwen35moe", "qwen3next"}  # linear-attention layers (ssm_* tensors, ssm.* keys)
TILED_VALUE_HEAD_ARCHS = {"qwen35", "qwen35moe"}  # _LinearAttentionVReorderBase's converters
MAMBA2_ARCHS = {"nemotron_h"}  # Mamba-2 layers (ssm_* tensors, ssm.* keys)
NO_ROPE_STEP = {"smollm3": 4}  # llama.cpp's n_no_rope_layer_step for the arch: a literal there, no key in the file
GLM_ARCHS = {"glm4", "glm4moe"}  # partial RoPE (rope.dimension_count); glm4moe: multi-token-prediction blocks last
MLA_ARCHS = {"deepseek2", "mistral4"}  # multi-head latent attention (models/mla.py)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def make_moe_tensor_names(block: str) -> dict[str, str]:
    """The router and the stacked experts under the family's MoE block (`block`)."""
    return {
        "ffn_gate_inp": f"{block}.gate",
        **{f"ffn_{p}_exps": f"{block}.switch_mlp.{p}_proj" for p in ("gate", "up", "down")},
    }


# Per-architecture differences from the table above (llama.cpp's tensor_mapping.py).
_ARCH_TENSOR_NAMES = {
    # Gemma 2/3: four norms per block; ffn_norm is the pre-feed-forward one
    "gemma2": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    # Phi-3: the checkpoint's fused projections; ffn_up holds gate_up_proj
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Mixtral (dense llama files hold none of these) and Qwen3-MoE
    "llama": make_moe_tensor_names("block_sparse_moe"),
    "qwen3moe": make_moe_tensor_names("mlp"),
}
_ARCH_TENSOR_NAMES["gemma3"] = _ARCH_TENSOR_NAMES["gemma2"]
# Qwen 3.5's linear-attention layers (gguf-py's tensor_mapping.py). Keys with a dot name a whole
# tensor: transformers' dt_bias and A_log carry no .weight/.bias suffix (ssm_a holds A: see
# undo_gated_delta_transforms).
_ARCH_TENSOR_NAMES["qwen35"] = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Qwen 3.5 MoE and Qwen3-Next: the routed experts and the shared expert, gated by sigmoid(ffn_gate_inp_shexp);
# Qwen3-Next's b|a projection stays one tensor (its q|k|v|z one comes split: undo_gated_delta_transforms)
_ARCH_TENSOR_NAMES["qwen35moe"] = {
    **_ARCH_TENSOR_NAMES["qwen35"],
    **make_moe_tensor_names("mlp"),
    **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")},
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_TENSOR_NAMES["qwen3next"] = {**_ARCH_TENSOR_NAMES["qwen35moe"], "ssm_ba": "linear_attn.in_proj_ba"}
# OLMo 2/3: the norms after attention and after the MLP (no norm before them)
_ARCH_TENSOR_NAMES["olmo2"] = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GLM-4: the fused gate_up_proj in ffn_up, and the norms after attention and after the MLP
_ARCH_TENSOR_NAMES["glm4"] = {
    "ffn_up": "mlp.gate_up_proj",
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
# GLM-4.5: post_attention_norm is the pre-MLP norm; dense leading layers' ffn_* are the default names;
# the router's score-correction bias is exp_probs_b.bias (the converter renames e_score_correction_bias)
_ARCH_TENSOR_NAMES["glm4moe"] = {
    "post_attention_norm": "post_attention_layernorm",
    **make_moe_tensor_names("mlp"),
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# gpt-oss: post_attention_norm is the pre-MLP norm; the sinks a whole tensor (the converter adds .weight);
# the router and the experts carry biases (experts.{gate,up,down}_proj, mlx-lm's names)
_ARCH_TENSOR_NAMES["gpt-oss"] = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")},
}
# Gemma 4: Gemma 2's four norms, the experts' three more, the per-layer input branch (inp_gate, proj,
# post_norm) and its embeddings, the layer scalar; the router's scale and the per-expert scales are
# `.scale` tensors beside the router's and the down experts' weights; gate and up experts one tensor
# (split by undo_gemma4_transforms); rope_freqs (the global layers' rotated pairs) is read there too
_ARCH_TENSOR_NAMES["gemma4"] = {
    **_ARCH_TENSOR_NAMES["gemma2"],
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale.weight": "layer_scalar",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
    "rope_freqs.weight": "rope_freqs",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
}
# Llama 4: the feed-forward block is `feed_forward` (dense, or router + experts + shared expert);
# rope_freqs (llama3 scaling's per-pair factors) is read by undo_llama4_transforms
_ARCH_TENSOR_NAMES["llama4"] = {
    **{f"ffn_{p}": f"feed_forward.{p}_proj" for p in ("gate", "up", "down")},
    "ffn_gate_inp": "feed_forward.router",
    **{f"ffn_{p}_exps": f"feed_forward.experts.{p}_proj" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp": f"feed_forward.shared_expert.{p}_proj" for p in ("gate", "up", "down")},
    "rope_freqs.weight": "rope_freqs",
}
# Multi-head latent attention: the low-rank query and KV projections, kv_b split per head (embed_q / unembed_out,
# mlx-lm's names) or whole (older files: split by undo_mla_transforms); DeepSeek's MoE block with its shared
# experts and the sigmoid router's correction bias; Mistral 4's experts with gate and up as one tensor
_ARCH_TENSOR_NAMES["deepseek2"] = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
    **make_moe_tensor_names("mlp"),
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_ARCH_TENSOR_NAMES["mistral4"] = {**_ARCH_TENSOR_NAMES["deepseek2"], "ffn_gate_up_exps": "mlp.experts.gate_up_proj"}
# Nemotron-H: every block is a norm and one mixer (transformers' backbone.layers.N.mixer.*, renamed
# by our family to mixer / self_attn / mlp by kind)
_ARCH_TENSOR_NAMES["nemotron_h"] = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
}


def load_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """A GGUF file's tensors and metadata (see load_gguf_with_types)."""
    weights, metadata, _ = load_gguf_with_types(path)
    return weights, metadata


def read_gguf_index(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str]]]:
    """Metadata and {tensor: (shape, dtype as loading gives it)} without reading the weights
    (for the run fingerprint): MLX maps native files lazily; K-quant files load as float32."""
    metadata, tensors = gguf_reader.read_gguf_header(path)
    if {t.type_name for t in tensors} <= gguf_reader.MLX_NATIVE_TYPES:
        weights, metadata = load_gguf(path)
        return metadata, {name: (tuple(w.shape), str(w.dtype)) for name, w in weights.items()}
    dtypes = {"F16": str(mx.float16)}
    return metadata, {t.name: (t.shape, dtypes.get(t.type_name, str(mx.float32))) for t in tensors}


def load_gguf_with_types(path: Path) -> tuple[dict[str, mx.array], dict[str, Any], dict[str, int]]:
    """A GGUF file's tensors, metadata and tensor-type counts. Files of MLX's types go through
    mx.load (Q4_0/Q4_1/Q8_0 stay packed); others are dequantized to float32 by gguf_reader."""
    metadata, tensors = gguf_reader.read_gguf_header(path)
    types: dict[str, int] = {}
    for info in tensors:
        types[info.type_name] = types.get(info.type_name, 0) + 1
    if types.keys() <= gguf_reader.MLX_NATIVE_TYPES:
        try:
            weights, metadata = mx.load(str(path), return_metadata=True)
        except Exception as exc:  # MLX raises plain ValueError/RuntimeError with gguflib's message
            raise MlxcelError(f"cannot read GGUF file {path}: {exc} (is the file complete and a GGUF model?)") from exc
        return weights, metadata, types
    arrays = gguf_reader.load_gguf_numpy(path, tensors)
    return {name: mx.array(value) for name, value in arrays.items()}, metadata, types


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
    head_dim = get("attention.key_length", None, required=False) or hidden // heads
    config = {
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        # Qwen 3.5 MoE has no dense MLP, and its files no feed_forward_length
        "intermediate_size": get("feed_forward_length", None, required=arch not in SHARED_EXPERT_ARCHS),
        "vocab_size": get("vocab_size", None, required=False) or (len(tokens) if tokens else None),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "eos_token_id": read_metadata_value(metadata, "tokenizer.ggml.eos_token_id"),
        "rope_traditional": arch in INTERLEAVED_ROPE_ARCHS,
    }
    if config["vocab_size"] is None:
        raise MlxcelError(f"{path}: GGUF metadata gives no vocabulary size")
    if arch in GEMMA_ARCHS and tokens is not None and "<end_of_turn>" in tokens:
        # llama.cpp ends a Gemma turn at <end_of_turn> (its EOT, found by text); the file names only <eos>
        config["eos_token_id"] = [config["eos_token_id"], list(tokens).index("<end_of_turn>")]
    if arch in ("gemma2", "gemma3"):
        config.update(make_gemma_config(arch, get, config))
    if arch in MOE_FAMILIES:
        # llama files are dense unless they name experts; qwen3moe ones must
        experts = get("expert_count", None, required=arch != "llama")
        if experts:
            family = MOE_FAMILIES[arch]
            config.update(model_type=family, **make_moe_config(family, get, config, experts))
    if arch in SHARED_EXPERT_ARCHS:
        config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
        config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
    if arch == "phi3":
        config["partial_rotary_factor"] = get("rope.dimension_count", head_dim) / head_dim
        config["sliding_window"] = get("attention.sliding_window", None, required=False)
    if arch in GATED_DELTA_ARCHS:
        config.update(make_gated_delta_config(get, config, path))
    if arch in MAMBA2_ARCHS:
        config.update(make_mamba2_config(get, config, path))
    if arch == "olmo2" and get("attention.sliding_window", None, required=False) is not None:
        family = "olmo3"
        config.update(make_olmo3_config(get, config, path))
    if arch in NO_ROPE_STEP:
        config["no_rope_layer_interval"] = NO_ROPE_STEP[arch]
    if arch == "gpt-oss":
        config.update(make_gpt_oss_config(get))
    if arch in GLM_ARCHS:
        config["partial_rotary_factor"] = get("rope.dimension_count", head_dim) / head_dim
    if arch == "glm4moe":
        config.update(make_glm4moe_config(get, config, path))
    if arch == "gemma4":
        config.update(make_gemma4_config(get, config, path, tokens))
    if arch == "llama4":
        config.update(make_llama4_config(get, config, path))
    if arch in MLA_ARCHS:
        config.update(make_mla_config(arch, get, config, path))
        family = config["model_type"]
    return family, config


def make_mla_config(arch: str, get, config: dict, path: Path) -> dict:
    """DeepSeek V2/V3 (`deepseek2`) and Mistral 4 (`mistral4`) from the keys DeepseekV2Model.set_gguf_parameters
    writes, read as llama.cpp reads them: the heads' widths from key_length_mla / value_length_mla (older
    files: key_length / value_length), the RoPE key's from rope.dimension_count; the router from
    expert_gating_func (absent: softmax, but for GLM-4.7-Flash's shape, as llama.cpp), a sigmoid one
    being DeepSeek V3's, a softmax one V2's (never renormalised: transformers' DeepseekV2 reads no
    norm_topk_prob) or Mistral 4's; leading_dense_block_count, expert groups, weights' norm and scale
    (absent: 0, none, off, 1). q_lora_rank is read from the tensors (undo_mla_transforms)."""
    rope = get("rope.dimension_count")
    key, value = get("attention.key_length_mla", None, required=False), None
    if key:
        value = get("attention.value_length_mla")
    else:  # written before llama.cpp split kv_b: key_length and value_length are the heads'
        key, value = get("attention.key_length"), get("attention.value_length")
    if not 0 < rope < key:
        raise MlxcelError(
            f"{path}: GGUF metadata gives a RoPE key of {rope} (rope.dimension_count) in heads {key} wide: the "
            "heads' keys need room beside it (is key_length_mla missing?)"
        )
    layers = config["num_hidden_layers"] - (get("nextn_predict_layers", 0, required=False) or 0)
    experts = get("expert_count", 0, required=False) or 0
    gating = get("expert_gating_func", None, required=False)
    if gating is None:  # llama.cpp: the DeepSeek V2 files written before the key; GLM-4.7-Flash's by its shape
        gating = GATING_SIGMOID if layers in (47, 48) and config["vocab_size"] == 154880 else GATING_SOFTMAX
    groups = get("expert_group_count", 1, required=False) or 1
    used_groups = get("expert_group_used_count", groups, required=False) or groups
    normalize = bool(get("expert_weights_norm", False, required=False))
    family = "mistral4" if arch == "mistral4" else "deepseek_v3" if gating == GATING_SIGMOID else "deepseek_v2"
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID) or (arch == "mistral4" and gating != GATING_SOFTMAX):
        routers = "1 (softmax)" if arch == "mistral4" else "1 (softmax) or 2 (sigmoid)"
        raise MlxcelError(
            f"{path}: GGUF metadata '{arch}.expert_gating_func' is {gating}; {arch} routes with {routers}"
        )
    if family == "deepseek_v2" and normalize and experts:
        raise MlxcelError(
            f"{path}: GGUF metadata '{arch}.expert_weights_norm' is true with a softmax router: DeepSeek V2's "
            "softmax router never renormalises its top-k weights (transformers' DeepseekV2), and no family here "
            "reads that combination"
        )
    return {
        "model_type": family,
        "num_hidden_layers": layers,
        "num_key_value_heads": config["num_attention_heads"],
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "q_lora_rank": get("attention.q_lora_rank", None, required=False) or None,
        "qk_nope_head_dim": key - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": value,
        "rope_interleave": True,
        "n_routed_experts": experts,
        "num_experts_per_tok": get("expert_used_count") if experts else 1,
        "moe_intermediate_size": get("expert_feed_forward_length") if experts else 0,
        "n_shared_experts": get("expert_shared_count", 0, required=False) or 0,
        "first_k_dense_replace": get("leading_dense_block_count", 0, required=False) or 0,
        "moe_layer_freq": 1,
        "n_group": groups,
        "topk_group": used_groups,
        "norm_topk_prob": normalize,
        "routed_scaling_factor": get("expert_weights_scale", 1.0, required=False) or 1.0,
        "topk_method": "group_limited_greedy" if used_groups < groups else "greedy",
        "rope_scaling": read_mla_rope_scaling(arch, get, path),
    }


def read_mla_rope_scaling(arch: str, get, path: Path) -> dict | None:
    """YaRN as DeepseekV2Model writes it (yarn_log_multiplier = 0.1 * mscale_all_dim, undone as llama.cpp
    does; the rotary mscale taken equal to it, as in every released config), or linear; Mistral 4's query
    scale (llama_4_scaling_beta, in steps of the original context) beside it."""
    kind = get("rope.scaling.type", None, required=False)
    scaling = None
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
        optional = {
            "beta_fast": "yarn_beta_fast",
            "beta_slow": "yarn_beta_slow",
            "attention_factor": "yarn_attn_factor",
        }
        for name, key in optional.items():
            if (found := get(f"rope.scaling.{key}", None, required=False)) is not None:
                scaling[name] = found
        if log_multiplier := get("rope.scaling.yarn_log_multiplier", None, required=False):
            scaling["mscale"] = scaling["mscale_all_dim"] = log_multiplier / 0.1
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif kind not in (None, "none"):
        raise MlxcelError(
            f"{path}: GGUF metadata '{arch}.rope.scaling.type' is {kind!r}; read here: yarn, linear, none"
        )
    if arch != "mistral4":
        return scaling
    beta = get("attention.temperature_scale", None, required=False)
    length = get("attention.temperature_length", None, required=False)
    if scaling is not None and scaling["rope_type"] == "yarn":
        length = scaling["original_max_position_embeddings"]  # (transformers' one key for both)
    return {
        **(scaling or {"rope_type": "default"}),
        "llama_4_scaling_beta": 0.1 if beta is None else beta,  # (the released config's: the converter drops it)
        "original_max_position_embeddings": length or 8192,
    }


def make_gpt_oss_config(get) -> dict:
    """gpt-oss as GptOssModel.set_gguf_parameters writes it: experts (expert_feed_forward_length wide),
    the window, YaRN's keys. What the file does not say is what llama.cpp and transformers both take:
    even layers slide (llama.cpp's swa pattern 2), the clamp (7.0, alpha 1.702). YaRN's correction range
    stays unrounded (truncate false), as the released config.json says and transformers computes it
    (llama.cpp rounds it, as it does for every YaRN model), so the file gives the safetensors' model."""
    rope = {"rope_type": "default"}
    if get("rope.scaling.type", None, required=False) == "yarn":
        rope = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0, required=False),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0, required=False),
            "truncate": False,
        }
        if (attention_factor := get("rope.scaling.yarn_attn_factor", None, required=False)) is not None:
            rope["attention_factor"] = attention_factor
    return {
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "intermediate_size": get("expert_feed_forward_length"),
        "sliding_window": get("attention.sliding_window"),
        "attention_bias": True,
        "rope_scaling": rope,
    }


def make_glm4moe_config(get, config: dict, path: Path) -> dict:
    """GLM-4.5's settings from the keys Glm4MoeModel.set_gguf_parameters writes, read as llama.cpp reads
    them: block_count counts the multi-token-prediction blocks appended after the decoder's
    (nextn_predict_layers), expert_weights_norm defaults to false and leading_dense_block_count to 0,
    the gating must be sigmoid (2), and routing is over all experts (llama.cpp reads no expert groups
    for glm4moe; the released models have n_group 1). Q/K norms and attention biases are read from the
    tensors (undo_glm_transforms)."""
    gating = get("expert_gating_func", 2, required=False)
    if gating != 2:
        raise MlxcelError(
            f"{path}: GGUF metadata 'glm4moe.expert_gating_func' is {gating}; GLM-4.5 routes with 2 (sigmoid)"
        )
    extra = get("nextn_predict_layers", 0, required=False) or 0
    if not 0 <= extra < config["num_hidden_layers"]:
        raise MlxcelError(
            f"{path}: GGUF metadata gives {extra} multi-token-prediction layers of {config['num_hidden_layers']} blocks"
        )
    return {
        "num_hidden_layers": config["num_hidden_layers"] - extra,
        "n_routed_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "n_shared_experts": get("expert_shared_count"),
        "first_k_dense_replace": get("leading_dense_block_count", 0, required=False),
        "routed_scaling_factor": get("expert_weights_scale"),
        "norm_topk_prob": bool(get("expert_weights_norm", False, required=False)),
        "n_group": 1,
        "topk_group": 1,
    }


def make_olmo3_config(get, config: dict, path: Path) -> dict:
    """OLMo 3 as Olmo2Model.set_gguf_parameters writes it: the window, which layers slide (a bool
    per layer), the full-attention layers' theta and YaRN keys, the sliding ones' theta
    (freq_base_swa; llama.cpp runs those layers without YaRN, as transformers)."""
    n = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", None, required=False)
    slides = pattern if pattern is not None else [(i + 1) % 4 != 0 for i in range(n)]
    full = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    if get("rope.scaling.type", None, required=False) == "yarn":
        optional = {
            "attention_factor": get("rope.scaling.yarn_attn_factor", None, required=False),
            "beta_fast": get("rope.scaling.yarn_beta_fast", None, required=False),
            "beta_slow": get("rope.scaling.yarn_beta_slow", None, required=False),
        }
        full.update(
            rope_type="yarn",
            factor=get("rope.scaling.factor"),
            original_max_position_embeddings=get("rope.scaling.original_context_length"),
            **{k: v for k, v in optional.items() if v is not None},
        )
    sliding = {"rope_theta": get("rope.freq_base_swa", config["rope_theta"], required=False), "rope_type": "default"}
    slides = read_per_layer(slides, n, "olmo2.attention.sliding_window_pattern", path)
    return {
        "model_type": "olmo3",
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["sliding_attention" if slide else "full_attention" for slide in slides],
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
    }


def make_gemma4_config(get, config: dict, path: Path, tokens: list | None) -> dict:
    """Gemma 4 as Gemma4Model.set_gguf_parameters writes it: key_length is the global layers' head
    size, key_length_swa the sliding ones'; head_count_kv and feed_forward_length one value or one
    a layer (the global layers' KV heads; the shared layers' double-wide MLPs); which layers slide
    (a bool a layer), the shared layers' count, the per-layer input width (0: none), the experts.
    The global layers' partial rotation, whether their keys double as values and the per-layer
    vocabulary come from the tensors (undo_gemma4_transforms). Its turn ends at <turn|>, as
    transformers' GGUF loader says (and at <|tool_response>)."""
    n = config["num_hidden_layers"]
    slides = read_per_layer(get("attention.sliding_window_pattern"), n, "gemma4.attention.sliding_window_pattern", path)
    kv = read_per_layer(get("attention.head_count_kv"), n, "gemma4.attention.head_count_kv", path)
    ff = read_per_layer(get("feed_forward_length"), n, "gemma4.feed_forward_length", path)
    shared = get("attention.shared_kv_layers", 0, required=False) or 0
    first_shared = n - shared
    sliding_kv = {kv[i] for i in range(n) if slides[i]} or {kv[0]}
    wide = {ff[i] for i in range(first_shared, n)}
    if (
        len(sliding_kv) > 1
        or {ff[i] for i in range(first_shared)} - {ff[0]}
        or wide - {ff[0], 2 * ff[0]}
        or len(wide) > 1
    ):
        raise MlxcelError(
            f"{path}: GGUF metadata gives sliding layers {sorted(sliding_kv)} KV heads and feed-forward widths {ff}: "
            "Gemma 4 has one KV head count for its sliding layers and one width (doubled in the shared layers at most)"
        )
    global_dim = get("attention.key_length")
    experts = get("expert_count", 0, required=False) or 0
    eos = config["eos_token_id"]
    ends = [list(tokens).index(t) for t in ("<turn|>", "<|tool_response>") if tokens is not None and t in tokens]
    return {
        "head_dim": get("attention.key_length_swa", global_dim, required=False),
        "num_key_value_heads": sliding_kv.pop(),
        "per_layer_config": {
            str(i): {"head_dim": global_dim, "num_key_value_heads": kv[i]} for i in range(n) if not slides[i]
        },
        "layer_types": ["sliding_attention" if slide else "full_attention" for slide in slides],
        "sliding_window": get("attention.sliding_window"),
        "num_kv_shared_layers": shared,
        "intermediate_size": ff[0],
        "use_double_wide_mlp": wide == {2 * ff[0]},
        "hidden_size_per_layer_input": get("embedding_length_per_layer_input", 0, required=False) or 0,
        "vocab_size_per_layer_input": config["vocab_size"],
        "final_logit_softcapping": get("final_logit_softcapping", None, required=False),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": config["rope_theta"]},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": get("rope.freq_base_swa", 10_000.0, required=False),
            },
        },
        "enable_moe_block": bool(experts),
        "num_experts": experts,
        "top_k_experts": get("expert_used_count") if experts else 0,
        "moe_intermediate_size": get("expert_feed_forward_length") if experts else 0,
        "eos_token_id": ([eos] if isinstance(eos, int) else list(eos or [])) + ends,
    }


def make_llama4_config(get, config: dict, path: Path) -> dict:
    """Llama 4 as llama.cpp runs its files: feed_forward_length is the dense layers' width (the
    converter swaps it with the experts'), MoE every interleave_moe_layer_step-th layer, and what
    the file does not say, llama.cpp's literals: 8192-token chunks on three layers in four, the
    fourth NoPE with temperature tuning (floor 8192, scale 0.1), QK norm but for the 128-expert
    model (Maverick)."""
    if get("attention.sliding_window", None, required=False) == 0:
        raise MlxcelError(
            f"{path}: a llama4 GGUF without chunked attention (attention.sliding_window 0: MobileLLM) is not "
            "supported; give its HF folder as model.path"
        )
    experts = get("expert_count", 0, required=False) or 0
    step = get("interleave_moe_layer_step")
    layers = config["num_hidden_layers"]
    return {
        "intermediate_size_mlp": config["intermediate_size"],
        "intermediate_size": get("expert_feed_forward_length"),
        "num_local_experts": experts,
        "num_experts_per_tok": get("expert_used_count", 1, required=False),
        "moe_layers": [i for i in range(layers) if step > 0 and (i + 1) % step == 0] if experts else [],
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": experts != 128,
    }


def make_gemma_config(arch: str, get, config: dict) -> dict:
    """Gemma 2/3 keys llama.cpp writes, and the ones it derives instead of storing."""
    # llama.cpp: queries scaled by 1/sqrt(hidden / heads) on the 27B models, else 1/sqrt(head_dim)
    is_27b = config["num_hidden_layers"] in (46, 62)
    extra = {
        "sliding_window": get("attention.sliding_window", None, required=False),
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if is_27b
        else config["head_dim"],
    }
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = get("attn_logit_softcapping", None, required=False)
        extra["final_logit_softcapping"] = get("final_logit_softcapping", None, required=False)
    else:  # local layers' base is fixed at 10k in llama.cpp; every 6th layer is global
        extra["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer llama.cpp: one flag per layer, true = sliding
            extra["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
        else:
            extra["sliding_window_pattern"] = pattern
        if get("rope.scaling.type", None, required=False) == "linear":
            extra["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return extra


def make_moe_config(family: str, get, config: dict, experts: int) -> dict:
    """Expert counts under the keys the family's ModelArgs reads."""
    used = get("expert_used_count")
    if family == "mixtral":  # softmax, top-k, renormalised: as llama.cpp's llama arch routes
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    # llama.cpp's qwen3moe makes every layer sparse and always renormalises the top-k weights:
    # GGUF has no norm_topk_prob key (the released Qwen3-MoE models set it true). Its expert
    # width without expert_feed_forward_length, feed_forward_length / expert_used_count, is ours too.
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": get("expert_feed_forward_length", None, required=config["intermediate_size"] is None)
        or config["intermediate_size"] // used,
    }


def make_gated_delta_config(get, config: dict, path: Path) -> dict:
    """The linear-attention settings from the keys Qwen3NextModel.set_gguf_parameters writes:
    ssm.state_size is the key head width, ssm.group_count the key heads, ssm.time_step_rank the
    value heads and ssm.inner_size their total width. llama.cpp makes layer i recurrent unless
    (i + 1) % full_attention_interval == 0 (default 4); RoPE turns rope.dimension_count of each head
    (text positions only: the M-RoPE sections see one position, which is plain RoPE)."""
    value_heads, inner = get("ssm.time_step_rank"), get("ssm.inner_size")
    interval = get("full_attention_interval", 4)
    if value_heads <= 0 or inner % value_heads or interval <= 0:
        raise MlxcelError(
            f"{path}: GGUF metadata gives ssm.inner_size {inner}, ssm.time_step_rank {value_heads} and "
            f"full_attention_interval {interval}: the inner size must be a whole number of value heads, "
            "and the interval positive"
        )
    layers = config["num_hidden_layers"]
    return {
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_num_key_heads": get("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "partial_rotary_factor": get("rope.dimension_count", config["head_dim"]) / config["head_dim"],
    }


def make_mamba2_config(get, config: dict, path: Path) -> dict:
    """Nemotron-H's settings from the keys GraniteHybridModel and NemotronHModel.set_gguf_parameters
    write. llama.cpp reads a block's kind from two per-layer arrays: head_count_kv > 0 is attention,
    feed_forward_length > 0 an MLP, neither a Mamba-2 mixer. ssm.time_step_rank is the Mamba heads,
    ssm.inner_size their total width, ssm.group_count the B/C groups. The converter drops
    head_dim's RoPE (these attention layers have none) but keeps key_length."""
    layers = config["num_hidden_layers"]
    kv_heads = read_per_layer(get("attention.head_count_kv"), layers, "attention.head_count_kv", path)
    ff = read_per_layer(get("feed_forward_length"), layers, "feed_forward_length", path)
    heads, inner = get("ssm.time_step_rank"), get("ssm.inner_size")
    if heads <= 0 or inner % heads:
        raise MlxcelError(
            f"{path}: GGUF metadata gives ssm.inner_size {inner} and ssm.time_step_rank {heads}: the inner size "
            "must be a whole number of Mamba heads"
        )
    eps = get("attention.layer_norm_rms_epsilon", None, required=False)
    return {
        "layers_block_type": ["attention" if kv else "mlp" if width else "mamba" for kv, width in zip(kv_heads, ff)],
        "num_key_value_heads": max(kv_heads) or config["num_attention_heads"],
        "intermediate_size": max(ff),
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "ssm_state_size": get("ssm.state_size"),
        "n_groups": get("ssm.group_count"),
        "conv_kernel": get("ssm.conv_kernel"),
        "layer_norm_epsilon": eps or get("attention.layer_norm_epsilon", 1e-5),
    }


def read_per_layer(value: Any, layers: int, key: str, path: Path) -> list[int]:
    """A per-layer GGUF array (or one value for every layer), one entry a layer."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise MlxcelError(f"{path}: GGUF metadata '{key}' holds {len(values)} entries for {layers} blocks")
    return values


def check_expert_tensors(weights: dict[str, mx.array], config: dict, arch: str, path: Path) -> None:
    """Before renaming (errors name llama.cpp's tensors): an MoE file holds every layer's router and
    stacked experts, expert_count of each; a file whose metadata names no experts holds none."""
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    if not experts:
        stray = next((name for name in sorted(weights) if is_expert_tensor(name)), None)
        if stray is not None:
            raise MlxcelError(
                f"{path}: tensor {stray!r} belongs to a mixture of experts, but the GGUF metadata lacks "
                f"'{arch}.expert_count'"
            )
        return
    layers = range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"])  # (GLM-4.5: dense first)
    for layer in config.get("moe_layers", layers):  # (Llama 4: MoE interleaved with dense layers)
        for base in ARCH_EXPERT_TENSORS.get(arch, EXPERT_TENSORS):
            name = f"blk.{layer}.{base}.weight"
            if name not in weights:
                raise MlxcelError(f"{path}: MoE GGUF ('{arch}.expert_count' = {experts}) lacks tensor {name!r}")
            if weights[name].shape[0] != experts:
                raise MlxcelError(
                    f"{path}: tensor {name!r} holds {weights[name].shape[0]} experts, but '{arch}.expert_count' says "
                    f"{experts}"
                )


def is_expert_tensor(name: str) -> bool:
    match = re.fullmatch(r"blk\.\d+\.(\w+)\.\w+", name)
    return match is not None and match.group(1) in (*EXPERT_TENSORS, *ARCH_EXPERT_TENSORS["gemma4"])


def read_phi3_longrope(weights: dict[str, mx.array], metadata: dict[str, Any], config: dict) -> None:
    """Phi-3 long-context RoPE: llama.cpp stores the factors as tensors, popped here into config."""
    long, short = weights.pop("rope_factors_long.weight", None), weights.pop("rope_factors_short.weight", None)
    if long is None or short is None:
        return
    original = read_metadata_value(metadata, "phi3.rope.scaling.original_context_length")
    config["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": long.tolist(),
        "short_factor": short.tolist(),
        "original_max_position_embeddings": original,
        "attention_factor": read_metadata_value(metadata, "phi3.rope.scaling.attn_factor"),
    }


def mark_unknown_token(metadata: dict[str, Any]) -> dict[str, Any]:
    """A SentencePiece vocabulary whose unknown token is typed as control (Gemma 3's GGUF files):
    llama.cpp takes the unknown id from tokenizer.ggml.unknown_token_id, so type that entry 2
    (unknown) for the SentencePiece rebuild, which needs one."""
    types = read_metadata_value(metadata, "tokenizer.ggml.token_type")
    unknown = read_metadata_value(metadata, "tokenizer.ggml.unknown_token_id")
    if read_metadata_value(metadata, "tokenizer.ggml.model") != "llama" or not types or 2 in types:
        return metadata
    if isinstance(unknown, int) and 0 <= unknown < len(types):
        types = list(types)
        types[unknown] = 2
        return {**metadata, "tokenizer.ggml.token_type": types}
    return metadata


def undo_converter_transforms(
    weights: dict[str, mx.array], arch: str, config: dict, path: Path | None = None
) -> dict[str, mx.array]:
    """Renamed tensors back to the values our family holds, where llama.cpp's converter changed them."""
    if arch in GEMMA_ARCHS:
        return undo_gemma_norm_offset(weights)
    if arch in GATED_DELTA_ARCHS:
        return undo_gated_delta_transforms(weights, config, path, tiled=arch in TILED_VALUE_HEAD_ARCHS)
    if arch in MAMBA2_ARCHS:
        return undo_mamba2_transforms(weights)
    if arch in GLM_ARCHS:
        return undo_glm_transforms(weights, config)
    if arch == "gemma4":
        return undo_gemma4_transforms(weights, config, path)
    if arch in MLA_ARCHS:
        return undo_mla_transforms(weights, config, path)
    if arch == "llama4":
        freqs = weights.pop("rope_freqs", None)  # llama3 scaling: each rotated pair's wavelength factor
        if freqs is not None:
            config["rope_factors"] = freqs.astype(mx.float32).tolist()
    return weights


def undo_gemma4_transforms(weights: dict[str, mx.array], config: dict, path: Path | None = None) -> dict[str, mx.array]:
    """Gemma 4's norms are stored as they are (no 1 + w). rope_freqs gives the global layers'
    rotation: 1 for a rotated pair, 1e30 (no rotation) for the rest; the global layers' keys are
    their values where they have no attn_v; the per-layer vocabulary is its embedding's rows; gate
    and up experts come as one tensor [E, 2I, H]; shared layers' own K/V weights (the Hub's
    checkpoints keep them, unused) are dropped."""
    freqs = weights.pop("rope_freqs", None)
    global_dim = next((c["head_dim"] for c in config["per_layer_config"].values()), config["head_dim"])
    if freqs is not None:
        values = freqs.astype(mx.float32).tolist()
        if len(values) != global_dim // 2 or any(v != 1.0 and v < 1e29 for v in values):
            raise MlxcelError(
                f"{path}: rope_freqs holds {len(values)} factors other than 1 and 1e30; Gemma 4's global layers "
                f"take {global_dim // 2}, 1 for each rotated pair and 1e30 for the rest"
            )
        config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 2 * values.count(1.0) / global_dim
    full = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    owner = next((i for i in full if i < first_shared), None)
    config["attention_k_eq_v"] = owner is not None and f"model.layers.{owner}.self_attn.v_proj.weight" not in weights
    if "model.embed_tokens_per_layer.weight" in weights:
        config["vocab_size_per_layer_input"] = weights["model.embed_tokens_per_layer.weight"].shape[0]
    out = {}
    for key, value in weights.items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= first_shared and parts[3] == "self_attn":
            if parts[4] in ("k_proj", "v_proj", "k_norm"):
                continue
        out[key] = value
    return split_gate_up_experts(out, "experts.gate_up_proj", "experts.switch_glu")


def split_gate_up_experts(weights: dict[str, mx.array], fused: str, into: str) -> dict[str, mx.array]:
    """Experts whose gate and up come as one tensor [E, 2I, H] (`fused`, each part: weight, scales,
    biases) split into `into`.gate_proj and `into`.up_proj (Gemma 4's and Mistral 4's files)."""
    out = {}
    for key, value in weights.items():
        if f".{fused}." not in key:
            out[key] = value
            continue
        base, part = key.split(f".{fused}.")
        out[f"{base}.{into}.gate_proj.{part}"], out[f"{base}.{into}.up_proj.{part}"] = mx.split(value, 2, axis=1)
    return out


def undo_mla_transforms(weights: dict[str, mx.array], config: dict, path: Path | None = None) -> dict[str, mx.array]:
    """The latent-attention families' tensors as they hold them: the multi-token-prediction blocks after the
    decoder's dropped; q_lora_rank read from q_a_proj (llama.cpp reads no key for it in some files); an older
    file's kv_b_proj [H * (nope + v), R] split per head into embed_q [H, R, nope] and unembed_out [H, v, R]
    (mla.split_kv_b; dequantized first: the pieces stay dense); Mistral 4's gate_up experts [E, 2I, H] split in
    two; a sigmoid router without its correction bias (optional to llama.cpp) given a zero one."""
    from mlxcel.models.glm4_moe import is_past_last_layer
    from mlxcel.models.mla import split_kv_b

    layers = config["num_hidden_layers"]
    weights = {k: v for k, v in weights.items() if not is_past_last_layer(k, layers)}
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    config["q_lora_rank"] = weights[q_a].shape[0] if q_a in weights else None
    heads, nope, width = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    for prefix in sorted(k[: -len(".weight")] for k in weights if k.endswith(".self_attn.kv_b_proj.weight")):
        if f"{prefix}.scales" in weights:
            dequantize_gguf_tensor(weights, prefix)
        packed = weights.pop(f"{prefix}.weight")
        expected = (heads * (nope + width), config["kv_lora_rank"])
        if tuple(packed.shape) != expected:
            raise MlxcelError(
                f"{path or 'GGUF file'}: tensor {prefix} has shape {tuple(packed.shape)}, but the GGUF metadata gives "
                f"{expected} ({heads} heads of {nope} + {width} over a latent of {config['kv_lora_rank']})"
            )
        attention = prefix[: -len(".kv_b_proj")]
        weights[f"{attention}.embed_q.weight"], weights[f"{attention}.unembed_out.weight"] = split_kv_b(
            packed, heads, nope
        )
    weights = split_gate_up_experts(weights, "mlp.experts.gate_up_proj", "mlp.switch_mlp")
    if config["model_type"] == "deepseek_v3" and config["n_routed_experts"]:
        for layer in range(config["first_k_dense_replace"], layers):
            weights.setdefault(
                f"model.layers.{layer}.mlp.gate.e_score_correction_bias", mx.zeros((config["n_routed_experts"],))
            )
    return weights


def undo_glm_transforms(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """GLM files keep transformers' values (GLM-4's interleaved and GLM-4.5's half-split Q/K rows alike);
    what the metadata does not say is read from the tensors, as llama.cpp does: Q/K/V biases
    (attention_bias) and GLM-4.5's Q/K norms (use_qk_norm). The multi-token-prediction blocks after the
    decoder's (their nextn.* tensors were skipped at renaming) are dropped: they do not generate."""
    layers = config["num_hidden_layers"]
    kept = {}
    for key, value in weights.items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
            continue
        kept[key] = value
    config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in kept
    config["use_qk_norm"] = "model.layers.0.self_attn.q_norm.weight" in kept
    return kept


def undo_gemma_norm_offset(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """llama.cpp's converter stores Gemma norms as 1 + w; our Gemma RMSNorm adds the 1 itself."""
    return {k: v.astype(mx.float32) - 1 if k.endswith("norm.weight") else v for k, v in weights.items()}


def undo_gated_delta_transforms(
    weights: dict[str, mx.array], config: dict, path: Path | None = None, tiled: bool = True
) -> dict[str, mx.array]:
    """Each linear-attention layer as our family holds it. The converter (Qwen3NextModel.modify_tensors)
    wrote ssm_a = -exp(A_log) and squeezed the conv kernel [C, 1, K] to [C, K] (ours: MLX's Conv1d
    [C, K, 1]). Qwen 3.5 (`tiled`): with more value heads than key heads, _LinearAttentionVReorderBase
    also moved the value heads from grouped by key head (transformers' order) to tiled, in in_proj_qkv's
    value rows, the conv's value channels, in_proj_z, in_proj_a/b, A_log and dt_bias (rows), and
    out_proj (columns). Qwen3-Next: in_proj_qkvz came as attn_qkv (all q, all k, all v) and attn_gate
    (all z), and in_proj_ba as it is (per key head: its b's, its a's). A tensor that is missing stays
    missing (the loader names it)."""
    weights = dict(weights)
    for layer in sorted({k.split(".linear_attn.")[0] for k in weights if ".linear_attn." in k}):
        prefix = f"{layer}.linear_attn"
        if f"{prefix}.A_log" in weights:
            weights[f"{prefix}.A_log"] = mx.log(-weights[f"{prefix}.A_log"].astype(mx.float32))
        if f"{prefix}.conv1d.weight" in weights:
            weights[f"{prefix}.conv1d.weight"] = weights[f"{prefix}.conv1d.weight"][..., None]
        try:
            if tiled and config["linear_num_value_heads"] != config["linear_num_key_heads"]:
                untile_layer_value_heads(weights, prefix, config)
            if f"{prefix}.in_proj_ba.weight" in weights:
                fuse_qkvz(weights, prefix, config)
        except ValueError as exc:  # a tensor's width is not the heads the metadata gives
            raise MlxcelError(
                f"{path or 'GGUF file'}: the tensors of {prefix} do not fit the GGUF metadata's ssm.* sizes "
                f"({exc}); is the file complete and from llama.cpp's converter?"
            ) from exc
    for key in [k for k in weights if k.endswith(".shared_expert_gate.weight") and weights[k].ndim == 1]:
        weights[key] = weights[key][None]  # a converter that squeezed [1, H]
    return weights


def fuse_qkvz(weights: dict[str, mx.array], prefix: str, config: dict) -> None:
    """Qwen3-Next's projections as our family holds them, in place: in_proj_qkvz = attn_qkv's rows then
    attn_gate's (its q|k|v|z order), in_proj_ba = all b's then all a's (the file keeps transformers'
    per-key-head groups)."""
    qkv, z, qkvz = f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z", f"{prefix}.in_proj_qkvz"
    if f"{qkv}.weight" in weights and f"{z}.weight" in weights:
        bits = {read_quantized_bits(weights, p) if f"{p}.scales" in weights else None for p in (qkv, z)}
        if len(bits) > 1:  # stored differently (one packed, or at two widths): both dense
            for part in (qkv, z):
                if f"{part}.scales" in weights:
                    dequantize_gguf_tensor(weights, part)
        for key in tensor_parts(weights, qkv):
            other = z + key[len(qkv) :]
            weights[qkvz + key[len(qkv) :]] = mx.concatenate([weights.pop(key), weights.pop(other)], axis=0)
    for key in tensor_parts(weights, f"{prefix}.in_proj_ba"):
        weights[key] = swap_blocks(weights[key], 0, config["linear_num_key_heads"], 2)


def swap_blocks(x: mx.array, axis: int, outer: int, inner: int) -> mx.array:
    """`axis` read as [outer, inner] blocks (each block's width, packed or not, kept whole) and
    rewritten as [inner, outer]."""
    axis %= x.ndim
    shape = x.shape
    blocks = x.reshape(*shape[:axis], outer, inner, -1, *shape[axis + 1 :])
    return blocks.swapaxes(axis, axis + 1).reshape(shape)


def undo_mamba2_transforms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Each Mamba-2 mixer as transformers holds it. Mamba2Model.modify_tensors (which NemotronHModel's
    Mamba blocks go through) wrote ssm_a = -exp(A_log) and ssm_d as [H, 1], the grouped norm's weight
    as [groups, width / groups] and the conv kernel squeezed to [C, K] (ours: MLX's Conv1d [C, K, 1]).
    The attention blocks' q/k rows were permuted per head for interleaved RoPE (undo_permute); these
    blocks have no RoPE and q.k is the same under one permutation of both, so they load as they are."""
    weights = dict(weights)
    for key in [k for k in weights if k.endswith(".mixer.A_log")]:
        prefix = key[: -len(".A_log")]
        weights[key] = mx.log(-weights[key].astype(mx.float32)).reshape(-1)
        for name in ("D", "norm.weight"):
            if f"{prefix}.{name}" in weights:
                weights[f"{prefix}.{name}"] = weights[f"{prefix}.{name}"].reshape(-1)
        if f"{prefix}.conv1d.weight" in weights:
            weights[f"{prefix}.conv1d.weight"] = weights[f"{prefix}.conv1d.weight"][..., None]
    return weights


def untile_layer_value_heads(weights: dict[str, mx.array], prefix: str, config: dict) -> None:
    """A Qwen 3.5 linear-attention layer's value heads back in transformers' order, in place: undo
    _reorder_v_heads, which read each value-head axis as [key head, value head of that key head] and
    wrote it as [value head, key head]."""
    key_heads = config["linear_num_key_heads"]
    untile = dict(outer=config["linear_num_value_heads"] // key_heads, inner=key_heads)
    key_dims = 2 * config["linear_key_head_dim"] * key_heads  # q and k rows (channels) come first
    for name, start in (("in_proj_qkv", key_dims), ("conv1d", key_dims), ("in_proj_z", 0)):
        for key in tensor_parts(weights, f"{prefix}.{name}"):
            rest, heads = weights[key][:start], weights[key][start:]
            weights[key] = mx.concatenate([rest, swap_blocks(heads, 0, **untile)], axis=0)
    rows = [*tensor_parts(weights, f"{prefix}.in_proj_a"), *tensor_parts(weights, f"{prefix}.in_proj_b")]
    for key in (*rows, f"{prefix}.A_log", f"{prefix}.dt_bias"):
        if key in weights:
            weights[key] = swap_blocks(weights[key], 0, **untile)
    out = f"{prefix}.out_proj"
    if f"{out}.scales" in weights and config["linear_value_head_dim"] % GGUF_GROUP_SIZE:
        dequantize_gguf_tensor(weights, out)  # a head's columns split a quantization group
    for key in tensor_parts(weights, out):
        weights[key] = swap_blocks(weights[key], -1, **untile)


def tensor_parts(weights: dict[str, mx.array], prefix: str) -> list[str]:
    """A layer's weight, and its scales and biases when it stays quantized (rows are independent; a
    quantized row's columns move in whole groups)."""
    return [f"{prefix}.{part}" for part in ("weight", "scales", "biases") if f"{prefix}.{part}" in weights]


def dequantize_gguf_tensor(weights: dict[str, mx.array], prefix: str) -> None:
    """One packed (weight, scales, biases) triple, or MXFP4 (weight, scales), as a dense float32 weight, in place."""
    if read_quantization(weights, prefix)["mode"] == "mxfp4":
        scales = weights.pop(f"{prefix}.scales")
        dense = mx.dequantize(weights[f"{prefix}.weight"], scales, group_size=32, bits=4, mode="mxfp4")
        weights[f"{prefix}.weight"] = dense.astype(mx.float32)  # (exact: E2M1 codes times powers of two)
        return
    bits = read_quantized_bits(weights, prefix)
    weights[f"{prefix}.weight"] = mx.dequantize(
        weights[f"{prefix}.weight"],
        # GGUF scales are fp16; dequantize in fp32 or every weight is rounded to fp16 (~1e-3 off)
        weights.pop(f"{prefix}.scales").astype(mx.float32),
        weights.pop(f"{prefix}.biases").astype(mx.float32),
        group_size=GGUF_GROUP_SIZE,
        bits=bits,
    )


def rename_gguf_weights(
    weights: dict[str, mx.array], arch: str = "llama", path: Path | None = None
) -> dict[str, mx.array]:
    """llama.cpp names (blk.3.attn_q.scales) -> ours (model.layers.3.self_attn.q_proj.scales)."""
    names = {**_TENSOR_NAMES, **_ARCH_TENSOR_NAMES.get(arch, {})}
    renamed = {}
    for name, value in weights.items():
        if arch in GLM_ARCHS | MLA_ARCHS and re.fullmatch(r"blk\.\d+\.nextn\.\w+\.\w+", name):
            continue  # a multi-token-prediction block's own tensors (undo_glm_transforms drops the rest of it)
        match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)(?:\.(weight|bias|scales|biases|scale))?", name)
        layer, base, kind = match.groups() if match else (None, None, None)
        whole = f"{base}.{kind}" if kind else base
        if match is not None and whole in names:  # a whole tensor's name (ssm_a, ssm_dt.bias)
            ours = names[whole]
        elif match is not None and kind is not None and base in names:
            ours = f"{names[base]}.{kind}"
        else:
            raise MlxcelError(f"{path or 'GGUF file'}: unexpected tensor {name!r} for GGUF architecture {arch!r}")
        prefix = f"model.layers.{layer}." if layer is not None else ""
        renamed[f"{prefix}{ours}"] = value
    return renamed


def read_quantization(weights: dict[str, mx.array], prefix: str) -> dict:
    """A packed layer's nn.quantize settings: MXFP4 tensors (gguf_reader.repack_mxfp4: E8M0 scales, uint8)
    as MLX's mxfp4 mode, the others affine with GGUF's group size."""
    if weights[f"{prefix}.scales"].dtype == mx.uint8:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": GGUF_GROUP_SIZE, "bits": read_quantized_bits(weights, prefix), "mode": "affine"}


def read_quantized_bits(weights: dict[str, mx.array], prefix: str) -> int:
    """Bits per weight of a quantized layer, from its packed width and its group count."""
    in_features = weights[f"{prefix}.scales"].shape[-1] * GGUF_GROUP_SIZE
    return weights[f"{prefix}.weight"].shape[-1] * 32 // in_features
