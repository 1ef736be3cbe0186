"""What a run needs to say about its model without loading it: the context length and family
capabilities (for dry runs), and the files' sizes plus a hash of the config and weights index
(for reproducibility records)."""

from __future__ import annotations

import hashlib
import json
import math
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.checkpoints.hub import MODEL_FILES
from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError

# safetensors' own limit on a file's JSON header (its MAX_HEADER_SIZE)
MAX_SAFETENSORS_HEADER = 100_000_000
# what the loaders read from a model folder (configs, weights, tokenizer and template files): each
# must be a regular file (or a link to one)
MODEL_FILE_SUFFIXES = tuple(pattern.removeprefix("*") for pattern in MODEL_FILES)


@dataclass
class ModelHeader:
    path: Path
    arch: str
    max_context: int
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    fingerprint: str = ""  # sha256 of the config and the weights index (names, shapes, dtypes)
    # attention head size, where the config says (checks decode.kv_group_size before loading)
    head_dim: int | None = None


def read_model_header(path: Path) -> ModelHeader:
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf_header(path)
    return read_hf_header(path)


def describe_file_kind(path: Path) -> str:
    """'a FIFO', 'a folder', ...: what a path that should be a regular file is instead."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a broken link" if path.is_symlink() else "missing"
    kinds = [
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_model_files(folder: Path) -> None:
    """The model folder's files (MODEL_FILE_SUFFIXES) must be regular files (or links to them):
    reading a FIFO named model.safetensors blocks forever, and a device never ends."""
    if not folder.is_dir():
        if not folder.is_file():
            raise ConfigError(
                ConfigIssue(
                    "model.path",
                    f"is {describe_file_kind(folder)}: expected a model folder or a .gguf file",
                    str(folder),
                )
            )
        return
    for path in sorted(folder.iterdir()):
        if path.suffix in MODEL_FILE_SUFFIXES and not path.is_file():
            raise ConfigError(
                ConfigIssue(
                    "model.path",
                    f"{path.name} is {describe_file_kind(path)}: a model's files must be regular files",
                    str(folder),
                )
            )


def read_hf_header(folder: Path) -> ModelHeader:
    check_model_files(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise MlxcelError(f"{folder}: no config.json (expected an HF model folder)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise MlxcelError(f"{config_path}: not valid JSON ({exc}); the model folder is damaged or incomplete") from exc
    if not isinstance(config, dict):
        raise MlxcelError(f"{config_path}: not a model config (a JSON object of settings)")
    digest = hashlib.sha256(config_path.read_bytes())
    index = folder / "model.safetensors.index.json"
    if index.exists():
        digest.update(index.read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(read_safetensors_header(weights))
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    return ModelHeader(
        folder,
        config.get("model_type", "?"),
        read_context_length(config),
        files,
        digest.hexdigest(),
        read_head_dim(config),
    )


def read_head_dim(config: dict) -> int | None:
    """head_dim, else hidden_size / num_attention_heads (of text_config in multimodal folders). A
    latent-attention model (kv_lora_rank) caches its latent and its RoPE key: a quantization group
    must divide both widths, so their greatest common divisor."""
    text = config.get("text_config") or config
    latent, rope = text.get("kv_lora_rank"), text.get("qk_rope_head_dim")
    if isinstance(latent, int) and isinstance(rope, int) and latent > 0 and rope > 0:
        return math.gcd(latent, rope)
    if isinstance(text.get("head_dim"), int):
        return text["head_dim"]
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def read_context_length(config: dict) -> int:
    """max_position_embeddings; multimodal folders (Gemma 3, LLaVA, newer Qwen2-VL) keep it under
    text_config, and Gemma 3's may leave it to the family's default."""
    if "text_config" in config and config.get("model_type") == "gemma3":
        from mlxcel.models.gemma3 import normalize_config

        config = normalize_config(config)
    text = config.get("text_config") or {}
    return config.get("max_position_embeddings") or text.get("max_position_embeddings", 4096)


def read_safetensors_header(path: Path) -> bytes:
    """The JSON header (tensor names, dtypes, shapes, offsets): the weights index of one file."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) < 8:
            raise MlxcelError(f"cannot read {path}: file too short for a safetensors header (is the file complete?)")
        size = struct.unpack("<Q", size_bytes)[0]
        if size > MAX_SAFETENSORS_HEADER:
            raise MlxcelError(
                f"cannot read {path}: its header claims {size} bytes, past safetensors' {MAX_SAFETENSORS_HEADER} "
                "(is the file damaged?)"
            )
        return f.read(size)


def read_gguf_header(path: Path) -> ModelHeader:
    from mlxcel.checkpoints.gguf import make_config_from_gguf, read_gguf_index

    metadata, index = read_gguf_index(path)  # no weights read (K-quant files are not dequantized here)
    _, config = make_config_from_gguf(metadata, path)
    digest = hashlib.sha256()
    for key in sorted(metadata):
        value = metadata[key]
        value = value.tolist() if hasattr(value, "tolist") else value
        digest.update(json.dumps([key, value], default=str).encode())
    for name in sorted(index):
        shape, dtype = index[name]
        digest.update(f"{name}:{shape}:{dtype}".encode())
    return ModelHeader(
        path,
        config["model_type"],
        config["max_position_embeddings"],
        {path.name: path.stat().st_size},
        digest.hexdigest(),
        read_head_dim(config),
    )
