"""Low-rank adapters (PEFT's LoRA) that apply to some rows of a batch and not others: Phi-4-multimodal's
vision LoRA changes the language model for prompts with images only.

A `LoRALinear` is an `nn.Linear` (same parameter names, so checkpoints load as they are) that also
holds an adapter (`lora`: A [r, in], B [out, r], scale), kept out of its parameters: the adapter is
read from its own folder when first needed, is never quantized, and `model.parameters()` stays the
checkpoint's. One `LoRAControl` shared by every adapted layer says, per forward pass, which rows take
the adapter and how:
- `rows` None: no row does (text-only batches): the plain layer;
- `fused`: every row does (a prefill of image prompts only): one matmul with W + scale * B @ A,
  merged per layer inside the graph, so no merged copy of the weights outlives its layer; only
  where the piece is long enough for merging to cost less than the low-rank products;
- otherwise unfused: W x + rows * scale * B (A x), rows [B, 1, 1] of 1.0 / 0.0 (decode, mixed batches).
Quantizing turns a LoRALinear into a `QuantizedLoRALinear`, which always runs unfused."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAControl:
    rows: mx.array | None = None  # [B, 1, 1] in the compute dtype: 1 where the adapter applies; None: nowhere
    fused: bool = False  # every row takes the adapter: merge it into the weights for this pass


@dataclass
class LoRAWeights:
    a: mx.array  # [r, in]
    b: mx.array  # [out, r]
    scale: float


class LoRAMixin:
    """The adapter on top of the base layer's own __call__ (dense or quantized)."""

    control: LoRAControl
    lora: LoRAWeights | None

    def attach_lora(self, control: LoRAControl, lora: LoRAWeights | None = None) -> None:
        self.control, self.lora = control, lora

    def __call__(self, x: mx.array) -> mx.array:
        lora, control = getattr(self, "lora", None), getattr(self, "control", None)
        if lora is None or control is None or control.rows is None:
            return super().__call__(x)
        if (
            control.fused
            and isinstance(self, LoRALinear)
            and is_merge_cheaper(x.size // x.shape[-1], *self.weight.shape)
        ):
            weight = (
                self.weight.astype(mx.float32) + lora.scale * (lora.b.astype(mx.float32) @ lora.a.astype(mx.float32))
            ).astype(self.weight.dtype)
            y = x @ weight.T
            return y + self.bias if "bias" in self else y
        delta = ((x @ lora.a.T) @ lora.b.T) * lora.scale
        return super().__call__(x) + control.rows * delta


def is_merge_cheaper(tokens: int, out_dims: int, in_dims: int) -> bool:
    """Merging costs out x in x r multiply-adds, the low-rank products tokens x (in + out) x r:
    merge for pieces of at least out x in / (in + out) tokens (about 1.5k-2.6k for Phi-4's layers)."""
    return tokens * (in_dims + out_dims) >= in_dims * out_dims


class QuantizedLoRALinear(LoRAMixin, nn.QuantizedLinear):
    pass


class LoRALinear(LoRAMixin, nn.Linear):
    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", quantize_input: bool = False
    ):
        if quantize_input:
            raise MlxcelError("activation quantization is not supported for LoRA layers")
        quantized = QuantizedLoRALinear.from_linear(self, group_size, bits, mode=mode)
        quantized.attach_lora(getattr(self, "control", None), getattr(self, "lora", None))
        return quantized


def make_lora_linear(input_dims: int, output_dims: int, bias: bool, control: LoRAControl) -> LoRALinear:
    layer = LoRALinear(input_dims, output_dims, bias=bias)
    layer.attach_lora(control)
    return layer


def read_adapter_scale(config: dict, rank: int, source: Path) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; r from the tensors
    (PEFT's rank_pattern only changes shapes)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise MlxcelError(f"{source}: peft_type {config.get('peft_type')!r} is not supported (only LORA adapters)")
    unsupported = [
        key
        for key in ("use_dora", "fan_in_fan_out", "alpha_pattern", "modules_to_save", "lora_bias")
        if config.get(key)
    ]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise MlxcelError(f"{source}: adapter settings {', '.join(unsupported)} are not supported (plain LoRA only)")
    alpha = config.get("lora_alpha", config.get("r", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_peft_adapter(folder: Path, layers: dict[str, LoRAMixin], dtype: mx.Dtype) -> int:
    """Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) onto
    `layers` (module path -> LoRA layer). Every adapter tensor must name one of them, with the
    layer's shape. Returns how many layers the adapter covers."""
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise MlxcelError(
                f"{path}: missing (the vision LoRA adapter; copy the {folder.name}/ folder from the original "
                "checkpoint)"
            )
    try:
        config = json.loads(config_path.read_text())
        tensors = mx.load(str(weights_path))
    except (json.JSONDecodeError, RuntimeError, ValueError) as exc:
        raise MlxcelError(f"cannot read the adapter in {folder}: {exc}") from exc
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                path, rest = name.split(marker, 1)
                if rest not in ("weight", "default.weight"):
                    raise MlxcelError(f"{weights_path}: unexpected adapter tensor {key}")
                pairs.setdefault(path, {})[part] = value
                break
        else:
            raise MlxcelError(
                f"{weights_path}: unexpected adapter tensor {key} (expected ...lora_A.weight / ...lora_B.weight)"
            )
    for path, pair in pairs.items():
        layer = layers.get(path)
        if layer is None:
            raise MlxcelError(
                f"{weights_path}: the adapter targets {path}, which is not an adapted layer of this model"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            raise MlxcelError(f"{weights_path}: {path} lacks its {'lora_B' if 'lora_A' in pair else 'lora_A'} tensor")
        a, b = pair["lora_A"], pair["lora_B"]
        out_dims, in_dims = (
            (layer.weight.shape[0], layer.weight.shape[1] * 32 // layer.bits)
            if isinstance(layer, nn.QuantizedLinear)
            else layer.weight.shape
        )
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[1] != in_dims or b.shape[0] != out_dims:
            raise MlxcelError(
                f"{weights_path}: {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the layer is "
                f"{in_dims} -> {out_dims}"
                " (does this adapter belong to this model?)"
            )
        layer.lora = LoRAWeights(a.astype(dtype), b.astype(dtype), read_adapter_scale(config, a.shape[0], config_path))
    return len(pairs)
