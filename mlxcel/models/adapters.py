"""LoRA adapters kept beside a layer's weights (docs/adapters.md): several adapters over one base
model, each token of a forward call taking one of them or none (`model.adapters`; also one adapter
on a quantized base). mlxcel/checkpoints/adapters.py reads the adapter folders and merges a lone
adapter into dense weights instead.

Each adapted layer keeps its adapters stacked, A as [n + 1, in, r] and scale * B as [n + 1, r, out]
(slot n: zeros, "no adapter"; ranks zero-padded to the widest); one `AdapterControl` shared by the
model says which adapter each token takes. Where it costs at most a quarter of the layer's own
work, a layer computes every adapter's product for every token as one matmul pair over the
adapters' columns side by side, the columns of the adapters a token does not take masked to zero
(`LayerAdapters.masked`); otherwise it gathers each token's product by its adapter (mx.gather_mm,
as vLLM's multi-LoRA kernels do). Either way a batch's LoRA product is two matmuls a layer whatever
its mix of adapters. Fusing Q/K/V or gate/up (base.fuse_linears) stacks the parts' A
along the rank and puts their B on the block diagonal (`fuse_adapters`), so fused layers keep their
adapters."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError

NO_ADAPTER = -1


@dataclass(eq=False)
class LayerAdapters:
    """What an adapted layer adds: each token's x @ a[i] @ b[i], i its adapter (slot n: none, zeros)."""

    a: mx.array  # [n + 1, in, R]: adapter i's A (transposed, zero-padded to the layer's widest rank)
    b: mx.array  # [n + 1, R, out]: adapter i's scale * B (transposed)
    control: AdapterControl

    def __post_init__(self):
        slots, in_dims, rank = self.a.shape
        out_dims, n = self.b.shape[2], slots - 1
        self.masked = prefers_columns(n, rank, in_dims, out_dims)
        if self.masked:
            self.a_columns = self.a[:n].transpose(1, 0, 2).reshape(in_dims, n * rank)  # column i * R + r
            self.b_columns = self.b[:n].reshape(n * rank, out_dims)
            mx.eval(self.a_columns, self.b_columns)


def prefers_columns(adapters: int, rank: int, in_dims: int, out_dims: int) -> bool:
    """Every adapter's product for every token costs adapters x rank x (in + out) multiply-adds a
    token: taken while that is at most a quarter of the layer's own in x out. The columns' matmuls
    are plain GEMMs, which every backend does best; on the 2-core CPU they beat gather_mm from a few
    hundred tokens (AdaptedMixin), and on the H100 (64 linears of the 1B shape, 4 adapters of rank
    16) gathering added 7.0 ms a call at 256 rows and 52.7 at 2,048 against the columns' 2.3 and 3.8."""
    return adapters * rank * (in_dims + out_dims) * 4 <= in_dims * out_dims


class AdapterControl:
    """Which adapter each token of the next forward call takes (one per model, shared by its layers).

    `names[i]` is adapter i. `set_tokens(index)` before a forward call: int32, -1 = no adapter, shaped
    [B] (one adapter a row, any call) or [B, L] (one a token: the call's input ids' shape, e.g. [1, T]
    for a packed line); with `logits_at` (the call's), also the positions whose logits are asked for,
    where the last layer's MLP runs on those positions only. Without set_tokens (or after clear()),
    every token takes `default`: -1 for model.adapters (the base model), 0 for one unmerged adapter."""

    def __init__(self, names: tuple[str, ...], default: int = NO_ADAPTER):
        self.names = names
        self.default = default
        self.index: mx.array | None = None
        self.index_at: mx.array | None = None
        self._picks: dict[tuple, mx.array] | None = {}
        self._traced: tuple | None = None  # (picks or None,) while a compiled step is traced

    def set_tokens(self, index: Any, logits_at: int | mx.array | None = None) -> None:
        host = None if isinstance(index, mx.array) else np.asarray(index, dtype=np.int32)
        if host is not None:
            if host.ndim not in (1, 2):
                raise MlxcelError(f"adapter index: expected [B] or [B, L] int32 (got shape {host.shape})")
            if host.size and (host.min() < NO_ADAPTER or host.max() >= len(self.names)):
                raise MlxcelError(
                    f"adapter index: values must be in [-1, {len(self.names) - 1}] (got {host.min()}..{host.max()})"
                )
        index = mx.array(host) if host is not None else index.astype(mx.int32)
        # -1 -> slot n, the zero adapter: a gather needs an index for every token
        self.index = mx.where(index < 0, len(self.names), index)
        self.index_at = None
        if logits_at is not None and self.index.ndim == 2:
            at = slice(logits_at, logits_at + 1) if isinstance(logits_at, int) else logits_at
            self.index_at = self.index[:, at]
        self._picks = {}
        if host is not None and host.size and (host == NO_ADAPTER).all():
            self._picks = None  # no token takes an adapter: every layer skips its product

    def clear(self) -> None:
        self.index, self.index_at, self._picks = None, None, {}

    def step_picks(self, rows: int) -> tuple:
        """A one-token step's picks as a compiled step's input: () where no row takes an adapter,
        else (each row's slot [rows] int32,). (Per-row models only: their default is no adapter, so
        pick is never a single int.)"""
        pick = self.pick((rows, 1))
        return () if pick is None else (pick,)

    @contextmanager
    def tracing(self, picks: tuple):
        """While a compiled step is traced: every layer takes `picks` (step_picks' form, the traced
        input), so the compiled graph reads the picks it is given, not those of its first call."""
        saved = self._traced, self._picks
        self._traced, self._picks = (picks[0] if picks else None,), {}
        try:
            yield
        finally:
            self._traced, self._picks = saved

    def tokens_for(self, lead: tuple[int, ...]) -> mx.array:
        """The index shaped to broadcast against a layer input's leading dims."""
        index = self.index
        if index.ndim == 1 and lead[0] == index.shape[0]:
            return index.reshape(index.shape[0], *([1] * (len(lead) - 1)))
        if index.ndim == 2:
            if tuple(index.shape) == lead:
                return index
            if self.index_at is not None and tuple(self.index_at.shape) == lead:
                return self.index_at
            if math.prod(lead) == index.size:
                return index.reshape(lead)
        raise MlxcelError(
            f"adapter index of shape {tuple(index.shape)} does not fit a layer input of {lead} tokens "
            "(set_tokens wants [B] or the call's [B, L]; with logits_at, the positions the call asks logits for)"
        )

    def pick(self, lead: tuple[int, ...]) -> int | mx.array | None:
        """None: no token takes an adapter; an int: every token takes that one; else each token's
        adapter slot, flattened ([prod(lead)] int32, n for none)."""
        if self._traced is not None:
            picks = self._traced[0]
            if picks is not None and picks.size != math.prod(lead):
                raise MlxcelError(f"a compiled step's adapter picks ({picks.size}) do not fit a layer input of {lead}")
            return picks
        if self._picks is None:
            return None
        if self.index is None:
            return None if self.default == NO_ADAPTER else self.default
        if lead not in self._picks:
            self._picks[lead] = mx.broadcast_to(self.tokens_for(lead), lead).flatten()
        return self._picks[lead]

    def column_mask(self, lead: tuple[int, ...], pick: mx.array, rank: int, dtype: mx.Dtype) -> mx.array:
        """[*lead, n * rank]: 1 over the columns of each token's adapter, 0 elsewhere (made once a
        call for all the layers of one rank)."""
        key = ("columns", lead, rank, dtype)
        if key not in self._picks:
            owner = mx.arange(len(self.names) * rank, dtype=mx.int32) // rank
            self._picks[key] = (pick[:, None] == owner).astype(dtype).reshape(*lead, -1)
        return self._picks[key]


class AdaptedMixin:
    """A Linear (dense or quantized) plus its adapters (`adapters`, not a parameter: the model's
    parameters stay the checkpoint's, and quantizing leaves the adapters in their dtype). A mixed
    call computes every adapter's product and masks the columns where that is cheap (`masked`), else
    gathers each token's product by its adapter. On the 2-core CPU (OpenBLAS, rank 16, 2048 wide),
    gathered vs masked: 8 tokens 0.12 vs 0.10 ms (2 adapters), 0.08 vs 0.19 (4); 512 tokens 3.3 vs
    1.3 ms (2), 3.3 vs 2.3 (4)."""

    adapters: LayerAdapters

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        adapters = self.adapters
        lead = tuple(x.shape[:-1])
        pick = adapters.control.pick(lead)
        if pick is None:
            return y
        if isinstance(pick, int):
            u, b = x @ adapters.a[pick], adapters.b[pick]
        elif adapters.masked:
            mask = adapters.control.column_mask(lead, pick, adapters.a.shape[2], x.dtype)
            u, b = (x @ adapters.a_columns) * mask, adapters.b_columns
        else:
            z = mx.gather_mm(x.reshape(-1, 1, x.shape[-1]), adapters.a, rhs_indices=pick)
            z = mx.gather_mm(z, adapters.b, rhs_indices=pick).reshape(*lead, -1)
            return y + z.astype(y.dtype)
        if u.dtype == b.dtype == y.dtype:
            # one kernel for the second product and the sum (H100, 64 linears of the 1B shape, eager:
            # 1.1 / 0.4 / 1.7 ms less a call than y + u @ b at 64 / 256 / 2,048 rows)
            return mx.addmm(y, u, b)
        return y + (u @ b).astype(y.dtype)


_ADAPTED: dict[type, type] = {}


def adapted_class(base: type) -> type:
    if base not in _ADAPTED:
        _ADAPTED[base] = type(f"Adapted{base.__name__}", (AdaptedMixin, base), {"unadapted": base})
    return _ADAPTED[base]


def unadapted_type(layer: nn.Module) -> type:
    return getattr(type(layer), "unadapted", type(layer))


def attach_layer_adapters(layer: nn.Module, adapters: LayerAdapters) -> None:
    layer.__class__ = adapted_class(unadapted_type(layer))
    layer.adapters = adapters


def fuse_adapters(fused: nn.Module, layers: list[nn.Module]) -> nn.Module:
    """The fused layer (Q/K/V or gate/up concatenated along the output) keeps its parts' adapters:
    each adapter's A stacked along the rank, its B on the block diagonal (a part without one: none)."""
    carried = [getattr(layer, "adapters", None) for layer in layers]
    present = [c for c in carried if c is not None]
    if not present:
        return fused
    outs = [linear_dims(layer)[1] for layer in layers]
    slots, dtype = present[0].a.shape[0], present[0].b.dtype
    rows = []
    for i, c in enumerate(carried):
        if c is None:
            continue
        blocks = [c.b if j == i else mx.zeros((slots, c.b.shape[1], out), dtype=dtype) for j, out in enumerate(outs)]
        rows.append(mx.concatenate(blocks, axis=2))
    a = mx.concatenate([c.a for c in present], axis=2)
    b = mx.concatenate(rows, axis=1)
    mx.eval(a, b)
    attach_layer_adapters(fused, LayerAdapters(a, b, present[0].control))
    return fused


def linear_dims(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a Linear, dense or quantized; None for any other module."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[1] * 32 // layer.bits, layer.weight.shape[0]
    if isinstance(layer, nn.Linear):
        return layer.weight.shape[1], layer.weight.shape[0]
    return None


def attach_adapters(
    model: nn.Module, names: tuple[str, ...], tensors: list[dict[str, tuple[mx.array, mx.array]]], default: int
) -> AdapterControl:
    """Keep adapters unmerged beside the weights: tensors[i] is adapter i's {module path: (A [r, in],
    scale * B [out, r])}. Sets and returns the model's `adapter_control`."""
    control = AdapterControl(names, default)
    found = dict(model.named_modules())
    for path in sorted({path for modules in tensors for path in modules}):
        layer = found[path]
        in_dims, out_dims = linear_dims(layer)
        rank = max(modules[path][0].shape[0] for modules in tensors if path in modules)
        a = mx.zeros((len(names) + 1, in_dims, rank))
        b = mx.zeros((len(names) + 1, rank, out_dims))
        for i, modules in enumerate(tensors):
            if path in modules:
                a_i, b_i = modules[path]
                a[i, :, : a_i.shape[0]] = a_i.T
                b[i, : a_i.shape[0]] = b_i.T
        dtype = compute_dtype(layer)
        a, b = a.astype(dtype), b.astype(dtype)
        mx.eval(a, b)
        attach_layer_adapters(layer, LayerAdapters(a, b, control))
    model.adapter_control = control
    return control


def compute_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a layer computes in (a quantized one: its scales')."""
    return layer.scales.dtype if isinstance(layer, nn.QuantizedLinear) else layer.weight.dtype
