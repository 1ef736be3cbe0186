"""SentencePiece (`llama`) GGUF vocabularies built from the checked-in mistral-common models, and
the texts whose llama.cpp ids tests/data/gguf_spm/llama_cpp_ids.json records.

`write_spm_gguf(path, variant)`:
- "v1", "v3", "v7": a mistral .model's pieces as they are (byte fallback; v3/v7 add control pieces);
- "gemma-like": v1 plus the structure of Gemma 3's GGUF: user-defined runs of 2-31 literal ASCII
  spaces (llama.cpp's converter respells Gemma's ▁▁.. pieces so), of tabs and newlines, HTML tags,
  control turn markers, no space prefix, and remove_extra_whitespaces set (which llama.cpp ignores
  for SentencePiece vocabularies). Two overlapping user-defined pieces, "<<<" and "<tag>", tell
  llama.cpp's longest-first order from leftmost-longest ("<<<tag>");
- "prefixed": the same added pieces with llama's space prefix.

Regenerate the ids (llama.cpp itself; CI cannot build it) with:
    python tests/data/gguf_spm/record_llama_cpp_ids.py
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import sentencepiece as spm

DATA = Path(__file__).parent / "data"
LLAMA_CPP_IDS = DATA / "gguf_spm" / "llama_cpp_ids.json"
VARIANTS = ("v1", "v3", "v7", "gemma-like", "prefixed")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
ADDED_USER_DEFINED = (
    [" " * n for n in range(2, 32)]
    + ["\t" * n for n in range(1, 9)]
    + ["\n" * n for n in range(1, 5)]
    + ["<table>", "</table>", "<td>", "</td>", "<<<", "<tag>"]
)
ADDED_CONTROL = ["<start_of_turn>", "<end_of_turn>"]

# The strings (Gemma 3 270M, where mlxcel and llama.cpp first differed) and the cases it
# names: runs of 2-64 spaces, tabs, newline + indentation, leading and trailing spaces, Korean
# with double spaces, a literal ▁; then ordinary text, code, control pieces in text, byte fallback.
TEXTS = [
    "def fibonacci(n):\n    ",
    "a  b   c",
    "    return x",
    *("x" + " " * n + "y" for n in range(2, 65)),
    *(" " * n for n in (1, 2, 5, 31, 32, 64)),
    "\tindented\n\t\tdeeper\n\t\t\t\t\t\t\t\t\t\tvery deep",
    "def f(x):\n    if x:\n        return [\n            x,\n        ]\n\n\n\nend",
    "  leading two",
    "trailing three   ",
    "   both sides   ",
    "안녕하세요  세계  두 칸  띄어쓰기",
    "literal ▁ and ▁▁ and a▁b and ▁",
    "<table><td>cell</td>  <td> spaced </td></table>",
    "<<<tag> and <<< and <tag>",
    "<start_of_turn>user\n  Hi  there<end_of_turn>\n<start_of_turn>model\n",
    "<s>Hello</s>world [INST] What is 2+2? [/INST] 4</s>",
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog. It's 2024; don't panic, I'll call at 10:30.",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i];\n}",
    "日本語のテキストと中文文本。",
    "Emoji: 😀👍🏽🇫🇷 👨\u200d👩\u200d👧 🤖",
    "Rare: 𓀀 🧿 ꙮ 뷁 (byte fallback in small vocabularies)",
    "multiple\n\n\nnewlines\r\n and\t\ttabs \t \n mixed",
    "",
    "\n",
]


def model_path(version: str) -> Path:
    return DATA / "sentencepiece" / f"mistral_{version}.model"


@cache
def load_mistral_processor(version: str) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(model_path(version)))


def read_pieces(version: str) -> list[tuple[str, float, int]]:
    sp = load_mistral_processor(version)

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        return CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i) else UNUSED if sp.is_unused(i) else NORMAL

    return [(sp.id_to_piece(i), sp.get_score(i), kind(i)) for i in range(sp.get_piece_size())]


def variant_pieces(variant: str) -> tuple[list[tuple[str, float, int]], bool, bool]:
    """(pieces, add_space_prefix, remove_extra_whitespaces) of a variant."""
    if variant in ("v1", "v3", "v7"):
        return read_pieces(variant), True, False
    pieces = read_pieces("v1")
    pieces += [(t, -1000.0, USER_DEFINED) for t in ADDED_USER_DEFINED] + [(t, 0.0, CONTROL) for t in ADDED_CONTROL]
    return pieces, variant == "prefixed", variant == "gemma-like"


def write_spm_gguf(path: Path, variant: str, add_bos: bool = True, chat_template: str | None = None) -> Path:
    import gguf

    pieces, add_space_prefix, remove_extra_whitespaces = variant_pieces(variant)
    writer = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads the architecture's hyperparameters even for vocab_only loads
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p[0] for p in pieces])
    writer.add_token_scores([p[1] for p in pieces])
    writer.add_token_types([p[2] for p in pieces])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_remove_extra_whitespaces(remove_extra_whitespaces)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_llama_cpp_ids() -> dict:
    return json.loads(LLAMA_CPP_IDS.read_text())
