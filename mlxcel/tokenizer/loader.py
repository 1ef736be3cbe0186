"""Pick the tokenizer backend for a model path and build it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.base import TOKENIZER_KINDS, MlxcelTokenizer

# What each backend reads from a model folder, in detection order.
_FOLDER_FILES = (("hf", "tokenizer.json"), ("sentencepiece", "tokenizer.model"), ("tiktoken", "*.tiktoken"))


def detect_tokenizer_kind(path: str | Path) -> str:
    """`.gguf` file -> gguf; folder with tokenizer.json -> hf; tokenizer.model -> sentencepiece
    (tiktoken when it holds tiktoken ranks); *.tiktoken -> tiktoken; else a folder holding exactly
    one .gguf -> gguf. A tokenizer file named directly counts as its folder."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_file():  # a tokenizer file named directly: its folder is read
        by_name = {"tokenizer.json": "hf", "tokenizer.model": "sentencepiece"}
        kind = "tiktoken" if path.suffix == ".tiktoken" else by_name.get(path.name)
        if kind is not None:
            return "tiktoken" if kind == "sentencepiece" and is_tiktoken_file(path) else kind
    if not path.is_dir():
        what = "file" if path.exists() else "path"
        raise MlxcelError(f"tokenizer: {what} {path} is neither a model folder nor a .gguf file")
    for kind, pattern in _FOLDER_FILES:
        if any(path.glob(pattern)):
            return "tiktoken" if kind == "sentencepiece" and is_tiktoken_file(path / pattern) else kind
    if len(list(path.glob("*.gguf"))) == 1:
        return "gguf"
    looked_for = ", ".join(p for _, p in _FOLDER_FILES) + ", one *.gguf"
    raise MlxcelError(f"tokenizer: no tokenizer found in {path} (looked for {looked_for})")


def load_tokenizer(
    path: str | Path, kind: str = "auto", gguf_metadata: dict[str, Any] | None = None
) -> MlxcelTokenizer:
    """Build the tokenizer for a model folder or a .gguf file.

    `kind` is auto (detect from the files) or one backend name. `gguf_metadata` lets a caller
    that already read the GGUF (the model loader) skip a second read.
    """
    if kind != "auto" and kind not in TOKENIZER_KINDS:
        raise MlxcelError(f"tokenizer.kind={kind}: unknown kind; choose one of auto, {', '.join(TOKENIZER_KINDS)}")
    path = Path(path).expanduser()
    if not path.exists():
        raise MlxcelError(f"tokenizer: {path} does not exist")
    kind = detect_tokenizer_kind(path) if kind == "auto" else kind
    if kind == "hf":
        from mlxcel.tokenizer.hf import load_hf_tokenizer

        folder = path if path.is_dir() else path.parent
        if not (folder / "tokenizer.json").is_file():
            raise MlxcelError(f"tokenizer.kind=hf: {folder} has no tokenizer.json")
        return load_hf_tokenizer(folder)
    if kind == "gguf":
        from mlxcel.tokenizer.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(find_gguf_file(path), gguf_metadata)
    folder = path if path.is_dir() else path.parent
    if kind == "sentencepiece":
        from mlxcel.tokenizer.sentencepiece import load_sentencepiece_tokenizer

        if not (folder / "tokenizer.model").is_file():
            raise MlxcelError(f"tokenizer.kind=sentencepiece: {folder} has no tokenizer.model")
        return load_sentencepiece_tokenizer(folder)
    from mlxcel.tokenizer.tiktoken_bpe import load_tiktoken_tokenizer

    return load_tiktoken_tokenizer(folder)


def is_tiktoken_file(path: Path) -> bool:
    """A tokenizer.model that holds tiktoken ranks (text lines 'base64 rank'), as Llama 3's originals do."""
    try:
        with path.open("rb") as f:
            head = f.read(64).split(b"\n")[0]
    except OSError:
        return False
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ [0-9]+", head) is not None


def find_gguf_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise MlxcelError(
            f"tokenizer.kind=gguf: need exactly one .gguf file in {path} (found {names}); pass the file itself"
        )
    return found[0]
