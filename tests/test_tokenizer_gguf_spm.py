"""GGUF SentencePiece vocabularies against llama.cpp's own ids (recorded: tests/data/gguf_spm/),
and the whole-token splitter against transcriptions of the two orders it implements."""

from __future__ import annotations

import random

import pytest

from mlxcel.tokenizer import load_tokenizer
from mlxcel.tokenizer.whole_tokens import WholeTokenSplitter
from tests.gguf_spm_fixtures import ADDED_USER_DEFINED, TEXTS, VARIANTS, read_llama_cpp_ids, write_spm_gguf
from tests.helpers import check_stream


def test_the_recording_covers_every_variant_and_text():
    recorded = read_llama_cpp_ids()["variants"]
    assert set(VARIANTS) <= set(recorded)
    for variant in VARIANTS:
        assert list(recorded[variant]) == TEXTS, f"{variant}: rerun tests/data/gguf_spm/record_llama_cpp_ids.py"


@pytest.mark.parametrize("variant", VARIANTS)
def test_ids_equal_llama_cpp(tmp_path, variant):
    pytest.importorskip("gguf")
    ours = load_tokenizer(write_spm_gguf(tmp_path / f"{variant}.gguf", variant))
    recorded = read_llama_cpp_ids()["variants"][variant]
    wrong = {text: (ours.encode(text), ref["ids"]) for text, ref in recorded.items() if ours.encode(text) != ref["ids"]}
    assert not wrong


@pytest.mark.parametrize("variant", ["gemma-like", "prefixed"])
def test_decode_gives_back_the_text(tmp_path, variant):
    """A literal ▁ decodes as a space, as in llama.cpp and SentencePiece; everything else exactly."""
    pytest.importorskip("gguf")
    ours = load_tokenizer(write_spm_gguf(tmp_path / f"{variant}.gguf", variant))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text.replace("▁", " "), text
        check_stream(ours, ids)


def test_user_defined_pieces_are_text_not_special(tmp_path):
    pytest.importorskip("gguf")
    ours = load_tokenizer(write_spm_gguf(tmp_path / "g.gguf", "gemma-like"))
    ids = ours.encode("<start_of_turn>user\n  <td>x</td>")
    assert ours.decode(ids, skip_special_tokens=True) == "user\n  <td>x</td>"
    assert {ours.id_to_token(i) for i in ids} >= {"  ", "<td>", "</td>", "\n"}


# --- the splitter ---------------------------------------------------------------------------------


def llama_cpp_partition(text: str, tokens: dict[str, int]) -> list[tuple[str, int | None]]:
    """llama-vocab.cpp's tokenizer_st_partition, transcribed: tokens by byte length (ties by id),
    each cuts its leftmost non-overlapping occurrences (std::string::find) from the raw fragments."""
    fragments: list[tuple[str, int | None]] = [(text, None)] if text else []
    for token, token_id in sorted(tokens.items(), key=lambda kv: (-len(kv[0].encode()), kv[1])):
        out = []
        for fragment, fid in fragments:
            if fid is not None:
                out.append((fragment, fid))
                continue
            offset = 0
            while (match := fragment.find(token, offset)) != -1:
                if match > offset:
                    out.append((fragment[offset:match], None))
                out.append((token, token_id))
                offset = match + len(token)
            if offset < len(fragment):
                out.append((fragment[offset:], None))
        fragments = out
    return fragments


def leftmost_longest(text: str, tokens: dict[str, int]) -> list[tuple[str, int | None]]:
    """Brute force: at each position the longest token starting there, else one character."""
    parts: list[tuple[str, int | None]] = []
    pos = 0
    while pos < len(text):
        match = max((t for t in tokens if text.startswith(t, pos)), key=len, default=None)
        if match is None:
            if parts and parts[-1][1] is None:
                parts[-1] = (parts[-1][0] + text[pos], None)
            else:
                parts.append((text[pos], None))
            pos += 1
        else:
            parts.append((match, tokens[match]))
            pos += len(match)
    return parts


def test_the_two_orders_differ_where_a_shorter_token_starts_first():
    tokens = {"ab": 0, "bcd": 1}
    assert WholeTokenSplitter(tokens, "leftmost-longest").split("abcd") == [("ab", 0), ("cd", None)]
    assert WholeTokenSplitter(tokens, "longest-first").split("abcd") == [("a", None), ("bcd", 1)]


def test_splitter_equals_both_references_on_random_texts():
    rng = random.Random(0)
    alphabet = "ab é▁\n"
    for _ in range(300):
        tokens = {"".join(rng.choices(alphabet, k=rng.randint(1, 4))): i for i in range(rng.randint(1, 8))}
        tokens = {t: i for i, t in enumerate(tokens)}
        longest_first = WholeTokenSplitter(tokens, "longest-first")
        leftmost = WholeTokenSplitter(tokens, "leftmost-longest")
        for _ in range(10):
            text = "".join(rng.choices(alphabet, k=rng.randint(0, 24)))
            assert longest_first.split(text) == llama_cpp_partition(text, tokens), (tokens, text)
            assert leftmost.split(text) == leftmost_longest(text, tokens), (tokens, text)


def test_space_runs_split_like_llama_cpp():
    tokens = {t: i for i, t in enumerate(ADDED_USER_DEFINED)}
    splitter = WholeTokenSplitter(tokens, "longest-first")
    for n in range(1, 100):
        text = "x" + " " * n + "y"
        assert splitter.split(text) == llama_cpp_partition(text, tokens)
    assert [p for p, _ in splitter.split(" " * 64)] == [" " * 31, " " * 31, "  "]
