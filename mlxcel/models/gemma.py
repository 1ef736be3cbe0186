"""Gemma: the Llama block with three changes: embeddings scaled by sqrt(hidden_size), RMSNorm
scaling by (1 + weight), and a GeGLU feed-forward (tanh-approximated GELU). Embeddings are tied.
Gemma 2 and Gemma 3 build on these pieces."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from mlxcel.models import llama

REQUIRED_KEYS = llama.REQUIRED_KEYS


class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_config(cls, config: dict, **overrides) -> llama.ModelArgs:
        # Gemma configs usually omit tie_word_embeddings: the checkpoints have no lm_head
        overrides = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **overrides}
        return super().from_config(config, **overrides)


class RMSNorm(nn.Module):
    """Scales by (1 + weight): the checkpoint stores the offset from one (zeros at init)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    # transformers maps Gemma's legacy hidden_act "gelu" to the tanh approximation as well
    return nn.gelu_approx(gate) * up


class MLP(llama.MLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(*self.project_gate_up(x)))


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: llama.ModelArgs):
        nn.Module.__init__(self)
        self.self_attn = llama.Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class GemmaModel(nn.Module):
    def __init__(self, args: llama.ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    def __init__(self, args: llama.ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = GemmaModel(args, self.make_layers(args))
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_layers(self, args: llama.ModelArgs) -> list[nn.Module]:
        return [TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    def embed_tokens(self, input_ids: mx.array) -> mx.array:
        h = self.model.embed_tokens(input_ids)
        # the scale is rounded to the weights' dtype first, as in the reference
        return h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)
