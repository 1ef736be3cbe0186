"""MLX affine quantization: folders written by `mlx_lm.convert -q` and `model.quantize` at load.

A quantized folder's config.json has `"quantization": {"group_size": 64, "bits": 4, ...}`,
plus per-layer entries keyed by module path (`"model.layers.0.mlp.down_proj": {"bits": 8, ...}`
or `false` for a layer left dense). A layer is quantized when its override says so, or when the
checkpoint has its `.scales`: the same rule as mlx-lm, so folders it writes load as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError

# a short fixed probe for the load-time error figure (ids below every vocabulary here)
PROBE_IDS = [(37 * i + 11) % 250 + 3 for i in range(32)]


def read_quantization_spec(spec: Any, source: Path) -> tuple[int, int, str]:
    """(group_size, bits, mode) from config.json's `quantization`, checked."""
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("group_size"), int)
        or not isinstance(spec.get("bits"), int)
    ):
        raise MlxcelError(f"{source}: 'quantization' must give integer group_size and bits (got {spec!r})")
    return spec["group_size"], spec["bits"], spec.get("mode", "affine")


def apply_checkpoint_quantization(model: nn.Module, spec: dict, weights: dict[str, mx.array], source: Path) -> None:
    """Swap in quantized layers where the checkpoint has them, before the weights are loaded."""
    group_size, bits, mode = read_quantization_spec(spec, source)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        override = spec.get(path)
        if isinstance(override, (bool, dict)):
            return override
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return read_packed_layout(module, weights, path, (group_size, bits, mode))

    nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=predicate)


def read_packed_layout(module: nn.Module, weights: dict[str, mx.array], path: str, default: tuple) -> bool | dict:
    """True when a layer's packed tensors have the folder's default group size and bits; else the
    ones their shapes give. A per-layer override keyed by the writer's module path, which the family
    renames (mlx-lm's `language_model.model.layers.0.mlp.gate` in a vision-language folder), still loads."""
    group_size, bits, mode = default
    if mode != "affine":
        return True
    dims = module.weight.shape[-1]
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    if packed is None:
        return True  # (apply_weights names the missing tensor)
    found = (dims // scales.shape[-1], packed.shape[-1] * 32 // dims)
    if found == (group_size, bits) or dims % scales.shape[-1] or (packed.shape[-1] * 32) % dims:
        return True  # the default, or shapes no layout gives (apply_weights names the tensor)
    return {"group_size": found[0], "bits": found[1], "mode": mode}


def quantize_at_load(model: nn.Module, bits: int, group_size: int) -> dict:
    """Quantize every Linear and Embedding of the language model whose input width the group size
    divides (the rest, and a VLM's vision stage, stay dense), and measure what it costs: max and mean
    |logit difference| against the dense model on a fixed 32-token probe."""
    vocab = model.args.vocab_size
    probe = mx.array([[i % vocab for i in PROBE_IDS]])
    dense = model(probe, model.make_cache()).astype(mx.float32)
    mx.eval(dense)

    vision = tuple(getattr(model, "vision_modules", ()))

    def predicate(path: str, module: nn.Module) -> bool:
        # A VLM's vision stage stays dense: the probe below could not measure what quantizing it costs.
        if path.split(".")[0] in vision:
            return False
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0

    try:
        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    except ValueError as exc:  # MLX names the unsupported bits / group size
        raise MlxcelError(f"model.quantize: {exc} (bits: 2, 3, 4, 5, 6 or 8; group_size: 32, 64 or 128)") from exc
    quantized = model(probe, model.make_cache()).astype(mx.float32)
    diff = mx.abs(quantized - dense)
    return {
        "bits": bits,
        "group_size": group_size,
        "source": "model.quantize",
        "probe_tokens": len(PROBE_IDS),
        "max_abs_logit_diff": round(diff.max().item(), 6),
        "mean_abs_logit_diff": round(diff.mean().item(), 6),
    }


def describe_checkpoint_quantization(spec: dict) -> dict:
    overrides = {k: v for k, v in spec.items() if isinstance(v, (bool, dict))}
    return {
        "bits": spec["bits"],
        "group_size": spec["group_size"],
        "source": "checkpoint",
        "layer_overrides": len(overrides),
    }


def dequantize_model(model: nn.Module) -> None:
    """Replace each quantized layer by its dense form (float32): the reference a quantized
    checkpoint is compared with."""
    from mlxcel.models.switch import QuantizedSwitchLinear, SwitchLinear

    for path, module in list(model.named_modules()):
        if isinstance(module, QuantizedSwitchLinear):  # MoE experts: [E, out, in], dequantized as they are
            dense = SwitchLinear.__new__(SwitchLinear)
            nn.Module.__init__(dense)
            dense.weight = dequantize_weight(module)
            set_module(model, path, dense)
        elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weight = dequantize_weight(module)
            if isinstance(module, nn.QuantizedLinear):
                dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
                if "bias" in module:
                    dense.bias = module.bias.astype(mx.float32)
            else:
                dense = nn.Embedding(weight.shape[0], weight.shape[1])
            dense.weight = weight
            set_module(model, path, dense)


def dequantize_weight(module: nn.Module) -> mx.array:
    """A quantized layer's weight in float32, whatever its mode (mxfp4's and nvfp4's scales are
    bytes, and they have no biases)."""
    mode = getattr(module, "mode", "affine")
    if mode != "affine":
        weight = mx.dequantize(module.weight, module.scales, None, module.group_size, module.bits, mode=mode)
        return weight.astype(mx.float32)
    scales, biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
    return mx.dequantize(module.weight, scales, biases, module.group_size, module.bits)


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    parent = model
    for part in parents:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    if last.isdigit():
        parent[int(last)] = module
    else:
        setattr(parent, last, module)
