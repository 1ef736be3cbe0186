"""llguidance's view of our tokenizers: every token's bytes, the special ids, the end ids.

llguidance computes token masks from the bytes each token adds to the text; these must be the
bytes our decode() gives for the token in mid-text. HF and byte-level GGUF tokenizers hand over
their tokenizer.json, tiktoken its ranks; SentencePiece goes through a TokenizerWrapper whose
pieces are spelled as bytes here. Ids past the tokenizer's vocabulary (padded embedding rows)
get no bytes, so no mask ever allows them.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from mlxcel.errors import MlxcelError

if TYPE_CHECKING:
    import llguidance

    from mlxcel.tokenizer.base import MlxcelTokenizer

_DUMMY = "▁"
# tokenizer -> {(n_vocab, eos ids): LLTokenizer}; weak, so a dropped tokenizer frees its tries
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_ll_tokenizer(tokenizer: MlxcelTokenizer, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of one of our tokenizers (mlxcel/tokenizer/base.py: MlxcelTokenizer), for every backend.

    n_vocab is the model's logits width (at least the tokenizer's vocab_size); eos_token_ids end a
    row, the first is the one a grammar's end forces. Built once per (tokenizer, n_vocab, eos ids).
    """
    key = (int(n_vocab), tuple(int(i) for i in eos_token_ids))
    built = _CACHE.setdefault(tokenizer, {})
    if key not in built:
        built[key] = build_ll_tokenizer(tokenizer, *key)
    return built[key]


def build_ll_tokenizer(tokenizer: MlxcelTokenizer, n_vocab: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    import llguidance

    from mlxcel.tokenizer.fast import FastTokenizer
    from mlxcel.tokenizer.sentencepiece import SentencePieceTokenizer
    from mlxcel.tokenizer.tiktoken_bpe import TiktokenTokenizer

    if not eos:
        raise MlxcelError("structured output needs an end-of-sequence token id; the tokenizer and model name none")
    n_vocab = max(n_vocab, tokenizer.vocab_size)
    if isinstance(tokenizer, FastTokenizer):
        return llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=n_vocab, eos_token=list(eos))
    if isinstance(tokenizer, TiktokenTokenizer):
        encoding = tokenizer.encoding
        return llguidance.LLTokenizer.from_tiktoken(
            encoder=encoding._mergeable_ranks,
            special_tokens=encoding._special_tokens,
            pattern=encoding._pat_str,
            eos_token=list(eos),
            n_vocab=n_vocab,
        )
    if isinstance(tokenizer, SentencePieceTokenizer):
        wrapper = llguidance.TokenizerWrapper(SentencePieceVocab(tokenizer, n_vocab, eos[0]))
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=list(eos))
    backend = getattr(tokenizer, "backend", type(tokenizer).__name__)
    raise MlxcelError(f"structured output does not support the {backend!r} tokenizer backend yet")


class SentencePieceVocab:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, bos/eos, and encode."""

    def __init__(self, tokenizer, n_vocab: int, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids, hidden = find_special_ids(tokenizer)
        self.tokens = spell_pieces(tokenizer, n_vocab)
        self._tokenizer = tokenizer
        # hidden text pieces SentencePiece still produces: spelled with byte pieces instead
        self._as_bytes = {i: ids for i in hidden if (ids := spell_in_bytes(tokenizer, self.tokens[i]))}

    def __call__(self, text: str) -> list[int]:
        # llguidance tokenizes text in mid-row: no dummy-prefix space, special tokens as text
        ids = self._tokenizer.encode_without_prefix(text)
        return [j for i in ids for j in self._as_bytes.get(i, (i,))]


def find_special_ids(tokenizer) -> tuple[list[int], list[int]]:
    """Control pieces, unknown, and added tokens that skip_special_tokens drops; added tokens that
    decode as text even then (GGUF user-defined runs of spaces, HTML tags) stay text, unless
    decode() eats the space of the piece after them (legacy with a dummy prefix): a mask cannot
    know that, so those are hidden from grammars as special too (the second list)."""
    sp = tokenizer.sp
    special = {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    text = []
    for i in tokenizer.special_tokens.values():
        if tokenizer.decode([i], skip_special_tokens=True) == "":
            special.add(i)
        elif i not in special:
            text.append(i)
    hidden = text if text and eats_next_space(tokenizer, text[0]) else []
    return sorted(special | set(hidden)), hidden


def eats_next_space(tokenizer, whole_id: int) -> bool:
    spaced = tokenizer.encode_without_prefix(" a")
    return tokenizer.decode([whole_id, *spaced]) != tokenizer.decode([whole_id]) + " a"


def spell_in_bytes(tokenizer, text: bytes) -> tuple[int, ...]:
    """<0xNN> pieces for these bytes, where the vocabulary has them all (byte fallback)."""
    ids = tuple(tokenizer.sp.piece_to_id(f"<0x{b:02X}>") for b in text)
    return ids if all(tokenizer.sp.is_byte(i) for i in ids) else ()


def spell_pieces(tokenizer, n_vocab: int) -> list[bytes]:
    """Each id's bytes as decode() gives them after other text: ▁ is a space, <0xNN> that byte,
    added tokens their text; unused pieces and ids without a token are empty (never allowed)."""
    sp = tokenizer.sp
    tokens = [b""] * n_vocab
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            tokens[i] = bytes([int(piece[3:5], 16)])
        elif not sp.is_unused(i):
            tokens[i] = piece.replace(_DUMMY, " ").encode()
    for text, i in tokenizer.special_tokens.items():
        if 0 <= i < n_vocab:
            tokens[i] = text.encode()
    return tokens
