"""A KV cache stored quantized (`decode.kv_bits`): MLX's affine quantization along head_dim.

Keys and values are quantized as they are written (group-wise along the last axis, as MLX
quantizes weights) and dequantized when attention reads them, so every family's attention
(fused kernel, soft-capped scores) runs unchanged. What stays resident is the quantized cache:
at 4 bits a quarter of bf16's bytes plus a scale and bias per group; only the layer being
computed has a full-precision copy, freed when its attention is done. A prompt's first piece
attends to its own full-precision keys, as the unquantized cache does.

Sliding-window layers keep their RotatingKVCache: a window is already bounded.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.errors import MlxcelError
from mlxcel.models.cache import KVCache, grow_storage

KV_BITS = (2, 3, 4, 5, 6, 8)


class QuantizedKVCache(KVCache):
    def __init__(self, bits: int, group_size: int, batch_size: int = 1, left_pad: mx.array | None = None):
        super().__init__(batch_size, left_pad)
        self.bits, self.group_size = bits, group_size
        self.quantized_keys: tuple[mx.array, mx.array, mx.array] | None = None  # (packed, scales, biases)
        self.quantized_values: tuple[mx.array, mx.array, mx.array] | None = None
        self.dtype = None

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def dequantize(self, parts: tuple[mx.array, mx.array, mx.array], end: int) -> mx.array:
        packed, scales, biases = (p[..., :end, :] for p in parts)
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits).astype(self.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, length = self.offset, keys.shape[2]
        if self.quantized_keys is None:
            check_head_dim(keys.shape[-1], self.group_size)
            check_head_dim(values.shape[-1], self.group_size)  # (an MLA layer's RoPE key is narrower)
            self.dtype = keys.dtype
            self.quantized_keys = tuple(p[..., :0, :] for p in self.quantize(keys))
            self.quantized_values = tuple(p[..., :0, :] for p in self.quantize(values))
        self.reserve(prev + length)
        self.offset = prev + length
        for stored, new in ((self.quantized_keys, self.quantize(keys)), (self.quantized_values, self.quantize(values))):
            for part, new_part in zip(stored, new):
                part[..., prev : self.offset, :] = new_part
        if prev == 0:
            return keys, values
        return self.dequantize(self.quantized_keys, self.offset), self.dequantize(self.quantized_values, self.offset)

    def reserve(self, needed: int) -> None:
        if self.quantized_keys is None or needed <= self.quantized_keys[0].shape[2]:
            return
        capacity = self.capacity_for(needed)
        self.quantized_keys = tuple(grow_storage(p, self.offset, capacity) for p in self.quantized_keys)
        self.quantized_values = tuple(grow_storage(p, self.offset, capacity) for p in self.quantized_values)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.quantized_keys is None else [*self.quantized_keys, *self.quantized_values]


def check_head_dim(head_dim: int, group_size: int) -> None:
    if head_dim % group_size:
        raise MlxcelError(
            f"decode.kv_group_size={group_size} does not divide the model's head_dim {head_dim}: "
            f"use a group size that does (32, 64 or 128), or drop decode.kv_bits"
        )


def quantize_caches(cache: list, bits: int, group_size: int) -> list:
    """Full-attention layers' caches replaced by quantized ones; sliding windows kept."""
    return [QuantizedKVCache(bits, group_size, c.batch_size, c.left_pad) if type(c) is KVCache else c for c in cache]
