"""LoRA adapters kept beside a layer's weights (docs/adapters.md): several adapters over one base
model, each token of a forward call taking one of them or none (`model.adapters`; also one adapter
on a quantized base). mlxcel/checkpoints/adapters.py reads the adapter folders and merges a lone
adapter into dense weights instead.

Each adapted layer keeps every adapter's A stacked along the rank ([R, in]) and its scale * B side
by side ([out, R]); one `AdapterControl` shared by the model says which adapter each token takes.
A token's rank columns are masked to its adapter's (0/1 over the R columns), so a batch's LoRA
product is two matmuls a layer whatever its mix of adapters. Fusing Q/K/V or gate/up (base.fuse_linears)
stacks the parts' A and puts their B on the block diagonal (`fuse_adapters`), so fused layers keep
their adapters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError

NO_ADAPTER = -1


@dataclass
class LayerAdapters:
    """What an adapted layer adds: ((x @ a.T) * mask) @ b.T, mask picking each token's columns."""

    a: mx.array  # [R, in]: every adapter's A, stacked along the rank
    b: mx.array  # [out, R]: scale * B, side by side
    owner: tuple[int, ...]  # the adapter each of the R columns belongs to
    control: AdapterControl


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
        self._masks: dict[tuple, mx.array | None] = {}

    def set_tokens(self, index: Any, logits_at: int | mx.array | None = None) -> None:
        host = None if isinstance(index, mx.array) else np.asarray(index, dtype=np.int32)
        if host is not None:
            if host.ndim not in (1, 2):
                raise MlxcelError(f"adapter index: expected [B] or [B, L] int32 (got shape {host.shape})")
            if host.size and (host.min() < NO_ADAPTER or host.max() >= len(self.names)):
                raise MlxcelError(
                    f"adapter index: values must be in [-1, {len(self.names) - 1}] (got {host.min()}..{host.max()})"
                )
        self.index = mx.array(host) if host is not None else index.astype(mx.int32)
        self.index_at = None
        if logits_at is not None and self.index.ndim == 2:
            at = slice(logits_at, logits_at + 1) if isinstance(logits_at, int) else logits_at
            self.index_at = self.index[:, at]
        self._masks = {}
        if host is not None and host.size and (host == NO_ADAPTER).all():
            self._masks = None  # no token takes an adapter: every layer skips its product

    def clear(self) -> None:
        self.index, self.index_at, self._masks = None, None, {}

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

    def mask_for(self, owner: tuple[int, ...], lead: tuple[int, ...], dtype: mx.Dtype) -> mx.array | None | bool:
        """None: no token takes any of these columns; True: every token takes every column (one
        adapter, all tokens); else a [..., R] 0/1 mask."""
        if self._masks is None:
            return None
        if self.index is None:
            if self.default == NO_ADAPTER:
                return None
            return True if all(o == self.default for o in owner) else self._constant_mask(owner, dtype)
        key = (owner, lead, dtype)
        if key not in self._masks:
            tokens = self.tokens_for(lead)
            self._masks[key] = (tokens[..., None] == mx.array(owner, dtype=mx.int32)).astype(dtype)
        return self._masks[key]

    def _constant_mask(self, owner: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        return mx.array([1.0 if o == self.default else 0.0 for o in owner], dtype=dtype)


class AdaptedMixin:
    """A Linear (dense or quantized) plus its adapters (`adapters`, not a parameter: the model's
    parameters stay the checkpoint's, and quantizing leaves the adapters in their dtype)."""

    adapters: LayerAdapters

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        adapters = self.adapters
        mask = adapters.control.mask_for(adapters.owner, tuple(x.shape[:-1]), x.dtype)
        if mask is None:
            return y
        z = x @ adapters.a.T
        if mask is not True:
            z = z * mask
        return y + (z @ adapters.b.T).astype(y.dtype)


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
    their A stacked along the rank, their B on the block diagonal (a part without one: zeros)."""
    carried = [getattr(layer, "adapters", None) for layer in layers]
    present = [c for c in carried if c is not None]
    if not present:
        return fused
    outs = [linear_dims(layer)[1] for layer in layers]
    ranks = [c.a.shape[0] if c is not None else 0 for c in carried]
    dtype = present[0].b.dtype
    rows = []
    for i, out_dims in enumerate(outs):
        blocks = [
            carried[j].b if j == i else mx.zeros((out_dims, rank), dtype=dtype) for j, rank in enumerate(ranks) if rank
        ]
        rows.append(mx.concatenate(blocks, axis=1))
    a = mx.concatenate([c.a for c in present], axis=0)
    b = mx.concatenate(rows, axis=0)
    mx.eval(a, b)
    owner = tuple(o for c in present for o in c.owner)
    attach_layer_adapters(fused, LayerAdapters(a, b, owner, present[0].control))
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
    per_layer: dict[str, list[tuple[int, mx.array, mx.array]]] = {}
    for i, modules in enumerate(tensors):
        for path, (a, b) in modules.items():
            per_layer.setdefault(path, []).append((i, a, b))
    for path, parts in per_layer.items():
        layer = found[path]
        dtype = compute_dtype(layer)
        a = mx.concatenate([a for _, a, _ in parts], axis=0).astype(dtype)
        b = mx.concatenate([b for _, _, b in parts], axis=1).astype(dtype)
        mx.eval(a, b)
        owner = tuple(i for i, a_i, _ in parts for _ in range(a_i.shape[0]))
        attach_layer_adapters(layer, LayerAdapters(a, b, owner, control))
    model.adapter_control = control
    return control


def compute_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a layer computes in (a quantized one: its scales')."""
    return layer.scales.dtype if isinstance(layer, nn.QuantizedLinear) else layer.weight.dtype
