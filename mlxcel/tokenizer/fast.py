"""MlxcelTokenizer over a `tokenizers.Tokenizer`: shared by the hf and gguf backends."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, processors

from mlxcel.tokenizer.literal import Span, encode_segment, overlaps, spans_within


class FastTokenizer:
    """A `tokenizers.Tokenizer` plus the metadata its file format keeps beside it.

    Whether encode() adds bos/eos is decided by the backend tokenizer's post-processor; the
    loaders set that up to match transformers, and `add_bos_token` reports what it does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: str,
        bos_token: str | None = None,
        eos_tokens: list[str] | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_templates: dict[str, str] | None = None,
        eos_token_ids: list[int] | None = None,
        bos_token_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.backend = backend
        # Named templates ("default", "tool_use", ...); chat_template is the default one.
        self.chat_templates = dict(chat_templates or {})
        self.chat_template = self.chat_templates.get("default", next(iter(self.chat_templates.values()), None))
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.unk_token = unk_token
        self.pad_token = pad_token
        # Explicit ids (GGUF metadata) win over a string lookup, which a duplicated string would fool.
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._lookup(bos_token)
        ids = eos_token_ids if eos_token_ids is not None else [self._lookup(t) for t in eos_tokens or []]
        self.eos_token_ids = list(dict.fromkeys(i for i in ids if i is not None))
        added = tokenizer.get_added_tokens_decoder().items()
        self.special_tokens = {t.content: i for i, t in added}
        # the special ones (not Qwen3's <think> nor a GGUF's user-defined pieces): a user's text of
        # one stays text (encode's literal_spans)
        self.control_tokens = {t.content: i for i, t in added if t.special}
        self._control_ids = set(self.control_tokens.values())
        self._literal_tokenizers: dict[str, Tokenizer] = {}
        self._added_around: tuple[list[int], list[int]] | None = None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Ask the post-processor rather than trusting a config flag: it is what encode() runs.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True, literal_spans: Sequence[Span] = ()) -> list[int]:
        """`literal_spans`: where a special token's text is text (a user's, mlxcel/tokenizer/literal.py)."""
        if not literal_spans:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.encode_literal(text, sorted(literal_spans))
        if add_special_tokens:
            head, tail = self.find_added_around()
            ids = head + ids + tail
        return ids

    def encode_literal(self, text: str, spans: list[Span]) -> list[int]:
        """The text as encode() cuts it at special tokens, less those that meet a span: the
        segments between the rest go, whole, to a copy of the tokenizer that matches no special
        token (`encode_special_tokens`, transformers' split_special_tokens), so they tokenize as
        they would in the whole text (normalizer, pre-tokenizer and model run per segment there
        too; only a Metaspace `prepend_scheme: first` looks at where a segment starts)."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        found = [(s, e, i) for i, (s, e) in zip(encoding.ids, encoding.offsets) if i in self._control_ids]
        markup = [(s, e, i) for s, e, i in found if not overlaps(s, e, spans)]
        if len(markup) == len(found):  # no special token met a span
            return encoding.ids
        ids: list[int] = []
        pos = 0
        for start, end, token in [*markup, (len(text), len(text), None)]:
            if start > pos:  # (a token's offsets cover the whitespace its lstrip/rstrip took)
                where = "first" if pos == 0 else "next"
                ids += encode_segment(
                    text[pos:start],
                    spans_within(pos, start, spans),
                    lambda t, where=where: self.literal_tokenizer(where).encode(t, add_special_tokens=False).ids,
                    lambda t: self.literal_tokenizer("inside").encode(t, add_special_tokens=False).ids,
                    self._control_ids,
                )
            if token is not None:
                ids.append(token)
            pos = max(pos, end)
        return ids

    def literal_tokenizer(self, where: str) -> Tokenizer:
        """A copy that matches no special token, for a segment that starts the text ("first"),
        follows a special token ("next": Metaspace's prepend_scheme first -> never), or continues
        one ("inside": no prepended space at all). Built on first use."""
        if where not in self._literal_tokenizers:
            data = json.loads(self.tokenizer.to_str())
            changed = dict(data)
            if where != "first":
                schemes = {"first": "never", "always": "never"} if where == "inside" else {"first": "never"}
                changed["pre_tokenizer"] = set_prepend_schemes(data.get("pre_tokenizer"), schemes)
            if where == "inside":
                changed["normalizer"] = drop_prepend_normalizers(data.get("normalizer"))
            if where != "first" and changed == data:  # (byte-level BPE: one copy serves all three)
                self._literal_tokenizers[where] = self.literal_tokenizer("first")
            else:
                copy = Tokenizer.from_str(json.dumps(changed))
                copy.encode_special_tokens = True
                copy.no_truncation()
                copy.no_padding()
                self._literal_tokenizers[where] = copy
        return self._literal_tokenizers[where]

    def find_added_around(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (bos, eos)."""
        if self._added_around is None:
            plain = self.tokenizer.encode("a", add_special_tokens=False).ids
            full = self.tokenizer.encode("a", add_special_tokens=True).ids
            at = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), 0)
            self._added_around = (full[:at], full[at + len(plain) :])
        return self._added_around

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"FastTokenizer(backend={self.backend!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r})"
        )


def set_prepend_schemes(pre_tokenizer: Any, schemes: dict[str, str]) -> Any:
    """A pre-tokenizer's JSON with its Metaspace prepend schemes mapped (inside Sequences too)."""
    if isinstance(pre_tokenizer, dict):
        if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") in schemes:
            return {**pre_tokenizer, "prepend_scheme": schemes[pre_tokenizer["prepend_scheme"]]}
        if isinstance(pre_tokenizer.get("pretokenizers"), list):
            inner = [set_prepend_schemes(p, schemes) for p in pre_tokenizer["pretokenizers"]]
            return {**pre_tokenizer, "pretokenizers": inner}
    return pre_tokenizer


def drop_prepend_normalizers(normalizer: Any) -> Any:
    """A normalizer's JSON without its Prepend steps (Llama's legacy "▁" before every segment)."""
    if isinstance(normalizer, dict):
        if normalizer.get("type") == "Prepend":
            return None
        if isinstance(normalizer.get("normalizers"), list):
            kept = [drop_prepend_normalizers(n) for n in normalizer["normalizers"]]
            return {**normalizer, "normalizers": [n for n in kept if n is not None]}
    return normalizer


def make_post_processor(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`[bos] $A [eos]`, either optional (transformers' `update_post_processor` does the same)."""
    bos_id = tokenizer.token_to_id(bos) if bos is not None else None
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    bos = bos if bos_id is not None else None
    eos = eos if eos_id is not None else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
