"""Gemma 4 text (model_type gemma4_text) and the language model of the multimodal gemma4 folders
(Gemma4ForConditionalGeneration: the vision and audio towers are not loaded).

What it adds to Gemma 3's block (sandwich norms around attention and the GeGLU MLP, q/k RMSNorm,
sliding and global layers):
- norms scale by their weight (not 1 + weight); values get a scale-free RMSNorm too; scores are
  not scaled (the q/k norms set their size: scale 1);
- global layers may differ from sliding ones in head size (`global_head_dim`) and, with
  `attention_k_eq_v`, in KV heads (`num_global_key_value_heads`), their keys doubling as values
  (one projection; values are its output before the key norm and RoPE). transformers 5.25 writes
  both per layer in `per_layer_config`; earlier configs write the two global keys;
- global layers rotate only `partial_rotary_factor` of each head ("proportional" RoPE: the first
  frequencies of a full-width rotation, the rest left unrotated);
- per-layer input embeddings (PLE, the E2B/E4B models): a second embedding of the token ids,
  [vocab, layers x P], plus a projection of the input embeddings, gives each layer a P-wide input
  that gates a residual branch after its MLP. They need the token ids: `forward_with_embeddings`
  (image rows) refuses a model with PLE;
- KV sharing: the last `num_kv_shared_layers` layers compute only queries and attend to the keys
  and values the last earlier layer of their attention type returned from its cache in the same
  forward call, with that layer's mask. `make_cache` has an entry for each layer that keeps its
  own KV (the first ones), so a shared layer's KV is held once, in its source's cache; shared
  layers may have a double-wide MLP (`use_double_wide_mlp`);
- an optional mixture of experts beside the dense MLP in every layer (the 26B A4B): its router
  RMS-normalises the residual stream (no weight), scales it, softmaxes over all experts, keeps the
  top k renormalised, times a per-expert scale; GeGLU experts; the two branches' outputs are
  normed and summed;
- a learned scalar on each layer's output, final logits soft-capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models import gemma, llama, text_backbone
from mlxcel.models.base import RoPE, apply_linear, fuse_linears
from mlxcel.models.gemma2 import softcap
from mlxcel.models.rotating_cache import SlidingWindowLayers
from mlxcel.models.switch import SwitchGLU, route_top_k

REQUIRED_KEYS = llama.REQUIRED_KEYS

# transformers' Gemma4TextConfig defaults for the keys this family reads (a config.json may omit them)
TEXT_CONFIG_DEFAULTS = {
    "model_type": "gemma4_text",
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
}
DEFAULT_GLOBAL_HEAD_DIM = 512  # transformers' value when a config names none
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
LAYER_TYPES = ("sliding_attention", "full_attention")
# keys the composite (gemma4) config owns: where both set them, transformers reads the top-level one
TOP_LEVEL_KEYS = ("eos_token_id", "tie_word_embeddings")
# placeholder ids of a multimodal folder: transformers embeds them as the pad token (text rows hold none)
MULTIMODAL_TOKEN_KEYS = ("image_token_id", "video_token_id", "audio_token_id")
# checkpoint prefix -> ours: transformers' Gemma4ForConditionalGeneration, and mlx-lm's gemma4 folders
LANGUAGE_MODEL_PREFIXES = {
    **text_backbone.LANGUAGE_MODEL_PREFIXES,
    "language_model.": "model.",  # (transformers' own layout without the model. prefix)
}
DROPPED_PREFIXES = tuple(
    prefix + name
    for prefix in ("", "model.")
    for name in ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.")
)
SHARED_LAYER_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")  # real checkpoints keep them for shared layers


def normalize_config(config: dict) -> dict:
    """A multimodal (model_type gemma4) config as its language model's own; others unchanged."""
    if "text_config" not in config:
        return config
    text = {**TEXT_CONFIG_DEFAULTS, **(config["text_config"] or {})}
    text.update({key: config[key] for key in TOP_LEVEL_KEYS if key in config})
    text["multimodal_token_ids"] = [config[key] for key in MULTIMODAL_TOKEN_KEYS if config.get(key) is not None]
    return text


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_types: list[str] = field(default_factory=list)
    layer_windows: list[int | None] = field(default_factory=list)
    head_dims: list[int] = field(default_factory=list)  # per layer
    kv_heads: list[int] = field(default_factory=list)  # per layer
    attention_k_eq_v: bool = False
    rope: dict = field(default_factory=dict)  # layer type -> rope parameters
    kv_sources: list[int | None] = field(default_factory=list)  # a shared layer's source layer, else None
    intermediate_sizes: list[int] = field(default_factory=list)  # per layer (double-wide shared layers)
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    final_logit_softcapping: float | None = None
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    pad_token_id: int = 0
    multimodal_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = {**TEXT_CONFIG_DEFAULTS, **config}
        check_supported(config)
        types = read_layer_types(config)
        head_dims, kv_heads = read_layer_heads(config, types)
        sources = read_kv_sources(config, types)
        for i, source in enumerate(sources):
            if source is not None and (head_dims[i], kv_heads[i]) != (head_dims[source], kv_heads[source]):
                raise MlxcelError(
                    f"config.json: layer {i} shares layer {source}'s keys and values but its heads differ "
                    f"({kv_heads[i]} x {head_dims[i]} against {kv_heads[source]} x {head_dims[source]})"
                )
        wide = 2 if config.get("use_double_wide_mlp") else 1
        moe = bool(config.get("enable_moe_block"))
        values = {
            "layer_types": types,
            "layer_windows": [config["sliding_window"] if t == "sliding_attention" else None for t in types],
            "head_dims": head_dims,
            "kv_heads": kv_heads,
            "attention_k_eq_v": bool(config.get("attention_k_eq_v")),
            "rope": read_rope(config, types),
            "kv_sources": sources,
            "intermediate_sizes": [config["intermediate_size"] * (wide if s is not None else 1) for s in sources],
            "hidden_size_per_layer_input": config.get("hidden_size_per_layer_input") or 0,
            "vocab_size_per_layer_input": config.get("vocab_size_per_layer_input") or config["vocab_size"],
            "final_logit_softcapping": config.get("final_logit_softcapping"),
            "enable_moe_block": moe,
            "num_experts": (config.get("num_experts") or 0) if moe else 0,
            "top_k_experts": (config.get("top_k_experts") or 0) if moe else 0,
            "moe_intermediate_size": (config.get("moe_intermediate_size") or 0) if moe else 0,
            "pad_token_id": config.get("pad_token_id") or 0,
            "multimodal_token_ids": list(config.get("multimodal_token_ids") or []),
            "tie_word_embeddings": config.get("tie_word_embeddings", True),
            "head_dim": config["head_dim"],
        }
        if moe and not 1 <= values["top_k_experts"] <= values["num_experts"]:
            raise MlxcelError(
                f"config.json: enable_moe_block needs num_experts >= top_k_experts >= 1 and moe_intermediate_size "
                f"(got num_experts={config.get('num_experts')}, top_k_experts={config.get('top_k_experts')})"
            )
        if moe and not values["moe_intermediate_size"]:
            raise MlxcelError("config.json: enable_moe_block needs moe_intermediate_size")
        return super().from_config(config, **{**values, **overrides})


def check_supported(config: dict) -> None:
    """What this family does not compute: refused by name, never run wrong."""
    act = config.get("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise MlxcelError(
            f"config.json: hidden_activation {act!r} is not supported for gemma4 (only gelu_pytorch_tanh, Gemma 4's)"
        )
    if config.get("use_bidirectional_attention") == "all":
        raise MlxcelError(
            "config.json: use_bidirectional_attention='all' (every token attends both ways) is not supported: "
            "generation needs causal attention"
        )


def read_layer_types(config: dict) -> list[str]:
    """Each layer's attention type: config.json's layer_types, else five sliding layers per global
    one; the last layer is always global (transformers forces it)."""
    n = config["num_hidden_layers"]
    types = list(
        config.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    )
    if len(types) != n:
        raise MlxcelError(f"config.json: layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise MlxcelError(f"config.json: layer_types holds {unknown}; each is sliding_attention or full_attention")
    types[-1] = "full_attention"
    return types


def read_layer_heads(config: dict, types: list[str]) -> tuple[list[int], list[int]]:
    """Each layer's (head_dim, KV heads): per_layer_config (transformers 5.25 writes it, keyed by
    layer index) where present; else global layers take global_head_dim (512 unless given) and,
    with attention_k_eq_v, num_global_key_value_heads."""
    head_dim, kv = config["head_dim"], config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        global_kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        per_layer = {
            i: {"head_dim": config.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM, "num_key_value_heads": global_kv}
            for i, t in enumerate(types)
            if t == "full_attention"
        }
    elif not isinstance(per_layer, dict):
        raise MlxcelError(f"config.json: per_layer_config must map layer indices to settings, got {per_layer!r}")
    head_dims, kv_heads = [head_dim] * len(types), [kv] * len(types)
    for key, settings in per_layer.items():
        layers = [i for i, t in enumerate(types) if t == key] if key in LAYER_TYPES else [int(key)]
        unknown = sorted(set(settings or {}) - {"head_dim", "num_key_value_heads"})
        if unknown or not all(0 <= i < len(types) for i in layers):
            raise MlxcelError(
                f"config.json: per_layer_config[{key!r}] = {settings!r}: a layer index below {len(types)} (or a "
                "layer type) with head_dim and num_key_value_heads only"
            )
        for i in layers:
            head_dims[i] = settings.get("head_dim") or head_dims[i]
            kv_heads[i] = settings.get("num_key_value_heads") or kv_heads[i]
    return head_dims, kv_heads


def read_kv_sources(config: dict, types: list[str]) -> list[int | None]:
    """For each of the last num_kv_shared_layers layers, the layer whose keys and values it reuses:
    the last earlier layer of its type (transformers' kv_sharing_modes); None for the others."""
    n, shared = len(types), config.get("num_kv_shared_layers") or 0
    if not 0 <= shared < n:
        raise MlxcelError(
            f"config.json: num_kv_shared_layers={shared} must be below num_hidden_layers={n} (some layer must "
            "compute the keys and values the others share)"
        )
    first = n - shared
    last_of = {t: i for i, t in enumerate(types[:first])}
    missing = sorted({t for t in types[first:]} - last_of.keys())
    if missing:
        raise MlxcelError(
            f"config.json: layers of type {missing[0]} share keys and values, but no layer before the first shared "
            f"one ({first}) is of that type"
        )
    return [None if i < first else last_of[types[i]] for i in range(n)]


def read_rope(config: dict, types: list[str]) -> dict:
    params = config.get("rope_parameters") or {}
    rope = {}
    for kind in set(types):
        settings = params.get(kind) or DEFAULT_ROPE[kind]
        if settings.get("rope_type", "default") not in ("default", "proportional", "linear"):
            raise MlxcelError(
                f"config.json: rope_parameters.{kind}.rope_type {settings['rope_type']!r} is not supported for gemma4 "
                "(default, proportional, linear)"
            )
        rope[kind] = settings
    return rope


def make_rope(settings: dict, head_dim: int) -> RoPE:
    """The layer type's rotation over the whole head. Proportional: transformers' frequencies
    base^(-2i/head_dim) for the first partial_rotary_factor * head_dim / 2 pairs (divided by
    `factor`), zero beyond (those pairs keep their values: an infinite wavelength here)."""
    kind, base = settings.get("rope_type", "default"), float(settings.get("rope_theta", 10_000.0))
    if kind == "linear":
        return RoPE(head_dim, base, scaling={"rope_type": "linear", "factor": settings["factor"]})
    rope = RoPE(head_dim, base)
    if kind == "proportional":
        pairs = int(settings.get("partial_rotary_factor", 1.0) * head_dim // 2)
        rotated = float(settings.get("factor", 1.0)) * base ** (mx.arange(0, 2 * pairs, 2, dtype=mx.float32) / head_dim)
        rope._freqs = mx.concatenate([rotated, mx.full((head_dim // 2 - pairs,), mx.inf)])
        rope.base = None
    return rope


def norm_values(v: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(v, None, eps)


class Attention(llama.Attention):
    """One layer's attention; a shared layer (`shares_kv`) has only its queries' weights."""

    def __init__(self, args: ModelArgs, index: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.kv_heads[index]
        self.head_dim = args.head_dims[index]
        self.scale = 1.0  # the q/k norms set the scores' size
        self.eps = args.rms_norm_eps
        self.shares_kv = args.kv_sources[index] is not None
        self.k_eq_v = args.attention_k_eq_v and args.layer_types[index] == "full_attention"
        dim, bias, heads = args.hidden_size, args.attention_bias, self.n_heads * self.head_dim
        self.q_proj = nn.Linear(dim, heads, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        if not self.shares_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.o_proj = nn.Linear(heads, dim, bias=bias)
        self.rope = make_rope(args.rope[args.layer_types[index]], self.head_dim)

    def fuse(self) -> None:
        if self.shares_kv:
            return
        parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
        fused = fuse_linears(parts)
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj
            if not self.k_eq_v:
                del self.v_proj

    def project_qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Q, K and V before their norms; with k_eq_v, V is K's projection."""
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if "qkv_proj" in self:
            parts = mx.split(apply_linear(self.qkv_proj, x), [q_size, q_size + kv_size], axis=-1)
            q, k = parts[0], parts[1]
            v = k if self.k_eq_v else parts[2]
            return q, k, v
        k = apply_linear(self.k_proj, x)
        return apply_linear(self.q_proj, x), k, k if self.k_eq_v else apply_linear(self.v_proj, x)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.project_qkv(x)
        q = self.q_norm(llama.to_heads(q, self.n_heads))
        k = llama.to_heads(k, self.n_kv_heads)
        v = k if self.k_eq_v else llama.to_heads(v, self.n_kv_heads)
        return q, self.k_norm(k), norm_values(v, self.eps)

    def prepare_queries(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return self.rope(self.q_norm(llama.to_heads(apply_linear(self.q_proj, x), self.n_heads)), offset)

    def __call__(self, x: mx.array, mask: Any, cache, shared: tuple | None = None) -> tuple[mx.array, tuple]:
        """The attention output, and (keys, values, rope offset) as its shared layers reuse them:
        what this layer's cache returned, or (a shared layer) its source's `shared`."""
        if shared is None:
            offset = cache.rope_offset()
            q, k, v = self.prepare(x, offset)
            keys, values = cache.update_and_fetch(k, v)
            shared = (keys, values, offset)
        else:
            keys, values, offset = shared
            q = self.prepare_queries(x, offset)
        return self.finish(self.attend(q, keys, values, mask)), shared


class MLP(gemma.MLP):
    def __init__(self, dim: int, hidden: int):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)


class GeluSwitchGLU(SwitchGLU):
    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return gemma.geglu(gate, up)


class Router(nn.Module):
    """The experts' choice from the residual stream: RMS-normalised (no weight), times `scale` and
    hidden_size**-0.5, projected; softmax over all experts in fp32, the top k renormalised, each
    weight times its expert's `per_expert_scale`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.eps, self.top_k, self.root = args.rms_norm_eps, args.top_k_experts, args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        indices, weights = route_top_k(self.proj(h), self.top_k, normalize=True)
        return indices, weights * self.per_expert_scale[indices].astype(mx.float32)


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = GeluSwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        return (self.switch_glu(x, indices) * weights[..., None]).sum(axis=-2).astype(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, index)
        self.mlp = MLP(dim, args.intermediate_sizes[index])
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))
        if args.hidden_size_per_layer_input:
            self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=eps)
        if args.enable_moe_block:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)

    def __call__(
        self, x: mx.array, mask: Any, cache, per_layer_input: mx.array | None, shared: tuple | None
    ) -> tuple[mx.array, tuple]:
        attended, shared = self.self_attn(self.input_layernorm(x), mask, cache, shared)
        return self.finish_block(x, attended, per_layer_input), shared

    def finish_block(self, x: mx.array, attended: mx.array, per_layer_input: mx.array | None = None) -> mx.array:
        """Everything after attention: norms, MLP (and experts), the per-layer input's branch, the scalar."""
        h = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:  # the experts beside the dense MLP, both from the residual stream
            indices, weights = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        per_layer = args.hidden_size_per_layer_input
        if per_layer:
            width = args.num_hidden_layers * per_layer
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(per_layer, eps=args.rms_norm_eps)


class Model(SlidingWindowLayers, llama.Model):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.kv_sources = args.kv_sources
        self.first_shared = next((i for i, s in enumerate(args.kv_sources) if s is not None), len(args.kv_sources))
        self.sources = set(s for s in args.kv_sources if s is not None)
        # one cache entry per layer that keeps its own keys and values: the first first_shared layers
        self.layer_windows = args.layer_windows[: self.first_shared]

    def cache_attentions(self) -> list[Attention]:
        """The attention of each make_cache entry's layer, in order (their head dims and KV heads
        differ between sliding and global layers: what one position costs per entry)."""
        return [layer.self_attn for layer in self.model.layers[: self.first_shared]]

    def embed_tokens(self, input_ids: mx.array) -> mx.array:
        h = self.model.embed_tokens(input_ids)
        return h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)  # rounded to the dtype first

    def per_layer_inputs(self, input_ids: mx.array, h: mx.array) -> mx.array:
        """[B, L, layers, P]: the token's own per-layer embedding and a projection of its input
        embedding (normed), averaged in the 1/sqrt(2) sense."""
        n, width = self.args.num_hidden_layers, self.args.hidden_size_per_layer_input
        own = self.model.embed_tokens_per_layer(input_ids)
        own = (own * mx.array(math.sqrt(width), dtype=own.dtype)).reshape(*input_ids.shape, n, width)
        projected = self.model.per_layer_model_projection(h) * self.args.hidden_size**-0.5
        projected = self.model.per_layer_projection_norm(projected.reshape(*h.shape[:-1], n, width))
        return (projected + own) * 2**-0.5

    def __call__(self, input_ids: mx.array, cache: list, mask: Any = None, logits_at: int | None = None) -> mx.array:
        return self.run_layers(*self.embed_with_layer_inputs(input_ids), cache, mask, logits_at)

    def embed_with_layer_inputs(self, input_ids: mx.array) -> tuple[mx.array, mx.array | None]:
        """The tokens' embeddings [B, L, hidden] and per-layer inputs [B, L, layers, P] (None without PLE)."""
        if self.args.multimodal_token_ids:  # as transformers embeds a multimodal folder's placeholders
            placeholder = mx.zeros(input_ids.shape, dtype=mx.bool_)
            for token in self.args.multimodal_token_ids:
                placeholder = placeholder | (input_ids == token)
            input_ids = mx.where(placeholder, self.args.pad_token_id, input_ids)
        h = self.embed_tokens(input_ids)
        return h, self.per_layer_inputs(input_ids, h) if self.args.hidden_size_per_layer_input else None

    def layer_entries(self) -> list[tuple[int | None, int | None]]:
        """For the segmented step: each layer's cache entry (its index, for the first_shared layers)
        and, for a shared layer, its source's entry (whose keys, values and mask it attends to)."""
        return [(None, source) if source is not None else (i, None) for i, source in enumerate(self.kv_sources)]

    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list, mask: Any = None, logits_at: int | None = None
    ) -> mx.array:
        if self.args.hidden_size_per_layer_input:
            raise MlxcelError(
                "gemma4: this model's per-layer input embeddings are looked up by token id, and a forward call "
                "from input embeddings (an image row) has none; send text rows"
            )
        return self.run_layers(embeddings, None, cache, mask, logits_at)

    def run_layers(
        self, h: mx.array, per_layer: mx.array | None, cache: list, mask: Any, logits_at: int | None
    ) -> mx.array:
        length = h.shape[1]
        masks = self.make_masks(length, cache) if mask is None else [mask] * len(cache)
        kept: dict[int, tuple] = {}
        for i, layer in enumerate(self.model.layers):
            source = self.kv_sources[i]
            if i == self.first_shared and logits_at is not None:
                # shared layers write nothing: only the position whose logits are asked for goes on
                h, per_layer, masks, kept = self.keep_one_query(h, per_layer, masks, kept, logits_at)
                logits_at = None
            layer_input = per_layer[:, :, i] if per_layer is not None else None
            if source is None:
                h, shared = layer(h, masks[i], cache[i], layer_input, None)
                if i in self.sources:
                    kept[i] = shared
            else:
                h, _ = layer(h, masks[source], None, layer_input, kept[source])
        if logits_at is not None:
            h = h[:, logits_at : logits_at + 1, :]
        return self.compute_logits(self.model.norm(h))

    def keep_one_query(
        self, h: mx.array, per_layer: mx.array | None, masks: list, kept: dict, at: int
    ) -> tuple[mx.array, mx.array | None, list, dict]:
        """The shared layers' inputs for query `at` alone: its hidden state and per-layer input,
        each source's mask row, rope offsets moved to it. A paged mask object stays whole (its
        attention pads and masks a piece's queries itself): then every query goes on."""
        if any(m is not None and not isinstance(m, (str, mx.array)) for m in masks):
            return h, per_layer, masks, kept
        length, rows = h.shape[1], list(masks)
        for source, (keys, _, _) in kept.items():
            mask = masks[source]
            if isinstance(mask, str):  # causal: the last query meets the last key
                rows[source] = mx.arange(keys.shape[2]) <= keys.shape[2] - length + at
            elif mask is not None and mask.shape[-2] == length:
                rows[source] = mask[..., at : at + 1, :]
        kept = {s: (k, v, offset + at) for s, (k, v, offset) in kept.items()}
        return h[:, at : at + 1], None if per_layer is None else per_layer[:, at : at + 1], rows, kept

    def compute_logits(self, h: mx.array) -> mx.array:
        logits = super().compute_logits(h)
        cap = self.args.final_logit_softcapping
        return softcap(logits, cap) if cap else logits

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            if "experts" in layer:
                layer.experts.switch_glu.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' and mlx-lm's names (text and multimodal folders) as ours: the towers
        dropped, shared layers' unused K/V weights dropped, fused experts split."""
        out = {}
        renamed = text_backbone.rename_language_model(weights, DROPPED_PREFIXES, LANGUAGE_MODEL_PREFIXES)
        for key, value in renamed.items():
            if "rotary_emb" in key:
                continue
            parts = key.split(".")
            if (
                len(parts) > 4
                and parts[:2] == ["model", "layers"]
                and parts[3] == "self_attn"
                and parts[4] in SHARED_LAYER_WEIGHTS
                and parts[2].isdigit()
                and int(parts[2]) < len(self.kv_sources)
                and self.kv_sources[int(parts[2])] is not None
            ):
                continue
            if key.endswith(".experts.gate_up_proj"):
                base = key[: -len("gate_up_proj")] + "switch_glu."
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = mx.split(value, 2, axis=1)
                continue
            if key.endswith(".experts.down_proj"):
                out[key[: -len("down_proj")] + "switch_glu.down_proj.weight"] = value
                continue
            out[key] = value
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
