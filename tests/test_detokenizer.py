"""Streaming detokenization equals one-shot decode, never emits broken UTF-8, stays O(1) per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, trainers

from mlxcel.tokenizer import MlxcelTokenizer, load_tokenizer
from tests.helpers import CORPUS, REPLACEMENT, check_stream, load_smollm2, make_hf_folder, requires_smollm2, stream


def make_byte_fallback_folder(folder: Path) -> Path:
    """A Llama-2-style tokenizer.json: ▁ for spaces, byte-fallback tokens, a decoder that strips
    the first leading space. Its ASCII alphabet sends CJK and emoji to <0xXX> byte tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    # ASCII-only training text: every non-ASCII character must go to byte tokens. (Capping the
    # alphabet instead is not deterministic: the trainer breaks frequency ties in hash order.)
    ascii_texts = [text for text in CORPUS if text.isascii()]
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog, said Hello World."] * 10 + ascii_texts, trainer
    )
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    data["model"]["fuse_unk"] = True
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory) -> MlxcelTokenizer:
    return load_tokenizer(make_byte_fallback_folder(tmp_path_factory.mktemp("bf")))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> MlxcelTokenizer:
    return load_tokenizer(make_hf_folder(tmp_path_factory.mktemp("hf")))


@requires_smollm2
def test_smollm2_streaming_equals_one_shot():
    tok = load_smollm2()
    for text in CORPUS:
        check_stream(tok, tok.encode(text))
    check_stream(tok, tok.encode("".join(CORPUS)))


@requires_smollm2
def test_smollm2_emoji_split_across_byte_tokens_is_held_back():
    tok = load_smollm2()
    ids = tok.encode("a😀")
    assert len(ids) >= 3 and all(REPLACEMENT in tok.decode([i]) for i in ids[1:])  # the emoji spans byte tokens
    chunks = stream(tok, ids)
    assert chunks[0] == "a" and all(c == "" for c in chunks[1:-2]) and chunks[-2:] == ["😀", ""]


@requires_smollm2
def test_incomplete_tail_is_flushed_by_finalize():
    tok = load_smollm2()
    ids = tok.encode("ok 😀")[:-1]  # cut the emoji's last byte token
    assert tok.decode(ids).endswith(REPLACEMENT)
    chunks = stream(tok, ids)
    assert REPLACEMENT in chunks[-1] and REPLACEMENT not in "".join(chunks[:-1])
    assert "".join(chunks) == tok.decode(ids)


def test_hf_streaming_equals_one_shot(hf_tok):
    for text in CORPUS:
        check_stream(hf_tok, hf_tok.encode(text))


def test_byte_fallback_streaming_equals_one_shot(byte_fallback):
    tok = byte_fallback
    ids = tok.encode("日本 😀")
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # the case the test is about
    assert tok.decode(ids[:-1]).endswith(REPLACEMENT)
    for text in CORPUS:
        check_stream(tok, tok.encode(text))
    # the first token's leading space is stripped once, as in the one-shot decode
    ids = tok.encode("the fox", add_special_tokens=False)
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "the fox"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: MlxcelTokenizer):
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("which", ["hf", "byte_fallback"])
def test_work_per_token_is_bounded(which, hf_tok, byte_fallback):
    inner = hf_tok if which == "hf" else byte_fallback
    ids = inner.encode(" ".join(CORPUS) * 12, add_special_tokens=False)
    assert len(ids) > 2000
    counting = CountingTokenizer(inner)
    assert "".join(stream(counting, ids)) == inner.decode(ids)
    assert max(counting.lengths) <= 24  # a window, not the sequence
    assert sum(counting.lengths) <= 8 * len(ids)
