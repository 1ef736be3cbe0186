"""The decode step compiled in segments, one between each pair of attention calls.

A one-token step is bound by the host, not the device: on the H200 a batch-1 step of a 1B model
spends its time building the graph in Python and in MLX's encoding while the GPU waits
(docs/benchmarks.md, "Where batch-1 decode time goes").
Compiling the whole step needs shapes that never change, which the growing KV cache defeats
(compiled.py works around it with an array mask, and the mask costs the fused attention kernel).
So only the attention is left eager, where the cache grows and the fused kernel sees exactly the
keys it needs; everything between one layer's attention and the next (o_proj, residuals, norms,
MLP, the next QKV projection and RoPE) is one compiled segment whose shapes are fixed for the
whole decode: [B, 1, hidden] in, Q/K/V out. The position goes in as an array, so a segment is
traced once per batch size, not per step.

A family takes part through the halves its blocks already use eagerly: `input_layernorm`,
`self_attn.prepare / attend / finish` and `finish_block`, so the compiled and eager steps run
the same code. Weights are captured as constants when a segment is traced: a model whose weights
change after loading must not keep its decoder (none of ours does; `after_prefill` is a no-op
for text models).
"""

from __future__ import annotations

import mlx.core as mx


class SegmentedDecoder:
    def __init__(self, model):
        self.model = model
        self.layers = model.model.layers
        last = len(self.layers) - 1
        self._enter = mx.compile(self._enter_first_layer)
        self._between = [mx.compile(self._make_between(i)) for i in range(last)]
        self._leave = mx.compile(self._leave_last_layer)

    def _enter_first_layer(self, tokens: mx.array, offset: mx.array):
        h = self.model.embed_tokens(tokens[:, None])
        layer = self.layers[0]
        return (h, *layer.self_attn.prepare(layer.input_layernorm(h), offset))

    def _make_between(self, i: int):
        layer, following = self.layers[i], self.layers[i + 1]

        def between(h: mx.array, attended: mx.array, offset: mx.array):
            h = layer.finish_block(h, layer.self_attn.finish(attended))
            return (h, *following.self_attn.prepare(following.input_layernorm(h), offset))

        return between

    def _leave_last_layer(self, h: mx.array, attended: mx.array) -> mx.array:
        layer = self.layers[-1]
        h = layer.finish_block(h, layer.self_attn.finish(attended))
        return self.model.compute_logits(self.model.model.norm(h))[:, -1, :]

    @staticmethod
    def can_drive(cache: list) -> bool:
        return True  # the caches stay eager: any of them (plain, rotating, quantized) works

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits [B, V] for the next position of every row; each layer's cache grows by one."""
        offset = cache[0].rope_offset()  # every layer's cache sits at the same position
        if isinstance(offset, int):
            offset = mx.array(offset, dtype=mx.int32)
        masks = self.model.make_masks(1, cache)
        h, q, k, v = self._enter(tokens, offset)
        for i, (layer, layer_cache, mask) in enumerate(zip(self.layers, cache, masks)):
            keys, values = layer_cache.update_and_fetch(k, v)
            attended = layer.self_attn.attend(q, keys, values, mask)
            if i < len(self._between):
                h, q, k, v = self._between[i](h, attended, offset)
        return self._leave(h, attended)
