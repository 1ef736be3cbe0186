"""LoRA adapter folders (docs/adapters.md): `model.adapter` (one, merged into the weights at load) and
`model.adapters` (several, kept unmerged beside them: models/adapters.py).

Two on-disk formats, told apart by their weights file:
- mlx-lm's (`mlx_lm.lora`): adapters.safetensors (`<module>.lora_a` [in, r], `.lora_b` [r, out]) and
  adapter_config.json (`fine_tune_type`, `lora_parameters: {rank, scale}`): y = W x + scale * B A x;
- PEFT's: adapter_model.safetensors (`base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight`
  [out, r]) and adapter_config.json (`r`, `lora_alpha`, `rank_pattern`, `alpha_pattern`, `use_rslora`):
  scale = alpha / r, or alpha / sqrt(r) with rsLoRA.

Everything a header tells (format, ranks, shapes, the modules targeted) is read and checked against
the model as its config builds it, before any weight loads (`plan_adapters`, `check_adapter`). One
adapter on dense weights is merged (W + scale * B @ A in float32) before quantize-at-load and the
fusion of the projections; otherwise (several adapters, a checkpoint-quantized base, or
model.merge_adapter=false) the adapters stay unmerged, picked per token through model.adapter_control."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.checkpoints.fingerprint import read_safetensors_header
from mlxcel.config import ADAPTER_NAME
from mlxcel.errors import MlxcelError
from mlxcel.models.adapters import NO_ADAPTER, attach_adapters, linear_dims

ADAPTER_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT settings that change what the adapter computes beyond plain LoRA, with what to do instead
PEFT_REFUSED = {
    "use_dora": "DoRA is not supported: merge it into the base with PEFT (merge_and_unload) and load that folder",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layers) is not supported",
    "modules_to_save": "modules_to_save (whole modules trained beside the LoRA) is not supported: merge with "
    "PEFT (merge_and_unload) and load that folder",
    "lora_bias": "lora_bias is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
}


@dataclass
class ModuleSpec:
    """One adapted module as the adapter's header gives it (no tensor read)."""

    a_key: str
    b_key: str
    rank: int
    in_dims: int
    out_dims: int
    scale: float


@dataclass
class AdapterSpec:
    key: str  # the config key naming it (model.adapter, model.adapters.NAME)
    folder: Path
    weights: Path
    kind: str  # "mlx-lm" | "peft"
    modules: dict[str, ModuleSpec]  # the adapter's module path -> its shapes
    paths: dict[str, str] = field(default_factory=dict)  # the adapter's module path -> the model's (check_adapter)


# ---- reading an adapter's header ----


def read_safetensors_shapes(path: Path) -> dict[str, list[int]]:
    try:
        header = json.loads(read_safetensors_header(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MlxcelError(f"cannot read {path}: its safetensors header is not JSON ({exc})") from exc
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def read_adapter(folder: str | Path, key: str = "model.adapter") -> AdapterSpec:
    """The adapter in `folder` as its config and safetensors header describe it: format, every
    module's rank, shapes and scale, all checked (no tensor is read)."""
    folder = Path(folder).expanduser()
    config_path = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise MlxcelError(f"{key}={folder}: not a folder (expected an adapter folder with {ADAPTER_CONFIG})")
    if (folder / MLX_LM_WEIGHTS).is_file():
        kind, weights = "mlx-lm", folder / MLX_LM_WEIGHTS
    elif (folder / PEFT_WEIGHTS).is_file():
        kind, weights = "peft", folder / PEFT_WEIGHTS
    else:
        raise MlxcelError(
            f"{key}={folder}: no {MLX_LM_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT) in the folder "
            "(PEFT's adapter_model.bin is not read: save with safe_serialization=True)"
        )
    if not config_path.is_file():
        raise MlxcelError(f"{key}={folder}: no {ADAPTER_CONFIG} beside {weights.name}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise MlxcelError(f"{config_path}: invalid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise MlxcelError(f"{config_path}: expected a JSON object")
    read = read_mlx_lm_modules if kind == "mlx-lm" else read_peft_modules
    modules = read(config, weights, config_path)  # the config's refusals first, then the header
    if not modules:
        raise MlxcelError(f"{weights}: holds no LoRA tensors")
    return AdapterSpec(key, folder, weights, kind, modules)


def pair_tensors(shapes: dict[str, list[int]], pattern: str, weights: Path, refused: dict[str, str]) -> dict:
    """module path -> {"A": key, "B": key} from tensor names matching `pattern` (groups: module, A|B);
    a name matching a `refused` regex is an error that says why."""
    pairs: dict[str, dict[str, str]] = {}
    for name in shapes:
        for marker, why in refused.items():
            if re.search(marker, name):
                raise MlxcelError(f"{weights}: tensor {name}: {why}")
        match = re.fullmatch(pattern, name)
        if match is None:
            raise MlxcelError(f"{weights}: unexpected tensor {name} (not a LoRA A or B matrix)")
        pairs.setdefault(match.group(1), {})[match.group(2).upper()] = name
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            have = "".join(pair)
            raise MlxcelError(f"{weights}: {module} has a LoRA {have} matrix but no {'B' if have == 'A' else 'A'}")
    return pairs


def read_mlx_lm_modules(config: dict, weights: Path, config_path: Path) -> dict[str, ModuleSpec]:
    kind = config.get("fine_tune_type", "lora")
    if kind == "dora":
        raise MlxcelError(
            f"{config_path}: fine_tune_type 'dora' is not supported: fuse it into the base with mlx_lm.fuse "
            "and load that folder as model.path"
        )
    if kind != "lora":
        raise MlxcelError(
            f"{config_path}: fine_tune_type {kind!r} is not an adapter ('full' writes whole weights: load them "
            "as model.path); only 'lora' loads as model.adapter"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("rank"), int) or "scale" not in params:
        raise MlxcelError(f"{config_path}: lora_parameters must give an integer rank and a scale (got {params!r})")
    rank, scale = params["rank"], float(params["scale"])
    shapes = read_safetensors_shapes(weights)
    refused = {r"\.m$": "DoRA magnitudes (fine_tune_type dora) are not supported"}
    pairs = pair_tensors(shapes, r"(.+)\.lora_(a|b)", weights, refused)
    modules = {}
    for module, pair in pairs.items():
        a, b = shapes[pair["A"]], shapes[pair["B"]]  # [in, r], [r, out]
        check_rank(
            module,
            a,
            b,
            a_rank=a[-1] if len(a) == 2 else None,
            b_rank=b[0] if len(b) == 2 else None,
            expected=rank,
            weights=weights,
        )
        modules[module] = ModuleSpec(pair["A"], pair["B"], rank, a[0], b[1], scale)
    return modules


def read_peft_modules(config: dict, weights: Path, config_path: Path) -> dict[str, ModuleSpec]:
    if config.get("peft_type", "LORA") != "LORA":
        raise MlxcelError(f"{config_path}: peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for setting, why in PEFT_REFUSED.items():
        if config.get(setting):
            raise MlxcelError(f"{config_path}: {setting}: {why}")
    if config.get("bias", "none") != "none":
        raise MlxcelError(f"{config_path}: bias {config['bias']!r} is not supported (trained biases: bias 'none' only)")
    shapes = read_safetensors_shapes(weights)
    refused = {
        r"\.lora_magnitude_vector": "DoRA is not supported",
        r"\.lora_embedding_": "adapters on embedding layers are not supported (Linear layers only)",
    }
    original = {name.removeprefix(PEFT_PREFIX): name for name in shapes}
    renamed = {short: shapes[name] for short, name in original.items()}
    pairs = pair_tensors(renamed, r"(.+)\.lora_(A|B)(?:\.default)?\.weight", weights, refused)
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = {}
    for module, pair in pairs.items():
        a, b = renamed[pair["A"]], renamed[pair["B"]]  # [r, in], [out, r]
        expected = rank_pattern.get(match_pattern(rank_pattern, module), r)
        check_rank(
            module,
            a,
            b,
            a_rank=a[0] if len(a) == 2 else None,
            b_rank=b[-1] if len(b) == 2 else None,
            expected=expected,
            weights=weights,
        )
        module_alpha = alpha_pattern.get(match_pattern(alpha_pattern, module), alpha)
        scale = module_alpha / math.sqrt(expected) if config.get("use_rslora") else module_alpha / expected
        modules[module] = ModuleSpec(original[pair["A"]], original[pair["B"]], expected, a[1], b[0], scale)
    check_targets(config.get("target_modules"), modules, weights, config_path)
    return modules


def match_pattern(patterns: dict, module: str) -> str | None:
    """PEFT's rank_pattern / alpha_pattern key for a module (peft.utils.other.get_pattern_key)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return pattern
    return None


def check_rank(module: str, a: list, b: list, a_rank, b_rank, expected: int, weights: Path) -> None:
    if len(a) != 2 or len(b) != 2 or a_rank != b_rank:
        raise MlxcelError(
            f"{weights}: {module} has LoRA A {tuple(a)} and B {tuple(b)}, which do not share a rank (2-D, A's rank "
            "side equal to B's)"
        )
    if a_rank != expected:
        raise MlxcelError(
            f"{weights}: {module} has rank {a_rank} (A {tuple(a)}, B {tuple(b)}) but adapter_config.json says "
            f"{expected} (a file from another run, or a config edited by hand?)"
        )


def check_targets(targets: Any, modules: dict, weights: Path, config_path: Path) -> None:
    """Each module named in target_modules (a list of names) has tensors in the file."""
    if not isinstance(targets, list):
        return  # a regex, "all-linear" or absent: the tensors say what is adapted
    for target in targets:
        if not any(m == target or m.endswith(f".{target}") for m in modules):
            raise MlxcelError(
                f"{config_path}: target_modules names {target!r} but {weights.name} holds no LoRA tensors for it "
                "(a truncated file, or the config of another adapter?)"
            )


# ---- the adapter against the model ----


def check_adapter(spec: AdapterSpec, model: nn.Module) -> None:
    """Every module the adapter adapts is a Linear of this model with the adapter's shapes (the
    model as built from its config: no weight needs to be loaded). Fills spec.paths."""
    found = dict(model.named_modules())
    arch = getattr(model, "model_type", type(model).__module__)
    for module, shape in spec.modules.items():
        path = resolve_module(module, found)
        if path is None:
            raise MlxcelError(
                f"{spec.weights}: the adapter adapts {module}, which this {arch} model does not have "
                "(an adapter for another architecture?)"
            )
        dims = linear_dims(found[path])
        if dims is None:
            raise MlxcelError(
                f"{spec.weights}: the adapter adapts {module}, a {type(found[path]).__name__} here; adapters "
                "adapt Linear layers only"
            )
        if dims != (shape.in_dims, shape.out_dims):
            raise MlxcelError(
                f"{spec.weights}: {module}: the adapter maps {shape.in_dims} -> {shape.out_dims} (rank {shape.rank}) "
                f"but this {arch} model's layer maps {dims[0]} -> {dims[1]} (an adapter for another model size?)"
            )
        spec.paths[module] = path


def resolve_module(module: str, found: dict[str, nn.Module]) -> str | None:
    """The model's path for an adapter's module name: the same, or (a multimodal folder's
    language model, named differently) the one module whose path ends at the same `layers.N...`."""
    if module in found:
        return module
    tail = re.search(r"(?:^|\.)(layers\.\d+\..+)$", module)
    if tail is None:
        return None
    matches = [path for path in found if path == tail.group(1) or path.endswith("." + tail.group(1))]
    return matches[0] if len(matches) == 1 else None


def read_adapter_tensors(spec: AdapterSpec) -> dict[str, tuple[mx.array, mx.array]]:
    """The model's module path -> (A [r, in], scale * B [out, r]) in float32."""
    try:
        tensors = mx.load(str(spec.weights))
    except (RuntimeError, ValueError) as exc:
        raise MlxcelError(f"cannot read {spec.weights}: {exc} (is the file complete?)") from exc
    out = {}
    for module, shape in spec.modules.items():
        a, b = tensors[shape.a_key].astype(mx.float32), tensors[shape.b_key].astype(mx.float32)
        if spec.kind == "mlx-lm":
            a, b = a.T, b.T
        out[spec.paths[module]] = (a, b * shape.scale)
    return out


def merge_adapter(model: nn.Module, spec: AdapterSpec) -> None:
    """W + scale * B @ A, in float32, into each dense layer (before the projections are fused)."""
    found = dict(model.named_modules())
    for path, (a, b) in read_adapter_tensors(spec).items():
        layer = found[path]
        layer.weight = (layer.weight.astype(mx.float32) + b @ a).astype(layer.weight.dtype)
        mx.eval(layer.weight)


def is_dense(model: nn.Module, spec: AdapterSpec) -> bool:
    found = dict(model.named_modules())
    return not any(isinstance(found[path], nn.QuantizedLinear) for path in spec.paths.values())


# ---- what the loader calls ----


@dataclass
class AdapterPlan:
    """model.adapter (`several` False: one, merged where the base is dense and `merge`) or
    model.adapters (several, unmerged), read and checked before the weights load."""

    specs: dict[str, AdapterSpec]
    several: bool
    merge: bool = True
    merged: bool = False

    def check(self, model: nn.Module) -> None:
        for spec in self.specs.values():
            check_adapter(spec, model)

    def merge_into(self, model: nn.Module) -> None:
        """Before quantize-at-load and the fusion: the one adapter into dense weights."""
        spec = next(iter(self.specs.values()))
        if not self.several and self.merge and is_dense(model, spec):
            merge_adapter(model, spec)
            self.merged = True

    def attach(self, model: nn.Module) -> None:
        """After quantizing, before the fusion: whatever was not merged stays beside the weights."""
        if not self.merged:
            tensors = [read_adapter_tensors(spec) for spec in self.specs.values()]
            attach_adapters(model, tuple(self.specs), tensors, default=NO_ADAPTER if self.several else 0)

    def describe(self) -> dict:
        return {
            "names": list(self.specs) if self.several else None,
            "paths": {name: str(spec.folder) for name, spec in self.specs.items()},
            "formats": sorted({spec.kind for spec in self.specs.values()}),
            "modules": sum(len(spec.modules) for spec in self.specs.values()),
            "merged": self.merged,
        }


def plan_adapters(adapter: str | None, adapters: dict[str, str] | None, merge: bool = True) -> AdapterPlan | None:
    """The adapters a load asks for, their headers read and checked (no tensor read)."""
    if adapter and adapters:
        raise MlxcelError("set model.adapter (one, merged) or model.adapters (several, unmerged), not both")
    if adapter:
        return AdapterPlan({"adapter": read_adapter(adapter, "model.adapter")}, several=False, merge=merge)
    if adapters:
        for name in adapters:
            if not re.fullmatch(ADAPTER_NAME, str(name)):
                raise MlxcelError(f"model.adapters: name {name!r} must match {ADAPTER_NAME} (letters, digits, _ . -)")
        specs = {name: read_adapter(path, f"model.adapters.{name}") for name, path in adapters.items()}
        return AdapterPlan(specs, several=True, merge=False)
    return None
