"""Load a model from an HF folder (config.json + safetensors) or a GGUF file.

Weights are evaluated here, so the first prefill does not wait on weight I/O.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.checkpoints import gguf
from mlxcel.checkpoints.adapters import plan_adapters
from mlxcel.checkpoints.embedded import EMBEDDED_MODELS, locate_embedded_model
from mlxcel.checkpoints.fingerprint import check_model_files
from mlxcel.checkpoints.hub import is_repo_id, resolve_repo
from mlxcel.checkpoints.quantize import (
    apply_checkpoint_quantization,
    describe_checkpoint_quantization,
    quantize_at_load,
)
from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError

# model_type in config.json -> module in mlxcel.models (names are checked before any import).
# A family is supported once its module exists: one file per family, added without touching this.
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3_vl",  # the multimodal folders: SigLIP + projector + the gemma3 text model
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",  # the multimodal folders: their language model (towers not loaded)
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "smollm3": "smollm3",
    "gpt_oss": "gpt_oss",
    "llama4_text": "llama4",
    "llama4": "llama4",  # the vision-language folders: their language model (the tower not loaded)
    "glm4": "glm4",
    "glm4_moe": "glm4_moe",
    # multi-head latent attention (models/mla.py): the cache keeps a latent a position
    "deepseek_v2": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2: a DeepSeek V3 text model
    "kimi_k25": "deepseek_v3",  # Kimi K2.5's vision-language folders: their language model
    "mistral4": "mistral4",  # Mistral 4: MLA with Llama 4's query scale, its own softmax router
    # hybrids: recurrent layers beside attention (models/recurrent.py)
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",  # the vision-language folders: their language model
    "nemotron_h": "nemotron_h",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",  # the vision-language folders: their language model
    "qwen3_next": "qwen3_next",
    # vision-language models (mlxcel/vision/stage.py has their contract)
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "llava": "llava",
    "llava_next": "llava",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "mistral3": "mistral3",
    "phi4_multimodal": "phi4_multimodal",
}
# model_type of layouts we do not read, with what to load instead
UNSUPPORTED_LAYOUTS = {
    "deepseek_v32": (
        "DeepSeek V3.2, whose sparse attention (the lightning indexer that picks each query's top-k keys) is not "
        "supported; DeepSeek V3 / V3.1 folders (deepseek_v3) load"
    ),
    "deepseek_v4": (
        "DeepSeek V4, whose compressed sparse attention layers (compressed KV with a lightning indexer) and "
        "hyper-connections are not supported; DeepSeek V3 / V3.1 folders (deepseek_v3) load"
    ),
    "mistral_large4": (
        "Mistral Large 4, whose sparse attention (an indexer picking each query's top-k keys), NoPE layers and "
        "layers sharing another layer's latent cache are not supported; Mistral 4 folders (mistral4) load"
    ),
    "mistral_large4_text": (
        "Mistral Large 4's language model, whose sparse attention (an indexer picking each query's top-k keys), "
        "NoPE layers and layers sharing another layer's latent cache are not supported; Mistral 4 folders "
        "(mistral4) load"
    ),
    "phi4mm": (
        "the original remote-code layout of Phi-4-multimodal (LoRA weights inside the checkpoint); load the "
        "transformers-format "
        "weights instead: `huggingface-cli download microsoft/Phi-4-multimodal-instruct --revision refs/pr/70 "
        "--local-dir DIR`, "
        "then model=phi4_multimodal model.path=DIR"
    ),
}
TEXT_ONLY_NOTE = "text only: the vision tower and projector are not loaded (images are not supported yet)"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class LoadedModel:
    model: Any  # a LanguageModel
    path: Path  # the folder or .gguf file the weights came from
    config: dict
    gguf_metadata: dict | None = None
    generation_config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # arch, path, dtype, params, load_ms, weights


def resolve_model_path(path: str | None) -> Path:
    if not path:
        raise ConfigError(
            ConfigIssue(
                "model.path",
                "required: a model folder, a .gguf file, a Hub repo id (org/name) or embedded:smollm2",
                path,
            )
        )
    if path.startswith("embedded:"):
        name = path.split(":", 1)[1]
        if name not in EMBEDDED_MODELS:
            raise ConfigError(
                ConfigIssue("model.path", f"unknown embedded model; known: {', '.join(EMBEDDED_MODELS)}", path)
            )
        return locate_embedded_model(name)
    if is_repo_id(path):
        return resolve_repo(path)
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ConfigError(ConfigIssue("model.path", "no such file or folder", path))
    return resolved


def pick_dtype(dtype: str) -> mx.Dtype:
    """auto: bf16 on a GPU, fp32 on the CPU (MLX's CPU half-precision matmul is far slower)."""
    if dtype == "auto":
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return DTYPES[dtype]


def load_model(
    path: str | None,
    dtype: str = "auto",
    gguf_weights: str = "auto",
    quantize: dict | None = None,
    fuse: bool | None = None,
    adapter: str | None = None,
    adapters: dict[str, str] | None = None,
    merge_adapter: bool = True,
) -> LoadedModel:
    """`quantize` ({"bits", "group_size"}): quantize the dense layers at load and record the
    logit error that costs in info["quantization"]. `fuse` (model.fuse; None: $MLXCEL_FUSE, else
    on): QKV and gate/up as single matmuls. `adapter` (a LoRA folder: merged into dense weights
    unless merge_adapter is false) or `adapters` ({name: folder}: unmerged, picked per token through
    model.adapter_control): checkpoints/adapters.py, checked against the model before its weights load."""
    start = time.perf_counter()
    resolved = resolve_model_path(path)
    target_dtype = pick_dtype(dtype)
    plan = plan_adapters(adapter, adapters, merge_adapter)
    if resolved.is_file() and resolved.suffix == ".gguf":
        loaded = load_gguf_model(resolved, target_dtype, gguf_weights)
        if plan is not None:
            plan.check(loaded.model)
    elif resolved.is_dir():
        loaded = load_hf_model(resolved, target_dtype, plan.check if plan is not None else None)
    else:
        raise ConfigError(
            ConfigIssue(
                "model.path", "expected a model folder (config.json + *.safetensors) or a .gguf file", str(resolved)
            )
        )
    if plan is not None:
        plan.merge_into(loaded.model)  # one adapter, dense weights: merged before quantizing and fusing
    if quantize:
        loaded.info["quantization"] = quantize_at_load(loaded.model, quantize["bits"], quantize["group_size"])
    if plan is not None:
        plan.attach(loaded.model)  # the rest stays beside the (maybe quantized) weights
        loaded.info["adapters"] = plan.describe()
    if (fuse_projections_enabled() if fuse is None else fuse) and hasattr(loaded.model, "fuse_projections"):
        loaded.model.fuse_projections()  # QKV and gate/up as single matmuls: fewer ops per token
    mx.eval(read_language_parameters(loaded.model))
    loaded.info.update(
        path=str(resolved),
        dtype=str(target_dtype).replace("mlx.core.", ""),
        params=count_parameters(loaded.model),
        load_ms=round((time.perf_counter() - start) * 1000, 1),
    )
    return loaded


def read_language_parameters(model) -> dict:
    """The parameters a text prompt uses: a VLM's vision stage (its `vision_modules`) stays
    unread from disk until the first image asks for it."""
    skip = set(getattr(model, "vision_modules", ()))
    return {name: value for name, value in model.parameters().items() if name not in skip}


def fuse_projections_enabled() -> bool:
    """MLXCEL_FUSE=0 keeps separate projections (to measure the fusion, or to debug)."""
    return os.environ.get("MLXCEL_FUSE", "1") not in ("0", "false", "off")


def list_supported_families() -> list[str]:
    return sorted(
        name for name, module in FAMILIES.items() if importlib.util.find_spec(f"mlxcel.models.{module}") is not None
    )


def import_family(model_type: str, source: Path):
    supported = list_supported_families()
    if model_type in UNSUPPORTED_LAYOUTS:
        raise MlxcelError(f"{source}: model_type {model_type!r} is {UNSUPPORTED_LAYOUTS[model_type]}")
    if model_type not in supported:
        raise MlxcelError(f"{source}: unsupported architecture {model_type!r} (supported: {', '.join(supported)})")
    return importlib.import_module(f"mlxcel.models.{FAMILIES[model_type]}")


def read_family_config(family, config: dict) -> dict:
    """config.json as the family reads it: a family whose folders nest the language model's
    settings (Gemma 3's multimodal ones) unwraps them here."""
    normalize = getattr(family, "normalize_config", None)
    return normalize(config) if normalize else config


def make_model(family, config: dict, source: Path, **overrides):
    missing = [key for key in family.REQUIRED_KEYS if key not in config]
    if missing:
        raise MlxcelError(f"{source}: missing required key(s) {', '.join(missing)}")
    return family.Model(family.ModelArgs.from_config(config, **overrides))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MlxcelError(f"{path}: invalid JSON ({exc})") from exc


def load_hf_model(folder: Path, dtype: mx.Dtype, check: Callable[[nn.Module], None] | None = None) -> LoadedModel:
    """`check`: called with the model as its config builds it, before any weight is read."""
    check_model_files(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise MlxcelError(f"{folder}: no config.json (expected an HF model folder)")
    config = read_json(config_path)
    model_type = config.get("model_type")
    if model_type is None:
        raise MlxcelError(f"{config_path}: missing required key model_type")
    quantization = config.get("quantization")
    family = import_family(model_type, config_path)
    model = make_model(family, read_family_config(family, config), config_path)
    if check is not None:
        check(model)
    weights, origins = load_safetensors(folder)
    weights = model.sanitize(weights)
    info = {"arch": model_type, "format": "safetensors"}
    if hasattr(model, "attach_preprocessor"):  # a VLM: its image processor reads preprocessor_config.json
        model.attach_preprocessor(folder)
    elif "vision_config" in config:  # sanitize dropped the vision weights
        info["note"] = TEXT_ONLY_NOTE
    if quantization is not None:  # MLX-quantized (mlx_lm.convert -q): packed weights stay packed
        if model.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        apply_checkpoint_quantization(model, quantization, weights, config_path)
        info["quantization"] = describe_checkpoint_quantization(quantization)
    kept = getattr(model, "float32_weights", ())  # parameters the family computes with in float32
    weights = {
        k: v.astype(mx.float32 if k.endswith(kept) and kept else dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    apply_weights(model, weights, folder, origins)
    generation_config = (
        read_json(folder / "generation_config.json") if (folder / "generation_config.json").exists() else {}
    )
    return LoadedModel(model, folder, config, None, generation_config, info)


def load_safetensors(folder: Path) -> tuple[dict[str, mx.array], dict[str, Path]]:
    """The weights and the file each came from. With an index, every file it names must exist
    and hold the tensors it lists; without one, shards named *-of-N must all be there."""
    index_path = folder / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map") or {}
        if not weight_map:
            raise MlxcelError(f"{index_path}: no weight_map (expected {{tensor name: shard file}})")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        check_shard_series(folder, files)
    if not files:
        raise MlxcelError(f"{folder}: no *.safetensors weights found")
    weights: dict[str, mx.array] = {}
    origins: dict[str, Path] = {}
    for name in files:
        file = folder / name
        if not file.exists():
            raise MlxcelError(f"{file}: listed in {index_path.name} but missing (download it again, or fix the index)")
        try:
            shard = mx.load(str(file))
        except Exception as exc:
            raise MlxcelError(f"cannot read {file}: {exc} (is the file complete?)") from exc
        weights.update(shard)
        origins.update(dict.fromkeys(shard, file))
    absent = sorted(k for k in weight_map if k not in weights)
    if absent:
        raise MlxcelError(
            f"{folder / weight_map[absent[0]]}: lacks tensor {absent[0]} that {index_path.name} puts there "
            f"({len(absent)} missing)"
        )
    return weights, origins


def check_shard_series(folder: Path, files: list[str]) -> None:
    """model-00001-of-00003.safetensors ...: without an index, a missing shard is found by name."""
    for name in files:
        match = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", name)
        if match is None:
            continue
        stem, digits, total = match.group(1), len(match.group(2)), int(match.group(3))
        for i in range(1, total + 1):
            shard = f"{stem}-{i:0{digits}d}-of-{match.group(3)}.safetensors"
            if shard not in files:
                raise MlxcelError(f"{folder / shard}: shard {i} of {total} is missing (download it again)")


def apply_weights(
    model: nn.Module, weights: dict[str, mx.array], source: Path, origins: dict[str, Path] | None = None
) -> None:
    """Checks names and shapes against the architecture the config built; errors name the file."""
    origins = origins or {}
    expected = {k for k, _ in _flatten(model.parameters())}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        details = []
        if missing:
            details.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unexpected:
            details.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}")
        raise MlxcelError(f"{source}: weights do not match the architecture: {'; '.join(details)}")
    for key, value in _flatten(model.parameters()):
        if weights[key].shape != value.shape:
            raise MlxcelError(
                f"{origins.get(key, source)}: tensor {key} has shape {tuple(weights[key].shape)}, but the config gives"
                f" {tuple(value.shape)} (does config.json belong to these weights?)"
            )
    model.load_weights(list(weights.items()), strict=True)


def load_gguf_model(path: Path, dtype: mx.Dtype, gguf_weights: str) -> LoadedModel:
    weights, metadata, types = gguf.load_gguf_with_types(path)
    family_name, config = gguf.make_config_from_gguf(metadata, path)
    arch = gguf.read_metadata_value(metadata, "general.architecture")
    if arch == "phi3":
        gguf.read_phi3_longrope(weights, metadata, config)
    gguf.check_expert_tensors(weights, config, arch, path)
    weights = gguf.rename_gguf_weights(weights, arch, path)
    weights = gguf.undo_converter_transforms(weights, arch, config, path)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    model = make_model(import_family(family_name, path), config, path, rope_traditional=config.pop("rope_traditional"))
    quantized = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    keep_quantized = choose_gguf_quantized(gguf_weights) and bool(quantized)
    if keep_quantized:
        specs = {prefix: gguf.read_quantization(weights, prefix) for prefix in quantized}  # (MXFP4: mode mxfp4)
        nn.quantize(model, class_predicate=lambda p, m: specs.get(p, False))
    else:
        weights = dequantize_weights(weights, quantized)
    kept = getattr(model, "float32_weights", ())  # parameters the family computes with in float32, as from HF
    weights = {
        k: v.astype(mx.float32 if kept and k.endswith(kept) else dtype)
        if not k.endswith((".scales", ".biases")) and mx.issubdtype(v.dtype, mx.floating)
        else v
        for k, v in weights.items()
    }
    if keep_quantized:  # scales/biases in the compute dtype (MXFP4's E8M0 scale bytes stay bytes)
        weights = {
            k: v.astype(dtype) if k.endswith((".scales", ".biases")) and mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    apply_weights(model, weights, path)
    # K-quant files (and float ones) arrive dense: every tensor dequantized to float32 on read
    info = {
        "arch": family_name,
        "format": "gguf",
        "weights": "quantized" if keep_quantized else "dequantized",
        "gguf_types": types,
    }
    return LoadedModel(model, path, config, metadata, {}, info)


def choose_gguf_quantized(gguf_weights: str) -> bool:
    """auto: keep GGUF weights quantized, except on the CPU with an optimised BLAS loaded, where
    dense fp32 prefill is much faster (docs/benchmarks.md). MLX's bundled reference BLAS
    makes dense slower than quantized."""
    if gguf_weights != "auto":
        return gguf_weights == "quantized"
    return mx.default_device() == mx.gpu or not is_optimized_blas_loaded()


def is_optimized_blas_loaded() -> bool:
    """Linux only: is OpenBLAS (e.g. LD_PRELOAD'ed) mapped into this process?"""
    maps = Path("/proc/self/maps")
    if sys.platform != "linux" or not maps.exists():
        return False
    return "libopenblas" in maps.read_text()


def dequantize_weights(weights: dict[str, mx.array], prefixes: list[str]) -> dict[str, mx.array]:
    weights = dict(weights)
    for prefix in prefixes:
        gguf.dequantize_gguf_tensor(weights, prefix)
    return weights


def count_parameters(model: nn.Module) -> int:
    total = 0
    for name, value in _flatten(model.parameters()):
        if name.endswith((".scales", ".biases")):
            continue
        if value.dtype == mx.uint32:  # packed quantized weight: count logical weights
            module_bits = _bits_of(model, name)
            total += value.size * 32 // module_bits
        else:
            total += value.size
    return total


def _bits_of(model: nn.Module, name: str) -> int:
    module = model
    for part in name.split(".")[:-1]:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module.bits


def _flatten(tree, prefix: str = ""):
    from mlx.utils import tree_flatten

    return tree_flatten(tree, prefix)
