"""tiktoken tokenizers: a `*.tiktoken` ranks file read from the folder, never downloaded.

The split pattern and special tokens come from tokenizer_config.json (`pattern` or `pat_str`;
`special_tokens` as content -> id, `added_tokens_decoder` as id -> token) and, where the config
lacks them, from a known preset picked by the ranks file's name and size (cl100k_base,
o200k_base, Qwen, Qwen3.5/3.6). Special tokens in the text are matched whole (tiktoken's
allowed_special="all"), as HF tokenizers match added tokens.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.hf import (
    load_chat_templates,
    load_tokenizer_config,
    read_token_string,
    read_token_strings,
)
from mlxcel.tokenizer.literal import Span, overlaps
from mlxcel.tokenizer.sentencepiece import pick_default_template

_CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""  # noqa: E501 (verbatim, as published)
_O200K_PATTERN = (  # tiktoken's o200k_base, its seven alternatives one per line
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n/]*"""
    r"""|\s*[\r\n]+"""
    r"""|\s+(?!\S)"""
    r"""|\s+"""
)
_QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (verbatim, as published)
_QWEN35_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (verbatim, as published)
# Qwen's added tokens that its tokenizer_config.json marks "special": false (Qwen2.5 to 3.6):
# matched whole in any text, a user's too, as transformers does (a template splits content at </think>).
_QWEN_PLAIN = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


_QWEN35_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    *_QWEN_PLAIN,
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
]


@dataclass(frozen=True)
class Preset:
    pattern: str
    special_tokens: dict[str, int]
    ranks: int  # the ranks file must have this many entries for the preset to apply
    eos_tokens: tuple[str, ...] = ()
    normalization: str | None = None  # Qwen's tokenizer NFC-normalizes the text first
    names: tuple[str, ...] = field(default=())
    plain: tuple[str, ...] = ()  # special tokens that are not control tokens (_QWEN_PLAIN)


def make_presets() -> list[Preset]:
    qwen = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
    cl100k = {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    }
    return [
        Preset(_CL100K_PATTERN, cl100k, 100256, ("<|endoftext|>",), names=("cl100k_base",)),
        Preset(
            _O200K_PATTERN,
            {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
            199998,
            ("<|endoftext|>",),
            names=("o200k_base",),
        ),
        Preset(
            _QWEN_PATTERN,
            {t: 151643 + i for i, t in enumerate(qwen)},
            151643,
            ("<|endoftext|>", "<|im_end|>"),
            "NFC",
            ("qwen",),
        ),
        Preset(
            _QWEN35_PATTERN,
            {t: 248044 + i for i, t in enumerate(_QWEN35_SPECIALS)},
            248044,
            ("<|endoftext|>", "<|im_end|>"),
            "NFC",
            ("qwen3_5", "qwen3_6"),
            _QWEN_PLAIN,
        ),
    ]


PRESETS = make_presets()


def find_preset(path: Path, ranks: int) -> Preset | None:
    """The preset named by the file (qwen.tiktoken, cl100k_base.tiktoken, ...), else the one of this size."""
    named = [p for p in PRESETS if path.stem in p.names and p.ranks == ranks]
    sized = [p for p in PRESETS if p.ranks == ranks]
    return (named or sized or [None])[0]


class TiktokenTokenizer:
    def __init__(
        self,
        encoding: tiktoken.Encoding,
        eos_tokens: list[str],
        bos_token: str | None = None,
        add_bos: bool = False,
        normalization: str | None = None,
        chat_templates: dict[str, str] | None = None,
        pad_token: str | None = None,
        plain_tokens: set[str] | None = None,
    ):
        self.encoding = encoding
        self.backend = "tiktoken"
        self.normalization = normalization
        self.special_tokens = dict(encoding._special_tokens)
        # the control ones (not Qwen's <think>, _QWEN_PLAIN): a user's text of one stays text (literal_spans)
        self.control_tokens = {t: i for t, i in self.special_tokens.items() if t not in (plain_tokens or set())}
        # tiktoken's split at special tokens, for encode's literal_spans (longest first where two start together)
        by_length = sorted(self.special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._special_ids = set(self.special_tokens.values())
        self._special_text = {i: t for t, i in self.special_tokens.items()}
        self.vocab_size = encoding.max_token_value + 1
        # ids with no token (gaps between ranks and specials) are dropped by decode, as HF does
        self._known_ids = set(encoding._mergeable_ranks.values()) | self._special_ids
        self.bos_token = bos_token
        self.bos_token_id = self._lookup(bos_token)
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.eos_token_ids = list(dict.fromkeys(i for i in map(self._lookup, eos_tokens) if i is not None))
        self.add_bos_token = add_bos and self.bos_token_id is not None
        self.unk_token = None
        self.pad_token = pad_token
        self.chat_templates = dict(chat_templates or {})
        self.chat_template = pick_default_template(self.chat_templates)

    def _lookup(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self.special_tokens:
            return self.special_tokens[token]
        ids = self.encoding.encode_ordinary(token)
        return ids[0] if len(ids) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = True, literal_spans: Sequence[Span] = ()) -> list[int]:
        """`literal_spans`: where a special token's text is text (a user's, mlxcel/tokenizer/literal.py)."""
        if literal_spans:
            ids = self.encode_literal(text, sorted(literal_spans))
        else:
            if self.normalization:
                text = unicodedata.normalize(self.normalization, text)
            ids = self.encoding.encode(text, allowed_special="all")
        return [self.bos_token_id] + ids if add_special_tokens and self.add_bos_token else ids

    def encode_literal(self, text: str, spans: list[Span]) -> list[int]:
        """encode() with the special tokens that meet a span left as text: tiktoken's own loop for
        a disallowed special (look again one character on), with encode_ordinary between."""
        if self.normalization:  # each piece on its own, so the spans still point at the token texts
            cuts = sorted({0, len(text), *(c for span in spans for c in span)})
            pieces = [unicodedata.normalize(self.normalization, text[a:b]) for a, b in zip(cuts, cuts[1:])]
            ends = dict(zip(cuts[1:], itertools.accumulate(map(len, pieces))))
            starts = {a: ends.get(a, 0) for a in cuts}
            text, spans = "".join(pieces), [(starts[s], ends[e]) for s, e in spans]
        ids: list[int] = []
        start = search = 0
        while self._special_pattern is not None and (match := self._special_pattern.search(text, search)):
            if match.group() in self.control_tokens and overlaps(match.start(), match.end(), spans):
                search = match.start() + 1
                continue
            ids += self.encoding.encode_ordinary(text[start : match.start()])
            ids.append(self.special_tokens[match.group()])
            start = search = match.end()
        return ids + self.encoding.encode_ordinary(text[start:])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = [i for i in map(int, ids) if i in self._known_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.encoding.decode(ids, errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_text:
            return self._special_text[token_id]
        try:
            return self.encoding.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")
        except KeyError:
            return None

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def load_ranks(path: Path) -> dict[bytes, int]:
    """`base64-token rank` per line, as tiktoken writes it (read here: tiktoken's loader may fetch URLs)."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise MlxcelError(f"{path}: cannot read ({exc})") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise MlxcelError(
                f"{path}: line {number} is not 'base64-token rank' ({line[:40]!r}); the ranks file is corrupt or not a "
                ".tiktoken file"
            ) from exc
    if not ranks:
        raise MlxcelError(f"{path}: the ranks file is empty")
    return ranks


def read_config_plain_tokens(config: dict) -> set[str]:
    """The added_tokens_decoder entries marked "special": false."""
    decoder = (config.get("added_tokens_decoder") or {}).values()
    return {v["content"] for v in decoder if isinstance(v, dict) and v.get("special") is False and "content" in v}


def read_config_specials(config: dict) -> dict[str, int]:
    specials = {
        t: i for t, i in (config.get("special_tokens") or {}).items() if isinstance(t, str) and isinstance(i, int)
    }
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        content = read_token_string(value)
        if content is not None and str(key).isdigit():
            specials[content] = int(key)
    return specials


def find_ranks_file(folder: Path) -> Path:
    found = sorted(folder.glob("*.tiktoken"))
    if not found and (folder / "tokenizer.model").is_file():
        return folder / "tokenizer.model"  # Llama 3's original folders: tiktoken ranks under this name
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise MlxcelError(f"tokenizer.kind=tiktoken: need exactly one *.tiktoken file in {folder} (found {names})")
    return found[0]


def load_tiktoken_tokenizer(folder: Path) -> TiktokenTokenizer:
    path = find_ranks_file(folder)
    ranks = load_ranks(path)
    config = load_tokenizer_config(folder)
    preset = find_preset(path, len(ranks))
    pattern = config.get("pattern") or config.get("pat_str") or (preset.pattern if preset else None)
    specials = read_config_specials(config)
    plain = read_config_plain_tokens(config) if specials else set(preset.plain if preset else ())
    specials = specials or (dict(preset.special_tokens) if preset else {})
    if pattern is None:
        known = ", ".join(f"{p.names[0]} ({p.ranks} ranks)" for p in PRESETS)
        raise MlxcelError(
            f"{path}: no split pattern for these {len(ranks)} ranks: tokenizer_config.json has no 'pattern' (or "
            "'pat_str') "
            f'and no known preset matches (known: {known}); add the model\'s regex as "pattern" to '
            f"{folder / 'tokenizer_config.json'}"
        )
    used = set(ranks.values())
    clashes = sorted(t for t, i in specials.items() if i in used)
    if clashes:
        raise MlxcelError(
            f"{path}: special token ids collide with ranks ({', '.join(clashes[:5])}); check the config's special "
            "tokens"
        )
    try:
        encoding = tiktoken.Encoding(path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as exc:  # a bad regex or inconsistent ranks
        raise MlxcelError(f"{path}: tiktoken rejected the vocabulary ({exc})") from exc
    eos = read_token_strings(config.get("eos_token")) or list(preset.eos_tokens if preset else [])
    normalization = config.get("normalization", preset.normalization if preset else None)
    return TiktokenTokenizer(
        encoding,
        eos_tokens=eos,
        bos_token=read_token_string(config.get("bos_token")),
        add_bos=bool(config.get("add_bos_token", False)),
        normalization=normalization,
        chat_templates=load_chat_templates(folder, config),
        pad_token=read_token_string(config.get("pad_token")),
        plain_tokens=plain,
    )
