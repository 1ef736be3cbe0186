"""SentencePiece tokenizers: `tokenizer.model` (+ tokenizer_config.json), also GGUF `llama` vocabularies.

Special tokens (the model's control pieces, the config's added and named tokens) are matched in
the text first, leftmost-longest as transformers does; only the text between them reaches
SentencePiece (docs/design.md, stage 1), so ids equal `SentencePieceProcessor.encode` on text without
special tokens. GGUF vocabularies also cut out their user-defined pieces, longest first, as
llama.cpp does (see gguf.py and whole_tokens.py).

SentencePiece adds a dummy-prefix space to every text it encodes. After a special token, the
config's `legacy` flag decides as in transformers: `legacy: false` encodes the following text
without that space (Metaspace prepend_scheme "first"); true or absent keeps it, as llama.cpp and
mistral-common do (each piece of text encoded on its own). decode() strips the dummy space
exactly where encode() added one, so decode(encode(x)) == x.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.hf import (
    load_chat_templates,
    load_tokenizer_config,
    read_json,
    read_token_string,
    read_token_strings,
)
from mlxcel.tokenizer.literal import Span, encode_segment, overlaps, spans_within
from mlxcel.tokenizer.spm_proto import write_field
from mlxcel.tokenizer.whole_tokens import WholeTokenSplitter

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_DUMMY = "▁"


class SentencePieceTokenizer:
    def __init__(
        self,
        processor: spm.SentencePieceProcessor,
        backend: str,
        added: dict[str, int] | None = None,
        non_special: set[str] | None = None,
        bos_token: str | None = None,
        eos_tokens: list[str] | None = None,
        add_bos: bool = True,
        add_eos: bool = False,
        legacy: bool = True,
        chat_templates: dict[str, str] | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        split_order: str = "leftmost-longest",
    ):
        self.sp = processor
        self._sp_no_prefix: spm.SentencePieceProcessor | None = None
        self.backend = backend
        self.legacy = legacy
        size = processor.get_piece_size()
        control = {processor.id_to_piece(i): i for i in range(size) if processor.is_control(i)}
        # Matched whole in the text: control pieces (SentencePiece never produces them from text)
        # and the caller's (`added`: a config's tokens, a GGUF's user-defined pieces); a folder's
        # user-defined pieces are left to SentencePiece, which keeps them whole.
        self.special_tokens = {**control, **(added or {})}
        self._whole_ids = set(self.special_tokens.values())  # ids matched before SentencePiece
        # skip_special_tokens drops all but the added tokens marked special=false (as transformers)
        self._skipped_ids = {i for t, i in self.special_tokens.items() if t not in (non_special or set())}
        # the special ones among them: a user's text of one stays text (encode's literal_spans)
        self.control_tokens = {t: i for t, i in self.special_tokens.items() if i in self._skipped_ids}
        self._added_text = {i: t for t, i in self.special_tokens.items()}
        self._splitter = WholeTokenSplitter(self.special_tokens, split_order)
        self.vocab_size = max([size - 1, *self.special_tokens.values()]) + 1
        self.bos_token = bos_token if bos_token is not None else piece_or_none(processor, processor.bos_id())
        eos_tokens = eos_tokens or [t for t in [piece_or_none(processor, processor.eos_id())] if t is not None]
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.unk_token = unk_token if unk_token is not None else piece_or_none(processor, processor.unk_id())
        self.pad_token = pad_token
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._lookup(self.bos_token)
        ids = eos_token_ids if eos_token_ids is not None else [self._lookup(t) for t in eos_tokens]
        self.eos_token_ids = list(dict.fromkeys(i for i in ids if i is not None))
        self.add_bos_token = add_bos and self.bos_token_id is not None
        eos_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._add_eos_id = eos_id if add_eos else None
        self.chat_templates = dict(chat_templates or {})
        self.chat_template = pick_default_template(self.chat_templates)

    def _lookup(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self.special_tokens:
            return self.special_tokens[token]
        i = self.sp.piece_to_id(token)
        return i if i != self.sp.unk_id() or token == self.unk_token else None

    def encode(self, text: str, add_special_tokens: bool = True, literal_spans: Sequence[Span] = ()) -> list[int]:
        """`literal_spans`: where a control token's text is text (a user's, mlxcel/tokenizer/literal.py)."""
        spans = sorted(literal_spans)
        is_text = (lambda start, end, i: i in self._skipped_ids and overlaps(start, end, spans)) if spans else None
        ids: list[int] = []
        pos = 0
        for index, (part, special_id) in enumerate(self._splitter.split(text, is_text)):
            if special_id is not None:
                ids.append(special_id)
            else:
                encode = self.sp.encode if index == 0 or self.legacy else self.encode_without_prefix
                inside = spans_within(pos, pos + len(part), spans)
                if inside:
                    ids += encode_segment(part, inside, encode, self.encode_without_prefix, self._skipped_ids)
                else:
                    ids += encode(part)
            pos += len(part)
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.add_bos_token else []) + ids
            ids += [self._add_eos_id] if self._add_eos_id is not None else []
        return ids

    def encode_without_prefix(self, text: str) -> list[int]:
        """SentencePiece without its dummy-prefix space (a second processor, built on first use)."""
        if self._sp_no_prefix is None:
            self._sp_no_prefix = load_processor(
                without_dummy_prefix(self.sp.serialized_model_proto()), "SentencePiece model"
            )
        return self._sp_no_prefix.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As transformers: one dummy space goes at the start of the output (before any piece or
        special token text); with legacy, also after each special token (where encode() added
        one). Skipped special tokens count as nothing, so window decodes of a stream agree."""
        out: list[str] = []
        run: list[int] = []
        run_after_special = prev_special = False
        seen_run = []  # a run of pieces came before (even one that decoded to nothing)

        def flush() -> None:
            if run:
                text = self.sp.decode(run)  # drops the first piece's leading space
                strips = (not seen_run and not any(out)) or (self.legacy and run_after_special)
                seen_run.append(True)
                if not strips and self.sp.id_to_piece(run[0]).startswith(_DUMMY):
                    text = " " + text
                out.append(text)
                run.clear()

        for i in map(int, ids):
            if i in self._whole_ids or i >= self.sp.get_piece_size():
                flush()
                if i in self._added_text and not (skip_special_tokens and i in self._skipped_ids):
                    out.append(self._added_text[i])
                prev_special = True
            elif i >= 0:
                run_after_special = prev_special if not run else run_after_special
                run.append(i)
                prev_special = False
        flush()
        return "".join(out)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added_text:
            return self._added_text[token_id]
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.sp.get_piece_size() else None

    def __repr__(self) -> str:
        return (
            f"SentencePieceTokenizer(backend={self.backend!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r})"
        )


def without_dummy_prefix(model: bytes) -> bytes:
    # A second normalizer_spec (field 3) merges into the first: protobuf's rule for a repeated
    # singular message field, so this sets add_dummy_prefix=false and keeps the rest.
    return model + write_field(3, write_field(3, False))


def piece_or_none(processor: spm.SentencePieceProcessor, i: int) -> str | None:
    return processor.id_to_piece(i) if 0 <= i < processor.get_piece_size() else None


def pick_default_template(templates: dict[str, str]) -> str | None:
    return templates.get("default", next(iter(templates.values()), None))


def load_processor(data: bytes, origin: Path | str) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except Exception as exc:  # sentencepiece raises a bare RuntimeError/OSError on bad bytes
        raise MlxcelError(
            f"{origin}: cannot read the SentencePiece model ({exc}); the file is corrupt or not a .model file"
        ) from exc
    if processor.get_piece_size() == 0:
        raise MlxcelError(f"{origin}: the SentencePiece model has no pieces")
    return processor


def read_added_tokens(folder: Path, config: dict) -> tuple[dict[str, int], set[str]]:
    """added_tokens.json and the config's added_tokens_decoder: content -> id, and the contents
    marked special=false (added_tokens.json has no flag: not special, as in transformers)."""
    added = {t: i for t, i in read_json(folder / "added_tokens.json").items() if isinstance(i, int)}
    non_special = set(added)
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        content = read_token_string(value)
        if content is not None and str(key).isdigit():
            added[content] = int(key)
            special = isinstance(value, dict) and bool(value.get("special", False))
            (non_special.discard if special else non_special.add)(content)
    return added, non_special


def load_sentencepiece_tokenizer(folder: Path) -> SentencePieceTokenizer:
    path = folder / "tokenizer.model"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise MlxcelError(f"{path}: cannot read ({exc})") from exc
    processor = load_processor(data, path)
    config = load_tokenizer_config(folder)
    added, non_special = read_added_tokens(folder, config)
    # Named specials the vocabulary has as ordinary pieces are matched whole too (as transformers).
    named = [read_token_string(config.get(n)) for n in _NAMED_SPECIALS]
    named += read_token_strings(config.get("additional_special_tokens")) + read_token_strings(
        config.get("extra_special_tokens")
    )
    for token in filter(None, named):
        i = added.get(token, processor.piece_to_id(token))
        if token not in added and (i != processor.unk_id() or token == piece_or_none(processor, processor.unk_id())):
            added[token] = i
        non_special.discard(token)  # named tokens are special
    return SentencePieceTokenizer(
        processor,
        backend="sentencepiece",
        added=added,
        non_special=non_special,
        bos_token=read_token_string(config.get("bos_token")),
        eos_tokens=read_token_strings(config.get("eos_token")),
        add_bos=bool(config.get("add_bos_token", True)),
        add_eos=bool(config.get("add_eos_token", False)),
        legacy=bool(config.get("legacy", True)),
        chat_templates=load_chat_templates(folder, config),
        unk_token=read_token_string(config.get("unk_token")),
        pad_token=read_token_string(config.get("pad_token")),
    )
