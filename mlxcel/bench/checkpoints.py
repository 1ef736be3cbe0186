"""The benchmark's checkpoints: HF folders (config.json + model.safetensors) that both mlxcel and
mlx-lm read, so the two run the very same weights.

- `smollm2`: the embedded SmolLM2-135M GGUF, dequantized into an HF folder (mlx-lm cannot read
  GGUF), with llama.cpp's Q/K row permutation undone so the usual (non-interleaved) RoPE applies.
- `qwen2.5-0.5b`, `llama-3.2-1b`: random weights in those models' shapes, seeded.
- `llama-16x64`: a random Llama of 16 layers 64 wide (SmolLM2's vocabulary): a step costs the
  host's graph building like a 1B model's, little compute, so host-side orders show on a CPU.
- `qwen3.5-0.8b`, `qwen3.5-moe-small`: hybrids (three Gated DeltaNet layers to one attention
  layer) in the real Qwen 3.5 folders' layout: transformers 5's `qwen3_5` / `qwen3_5_moe`
  configs (the text model's settings under `text_config`) and tensor names
  (`model.language_model.*`, conv1d [C, 1, K], zero-centred norms), with no vision tower.
  mlxcel's and mlx-lm's sanitize both read that layout, so the two run the same weights.
- `gpt-oss-small`: openai/gpt-oss-20b cut to fit a benchmark (4 of its 24 layers, 8 of its 32
  experts), in the released folder's layout: experts as MXFP4 blocks and E8M0 scales
  (`quantization_config` mxfp4), which both engines keep packed (MLX's mxfp4 mode).
- `gemma4-e2b-small`: google/gemma-4-E2B's language model cut to 10 of its 35 layers, in the
  released `gemma4` folder's layout (`text_config`, `model.language_model.*`), no vision or
  audio tower.
- `deepseek-v2-lite-small`: deepseek-ai/DeepSeek-V2-Lite (multi-head latent attention and
  DeepSeek's MoE) cut to 8 of its 27 layers, in the released `deepseek_v2` folder's layout, which
  is also what transformers 5.25's save_pretrained writes (per-expert `mlp.experts.N.*`) and what
  mlx-lm 0.32's deepseek_v2 sanitize stacks: see DEEPSEEK_V2_LITE_SMALL for where each number
  comes from and why the cut.
- any other value: a path to an HF folder; its config gets a top-level `rope_theta` (mlx-lm reads
  nothing else, transformers 5 writes it under `rope_parameters`) and its weights are linked.

Folders are written once per dtype under the work dir and reused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx

from mlxcel.checkpoints import gguf
from mlxcel.checkpoints.loader import resolve_model_path

WEIGHTS_FILE = "model.safetensors"  # mlx-lm globs model*.safetensors
INIT_STD = 0.02  # the usual init scale: logits spread enough that greedy ties are rare


def list_hybrid_layer_types(layers: int, interval: int = 4) -> list[str]:
    """Qwen 3.5's layer order: every `interval`-th layer full attention, the rest Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


# Qwen 3.5's text positions: M-RoPE's three sections see one position, so plain RoPE on the first
# quarter of each head.
QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
QWEN3_5_TEXT = {  # what Qwen3.5-0.8B and -35B-A3B share
    "head_dim": 256,
    "attn_output_gate": True,
    "attention_bias": False,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": QWEN3_5_ROPE,
    "eos_token_id": 248044,
}

# openai/gpt-oss-20b's config.json, cut to 4 of its 24 layers (two sliding / full pairs) and 8 of its
# 32 experts, each as wide as the real one, each token still routed to 4: 2.06B parameters (1.16B of
# them the untied embedding and head). YaRN's correction range is rounded (`truncate` true; the
# released config says false): mlx-lm 0.32 always rounds it, and the same frequencies on both sides
# keep the greedy-token check meaningful (rounding costs nothing either way).
GPT_OSS_LAYERS = 4
GPT_OSS_SMALL = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": GPT_OSS_LAYERS,
    "layer_types": ["sliding_attention", "full_attention"] * (GPT_OSS_LAYERS // 2),
    "sliding_window": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": True,
    },
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "initializer_range": 0.02,
    "use_cache": True,
    # as released: the experts in MXFP4, the rest in the folder's dtype
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
MXFP4_BLOCK = 32  # weights per E8M0 scale; a block's 32 E2M1 codes are 16 bytes
MXFP4_SCALE_BYTES = (119, 121)  # E8M0 exponents drawn from [119, 121): scales 2^-8, 2^-7, weights' RMS ~0.02


def list_gemma4_layer_types(layers: int, period: int = 5) -> list[str]:
    """Gemma 4 E2B's layer order: four sliding layers, then a full one."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


# google/gemma-4-E2B's language model (its config.json's text_config), cut to 10 of its 35 layers
# (two of its seven groups of four sliding layers and a full one); the last 5 share the keys and values
# of the last own layer of their type (E2B: the last 20 of 35) and have its double-wide MLP; every
# width as released. 1.59B parameters, 0.67B of them the per-layer input embeddings (a lookup).
GEMMA4_LAYERS = 10
GEMMA4_E2B_SMALL = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "tie_word_embeddings": True,
    "eos_token_id": [1, 106],
    "vision_config": None,
    "audio_config": None,
    "text_config": {
        "model_type": "gemma4_text",
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": GEMMA4_LAYERS,
        "layer_types": list_gemma4_layer_types(GEMMA4_LAYERS),
        "num_kv_shared_layers": GEMMA4_LAYERS // 2,
        "use_double_wide_mlp": True,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "attention_bias": False,
        "sliding_window": 512,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
        "hidden_size_per_layer_input": 256,
        "enable_moe_block": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
    },
}

# deepseek-ai/DeepSeek-V2-Lite's config.json (the released one: transformers' DeepseekV2Config docstring
# names that checkpoint, and the config as transformers 5 re-saves it, with the released folder's
# tensor list, 15,706,484,224 parameters, is in public model reports), read against transformers
# 5.25's DeepseekV2Config and mlx-lm 0.32's deepseek_v2 ModelArgs, which take every key below:
# - attention: 16 heads over hidden 2048; no query compression (q_lora_rank null: one q_proj to
#   16 x (128 + 64)); a latent of kv_lora_rank 512 and one shared RoPE key of qk_rope_head_dim 64
#   (kv_a_proj_with_mqa 2048 -> 576, kv_a_layernorm), decompressed by kv_b_proj to 16 x (128 + 128);
# - MLP: layer 0 dense (first_k_dense_replace 1, SwiGLU of 10944), then every layer (moe_layer_freq 1)
#   64 routed experts of 1408, 6 per token, plus n_shared_experts 2 (one shared MLP of 2 x 1408);
# - routing: softmax over the experts, greedy top-6 (topk_method greedy, scoring_func softmax,
#   n_group = topk_group = 1), weights not renormalised (norm_topk_prob false), routed_scaling_factor 1.0;
# - positions: rope_theta 10000, YaRN (factor 40 over original_max_position_embeddings 4096, beta_fast
#   32, beta_slow 1, mscale = mscale_all_dim = 0.707), max_position_embeddings 163840 (= 40 x 4096);
#   written as the released folder writes it (`rope_scaling` with `type`, top-level `rope_theta`):
#   transformers 5 reads it into rope_parameters, mlx-lm reads only these two keys;
# - rms_norm_eps 1e-6, vocabulary 102400, untied head, bos 100000, eos 100001.
# Cut to 8 of its 27 layers (the dense one and 7 MoE layers), every layer as wide as the real one and
# all 64 experts kept, each token still routed to 6: 4.60B parameters (0.42B of them the embedding
# and head), ~9.2 GB in bf16. The whole model (15.7B, ~31 GB in bf16) would be built again on every
# fresh GPU lease, and the ragged job could not fit: mlx-lm caches decompressed keys and values
# ([B, 16, L, 192] + [B, 16, L, 128] a layer, 27 x 16 x 320 values a position), which at 256 rows of
# up to ~1.5k positions is ~100 GB beside the two engines' 62 GB of weights on a 141 GB H200. Per
# layer (what the ratios measure, and the KV bytes a position per layer) the cut changes nothing.
DEEPSEEK_V2_LITE_LAYERS = 8
DEEPSEEK_V2_LITE_SMALL = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_hidden_layers": DEEPSEEK_V2_LITE_LAYERS,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "attention_bias": False,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "initializer_range": 0.02,
    "use_cache": True,
}

# Published shapes of the real models (their config.json), random weights; and one made-up shape.
RANDOM_SHAPES = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
    },
    "llama-16x64": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3.5-0.8B's language model, as its config.json gives it (no vision tower).
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {
            **QWEN3_5_TEXT,
            "model_type": "qwen3_5_text",
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "num_hidden_layers": 24,
            "layer_types": list_hybrid_layer_types(24),
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "linear_num_value_heads": 16,
            "tie_word_embeddings": True,
        },
    },
    # Qwen/Qwen3.5-35B-A3B's language model cut to fit a benchmark: 8 of its 40 layers (two groups
    # of three Gated DeltaNet and one attention layer) and 64 of its 256 experts, each layer as
    # wide as the real one, each token still routed to 8 experts plus the shared one.
    "qwen3.5-moe-small": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            **QWEN3_5_TEXT,
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "num_hidden_layers": 8,
            "layer_types": list_hybrid_layer_types(8),
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "linear_num_value_heads": 32,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
        },
    },
    "gpt-oss-small": GPT_OSS_SMALL,
    "gemma4-e2b-small": GEMMA4_E2B_SMALL,
    "deepseek-v2-lite-small": DEEPSEEK_V2_LITE_SMALL,
}
CHECKPOINT_NAMES = ("smollm2", *RANDOM_SHAPES)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def prepare_checkpoint(name: str, work_dir: Path, dtype: mx.Dtype) -> Path:
    """The HF folder for a checkpoint name or a model folder path, built on first use."""
    if name == "smollm2":
        return export_smollm2(work_dir / f"smollm2-{dtype_name(dtype)}", dtype)
    if name in RANDOM_SHAPES:
        return build_random_checkpoint(work_dir / f"{name}-{dtype_name(dtype)}", RANDOM_SHAPES[name], dtype)
    folder = Path(name).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(f"{name}: not a checkpoint name ({', '.join(CHECKPOINT_NAMES)}) nor an HF model folder")
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:8]  # two folders may share a name
    return link_hf_folder(folder, work_dir / f"folder-{folder.resolve().name}-{digest}")


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / WEIGHTS_FILE).exists()


def write_folder(folder: Path, config: dict, weights: dict[str, mx.array]) -> Path:
    """Write into a temporary sibling and rename, so an interrupted build is never reused."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mx.save_safetensors(str(partial / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def add_top_level_rope_theta(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config:
        config = {**config, "rope_theta": rope.get("rope_theta", 10000.0)}
    return config


def link_hf_folder(source: Path, folder: Path) -> Path:
    """A view of `source` for mlx-lm: its config with a top-level rope_theta, its files linked."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item.resolve())
    config = add_top_level_rope_theta(json.loads((source / "config.json").read_text()))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def unpermute_from_llama_cpp(weight: mx.array, n_head: int) -> mx.array:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute (interleaved pairs -> rotate-half rows)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def export_smollm2(folder: Path, dtype: mx.Dtype) -> Path:
    if is_complete(folder):
        return folder
    path = resolve_model_path("embedded:smollm2")
    weights, metadata = gguf.load_gguf(path)
    family, config = gguf.make_config_from_gguf(metadata, path)
    interleaved = config.pop("rope_traditional")
    weights = dequantize_gguf(gguf.rename_gguf_weights(weights))
    if interleaved:  # HF layout, so both engines run the standard RoPE on the same rows
        for key in list(weights):
            if key.endswith("self_attn.q_proj.weight"):
                weights[key] = unpermute_from_llama_cpp(weights[key], config["num_attention_heads"])
            elif key.endswith("self_attn.k_proj.weight"):
                weights[key] = unpermute_from_llama_cpp(weights[key], config["num_key_value_heads"])
    config.update(
        architectures=[f"{family.capitalize()}ForCausalLM"],
        tie_word_embeddings="lm_head.weight" not in weights,
        torch_dtype=dtype_name(dtype),
    )
    return write_folder(folder, config, {k: v.astype(dtype) for k, v in weights.items()})


def dequantize_gguf(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """GGUF Q4/Q8 triples -> dense fp32 (fp16 scales would round every weight otherwise)."""
    dense = {}
    for key, value in weights.items():
        if key.endswith((".scales", ".biases")):
            continue
        prefix = key[: -len(".weight")] if key.endswith(".weight") else None
        if prefix is not None and f"{prefix}.scales" in weights:
            value = mx.dequantize(
                value,
                weights[f"{prefix}.scales"].astype(mx.float32),
                weights[f"{prefix}.biases"].astype(mx.float32),
                group_size=gguf.GGUF_GROUP_SIZE,
                bits=gguf.read_quantized_bits(weights, prefix),
            )
        dense[key] = value.astype(mx.float32)
    return dense


def list_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama / Qwen2 / Qwen 3.5 / gpt-oss / Gemma 4 / DeepSeek V2 checkpoint."""
    if config["model_type"] == "deepseek_v2":
        return list_deepseek_v2_shapes(config)
    if config["model_type"] in HYBRID_TYPES:
        return list_qwen3_5_shapes(config)
    if config["model_type"] == "gpt_oss":
        return list_gpt_oss_shapes(config)
    if config["model_type"] == "gemma4":
        return list_gemma4_shapes(config)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qkv_bias = config["model_type"] == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
        if qkv_bias:
            for proj, rows in (
                ("q_proj", heads * head_dim),
                ("k_proj", kv_heads * head_dim),
                ("v_proj", kv_heads * head_dim),
            ):
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")
# RMSNorms that transformers computes as (1 + weight): a folder in its layout stores 0 for a unit norm
ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "language_model.norm.weight",
)


def list_qwen3_5_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers 5's Qwen3_5(Moe)ForConditionalGeneration tensors, less the vision tower and
    the multi-token-prediction head (neither engine reads them)."""
    text = config["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    key_dim, value_dim = k_heads * text["linear_key_head_dim"], v_heads * text["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    base = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {
        base + "embed_tokens.weight": (vocab, hidden),
        base + "norm.weight": (hidden,),
    }
    for i, kind in enumerate(text["layer_types"]):
        p = f"{base}layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update(
                {
                    a + "in_proj_qkv.weight": (conv_dim, hidden),
                    a + "in_proj_z.weight": (value_dim, hidden),
                    a + "in_proj_b.weight": (v_heads, hidden),
                    a + "in_proj_a.weight": (v_heads, hidden),
                    a + "conv1d.weight": (conv_dim, 1, text["linear_conv_kernel_dim"]),
                    a + "dt_bias": (v_heads,),
                    a + "A_log": (v_heads,),
                    a + "norm.weight": (text["linear_value_head_dim"],),
                    a + "out_proj.weight": (hidden, value_dim),
                }
            )
        else:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (2 * heads * head_dim, hidden),  # each head's query and output gate
                    a + "k_proj.weight": (kv_heads * head_dim, hidden),
                    a + "v_proj.weight": (kv_heads * head_dim, hidden),
                    a + "o_proj.weight": (hidden, heads * head_dim),
                    a + "q_norm.weight": (head_dim,),
                    a + "k_norm.weight": (head_dim,),
                }
            )
        m = p + "mlp."
        if text.get("num_experts"):
            experts, inter, shared = (
                text["num_experts"],
                text["moe_intermediate_size"],
                text["shared_expert_intermediate_size"],
            )
            shapes.update(
                {
                    m + "gate.weight": (experts, hidden),
                    m + "experts.gate_up_proj": (experts, 2 * inter, hidden),
                    m + "experts.down_proj": (experts, hidden, inter),
                    m + "shared_expert.gate_proj.weight": (shared, hidden),
                    m + "shared_expert.up_proj.weight": (shared, hidden),
                    m + "shared_expert.down_proj.weight": (hidden, shared),
                    m + "shared_expert_gate.weight": (1, hidden),
                }
            )
        else:
            inter = text["intermediate_size"]
            shapes.update(
                {
                    m + "gate_proj.weight": (inter, hidden),
                    m + "up_proj.weight": (inter, hidden),
                    m + "down_proj.weight": (hidden, inter),
                }
            )
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def list_gpt_oss_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers' GptOssForCausalLM tensors as the released folders store them: each expert
    projection as MXFP4 blocks [E, out, in/32, 16] and E8M0 scales [E, out, in/32] (uint8;
    gate_up's rows alternate gate and up) beside its bias [E, out]."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts = config["num_local_experts"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, rows, columns in (
            ("q_proj", heads * head_dim, hidden),
            ("k_proj", kv_heads * head_dim, hidden),
            ("v_proj", kv_heads * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
        ):
            shapes.update({f"{p}self_attn.{proj}.weight": (rows, columns), f"{p}self_attn.{proj}.bias": (rows,)})
        shapes.update(
            {
                p + "self_attn.sinks": (heads,),
                p + "mlp.router.weight": (experts, hidden),
                p + "mlp.router.bias": (experts,),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
        for proj, rows, columns in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            e = f"{p}mlp.experts.{proj}"
            blocks = columns // MXFP4_BLOCK
            shapes.update(
                {
                    e + "_blocks": (experts, rows, blocks, MXFP4_BLOCK // 2),
                    e + "_scales": (experts, rows, blocks),
                    e + "_bias": (experts, rows),
                }
            )
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


GEMMA4_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def list_gemma4_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers 5's Gemma4ForConditionalGeneration tensors, less the vision and audio towers: the
    dense models' (E2B, E4B, 31B); a KV-shared layer has no key/value projections of its own."""
    text = config["text_config"]
    if text.get("enable_moe_block") or text.get("attention_k_eq_v"):
        raise ValueError("the bench builds Gemma 4's dense layers only (no enable_moe_block, no attention_k_eq_v)")
    hidden, vocab, heads = text["hidden_size"], text["vocab_size"], text["num_attention_heads"]
    layers, per_layer = text["num_hidden_layers"], text.get("hidden_size_per_layer_input") or 0
    first_shared = layers - (text.get("num_kv_shared_layers") or 0)
    base = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {
        base + "embed_tokens.weight": (vocab, hidden),
        base + "norm.weight": (hidden,),
    }
    if per_layer:
        shapes.update(
            {
                base + "embed_tokens_per_layer.weight": (text["vocab_size_per_layer_input"], layers * per_layer),
                base + "per_layer_model_projection.weight": (layers * per_layer, hidden),
                base + "per_layer_projection_norm.weight": (per_layer,),
            }
        )
    for i, kind in enumerate(text["layer_types"]):
        p = f"{base}layers.{i}."
        head_dim = text["global_head_dim"] if kind == "full_attention" else text["head_dim"]
        kv = text["num_key_value_heads"] * head_dim
        a = p + "self_attn."
        shapes.update(
            {
                a + "q_proj.weight": (heads * head_dim, hidden),
                a + "q_norm.weight": (head_dim,),
                a + "o_proj.weight": (hidden, heads * head_dim),
            }
        )
        if i < first_shared:
            shapes.update({a + "k_proj.weight": (kv, hidden), a + "v_proj.weight": (kv, hidden)})
            shapes[a + "k_norm.weight"] = (head_dim,)
        wide = 2 if text.get("use_double_wide_mlp") and i >= first_shared else 1
        inter = wide * text["intermediate_size"]
        shapes.update(
            {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "layer_scalar": (1,),
            }
        )
        for norm in GEMMA4_LAYER_NORMS:
            shapes[f"{p}{norm}.weight"] = (hidden,)
        if per_layer:
            shapes.update(
                {
                    p + "per_layer_input_gate.weight": (per_layer, hidden),
                    p + "per_layer_projection.weight": (hidden, per_layer),
                    p + "post_per_layer_input_norm.weight": (hidden,),
                }
            )
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def list_deepseek_v2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers' DeepseekV2ForCausalLM tensors as save_pretrained writes them and DeepSeek released
    them: each routed expert's SwiGLU on its own (`mlp.experts.N.{gate,up,down}_proj.weight`; transformers
    fuses them into experts.gate_up_proj / down_proj only in memory, mlx-lm stacks them at load).
    Multi-head latent attention: a query projection (or the q_a / q_b pair where q_lora_rank is set),
    kv_a_proj_with_mqa to the latent and the shared RoPE key, kv_a_layernorm, kv_b_proj back to each
    head's no-RoPE key and value."""
    hidden, vocab, heads = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    latent, rope, nope, value = (
        config["kv_lora_rank"],
        config["qk_rope_head_dim"],
        config["qk_nope_head_dim"],
        config["v_head_dim"],
    )
    q_rank, experts = config.get("q_lora_rank"), config.get("n_routed_experts") or 0
    expert_inter, first_dense = config["moe_intermediate_size"], config.get("first_k_dense_replace") or 0
    frequency = config.get("moe_layer_freq") or 1
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_rank:
            shapes.update(
                {
                    a + "q_a_proj.weight": (q_rank, hidden),
                    a + "q_a_layernorm.weight": (q_rank,),
                    a + "q_b_proj.weight": (heads * (nope + rope), q_rank),
                }
            )
        else:
            shapes[a + "q_proj.weight"] = (heads * (nope + rope), hidden)
        shapes.update(
            {
                a + "kv_a_proj_with_mqa.weight": (latent + rope, hidden),
                a + "kv_a_layernorm.weight": (latent,),
                a + "kv_b_proj.weight": (heads * (nope + value), latent),
                a + "o_proj.weight": (hidden, heads * value),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
        sparse = experts and i >= first_dense and i % frequency == 0
        mlps = [("mlp.", config["intermediate_size"])]
        if sparse:
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            mlps = [(f"mlp.experts.{e}.", expert_inter) for e in range(experts)]
            mlps.append(("mlp.shared_experts.", expert_inter * config["n_shared_experts"]))
        for m, inter in mlps:
            shapes.update(
                {
                    f"{p}{m}gate_proj.weight": (inter, hidden),
                    f"{p}{m}up_proj.weight": (inter, hidden),
                    f"{p}{m}down_proj.weight": (hidden, inter),
                }
            )
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def make_initial_weight(
    name: str, dims: tuple[int, ...], dtype: mx.Dtype, key: mx.array, zero_centred: bool
) -> mx.array:
    """A tensor's random start, as transformers initializes it where a normal draw would not do."""
    if name.endswith(".A_log"):  # log of each head's decay rate, uniform in [0.01, 16]
        # float32 as both engines compute with it (mlxcel's float32_weights, mlx-lm's cast_predicate)
        return mx.log(mx.random.uniform(0.01, 16.0, dims, key=key))
    if name.endswith(".dt_bias"):
        return mx.ones(dims, dtype=dtype)
    if name.endswith("_blocks"):  # MXFP4: two E2M1 codes a byte, every code equally likely
        return mx.random.randint(0, 256, dims, dtype=mx.uint8, key=key)
    if name.endswith("_scales"):  # MXFP4: a block's E8M0 exponent byte
        return mx.random.randint(*MXFP4_SCALE_BYTES, dims, dtype=mx.uint8, key=key)
    if name.endswith(".layer_scalar"):  # Gemma 4 scales each layer's output by it: 1 as transformers starts it
        return mx.ones(dims, dtype=dtype)
    if name.endswith("norm.weight"):
        unit = zero_centred and name.endswith(ZERO_CENTRED_NORMS)
        return (mx.zeros if unit else mx.ones)(dims, dtype=dtype)
    return (INIT_STD * mx.random.normal(dims, key=key)).astype(dtype)


def build_random_checkpoint(folder: Path, shape: dict, dtype: mx.Dtype, seed: int = 0) -> Path:
    if is_complete(folder):
        return folder
    zero_centred = shape["model_type"] in HYBRID_TYPES
    weights = {}
    for index, (name, dims) in enumerate(sorted(list_weight_shapes(shape).items())):
        # one key per tensor: the same weights whatever else changes
        weights[name] = make_initial_weight(name, dims, dtype, mx.random.key(seed * 100003 + index), zero_centred)
        mx.eval(weights[name])
    config = {**shape, "torch_dtype": dtype_name(dtype)}
    return write_folder(folder, config, weights)


def read_model_config(folder: Path) -> dict:
    """A folder's config.json, a multimodal folder's text_config over it: where the bench finds
    vocab_size and the special token ids."""
    config = json.loads((folder / "config.json").read_text())
    return {**config, **(config.get("text_config") or {})}
