"""The prompt cache on disk (`runner.prompt_cache_dir`): each tree node a safetensors file, so a
shared system prompt is prefilled once per machine, not once per job.

Layout: `<dir>/<model key>/<hash of the prefix's token ids>-<start>.safetensors`, one file per
node: the KV of positions [start, end) of a prefix, every layer's arrays as `<layer>.<i>`, and in
its metadata the format version, the model key and the prefix's token ids [0, end). The model key
hashes everything that changes what the KV holds: the checkpoint (its fingerprint, and each
weights file's size and first and last megabyte, so two fine-tunes of one architecture differ),
dtype, quantize-at-load, fusion, KV quantization, the device kind and the MLX and mlxcel versions.

A file that is corrupt, from another model key or another format version is ignored with a
one-line warning and never used. Files are written to a temporary name and renamed, so a job
killed mid-write leaves no half file behind, and two jobs writing the same node write the same
bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxcel
from mlxcel.engine.prompt_cache import Node, PromptCache

FORMAT_VERSION = 1
SAMPLED_BYTES = 1 << 20  # of each weights file's start and end, hashed into the model key
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


def describe_model_key(path: Path, fingerprint: str, settings: dict) -> str:
    """A hash of what makes two jobs' cached KV interchangeable (module docstring)."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    weights = []
    for file in (f for f in files if f.is_file() and f.suffix in WEIGHT_SUFFIXES):
        size = file.stat().st_size
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            digest.update(handle.read(SAMPLED_BYTES))
            if size > SAMPLED_BYTES:
                handle.seek(max(SAMPLED_BYTES, size - SAMPLED_BYTES))
                digest.update(handle.read(SAMPLED_BYTES))
        weights.append([str(file.relative_to(path)) if path.is_dir() else file.name, size, digest.hexdigest()])
    described = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "weights": weights,
        "settings": settings,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlxcel": mlxcel.__version__,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def hash_tokens(model_key: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(model_key.encode() + np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32]


def prefix_of(node: Node) -> np.ndarray:
    """The token ids from the root to the end of `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int32)


def save_entries(cache: PromptCache, folder: Path, model_key: str) -> int:
    """Write every node not on disk yet; returns how many were written."""
    target = folder / model_key
    written = 0
    for node in list(cache.iter_nodes()):
        if node.saved:
            continue
        tokens = prefix_of(node)
        start = len(tokens) - len(node.tokens)
        arrays = {f"{layer}.{i}": a for layer, stored in enumerate(node.stored) for i, a in enumerate(stored)}
        metadata = {
            "format": str(FORMAT_VERSION),
            "model_key": model_key,
            "start": str(start),
            "token_ids": json.dumps(tokens.tolist()),
        }
        target.mkdir(parents=True, exist_ok=True)
        path = target / f"{hash_tokens(model_key, tokens)}-{start}.safetensors"
        partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.safetensors")
        mx.save_safetensors(str(partial), arrays, metadata=metadata)
        os.replace(partial, path)
        node.saved = True
        written += 1
    return written


def load_entries(cache: PromptCache, folder: Path, model_key: str, num_layers: int, log=sys.stderr) -> int:
    """Insert this model's saved nodes (shorter prefixes first, so parents come before children);
    returns how many were used."""
    target = folder / model_key
    if not target.is_dir():
        return 0
    entries = []
    for path in sorted(target.glob("*.safetensors")):
        if path.name.startswith("."):
            continue  # another job's file being written
        try:
            entries.append(read_entry(path, model_key, num_layers))
        except (ValueError, RuntimeError, OSError, KeyError) as exc:
            print(f"mlxcel: prompt cache: ignoring {path} ({exc})", file=log, flush=True)
    used = 0
    for tokens, start, stored in sorted(entries, key=lambda e: len(e[0])):
        found = cache.insert(tokens, start, stored)
        if found.length == len(tokens):
            for node in found.nodes:
                node.saved = True
            used += 1
    return used


def read_entry(path: Path, model_key: str, num_layers: int) -> tuple[np.ndarray, int, list[list[mx.array]]]:
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises plain exceptions for unreadable files
        raise ValueError(f"not a readable safetensors file: {exc}") from exc
    if metadata.get("format") != str(FORMAT_VERSION):
        raise ValueError(f"format version {metadata.get('format')!r}, this mlxcel writes {FORMAT_VERSION}")
    if metadata.get("model_key") != model_key:
        raise ValueError("written for another model or other settings")
    tokens = np.array(json.loads(metadata["token_ids"]), dtype=np.int32)
    start = int(metadata["start"])
    if path.name != f"{hash_tokens(model_key, tokens)}-{start}.safetensors":
        raise ValueError("its token ids do not match its name")
    per_layer = len(arrays) // num_layers if num_layers else 0
    stored = [[arrays.get(f"{layer}.{i}") for i in range(per_layer)] for layer in range(num_layers)]
    shapes_ok = per_layer * num_layers == len(arrays) and all(
        a is not None and a.shape[0] == len(tokens) - start for layer in stored for a in layer
    )
    if not shapes_ok or not 0 <= start < len(tokens):
        raise ValueError("its arrays do not match its token ids or this model's layers")
    return tokens, start, stored
