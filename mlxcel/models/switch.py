"""Mixture-of-experts pieces the MoE families share: expert weights stacked as [E, out, in] and
applied with `mx.gather_mm` (`gather_qmm` when quantized) to each token's top-k experts only, a
top-k router, and the sanitising that stacks a checkpoint's per-expert tensors.

Module names follow mlx-lm's (`switch_mlp.{gate,up,down}_proj`), so MLX-quantized MoE folders
written by `mlx_lm.convert -q` name the same tensors."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models.base import swiglu

# Below this many (token, expert) pairs the gather is cheaper than sorting rows by expert.
SORT_MIN_PAIRS = 64


def quantize_stacked(kind: type, weight: mx.array, group_size: int, bits: int, mode: str) -> nn.Module:
    """A `kind` module (QuantizedSwitchLinear, mla.QuantizedMultiLinear) holding `weight` [n, out, in]
    quantized along its input dimension, frozen, as nn.quantize makes quantized layers."""
    layer = kind.__new__(kind)
    nn.Module.__init__(layer)
    layer.group_size, layer.bits, layer.mode = group_size, bits, mode
    layer.weight, layer.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
    if biases:
        layer.biases = biases[0]
    layer.freeze()
    return layer


class SwitchLinear(nn.Module):
    """E linear layers without bias, weight [E, out, in]; row i of x goes through expert indices[i]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self.weight
        if w.dtype != mx.float32 and mx.default_device() != mx.gpu:
            # MLX's CPU gather_mm is float32-only (0.32): half-precision weights are upcast per call
            out = mx.gather_mm(
                x.astype(mx.float32),
                w.astype(mx.float32).swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            )
            return out.astype(x.dtype)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedSwitchLinear:
        """For nn.quantize: each expert quantized along its input dimension, as mlx-lm does."""
        return quantize_stacked(QuantizedSwitchLinear, self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((num_experts, output_dims, input_dims)), group_size, bits, mode=mode
        )
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )


def concatenate_switch_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One SwitchLinear computing several projections (gate and up): their experts' outputs
    concatenated. None when they cannot be joined (mixed quantization)."""
    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers):
        return None
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    if isinstance(first, QuantizedSwitchLinear):
        if any(
            (layer.bits, layer.group_size, layer.mode) != (first.bits, first.group_size, first.mode) for layer in layers
        ):
            return None
        fused.group_size, fused.bits, fused.mode = first.group_size, first.bits, first.mode
    for name in ("weight", "scales", "biases"):
        if name in first:  # groups run along the input dimension, so outputs concatenate as they are
            setattr(fused, name, mx.concatenate([layer[name] for layer in layers], axis=1))
    if isinstance(first, QuantizedSwitchLinear):
        fused.freeze()
    return fused


class SwitchGLU(nn.Module):
    """Each token through its k experts' SwiGLU MLPs: [..., H] and indices [..., k] -> [..., k, H]."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts)

    def fuse(self) -> None:
        """Gate and up as one gathered matmul (after the weights are loaded under their own names)."""
        fused = concatenate_switch_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def project_gate_up(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> tuple[mx.array, mx.array]:
        if "gate_up_proj" in self:
            return tuple(mx.split(self.gate_up_proj(x, indices, sorted_indices), 2, axis=-1))
        return self.gate_proj(x, indices, sorted_indices), self.up_proj(x, indices, sorted_indices)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        """The experts' gated activation (gpt-oss clamps its own)."""
        return swiglu(gate, up)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        def experts(x: mx.array, idx: mx.array, do_sort: bool) -> mx.array:
            return self.down_proj(self.activate(*self.project_gate_up(x, idx, do_sort)), idx, do_sort)

        return through_experts(x, indices, experts)


def through_experts(x: mx.array, indices: mx.array, experts) -> mx.array:
    """Each token through its k experts: [..., H] and indices [..., k] -> [..., k, H].
    `experts(x, idx, sorted)`: the experts' gathered matmuls over [N, 1, H] rows and their expert
    ids. With many (token, expert) pairs the rows go in expert order, so each expert's weights are
    read once per call, not once per row."""
    k = indices.shape[-1]
    x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H]: one [1, H] matrix per token
    do_sort = indices.size >= SORT_MIN_PAIRS
    if not do_sort:
        return experts(x, indices, False).squeeze(-2)
    flat = indices.flatten()
    order = mx.argsort(flat)
    out = experts(x.flatten(0, -3)[order // k], flat[order], True)
    return mx.unflatten(out[mx.argsort(order)], 0, indices.shape).squeeze(-2)


def route_top_k(router_logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """transformers' TopKRouter: softmax over all experts in fp32, the k largest probabilities,
    renormalised to sum to 1 when `normalize`. Returns (expert indices, weights in fp32)."""
    probs = mx.softmax(router_logits.astype(mx.float32), axis=-1)
    indices = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-style routing (Nemotron 3, GLM-4.5): sigmoid scores; the choice adds
    e_score_correction_bias (and keeps the best topk_group of n_group groups, a group scored by its
    two best), the weights are the plain scores, normalised when `normalize`, times `scale`. In
    float32, as transformers keeps it."""

    def __init__(
        self,
        hidden_size: int,
        experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        normalize: bool = True,
        scale: float = 1.0,
    ):
        super().__init__()
        if not 1 <= top_k <= experts or experts % n_group:
            raise MlxcelError(
                f"config.json: num_experts_per_tok={top_k} must be between 1 and n_routed_experts "
                f"({experts}), and n_routed_experts a multiple of n_group ({n_group})"
            )
        self.weight = mx.zeros((experts, hidden_size))
        self.e_score_correction_bias = mx.zeros((experts,))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.normalize, self.scale = normalize, scale

    @classmethod
    def from_args(cls, args) -> GroupedSigmoidRouter:
        """From a family's args under DeepSeek's config names (n_routed_experts, n_group, ...)."""
        return cls(
            args.hidden_size,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        groups = (self.n_group, self.topk_group) if self.n_group > 1 and self.topk_group < self.n_group else None
        return pick_experts(scores, choice, self.top_k, groups, 2, -mx.inf, self.normalize, self.scale)


def pick_experts(
    scores: mx.array,
    choice: mx.array,
    top_k: int,
    groups: tuple[int, int] | None = None,
    group_best: int = 2,
    dropped_value: float = 0.0,
    normalize: bool = False,
    scale: float = 1.0,
) -> tuple[mx.array, mx.array]:
    """The DeepSeek-style routers' choice (V3's and GLM's sigmoid, V2's and Mistral 4's softmax):
    with `groups` (n_group, topk_group), keep the topk_group groups whose `group_best` best `choice`
    values sum highest, the others' set to `dropped_value`; the top_k of `choice`; their `scores` as
    weights, normalised when `normalize`, times `scale`."""
    if groups is not None:
        n_group, topk_group = groups
        grouped = mx.unflatten(choice, -1, (n_group, -1))
        group_scores = mx.topk(grouped, group_best, axis=-1).sum(axis=-1)  # [..., n_group]
        dropped = mx.argpartition(group_scores, kth=n_group - topk_group - 1, axis=-1)[
            ..., : n_group - topk_group, None
        ]
        choice = mx.flatten(mx.put_along_axis(grouped, dropped, mx.array(dropped_value), axis=-2), -2, -1)
    indices = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return indices, weights * scale


class SparseMoeBlock(nn.Module):
    """Router (`gate`) and experts (`switch_mlp`): the experts' outputs weighted by the router."""

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise MlxcelError(
                f"config.json: num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})"
            )
        self.top_k, self.normalize = top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden_size, expert_size, num_experts)

    def fuse(self) -> None:
        self.switch_mlp.fuse()

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = route_top_k(self.gate(x), self.top_k, self.normalize)
        y = self.switch_mlp(x, indices)
        return (y * weights[..., None]).sum(axis=-2).astype(x.dtype)


def stack_expert_weights(
    weights: dict[str, mx.array], prefix: str, num_experts: int, names: dict[str, str]
) -> dict[str, mx.array]:
    """Checkpoint experts under `prefix` (e.g. "model.layers.3.mlp") -> `prefix.switch_mlp.*`.

    Two layouts: per expert, `experts.N.<name>.<weight|scales|biases>` with `names` mapping the
    checkpoint's projection names to gate_proj/up_proj/down_proj (what transformers 5's
    save_pretrained still writes); or already stacked, `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I] (transformers 5 in memory). Returns the weights, rewritten."""
    weights = dict(weights)
    stacked = f"{prefix}.experts.gate_up_proj"
    if stacked in weights:
        gate, up = mx.split(weights.pop(stacked), 2, axis=1)
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = up
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
        return weights
    for source, target in names.items():
        for part in ("weight", "scales", "biases"):
            keys = [f"{prefix}.experts.{e}.{source}.{part}" for e in range(num_experts)]
            present = [key in weights for key in keys]
            if not any(present):
                continue
            if not all(present):
                missing = keys[present.index(False)]
                raise MlxcelError(
                    f"checkpoint has {sum(present)} of {num_experts} experts for {prefix}: no tensor {missing}"
                )
            weights[f"{prefix}.switch_mlp.{target}.{part}"] = mx.stack([weights.pop(key) for key in keys])
    return weights
