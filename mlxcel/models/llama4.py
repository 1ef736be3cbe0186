"""Llama 4 text (llama4_text, and the language model of llama4 checkpoints; the vision tower is
not loaded). transformers' Llama4ForCausalLM:
- chunked local attention on the RoPE layers (`attention_chunk_size` C: a query at position p sees
  the keys from floor(p / C) * C to itself; cache.ChunkedKVCache, and a ring of one chunk per row
  in the scheduler: paged_window.py), full attention on the NoPE layers (`no_rope_layers[i]` 0,
  by default every `no_rope_layer_interval`-th layer; `layer_types` where the config lists them);
- RoPE on interleaved pairs (transformers' complex form), then a weightless L2 (RMS) norm of each
  head of q and k on the RoPE layers where `use_qk_norm`;
- the NoPE layers' queries scaled by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at
  position p (`attn_temperature_tuning`);
- MoE layers (`moe_layers`, else every `interleave_moe_layer_step`-th): a shared expert plus the
  top-k routed experts, each fed the token scaled by the sigmoid of its router logit (no
  renormalisation); the other layers a dense SwiGLU of `intermediate_size_mlp`.

Weights: transformers' (experts stacked as gate_up_proj [E, H, 2I] and down_proj [E, I, H], x @ W),
and mlx-lm's (mlx-community folders: experts.{gate,up,down}_proj as SwitchGLU), each at the top
level (llama4_text) or under language_model. (llama4)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.base import NoRoPE, RoPE, read_rope_theta
from mlxcel.models.cache import ChunkedKVCache, KVCache, make_attention_mask, make_chunk_mask
from mlxcel.models.switch import SwitchGLU
from mlxcel.models.text_backbone import rename_language_model

REQUIRED_KEYS = llama.REQUIRED_KEYS
# transformers' Llama4TextConfig defaults, where a llama4 folder's text_config is silent
TEXT_CONFIG_DEFAULTS = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
}
DEFAULT_ROPE_THETA = 500000.0  # (Llama4TextConfig.default_theta)
DROPPED = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")


@dataclass
class ModelArgs(llama.ModelArgs):
    intermediate_size_mlp: int = 16384
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: list[int] = field(default_factory=list)
    rope_layers: list[bool] = field(default_factory=list)
    layer_chunks: list[int | None] = field(default_factory=list)
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    rope_factors: list[float] | None = None  # (GGUF: llama3 scaling as llama.cpp's per-pair factors)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = text_config(config)
        n = config["num_hidden_layers"]
        interval = config.get("no_rope_layer_interval", 4)
        flags = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) < n:
            raise MlxcelError(f"config.json: no_rope_layers has {len(flags)} entries for num_hidden_layers={n}")
        rope_layers = [bool(flag) for flag in flags[:n]]
        chunk = config.get("attention_chunk_size", 8192)
        default = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers]
        types = config.get("layer_types") or default
        if len(types) != n or set(types) - {"chunked_attention", "full_attention"}:
            raise MlxcelError(
                f"config.json: layer_types must hold {n} entries of chunked_attention / full_attention, got {types}"
            )
        if chunk is None and "chunked_attention" in types:
            raise MlxcelError("config.json: layer_types has chunked_attention layers and attention_chunk_size is null")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise MlxcelError(f"config.json: attention_chunk_size must be a positive integer, got {chunk!r}")
        step = config.get("interleave_moe_layer_step", 1)
        moe_layers = config.get("moe_layers")
        values = {
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
            "rope_theta": read_rope_theta(config, DEFAULT_ROPE_THETA),
            "rope_traditional": True,  # transformers rotates (x[2i], x[2i + 1]) pairs (its complex form)
            "intermediate_size_mlp": config.get("intermediate_size_mlp", 16384),
            "num_local_experts": config.get("num_local_experts", 16),
            "num_experts_per_tok": config.get("num_experts_per_tok", 1),
            "moe_layers": list(range(step - 1, n, step)) if moe_layers is None else list(moe_layers),
            "rope_layers": rope_layers,
            "layer_chunks": [chunk if kind == "chunked_attention" else None for kind in types],
            "use_qk_norm": config.get("use_qk_norm", True),
            # (released configs write an int here: 4; any true value turns it on, as in transformers)
            "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
            "floor_scale": float(config.get("floor_scale", 8192)),
            "attn_scale": float(config.get("attn_scale", 0.1)),
            "rope_factors": config.get("rope_factors"),
        }
        return super().from_config(config, **{**values, **overrides})


def text_config(config: dict) -> dict:
    """A llama4 (vision-language) config's language model settings, over transformers'
    Llama4TextConfig defaults; a llama4_text config as it is."""
    if "text_config" not in config:
        return config
    text = {**TEXT_CONFIG_DEFAULTS, **(config["text_config"] or {})}
    text.setdefault("eos_token_id", config.get("eos_token_id"))
    return text


def normalize_config(config: dict) -> dict:
    """config.json as the loader checks it (REQUIRED_KEYS): a llama4 folder's text_config."""
    return text_config(config)


class FactoredRoPE(RoPE):
    """Interleaved RoPE whose pair i turns `factors[i]` times slower (llama.cpp's rope_freqs: how
    its GGUF files carry llama3 scaling)."""

    def __init__(self, dims: int, base: float, factors: list[float]):
        super().__init__(dims, base, traditional=True)
        if len(factors) != dims // 2:
            raise MlxcelError(f"rope_freqs holds {len(factors)} factors for a head of {dims} (expected {dims // 2})")
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * mx.array(factors, dtype=mx.float32)
        self.base = None


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args)
        use_rope = args.rope_layers[layer]
        if not use_rope:
            self.rope = NoRoPE()
        elif args.rope_factors is not None:
            self.rope = FactoredRoPE(self.head_dim, args.rope_theta, args.rope_factors)
        self.qk_norm_eps = args.rms_norm_eps if use_rope and args.use_qk_norm else None
        # NoPE layers: each query scaled by a factor that grows with its position
        tuned = args.attn_temperature_tuning and not use_rope
        self.temperature = (args.floor_scale, args.attn_scale) if tuned else None

    def prepare(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().prepare(x, offset)
        if self.qk_norm_eps is not None:  # after RoPE, as transformers (a rotation keeps the norm anyway)
            q = mx.fast.rms_norm(q, None, self.qk_norm_eps)
            k = mx.fast.rms_norm(k, None, self.qk_norm_eps)
        if self.temperature is not None:
            q = (q * self.temperature_scales(offset, q.shape[2])).astype(q.dtype)
        return q, k, v

    def temperature_scales(self, offset: int | mx.array, length: int) -> mx.array:
        """[B or 1, 1, L, 1]: each query's factor at its position (a left-padded row's padding at 0)."""
        floor_scale, attn_scale = self.temperature
        start = offset[..., None] if isinstance(offset, mx.array) else offset
        positions = mx.maximum(mx.arange(length) + start, 0).astype(mx.float32)
        scales = mx.log1p(mx.floor((positions + 1) / floor_scale)) * attn_scale + 1
        return scales.reshape(-1, 1, length, 1)


class MoE(nn.Module):
    """transformers' Llama4TextMoe: the shared expert on every token, plus its top-k experts, each
    fed the token times sigmoid(its router logit)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if not 1 <= args.num_experts_per_tok <= args.num_local_experts:
            raise MlxcelError(
                f"config.json: num_experts_per_tok={args.num_experts_per_tok} must be between 1 and "
                f"num_local_experts={args.num_local_experts}"
            )
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts)
        self.shared_expert = llama.MLP(args)

    def fuse(self) -> None:
        self.experts.fuse()
        self.shared_expert.fuse()

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.router(x)
        indices = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        scores = mx.sigmoid(mx.take_along_axis(logits, indices, axis=-1).astype(mx.float32)).astype(x.dtype)
        # each (token, expert) pair its own input row: the token scaled by that expert's score
        routed = self.experts(x[..., None, :] * scores[..., None], indices[..., None])  # [..., k, 1, H]
        return self.shared_expert(x) + routed.squeeze(-2).sum(axis=-2)


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.self_attn = Attention(args, layer)
        if layer in args.moe_layers:
            self.feed_forward = MoE(args)
        else:
            self.feed_forward = llama.MLP(replace(args, intermediate_size=args.intermediate_size_mlp))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + attended
        return h + self.feed_forward(self.post_attention_layernorm(h))


class Llama4TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = Llama4TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.layer_chunks = args.layer_chunks

    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list:
        pad = mx.array(left_pad, dtype=mx.int32) if left_pad is not None and any(left_pad) else None
        return [
            KVCache(batch_size, pad) if chunk is None else ChunkedKVCache(chunk, batch_size, pad)
            for chunk in self.layer_chunks
        ]

    def make_masks(self, length: int, cache: list) -> list:
        """One mask per kind of layer (chunked or full): the paged caches mask their own rows."""
        built: dict = {}
        masks = []
        for layer_cache in cache:
            chunk = getattr(layer_cache, "chunk", None)
            if chunk not in built:
                plain = chunk is None or hasattr(layer_cache, "attention_mask")  # (paged: masks its own rows)
                built[chunk] = (make_attention_mask if plain else make_chunk_mask)(length, layer_cache)
            masks.append(built[chunk])
        return masks

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.feed_forward.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(rename_language_model(weights, DROPPED))
        for i in self.args.moe_layers:
            prefix = f"model.layers.{i}.feed_forward.experts"
            if f"{prefix}.gate_up_proj" in weights:  # transformers' stacked experts, x @ W
                gate, up = mx.split(weights.pop(f"{prefix}.gate_up_proj"), 2, axis=-1)
                weights[f"{prefix}.gate_proj.weight"] = mx.contiguous(gate.swapaxes(1, 2))
                weights[f"{prefix}.up_proj.weight"] = mx.contiguous(up.swapaxes(1, 2))
            if f"{prefix}.down_proj" in weights:
                weights[f"{prefix}.down_proj.weight"] = mx.contiguous(weights.pop(f"{prefix}.down_proj").swapaxes(1, 2))
        return weights
