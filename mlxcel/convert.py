"""`mlxcel-convert`: any checkpoint mlxcel loads -> an MLX folder in mlx-community's layout.

    mlxcel-convert model.path=Qwen/Qwen2.5-0.5B-Instruct convert.output=qwen-4bit 'convert.quantize={bits: 4}'

The source is what `model.path` names for mlxcel-run (an HF folder, a .gguf file, an MLX-quantized
folder, a Hub id in the cache). It loads with separate projections (model.fuse off: the folder
holds q/k/v and gate/up as the checkpoint names them), optionally quantized (`convert.quantize`,
per-layer `convert.layers`) or cast (`convert.dtype`), and is written as sharded safetensors with
model.safetensors.index.json, config.json (with `quantization` as mlx-lm writes it), the tokenizer
and chat template files and generation_config.json, plus mlxcel_convert.json: what was converted
from what. Both mlxcel and mlx-lm load the folder; docs/convert.md has the keys.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError

from mlxcel.config import Bool, Group, at_most, format_errors, make_hint
from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError

RECORD_FILE = "mlxcel_convert.json"
INDEX_FILE = "model.safetensors.index.json"
# the modes mx.quantize may take, with mlx-lm's defaults (group size, bits) for each
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}
PROBE_GROUP_SIZES = (16, 32, 64, 128)
PROBE_BITS = range(1, 9)
# tokenizer, template and generation files copied from the source folder (the weights, config.json
# and an index are written anew)
COPIED_FILES = ("*.json", "*.model", "*.tiktoken", "*.jinja", "*.txt")
NOT_COPIED = {"config.json", INDEX_FILE, RECORD_FILE}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted for interleaved RoPE (undone here)
PERMUTED_GGUF_ARCHS = {"llama", "smollm3"}
# GGUF architectures whose interleaved RoPE no HF config key says: not written as HF folders
UNWRITABLE_GGUF_ARCHS = {"glm4", "llama4"}
MAX_SHARD_GB = 1024.0


class LayerQuantization(Group):
    """One layer's quantization in convert.layers; a field left out is convert.quantize's."""

    bits: Annotated[int, Strict()] | None = None
    group_size: Annotated[int, Strict()] | None = None
    mode: str | None = None


class QuantizeSettings(Group):
    """convert.quantize: a field left out is the mode's default (affine: 64 and 4 bits)."""

    bits: Annotated[int, Strict()] | None = None
    group_size: Annotated[int, Strict()] | None = None
    mode: str = "affine"


class ConvertConfig(Group):
    output: str | None = None
    overwrite: Bool = False
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantize: QuantizeSettings | None = None
    layers: dict[str, Literal[False] | LayerQuantization] | None = None  # (null: none; YAML's {} refuses new keys)
    dequantize: Bool = False
    shard_gb: Annotated[
        float, Field(gt=0), at_most(MAX_SHARD_GB, f"must be a number of GB in (0, {MAX_SHARD_GB:g}]")
    ] = 5.0
    tokenizer: str | None = None
    adapter: str | None = None
    progress: Literal["auto", "bar", "log", "off"] = "auto"


# ---- the config ----
@functools.cache
def list_quantization_modes() -> dict[str, set[tuple[int, int]]]:
    """{mode: {(group_size, bits), ...}} that the installed MLX's mx.quantize takes on this device."""
    import mlx.core as mx

    probe = mx.ones((1, 256))
    modes: dict[str, set[tuple[int, int]]] = {}
    for mode in MODE_DEFAULTS:
        for group_size in PROBE_GROUP_SIZES:
            for bits in PROBE_BITS:
                try:
                    mx.eval(*mx.quantize(probe, group_size, bits, mode=mode))
                except Exception:  # (ValueError, or a RuntimeError from a backend without the mode)
                    continue
                modes.setdefault(mode, set()).add((group_size, bits))
    return modes


def resolve_quantization(
    key: str, mode: str, group_size: int | None, bits: int | None
) -> tuple[dict | None, list[ConfigIssue]]:
    """{"group_size", "bits", "mode"} with the mode's defaults filled in, or the issues."""
    modes = list_quantization_modes()
    if mode not in modes:
        return None, [ConfigIssue(f"{key}.mode", f"must be one of {', '.join(modes)} (the installed MLX's)", mode)]
    pairs = modes[mode]
    default_group, default_bits = MODE_DEFAULTS[mode]
    group_size = default_group if group_size is None else group_size
    bits = default_bits if bits is None else bits
    issues = []
    group_sizes = sorted({g for g, _ in pairs})
    if group_size not in group_sizes:
        legal = ", ".join(map(str, group_sizes))
        issues.append(ConfigIssue(f"{key}.group_size", f"must be one of {legal} for mode {mode}", group_size))
    bit_widths = sorted({b for g, b in pairs if g == group_size or group_size not in group_sizes})
    if bits not in bit_widths:
        legal = ", ".join(map(str, bit_widths))
        issues.append(ConfigIssue(f"{key}.bits", f"must be one of {legal} for mode {mode}", bits))
    return (None if issues else {"group_size": group_size, "bits": bits, "mode": mode}), issues


def resolve_base(cfg: ConvertConfig) -> tuple[dict | None, list[ConfigIssue]]:
    q = cfg.quantize
    return resolve_quantization("convert.quantize", q.mode, q.group_size, q.bits)


def resolve_layer(pattern: str, layer: LayerQuantization, base: dict) -> tuple[dict | None, list[ConfigIssue]]:
    """A convert.layers entry: what it leaves out is convert.quantize's (the mode's defaults
    when it names another mode)."""
    mode = layer.mode or base["mode"]
    same = mode == base["mode"]
    group_size = layer.group_size or (base["group_size"] if same else None)
    bits = layer.bits or (base["bits"] if same else None)
    return resolve_quantization(f"convert.layers.{pattern}", mode, group_size, bits)


def validate_convert_config(data: Any) -> ConvertConfig:
    """convert.* checked as validate_config checks the rest: one ConfigError with every problem."""
    try:
        cfg = ConvertConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(format_errors(ConvertConfig, err.errors(), ("convert",))) from None
    cfg.layers = cfg.layers or {}
    issues = []
    if not cfg.output:
        issues.append(ConfigIssue("convert.output", "required: the folder to write, e.g. convert.output=model-4bit"))
    if cfg.quantize is not None:
        issues += resolve_base(cfg)[1]
        if cfg.dequantize:
            issues.append(ConfigIssue("convert.dequantize", "give either convert.quantize or convert.dequantize=true"))
    if cfg.layers and cfg.quantize is None:
        message = "per-layer overrides need convert.quantize (e.g. 'convert.quantize={bits: 4}')"
        issues.append(ConfigIssue("convert.layers", message, has_value=False))
    elif cfg.layers and resolve_base(cfg)[0] is not None:
        for pattern, layer in cfg.layers.items():
            if layer is not False:
                issues += resolve_layer(pattern, layer, resolve_base(cfg)[0])[1]
    if issues:
        raise ConfigError(issues, hint=make_hint(issues[0].path))
    return cfg


# ---- the command line ----
# mlx_lm.convert's flags, named as the overrides to type
CONVERT_FLAGS = {
    "--hf-path": "model.path={}",
    "--model": "model.path={}",
    "--mlx-path": "convert.output={}",
    "-q": "'convert.quantize={{bits: 4}}'",
    "--quantize": "'convert.quantize={{bits: 4}}'",
    "--q-bits": "'convert.quantize={{bits: {}}}'",
    "--q-group-size": "'convert.quantize={{group_size: {}}}'",
    "--q-mode": "'convert.quantize={{mode: {}}}'",
    "--dtype": "convert.dtype={}",
    "-d": "convert.dequantize=true",
    "--dequantize": "convert.dequantize=true",
}


def check_convert_args(args: list[str]) -> list[str]:
    """Overrides only: mlx_lm.convert's flags and bare words are one line naming what to type."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in CONVERT_FLAGS:
            value = value or (args[i + 1] if i + 1 < len(args) else "VALUE")
            override = CONVERT_FLAGS[flag].format(value)
            raise ConfigError(ConfigIssue(flag, f"mlxcel-convert takes overrides: type {override}", has_value=False))
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            message = (
                "not an option of mlxcel-convert: settings are KEY=VALUE overrides, e.g. mlxcel-convert "
                "model.path=SOURCE convert.output=FOLDER (mlxcel-convert --help)"
            )
            raise ConfigError(ConfigIssue(arg, message, has_value=False))
    return args


def add_convert_group(overrides: list[str]) -> list[str]:
    """conf/convert/ is not in mlxcel-run's defaults: put it in (convert=NAME picks another file)."""
    picked = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "convert"]
    rest = [o for o in overrides if o not in picked]
    name = picked[-1].split("=", 1)[1] if picked else "default"
    return [f"+convert={name}", *rest]


def convert_command(args: list[str], log=sys.stderr) -> int:
    from mlxcel.cli import check_utf8, compose_config, describe_version
    from mlxcel.config import validate_config

    check_utf8(args)
    if any(arg in ("--help", "-h") for arg in args):
        print(__doc__.strip() + "\n\nKeys: conf/convert/default.yaml; docs/convert.md.", file=sys.stdout)
        return 0
    if "--version" in args:
        print(describe_version())
        return 0
    data = compose_config(add_convert_group(check_convert_args(args)))
    settings = validate_convert_config(data.pop("convert", None))
    cfg = validate_config(data)
    record = convert(cfg, settings, log)
    print(
        f"mlxcel-convert: wrote {record['output']['path']} ({record['output']['files']} files, "
        f"{format_size(record['output']['bytes'])}) in {record['seconds']:.1f} s",
        file=log,
        flush=True,
    )
    return 0


def entry() -> None:
    """`mlxcel-convert`: OpenBLAS preloaded on a Linux CPU (as mlxcel-run), then `main`."""
    from mlxcel.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv[1:], module="mlxcel.convert")
    main()


def main() -> None:
    from mlxcel.cli import run_command

    run_command(convert_command)


# ---- the conversion ----
def convert(cfg, settings: ConvertConfig, log=sys.stderr) -> dict:
    """Load `cfg.model.path`, quantize or cast it as `settings` say, write the folder; returns the
    record written beside it (mlxcel_convert.json)."""
    from mlxcel.checkpoints.adapters import check_adapter, merge_adapter, read_adapter
    from mlxcel.checkpoints.fingerprint import read_model_header
    from mlxcel.checkpoints.loader import count_parameters, load_model, resolve_model_path
    from mlxcel.devices import select_device

    started = time.perf_counter()
    source = resolve_model_path(cfg.model.path)
    output = prepare_output(settings.output, settings.overwrite, source)
    adapter = read_adapter(settings.adapter, "convert.adapter") if settings.adapter is not None else None
    select_device(cfg.runner.device)
    header = read_model_header(source)
    is_gguf = source.is_file() and source.suffix == ".gguf"
    dtype = choose_dtype(settings.dtype, source, is_gguf)
    try:
        loaded = load_model(str(source), dtype=dtype, gguf_weights="dequantize", fuse=False)
    except ConfigError:
        raise
    except MlxcelError as exc:
        raise MlxcelError(f"cannot convert {cfg.model.path}: {exc}") from None
    model, config = loaded.model, dict(loaded.config)
    if is_gguf:
        config = make_gguf_config(loaded, dtype)
    source_quantization = config.get("quantization") if not is_gguf else None
    if adapter is not None:
        check_adapter(adapter, model)
        if source_quantization is not None and settings.quantize is None and not settings.dequantize:
            settings = requantize_like(settings, source_quantization)  # merged weights, the source's quantization
    if source_quantization is not None and (settings.quantize is not None or settings.dequantize):
        dequantize_to(model, dtype)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    if adapter is not None:
        merge_adapter(model, adapter)  # into the dense, un-fused weights, before quantizing
    if settings.quantize is not None:
        quantization = quantize_model(model, settings)
        config["quantization"] = config["quantization_config"] = quantization
    for key in ("torch_dtype", "dtype"):
        if key in config or (key == "torch_dtype" and is_gguf):
            config[key] = dtype
    weights = read_weights(loaded)
    files = write_weights(output, weights, settings, count_parameters(model))
    write_config(output, config)
    copied = write_tokenizer_files(output, loaded, settings.tokenizer)
    record = {
        "source": {
            "model.path": cfg.model.path,
            "path": str(source),
            "format": loaded.info.get("format"),
            "arch": loaded.info.get("arch"),
            "fingerprint": header.fingerprint,
            "quantization": source_quantization
            and {k: source_quantization.get(k) for k in ("bits", "group_size", "mode")},
        },
        "options": {**settings.model_dump(mode="json"), "resolved_dtype": dtype, "model.fuse": False},
        "quantization": config.get("quantization"),
        "output": {
            "path": str(output),
            "files": len(files) + len(copied) + 2,
            "bytes": sum(files.values()),
            "shards": sorted(files),
            "copied": copied,
        },
        "mlxcel": describe_versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 2),
    }
    (output / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def prepare_output(value: str, overwrite: bool, source: Path) -> Path:
    """The output folder, created and writable; a non-empty one only with convert.overwrite=true
    (then its old weights and index go: a shard left from a larger conversion would load)."""
    folder = Path(value).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(ConfigIssue("convert.output", "is a file, not a folder; name a folder to write", value))
    if folder.resolve() == source.resolve() or (source.is_dir() and folder.resolve() in source.resolve().parents):
        message = "holds the source checkpoint: writing there would replace the weights being read; pick another folder"
        raise ConfigError(ConfigIssue("convert.output", message, value))
    if folder.is_dir() and any(folder.iterdir()):
        if not overwrite:
            message = "is not empty; pick another folder, or set convert.overwrite=true to write into it"
            raise ConfigError(ConfigIssue("convert.output", message, value))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".mlxcel-convert-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(ConfigIssue("convert.output", f"cannot write there: {exc.strerror}", value)) from None
    if overwrite:
        for old in [*folder.glob("*.safetensors"), folder / INDEX_FILE]:
            if old.is_file():
                old.unlink()
    return folder


def choose_dtype(dtype: str, source: Path, is_gguf: bool) -> str:
    """auto: the dtype the source's config.json names (torch_dtype, or transformers 5's dtype),
    else float16 (a GGUF's, and mlx-community's usual)."""
    if dtype != "auto":
        return dtype
    if is_gguf:
        return "float16"
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError):
        return "float16"  # (the loader names what is wrong with it)
    text = config.get("text_config") or {}
    named = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return named if named in ("float32", "float16", "bfloat16") else "float16"


def requantize_like(settings: ConvertConfig, quantization: dict) -> ConvertConfig:
    """Settings that quantize the merged model as the source was (its bits, group size and mode,
    and its per-layer entries), as mlx_lm.fuse does for a quantized base."""
    base = QuantizeSettings(**{k: quantization[k] for k in ("bits", "group_size", "mode") if k in quantization})
    layers = {
        path: value if value is False else LayerQuantization(**value)
        for path, value in quantization.items()
        if isinstance(value, dict) or value is False
    }
    return settings.model_copy(update={"quantize": base, "layers": {**layers, **(settings.layers or {})}})


def make_gguf_config(loaded, dtype: str) -> dict:
    """config.json for a GGUF source: the HF-style config the loader built from its metadata,
    with Q/K rows un-permuted where llama.cpp's converter permuted them (HF's rotate-half RoPE)."""
    import mlx.core as mx

    from mlxcel.checkpoints.gguf import read_metadata_value

    arch = read_metadata_value(loaded.gguf_metadata, "general.architecture")
    if arch in UNWRITABLE_GGUF_ARCHS:
        raise MlxcelError(
            f"{loaded.path}: GGUF architecture {arch!r} cannot be written as an MLX folder yet; convert its HF "
            "checkpoint instead"
        )
    config = dict(loaded.config)
    model = loaded.model
    if arch in PERMUTED_GGUF_ARCHS:
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        updates = []
        for name, value in read_weights(loaded).items():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                count = heads if ".q_proj." in name else kv_heads
                rows = value.shape[0]
                value = value.reshape(count, rows // count // 2, 2, *value.shape[1:]).swapaxes(1, 2)
                updates.append((name, value.reshape(rows, *value.shape[3:])))
        model.load_weights(updates, strict=False)
        mx.eval(model.parameters())
    config.pop("rope_traditional", None)
    config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings"))
    return config


def dequantize_to(model, dtype: str) -> None:
    """A quantized source's layers dense again (to requantize, or convert.dequantize), in `dtype`."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    from mlxcel.checkpoints.quantize import dequantize_model

    dequantize_model(model)
    target = getattr(mx, dtype)
    kept = tuple(getattr(model, "float32_weights", ()))  # (the family computes these in float32, as loaded)

    def cast(name: str, value):
        keep = kept and name.endswith(kept)
        return value.astype(target) if mx.issubdtype(value.dtype, mx.floating) and not keep else value

    model.update(tree_map_with_path(cast, model.parameters()))


def quantize_model(model, settings: ConvertConfig) -> dict:
    """Quantize what quantize_at_load quantizes (every Linear and Embedding of the language model
    whose input width the group size divides) with convert.layers' overrides; returns config.json's
    `quantization`, each override written under its layer's path as mlx-lm writes them."""
    from mlx import nn

    base = resolve_base(settings)[0]
    vision = tuple(getattr(model, "vision_modules", ()))
    quantization = dict(base)
    used: set[str] = set()

    def pick(path: str) -> tuple[str | None, bool | dict]:
        for pattern, layer in settings.layers.items():
            if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, f"*.{pattern}"):
                if layer is False:
                    return pattern, False
                return pattern, resolve_layer(pattern, layer, base)[0]
        return None, True

    def predicate(path: str, module) -> bool | dict:
        if path.split(".")[0] in vision or not hasattr(module, "to_quantized"):
            return False
        pattern, spec = pick(path)
        if pattern is not None:
            used.add(pattern)
        if spec is False:
            quantization[path] = False  # (both loaders keep a layer dense that its entry says false)
            return False
        group_size = spec["group_size"] if isinstance(spec, dict) else base["group_size"]
        if module.weight.shape[-1] % group_size:
            return False
        if isinstance(spec, dict) and spec != base:
            quantization[path] = spec
            return spec
        return True

    try:
        nn.quantize(model, base["group_size"], base["bits"], mode=base["mode"], class_predicate=predicate)
    except ValueError as exc:  # MLX names what a layer cannot take
        raise MlxcelError(f"convert.quantize: {exc}") from None
    unused = [pattern for pattern in settings.layers if pattern not in used]
    if unused:
        examples = [path for path, module in model.named_modules() if hasattr(module, "to_quantized")][:4]
        raise ConfigError(
            ConfigIssue(
                f"convert.layers.{unused[0]}",
                f"matches no layer that quantizes; layers are named by path or its tail, e.g. {', '.join(examples)}"
                " (a pattern may use * and ?)",
                has_value=False,
            )
        )
    return quantization


def read_weights(loaded) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(loaded.model.parameters()))


def make_shards(weights: dict, shard_bytes: int) -> list[dict]:
    """Tensors in name order, a new shard when the next would pass `shard_bytes` (a larger tensor
    gets a shard of its own), as mlx-lm's make_shards does."""
    shards: list[dict] = []
    size = 0
    for name in sorted(weights):
        value = weights[name]
        if not shards or size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def write_weights(output: Path, weights: dict, settings: ConvertConfig, parameters: int) -> dict[str, int]:
    """The shards (model.safetensors, or model-0000i-of-0000n.safetensors) and the index; returns
    {shard: bytes}. Each tensor is computed (cast, quantized) as the bar moves."""
    import mlx.core as mx

    shards = make_shards(weights, int(settings.shard_gb * 2**30))
    total = sum(v.nbytes for v in weights.values())
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    progress = ByteProgress(total, settings.progress)
    weight_map, files = {}, {}
    try:
        for name, shard in zip(names, shards):
            for value in shard.values():
                mx.eval(value)
                progress.add(value.nbytes, name)
            path = output / name
            mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
            files[name] = path.stat().st_size
            weight_map.update(dict.fromkeys(shard, name))
    except OSError as exc:
        raise MlxcelError(f"cannot write {output}: {exc.strerror or exc}") from None
    finally:
        progress.close()
    index = {
        "metadata": {"total_size": total, "total_parameters": parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (output / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n", encoding="utf-8")
    return files


def write_config(output: Path, config: dict) -> None:
    """config.json sorted, without the source's own name (as mlx-lm's save_config)."""
    config = add_legacy_rope_keys({k: v for k, v in config.items() if k != "_name_or_path"})
    (output / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n", encoding="utf-8")


def add_legacy_rope_keys(config: dict) -> dict:
    """transformers 5 writes RoPE's settings as `rope_parameters` only; mlx-lm (0.32) reads
    `rope_theta` and `rope_scaling`, and without them runs its own default base (Qwen2: 1e6 for a
    checkpoint's 1e4). Both keys are added where missing; transformers reads either form."""
    parameters = config.get("rope_parameters")
    if not isinstance(parameters, dict):
        return config
    config = dict(config)
    if "rope_theta" in parameters and "rope_theta" not in config:
        config["rope_theta"] = parameters["rope_theta"]
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        config["rope_scaling"] = scaling
    return config


def write_tokenizer_files(output: Path, loaded, tokenizer_folder: str | None) -> list[str]:
    """The tokenizer, chat template and generation files: copied from the source folder (or
    convert.tokenizer's); a GGUF's byte-level BPE vocabulary written as tokenizer.json."""
    source = Path(tokenizer_folder).expanduser() if tokenizer_folder else loaded.path
    if tokenizer_folder and not source.is_dir():
        message = "must be a folder holding tokenizer files"
        raise ConfigError(ConfigIssue("convert.tokenizer", message, tokenizer_folder))
    if source.is_dir():
        copied = copy_folder_files(source, output)
        if tokenizer_folder and loaded.path.is_dir() and (loaded.path / "generation_config.json").is_file():
            shutil.copy2(loaded.path / "generation_config.json", output / "generation_config.json")
        return copied
    return write_gguf_tokenizer(output, loaded)


def copy_folder_files(source: Path, output: Path) -> list[str]:
    copied = []
    for pattern in COPIED_FILES:
        for path in sorted(source.glob(pattern)):
            if path.name in NOT_COPIED or path.name.endswith(".index.json") or not path.is_file():
                continue
            shutil.copy2(path, output / path.name)
            copied.append(path.name)
    return copied


def write_gguf_tokenizer(output: Path, loaded) -> list[str]:
    from mlxcel.tokenizer.fast import FastTokenizer
    from mlxcel.tokenizer.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(loaded.path, loaded.gguf_metadata)
    if not isinstance(tokenizer, FastTokenizer):
        raise MlxcelError(
            f"{loaded.path}: its SentencePiece vocabulary cannot be written as tokenizer files yet; give the "
            "original model's tokenizer folder with convert.tokenizer=FOLDER"
        )
    tokenizer.tokenizer.save(str(output / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
        "add_bos_token": tokenizer.add_bos_token,
        "model_max_length": loaded.config.get("max_position_embeddings"),
    }
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    settings = {k: v for k, v in settings.items() if v is not None}
    (output / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    generation = {"eos_token_id": tokenizer.eos_token_ids}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    (output / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def describe_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import mlxcel

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = None
    return {"version": mlxcel.__version__, "mlx": mlx}


def format_size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


class ByteProgress:
    """The bytes written so far: a one-line bar on a terminal, a log line every `interval_s` otherwise."""

    def __init__(self, total: int, mode: str = "auto", stream=None, interval_s: float = 10.0):
        from mlxcel.progress import BAR_WIDTH, REDRAW_S

        self.stream = stream if stream is not None else sys.stderr
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.mode = ("bar" if is_tty else "log") if mode == "auto" else mode
        self.total, self.done = max(total, 1), 0
        self.width, self.redraw_s, self.interval_s = BAR_WIDTH, REDRAW_S, interval_s
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def add(self, size: int, shard: str) -> None:
        self.done += size
        now = time.perf_counter()
        finished = self.done >= self.total
        if self.mode == "bar" and (finished or now - self.last >= self.redraw_s):
            self.last, self.drawn = now, True
            self.stream.write("\r" + self.describe(now, shard, bar=True))
            self.stream.flush()
        elif self.mode == "log" and (finished or now - self.last >= self.interval_s):
            self.last = now
            print("mlxcel-convert: " + self.describe(now, shard, bar=False), file=self.stream, flush=True)

    def describe(self, now: float, shard: str, bar: bool) -> str:
        from mlxcel.progress import format_seconds

        fraction = min(1.0, self.done / self.total)
        elapsed = now - self.start
        eta = elapsed / fraction - elapsed if fraction > 0 else float("nan")
        text = f"{format_size(self.done)}/{format_size(self.total)} | {shard} | ETA {format_seconds(eta)}"
        if not bar:
            return text
        filled = int(self.width * fraction)
        return f"[{'#' * filled}{'-' * (self.width - filled)}] {text}"

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


if __name__ == "__main__":
    main()
