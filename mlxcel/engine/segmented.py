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

Layers without attention run whole inside the segment that reaches them. A recurrent layer
(Gated DeltaNet, Mamba-2: models/recurrent.py) keeps a fixed-size state, so its states are the
segment's inputs and outputs: read from the layer's cache before the call and written after it,
through the cache's own read/write (the batch engine's RecurrentCache or the scheduler's
PagedRecurrentCache keep their per-row bookkeeping outside the compiled function). A model
without such layers has one segment per pair of attention calls, with no states, as before.

A family takes part through the halves its blocks already use eagerly, so the compiled and eager
steps run the same code:
- an attending layer (one with `self_attn`): `input_layernorm`, `self_attn.prepare` (Q, K, V and
  whatever its `finish` needs besides the attention output: Qwen 3.5's output gate),
  `self_attn.attend`, `self_attn.finish` and `finish_block`;
- any other layer: `run_with_states(h, states) -> (h, states)` (states: [] for a layer that keeps
  nothing, Nemotron-H's MLP blocks) and, with a cache entry, `initial_states(rows)`;
- `layer_entries()` on the model (default: layer i owns entry i): each layer's cache entry, and for
  a layer that attends with another's keys and values (Gemma 4's shared layers: `prepare_queries`,
  nothing written) that layer's entry, whose mask it takes too;
- `embed_with_layer_inputs(ids)` on the model (default: `embed_tokens`): the embeddings and the
  per-layer inputs [B, 1, layers, P] (Gemma 4's PLE), made once a step; each layer's slice goes
  to its `finish_block` / `run_with_states`.
A model whose rows take different adapters (models/adapters.py) passes each row's pick into every
segment as an input (`AdapterControl.step_picks`), so a traced segment follows the rows' adapters
instead of keeping those of the call it was traced in.
Weights are captured as constants when a segment is traced: a model whose weights change after
loading must not keep its decoder (none of ours does; `after_prefill` is a no-op for text models).
"""

from __future__ import annotations

import mlx.core as mx


class SegmentedDecoder:
    def __init__(self, model):
        self.model = model
        self.layers = model.model.layers
        # each layer's (cache entry or None, the entry whose keys and values it attends to or None)
        default = [(i, None) for i in range(len(self.layers))]
        pairs = model.layer_entries() if hasattr(model, "layer_entries") else default
        self.entries, self.sources = [entry for entry, _ in pairs], [source for _, source in pairs]
        self.kept = {source for source in self.sources if source is not None}  # entries whose KV others reuse
        self.attending = [i for i, layer in enumerate(self.layers) if "self_attn" in layer]
        bounds = [-1, *self.attending, len(self.layers)]
        # segment j closes attending[j - 1], runs the layers between, opens attending[j] (or leaves)
        self.runs = [list(range(start + 1, end)) for start, end in zip(bounds, bounds[1:])]
        self.stateful = [[i for i in run if self.entries[i] is not None] for run in self.runs]
        self._segments = [mx.compile(self._make_segment(j)) for j in range(len(self.runs))]
        control = getattr(model, "adapter_control", None)
        self.adapters = control if control is not None and control.default < 0 else None  # per-row picks

    def _embed(self, tokens: mx.array) -> tuple[mx.array, tuple]:
        ids = tokens[:, None]
        if hasattr(self.model, "embed_with_layer_inputs"):
            h, per_layer = self.model.embed_with_layer_inputs(ids)
            return h, () if per_layer is None else (per_layer,)
        return self.model.embed_tokens(ids), ()

    @staticmethod
    def _layer_inputs(context: tuple, i: int) -> tuple:
        return tuple(per_layer[:, :, i] for per_layer in context)

    def _open(self, i: int, h: mx.array, offset: mx.array) -> tuple:
        """Layer i's attention inputs: (Q, K, V, what its finish takes), or (Q,) for a shared layer."""
        layer = self.layers[i]
        x = layer.input_layernorm(h)
        if self.sources[i] is not None:
            return (layer.self_attn.prepare_queries(x, offset),)
        return tuple(layer.self_attn.prepare(x, offset))

    def _make_segment(self, j: int):
        closes = self.attending[j - 1] if j else None
        opens = self.attending[j] if j < len(self.attending) else None
        run = self.runs[j]

        def segment(carry, offset: mx.array, context: tuple, states: list, picks: tuple):
            if self.adapters is None:
                return run_segment(carry, offset, context, states)
            with self.adapters.tracing(picks):
                return run_segment(carry, offset, context, states)

        def run_segment(carry, offset: mx.array, context: tuple, states: list):
            if closes is None:  # the first segment starts from the tokens
                h, context = self._embed(carry)
            else:
                h, attended, rest = carry
                layer = self.layers[closes]
                h = layer.finish_block(h, layer.self_attn.finish(attended, *rest), *self._layer_inputs(context, closes))
            given, written = iter(states), []
            for i in run:
                keeps = self.entries[i] is not None
                inputs = self._layer_inputs(context, i)
                h, new = self.layers[i].run_with_states(h, next(given) if keeps else [], *inputs)
                if keeps:
                    written.append(new)
            if opens is None:
                out, opened = self.model.compute_logits(self.model.model.norm(h))[:, -1, :], ()
            else:
                out, opened = h, self._open(opens, h, offset)
            return (out, written, opened, context) if closes is None else (out, written, opened)

        return segment

    @staticmethod
    def can_drive(cache: list) -> bool:
        return True  # the caches stay eager: any of them (plain, rotating, quantized, paged, recurrent) works

    def _position(self, cache: list) -> mx.array:
        """The step's position (every layer's cache sits at the same one), from an attending layer's cache."""
        entry = next((self.entries[i] for i in self.attending if self.sources[i] is None), None)
        offset = 0 if entry is None else cache[entry].rope_offset()
        return mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else offset

    def _read_states(self, j: int, cache: list) -> list:
        states = []
        for i in self.stateful[j]:
            layer_states, leads = cache[self.entries[i]].read(self.layers[i].initial_states)
            if leads is not None and leads.any():
                raise RuntimeError("a one-token decode step has no padding before a row's token")
            states.append(layer_states)
        return states

    def _write_states(self, j: int, cache: list, written: list) -> None:
        for i, layer_states in zip(self.stateful[j], written):
            cache[self.entries[i]].write(layer_states, 1)

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits [B, V] for the next position of every row; each layer's cache advances by one."""
        offset = self._position(cache)
        masks = self.model.make_masks(1, cache) if self.attending else []
        picks = self.adapters.step_picks(tokens.shape[0]) if self.adapters is not None else ()
        out, written, opened, context = self._segments[0](tokens, offset, (), self._read_states(0, cache), picks)
        self._write_states(0, cache, written)
        kept = {}
        for j, i in enumerate(self.attending, start=1):
            entry, source = self.entries[i], self.sources[i]
            if source is None:
                q, k, v, *rest = opened
                keys, values = cache[entry].update_and_fetch(k, v)
                if entry in self.kept:
                    kept[entry] = (keys, values)
                mask = masks[entry]
            else:  # a shared layer: its source's keys, values and mask, nothing written
                (q, *rest), (keys, values), mask = opened, kept[source], masks[source]
            attended = self.layers[i].self_attn.attend(q, keys, values, mask)
            states = self._read_states(j, cache)
            out, written, opened = self._segments[j]((out, attended, tuple(rest)), offset, context, states, picks)
            self._write_states(j, cache, written)
        return out
