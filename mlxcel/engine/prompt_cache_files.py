"""The prompt cache on disk (`runner.prompt_cache_dir`): each tree node a safetensors file, so a
shared system prompt is prefilled once per machine, not once per job.

Layout: `<dir>/<model key>/<hash of the prefix's token ids>-<start>.safetensors`, one file per
node: the KV of positions [start, end) of a prefix, every layer's arrays as `<layer>.<i>` (a hybrid's
recurrent layers' states after `end` as `<layer>.s<i>`, where the node keeps them), and in
its metadata the format version, the model key and the prefix's token ids [0, end). The model key
hashes everything that changes what the KV holds: the checkpoint (its fingerprint, and each
weights file's size and first and last megabyte, so two fine-tunes of one architecture differ),
dtype, quantize-at-load, fusion, KV quantization, the device kind and the MLX and mlxcel versions.

The folder is untrusted input: a file that is corrupt, from another model key or another format
version, whose arrays are not exactly what this model's layers store (count, shape, dtype: the
layout, from the model, not from the file), whose checksum (sha256 of its arrays, in its metadata)
does not match, or that holds NaN or infinite values is ignored with a one-line warning and never
used. Files are written to a temporary name and renamed, so a job killed mid-write leaves no half
file behind, and two jobs writing the same node write the same bytes. A folder that cannot be
written (a file, read-only, full) is said once; the job goes on without saving there.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TextIO

import mlx.core as mx
import numpy as np

import mlxcel
from mlxcel.engine.prompt_cache import Node, PromptCache
from mlxcel.engine.scheduler import cache_attentions, cache_widths, layer_chunks, layer_windows, recurrent_layers

# per layer, (shape after the positions axis, dtype) of each array its cache stores (read_positions)
Layout = list[list[tuple[tuple[int, ...], mx.Dtype]]]

# 2: entries carry a checksum. The version is hashed into the model key, so version-1 entries
# sit under another key's folder: a miss, never read (and left on disk).
FORMAT_VERSION = 2
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


def describe_layout(model, dtype: str, kv_bits: int | None, kv_group_size: int) -> Layout:
    """What each layer's paged cache stores for a position (PagedKVCache / QuantizedPagedKVCache
    read_positions): keys and values [kv_heads, head_dim] in the model's dtype, or with `kv_bits`
    in full-attention layers their quantized parts (packed, scales, biases each). Nothing for a
    chunked layer: it keeps a ring a row (describe_states)."""
    # one per cache entry; None: a recurrent layer
    layers = [None if chunk is not None else a for a, chunk in zip(cache_attentions(model), layer_chunks(model))]
    plain = []
    for attention in layers:
        widths = cache_widths(attention) if attention else ()
        plain.append([((attention.n_kv_heads, width), getattr(mx, dtype)) for width in widths])
    if not kv_bits:
        return plain
    layout = []
    for kinds, window in zip(plain, layer_windows(model)):
        if not kinds or window is not None:
            layout.append(kinds)  # a recurrent layer (nothing per position), or a window kept unquantized
            continue
        quantized = []
        for shape, kind in kinds:  # keys' parts, then values' (packed, scales, biases each)
            parts = mx.quantize(mx.zeros((1, *shape), kind), group_size=kv_group_size, bits=kv_bits)
            quantized += [(p.shape[1:], p.dtype) for p in parts]
        layout.append(quantized)
    return layout


def describe_states(model) -> Layout | None:
    """What a hybrid's recurrent layers keep after a prefix ([1, ...] arrays each, per cache entry;
    [] for attention layers), and a chunked layer's ring (its chunk of keys and values,
    paged_window.py), from a one-token probe; None for a model without them."""
    if not any(recurrent_layers(model)) and not any(c is not None for c in layer_chunks(model)):
        return None
    cache = model.make_cache(1)
    model(mx.array([[0]]), cache)
    return [describe_cache_states(c) for c in cache]


def describe_cache_states(cache) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    if hasattr(cache, "states"):
        return [(tuple(a.shape[1:]), a.dtype) for a in cache.states]
    if getattr(cache, "chunk", None) is not None:  # keys, values [1, kv_heads, L, D] -> a ring [chunk, kv_heads, D]
        return [((cache.chunk, a.shape[1], a.shape[3]), a.dtype) for a in (cache.keys, cache.values)]
    return []


def checksum_arrays(arrays: dict[str, mx.array]) -> str:
    """sha256 over the arrays' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = mx.contiguous(arrays[name])
        digest.update(f"{name}|{array.dtype}|{list(array.shape)};".encode())
        digest.update(memoryview(array))
    return digest.hexdigest()


def hash_tokens(model_key: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(model_key.encode() + np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32]


def prefix_of(node: Node) -> np.ndarray:
    """The token ids from the root to the end of `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int32)


def save_entries(cache: PromptCache, folder: Path, model_key: str, log: TextIO | None = None) -> int:
    """Write every node not on disk yet; returns how many were written. A write the system refuses
    (read-only, full, not a folder) is said once and ends the cache's saving: the job goes on."""
    if cache.folder_error is not None:
        return 0
    target = folder / model_key
    written = 0
    for node in list(cache.iter_nodes()):
        if node.saved:
            continue
        tokens = prefix_of(node)
        start = len(tokens) - len(node.tokens)
        arrays = {f"{layer}.{i}": a for layer, stored in enumerate(node.stored) for i, a in enumerate(stored)}
        for layer, states in enumerate(node.states or []):
            arrays.update({f"{layer}.s{i}": a for i, a in enumerate(states)})
        metadata = {
            "format": str(FORMAT_VERSION),
            "model_key": model_key,
            "start": str(start),
            "token_ids": json.dumps(tokens.tolist()),
            "sha256": checksum_arrays(arrays),
        }
        path = target / f"{hash_tokens(model_key, tokens)}-{start}.safetensors"
        try:
            target.mkdir(parents=True, exist_ok=True)
            write_entry(path, arrays, metadata)
        except OSError as exc:
            refuse_folder(cache, f"cannot write {exc.filename or path} ({exc.strerror or exc})", log)
            break
        node.saved = True
        written += 1
    return written


def open_entry(path: Path, mode: str):
    return open(path, mode)  # (one place, so tests can make the system refuse a write)


def write_entry(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Under a temporary name, then renamed; nothing is left behind when the write fails. Written
    through a Python file, whose failed writes raise (MLX's own file writer ignores them)."""
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.safetensors")
    try:
        with open_entry(partial, "wb") as handle:
            mx.save_safetensors(handle, arrays, metadata=metadata)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def refuse_folder(cache: PromptCache, reason: str, log: TextIO | None) -> None:
    cache.folder_error = reason
    message = f"mlxcel: prompt cache: {reason}: no entries are saved there (the job goes on)"
    print(message, file=log or sys.stderr, flush=True)


def load_entries(
    cache: PromptCache,
    folder: Path,
    model_key: str,
    layout: Layout,
    log: TextIO | None = None,
    states: Layout | None = None,
) -> int:
    """Insert this model's saved nodes (shorter prefixes first, so parents come before children);
    returns how many were used. A folder that cannot be made is said here, at the job's start.
    `states`: a hybrid's recurrent states' layout (describe_states)."""
    target = folder / model_key
    try:
        target.mkdir(parents=True, exist_ok=True)
        paths = sorted(target.glob("*.safetensors"))
    except OSError as exc:
        refuse_folder(cache, f"cannot use {folder} as runner.prompt_cache_dir ({exc.strerror or exc})", log)
        return 0
    entries = []
    for path in paths:
        if path.name.startswith("."):
            continue  # another job's file being written
        try:
            entries.append(read_entry(path, model_key, layout, states))
        except (ValueError, RuntimeError, OSError, KeyError) as exc:
            print(f"mlxcel: prompt cache: ignoring {path} ({exc})", file=log or sys.stderr, flush=True)
    used = 0
    for tokens, start, stored, kept in sorted(entries, key=lambda e: len(e[0])):
        found = cache.insert(tokens, start, stored, kept)
        if found.length == len(tokens):
            for node in found.nodes:
                node.saved = True
            used += 1
    return used


def read_entry(
    path: Path, model_key: str, layout: Layout, states: Layout | None = None
) -> tuple[np.ndarray, int, list[list[mx.array]], list[list[mx.array]] | None]:
    """The file's (token ids, start, per-layer arrays, a hybrid's states or None), or ValueError
    saying why it is not used."""
    if not path.is_file():  # a FIFO would block the job's start; a folder cannot be read
        raise ValueError("not a regular file")
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises plain exceptions for unreadable files
        raise ValueError(f"not a readable safetensors file: {exc}") from exc
    if metadata.get("format") != str(FORMAT_VERSION):
        raise ValueError(f"format version {metadata.get('format')!r}, this mlxcel writes {FORMAT_VERSION}")
    if metadata.get("model_key") != model_key:
        raise ValueError("written for another model or other settings")
    tokens, start = read_token_ids(metadata)
    if path.name != f"{hash_tokens(model_key, tokens)}-{start}.safetensors":
        raise ValueError("its token ids do not match its name")
    kept = {name: a for name, a in arrays.items() if ".s" in name}
    if kept and states is None:
        raise ValueError("it keeps recurrent states, and this model has none")
    check_layout({name: a for name, a in arrays.items() if name not in kept}, layout, len(tokens) - start)
    if kept:
        check_layout(kept, states, 1, "s")
    if "sha256" not in metadata:
        raise ValueError("no checksum")
    if checksum_arrays(arrays) != metadata["sha256"]:
        raise ValueError("its arrays do not match their checksum (damaged or edited)")
    floats = [mx.isfinite(a).all() for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)]
    if floats and not mx.stack(floats).all().item():
        raise ValueError("its arrays hold NaN or infinite values")
    stored = [[arrays[f"{layer}.{i}"] for i in range(len(kinds))] for layer, kinds in enumerate(layout)]
    if not kept:
        return tokens, start, stored, None
    return tokens, start, stored, [[kept[f"{layer}.s{i}"] for i in range(len(k))] for layer, k in enumerate(states)]


def read_token_ids(metadata: dict[str, str]) -> tuple[np.ndarray, int]:
    """The metadata's token ids (a JSON list of int32 ids) and start (in [0, len))."""
    try:
        ids = json.loads(metadata.get("token_ids", ""))
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 2**31 for i in ids):
        raise ValueError("its token_ids are not a list of token ids")
    start = metadata.get("start", "")
    if not start.isdecimal() or not 0 <= int(start) < len(ids):
        raise ValueError(f"its start {start!r} is not a position of its {len(ids)} token ids")
    return np.array(ids, dtype=np.int32), int(start)


def check_layout(arrays: dict[str, mx.array], layout: Layout, positions: int, prefix: str = "") -> None:
    """Every array this model's layers store for `positions` positions (names `<layer>.<prefix><i>`),
    exactly, and no other."""
    expected = {
        f"{layer}.{prefix}{i}": ((positions, *shape), kind)
        for layer, kinds in enumerate(layout)
        for i, (shape, kind) in enumerate(kinds)
    }
    mismatch = "its arrays do not match its token ids or this model's layers"
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing or extra:
        raise ValueError(f"{mismatch} ({f'no {missing[0]}' if missing else f'{extra[0]} is not one of them'})")
    for name, (shape, kind) in expected.items():
        array = arrays[name]
        if tuple(array.shape) != shape or array.dtype != kind:
            got, want = describe_array(array.shape, array.dtype), describe_array(shape, kind)
            raise ValueError(f"{mismatch} ({name} is {got}, this model stores {want})")


def describe_array(shape, dtype: mx.Dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('mlx.core.')}"
