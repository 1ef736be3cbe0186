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


class StopStringFilter:
    """Cuts streamed text at the first stop string, which may span any number of tokens.

    Text that could still become a stop string (a suffix that is a stop string's prefix) is held
    back until the next chunk decides; the stop string itself and everything after it are dropped.
    """

    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped or not self.stop_strings:
            return "" if self.stopped else text
        buffer = self.held + text
        found = [i for i in (buffer.find(s) for s in self.stop_strings) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return buffer[: min(found)]
        keep = max((k for s in self.stop_strings for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        rest, self.held = self.held, ""
        return "" if self.stopped else rest


class TextStream:
    """Streaming detokenizer plus stop strings: what a generated row prints and keeps."""

    def __init__(
        self, tokenizer: MlxcelTokenizer, stop_strings: list[str] | None = None, skip_special_tokens: bool = False
    ):
        self.detokenizer = StreamingDetokenizer(tokenizer, skip_special_tokens)
        self.filter = StopStringFilter(list(stop_strings or []))
        self._chunks: list[str] = []

    @property
    def stopped(self) -> bool:
        """A stop string was found: the row should end."""
        return self.filter.stopped

    @property
    def tokens(self) -> list[int]:
        """Every id added so far."""
        return self.detokenizer.tokens

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def add_token(self, token_id: int) -> str:
        return self._emit(self.filter.push(self.detokenizer.add_token(token_id)))

    def finalize(self) -> str:
        return self._emit(self.filter.push(self.detokenizer.finalize()) + self.filter.flush())

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text


class DeferredTextStream:
    """A TextStream for a row whose text nobody reads as it grows and no stop string can end:
    it keeps the ids and decodes them once, at the end. That text equals the streamed one (the
    streaming decode equals the one-shot decode), and a step of a large batch skips the per-token
    decodes, which bounded the host's work per step of a large batch on a GPU
    (docs/benchmarks.md)."""

    stopped = False

    def __init__(self, tokenizer: MlxcelTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []  # every id added so far
        self.text = ""

    def add_token(self, token_id: int) -> str:
        self.tokens.append(token_id)
        return ""

    def finalize(self) -> str:
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)
        return self.text
