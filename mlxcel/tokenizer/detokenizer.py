"""Streaming detokenization: text per token without broken UTF-8, equal to a one-shot decode.

Decoding one token alone is wrong in general: a byte-level or byte-fallback token can carry
half a UTF-8 character, and some decoders treat the first token of a sequence specially
(SentencePiece strips its leading space). So each step decodes a short window, the tokens of
the last emitted chunk (context) plus the tokens not emitted yet, and emits what the window
adds beyond the context, once it does not end in U+FFFD (an incomplete character). A boundary
is only ever placed after a complete character, where a UTF-8 decoder is back in its initial
state, so window decodes agree with the one-shot decode. Work per token is bounded by the
window, not the sequence.
"""

from __future__ import annotations

from mlxcel.tokenizer.base import MlxcelTokenizer

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    def __init__(self, tokenizer: MlxcelTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self._chunks: list[str] = []
        self._window: list[int] = []  # context tokens followed by pending ones
        self._context_len = 0  # how many of _window were already emitted
        self._context_text = ""  # decode of the context tokens alone

    @property
    def text(self) -> str:
        """Everything emitted so far (held-back bytes excluded)."""
        return "".join(self._chunks)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is incomplete)."""
        self.tokens.append(token_id)
        self._window.append(token_id)
        decoded = self._decode(self._window)
        if decoded.endswith(_REPLACEMENT) or not decoded.startswith(self._context_text):
            return ""
        new_text = decoded[len(self._context_text) :]
        if new_text:
            # The pending tokens become the next context; one decode per emitted chunk.
            self._window = self._window[self._context_len :]
            self._context_len = len(self._window)
            self._context_text = self._decode(self._window)
        else:
            # Nothing visible (e.g. a skipped special token): keep the context, mark it emitted.
            self._context_len = len(self._window)
            self._context_text = decoded
        return self._emit(new_text)

    def finalize(self) -> str:
        """Flush what is held back (an incomplete character decodes to U+FFFD, as one-shot)."""
        decoded = self._decode(self._window)
        rest = decoded[len(self._context_text) :]
        self._window = self._window[self._context_len :] if rest else self._window
        self._context_len = len(self._window)
        self._context_text = self._decode(self._window)
        return self._emit(rest)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
