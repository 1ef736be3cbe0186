"""Special tokens typed by a user are text: where a rendered prompt holds them, and how encode() keeps them text.

A chat template's own markup (`<|im_start|>`, `[INST]`, a VLM's image placeholder) is tokenized
with its special tokens parsed. The same text inside a message's content is the user's
(template.special_tokens_in_content=text, the default): it is tokenized as characters, as
transformers does with `split_special_tokens=True` (HF tokenizers' `encode_special_tokens`) and
llama.cpp with `parse_special=false`. Added tokens that are not special (Qwen3's `<think>`, a
GGUF's user-defined pieces) stay whole either way, as there.

To tell the user's occurrences from the template's, the template renders the messages with each
special token's text replaced by a sentinel (a private-use character found nowhere in what the
template reads); `Escapes.unescape` puts the text back and returns the spans it covers, the
`literal_spans` that every backend's encode() takes. Nothing changes for content without special
tokens' text: no spans, the same encode() as before.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.whole_tokens import WholeTokenSplitter

Span = tuple[int, int]
# Private-use characters, in the order they are tried as sentinels (no font draws them and no
# tokenizer gives them a meaning; one that occurs in the input is never picked).
_SENTINEL_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
_ESCAPED_FORM = re.compile(r"\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}")
_finders: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> splitter over its control tokens


def sentinel_forms(char: str) -> set[str]:
    """The character as a template can print it: itself, and escaped by tojson(ensure_ascii) or
    by a Python repr (`{{ message.tool_calls }}` prints a dict)."""
    return {char, json.dumps(char)[1:-1], repr(char)[1:-1]}


@dataclass(frozen=True)
class Escapes:
    """Special token texts and the sentinels that stand for them while a template renders."""

    sentinels: dict[str, str]  # token text -> sentinel character
    finder: WholeTokenSplitter | None = None  # finds the token texts in a string (escape)

    def escape(self, value: Any) -> Any:
        """`value` with every token text in its strings (keys too) replaced by its sentinel."""
        if isinstance(value, str):
            if self.finder is None:
                return value
            parts = self.finder.split(value)
            return "".join(self.sentinels.get(part, part) if token is not None else part for part, token in parts)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape(v) for v in value)
        return value

    def unescape(self, text: str) -> tuple[str, tuple[Span, ...]]:
        """The text with the token texts back, and the span each occupies (sorted)."""
        if not self.sentinels:
            return text, ()
        forms = {form: token for token, char in self.sentinels.items() for form in sentinel_forms(char)}
        pattern = "|".join(map(re.escape, sorted(forms, key=len, reverse=True)))
        out: list[str] = []
        spans: list[Span] = []
        pos = size = 0
        for match in re.finditer(pattern, text):
            out.append(text[pos : match.start()])
            size += match.start() - pos
            token = forms[match.group()]
            out.append(token)
            spans.append((size, size + len(token)))
            size += len(token)
            pos = match.end()
        out.append(text[pos:])
        return "".join(out), tuple(spans)


def iterate_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from iterate_strings(k)
            yield from iterate_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iterate_strings(v)


def pick_sentinels(tokens: Sequence[str], avoid: list[str]) -> dict[str, str]:
    """A distinct sentinel per token text, none of whose printed forms occurs in `avoid`."""
    if not tokens:
        return {}
    chars = set().union(*map(set, avoid)) if avoid else set()
    escaped = {form for text in avoid if "\\" in text for form in _ESCAPED_FORM.findall(text)}
    picked: dict[str, str] = {}
    wanted = iter(tokens)
    token = next(wanted, None)
    for low, high in _SENTINEL_RANGES:
        for code in range(low, high + 1):
            if token is None:
                return picked
            char = chr(code)
            if char in chars or sentinel_forms(char) & escaped:
                continue
            picked[token] = char
            token = next(wanted, None)
    if token is not None:
        raise MlxcelError("the prompt uses every private-use character; mlxcel cannot mark the user's special tokens")
    return picked


def control_finder(tokenizer: Any) -> WholeTokenSplitter | None:
    """A splitter over the tokenizer's control tokens (built once per tokenizer: Gemma has 6k)."""
    try:
        return _finders[tokenizer]
    except (KeyError, TypeError):
        pass
    tokens = dict(getattr(tokenizer, "control_tokens", None) or {})
    finder = WholeTokenSplitter(tokens) if tokens else None
    try:
        _finders[tokenizer] = finder
    except TypeError:  # not weak-referenceable: build it again next time
        pass
    return finder


def find_escapes(tokenizer: Any, user_values: Sequence[Any], other_values: Sequence[Any] = ()) -> Escapes | None:
    """The escapes for the control tokens' texts that occur in `user_values` (messages, tools),
    with sentinels found nowhere in them nor in `other_values` (the template, its variables);
    None when no control token's text occurs there."""
    finder = control_finder(tokenizer)
    if finder is None:
        return None
    user = [s for value in user_values for s in iterate_strings(value)]
    found = dict.fromkeys(part for text in user for part, token in finder.split(text) if token is not None)
    if not found:
        return None
    avoid = user + [s for value in other_values for s in iterate_strings(value)]
    return Escapes(pick_sentinels(list(found), avoid), finder)


def escape_spans(text: str, spans: Sequence[Span]) -> tuple[str, Escapes]:
    """The text with each span replaced by its sentinel, and the escapes that put them back: the
    literal spans survive a rewrite of the text (a VLM expanding its image placeholders)."""
    sentinels = pick_sentinels(list(dict.fromkeys(text[s:e] for s, e in spans)), [text])
    out, pos = [], 0
    for start, end in spans:
        out += [text[pos:start], sentinels[text[start:end]]]
        pos = end
    out.append(text[pos:])
    return "".join(out), Escapes(sentinels)


def encode_text(tokenizer: Any, text: str, spans: Sequence[Span] = (), add_special_tokens: bool = False) -> list[int]:
    """tokenizer.encode, with `literal_spans` only where there are some (any MlxcelTokenizer)."""
    if spans:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, literal_spans=tuple(spans))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---- what the backends share ----
def overlaps(start: int, end: int, spans: Sequence[Span]) -> bool:
    """[start, end) meets one of the sorted, disjoint spans."""
    i = bisect.bisect_left(spans, (end,))  # the first span starting at or after end
    return i > 0 and spans[i - 1][1] > start


def spans_within(start: int, end: int, spans: Sequence[Span]) -> list[Span]:
    """The spans that meet [start, end), clipped and made relative to start."""
    return [(max(s, start) - start, min(e, end) - start) for s, e in spans if s < end and e > start]


def encode_segment(text: str, spans: Sequence[Span], encode, encode_inside, control_ids: set[int]) -> list[int]:
    """A plain segment (between markup tokens) that holds literal spans: `encode` it whole, as
    the backend encodes text; where the subword model rebuilt a control token out of a user's
    text (a vocabulary whose merges reach one), each literal character is encoded on its own
    (`encode_inside`: no leading-space prefix), so none can be. Never a control id from a span."""
    ids = encode(text)
    if control_ids.isdisjoint(ids):
        return ids
    cuts = sorted({c for s, e in spans for c in range(s, e + 1)} | {0, len(text)})
    ids = []
    for start, end in zip(cuts, cuts[1:]):
        piece = (encode if start == 0 else encode_inside)(text[start:end]) if end > start else []
        if overlaps(start, end, spans) and not control_ids.isdisjoint(piece):
            raise MlxcelError(
                f"the tokenizer encodes the character {text[start:end]!r} as a control token, so the user's text "
                "cannot stay text; drop it from the message, or set template.special_tokens_in_content=special"
            )
        ids += piece
    return ids
