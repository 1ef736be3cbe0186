"""GGUF tokenizers: rebuild a `tokenizers.Tokenizer` from llama.cpp's metadata keys.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the pre-tokenizer regexes come from
llama.cpp's llama-vocab.cpp (keyed by `tokenizer.ggml.pre`), since llama.cpp is what wrote these
files and the model was trained with the matching split. SentencePiece vocabularies
(`"llama"`: pieces, scores, types) are rebuilt into a SentencePiece model and run by the
sentencepiece backend, as llama.cpp's SPM tokenizer mirrors SentencePiece on plain text; what
llama.cpp does around it is done here: control, unknown and user-defined pieces are cut out of the
raw text first, longest first, and no extra whitespace is removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.fast import FastTokenizer, make_post_processor
from mlxcel.tokenizer.sentencepiece import SentencePieceTokenizer, load_processor
from mlxcel.tokenizer.spm_proto import CONTROL, UNKNOWN, USER_DEFINED, make_spm_model

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5: Qwen2's split with combining marks kept in words and out of punctuation runs
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gpt-oss (o200k): cased words split where the case changes, contractions kept on their word, digits in threes
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (each splits the pieces of the last).
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "deepseek-r1-qwen": (_QWEN2,),
    "megrez": (_QWEN2,),
    "gpt-4o": (_O200K,),  # llama.cpp's GPT4O: the original tokenizer.json regex
    "llama4": (_O200K,),  # (llama.cpp splits Llama 4's as GPT4O)
    "glm4": (_LLAMA3,),  # llama.cpp's CHATGLM4: Llama 3's split, no BOS by default, merges applied
    "chatglm-bpe": (_LLAMA3,),
}
# llama.cpp defaults for files that lack the add_bos key: llama3-style vocabularies add bos.
_ADDS_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3"}
# llama.cpp takes a whole pre-token that is in the vocabulary as is, before any merge.
_IGNORES_MERGES = _ADDS_BOS_BY_DEFAULT


def load_gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's metadata from its header alone: no weights are mapped, so files whose tensor
    types MLX cannot read (K-quants) still give their tokenizer, and a dry run stays fast."""
    from mlxcel.checkpoints.gguf_reader import read_gguf_header

    try:
        metadata, _ = read_gguf_header(path)
    except MlxcelError:
        raise
    except Exception as exc:
        raise MlxcelError(f"{path}: cannot read GGUF metadata ({exc})") from exc
    return metadata


def read_value(value: Any) -> Any:
    """mx.load gives integers as 0-d arrays and number lists as arrays: make them Python."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def load_gguf_tokenizer(path: Path, metadata: dict[str, Any] | None = None) -> FastTokenizer | SentencePieceTokenizer:
    from mlxcel.checkpoints.gguf import mark_unknown_token

    meta = mark_unknown_token(metadata if metadata is not None else load_gguf_metadata(path))

    def get(key: str, default: Any = None) -> Any:
        return read_value(meta[key]) if key in meta else default

    model = get("tokenizer.ggml.model")
    if model is None:
        raise MlxcelError(f"{path}: the GGUF has no tokenizer (no tokenizer.ggml.model key)")
    if model == "llama":
        return load_gguf_spm(path, get, read_gguf_templates(meta))
    if model != "gpt2":
        raise MlxcelError(
            f"{path}: GGUF tokenizer.ggml.model={model!r} is not supported yet; 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece) are; give the model folder's own tokenizer with tokenizer.path=..."
        )
    tokens: list[str] = list(get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = get("tokenizer.ggml.pre") or "default"
    tokenizer = make_byte_level_bpe(tokens, types, list(get("tokenizer.ggml.merges") or []), pre, path)

    def token_at(key: str) -> str | None:
        i = get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    add_bos = bool(get("tokenizer.ggml.add_bos_token", pre in _ADDS_BOS_BY_DEFAULT))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = make_post_processor(tokenizer, bos if add_bos else None, eos if add_eos else None)
    # End-of-turn / end-of-message ids also end generation in llama.cpp.
    eos_ids = [
        get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    result = FastTokenizer(
        tokenizer,
        backend="gguf",
        bos_token=bos,
        eos_tokens=[eos] if eos is not None else [],
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        chat_templates=read_gguf_templates(meta),
        eos_token_ids=[i for i in eos_ids if isinstance(i, int)],
        bos_token_id=get("tokenizer.ggml.bos_token_id") if bos is not None else None,
    )
    result.vocab_size = max(result.vocab_size, len(tokens))  # duplicate strings still own an id
    return result


def read_gguf_templates(meta: dict[str, Any]) -> dict[str, str]:
    """tokenizer.chat_template (default) and tokenizer.chat_template.NAME (named, e.g. tool_use)."""
    prefix = "tokenizer.chat_template"
    templates = {}
    for key, value in meta.items():
        if key == prefix or key.startswith(prefix + "."):
            value = read_value(value)
            if isinstance(value, str):
                templates["default" if key == prefix else key[len(prefix) + 1 :]] = value
    return templates


def load_gguf_spm(path: Path, get: Any, templates: dict[str, str]) -> SentencePieceTokenizer:
    tokens: list[str] = list(get("tokenizer.ggml.tokens") or [])
    scores: list[float] = list(get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types: list[int] = list(get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or len(scores) != len(tokens) or len(types) != len(tokens):
        raise MlxcelError(
            f"{path}: GGUF llama vocabulary is inconsistent ({len(tokens)} tokens, {len(scores)} scores, {len(types)} "
            "types)"
        )
    if UNKNOWN not in types:
        raise MlxcelError(f"{path}: GGUF llama vocabulary has no unknown token (token_type 2); SentencePiece needs one")
    # llama.cpp's SPM path never collapses whitespace (tokenizer.ggml.remove_extra_whitespaces is
    # read for T5's UGM vocabularies only).
    data = make_spm_model(
        list(zip(tokens, scores, types)), add_dummy_prefix=bool(get("tokenizer.ggml.add_space_prefix", True))
    )
    processor = load_processor(data, path)
    # llama.cpp cuts these out of the raw text before its merges, user-defined pieces even when it
    # does not parse special tokens: Gemma's runs of spaces (respelled from ▁▁.. by its converter,
    # so SentencePiece, which sees ▁, could never match them), tabs, newlines and HTML tags.
    whole: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            whole.setdefault(token, i)
    user_defined = {token for token, kind in zip(tokens, types) if kind == USER_DEFINED}

    def id_at(key: str) -> int | None:
        i = get(key)
        return i if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos_id = id_at("tokenizer.ggml.bos_token_id")
    eos_ids = [
        id_at(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    eos_ids = [i for i in eos_ids if i is not None]
    pad_id = id_at("tokenizer.ggml.padding_token_id")
    return SentencePieceTokenizer(
        processor,
        backend="gguf",
        added=whole,
        non_special=user_defined,  # plain text: skip_special_tokens keeps them, as llama.cpp
        split_order="longest-first",
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_tokens=[tokens[i] for i in eos_ids],
        add_bos=bool(get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's SPM default
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        legacy=True,  # llama.cpp puts the space prefix after every special token
        chat_templates=templates,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        pad_token=tokens[pad_id] if pad_id is not None else None,
    )


def split_merge(merge: str) -> tuple[str, str]:
    # Like llama.cpp: the separator is the first space after the first character.
    pos = merge.find(" ", 1)
    return (merge[:pos], merge[pos + 1 :]) if pos > 0 else (merge, "")


def make_byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str, path: Path) -> Tokenizer:
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise MlxcelError(
            f"{path}: GGUF tokenizer.ggml.pre={pre!r} is not supported yet; known: "
            f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))}"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [split_merge(m) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORES_MERGES)
    tokenizer = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the text, as llama.cpp does; they keep
    # their ids because their text is already a vocabulary key.
    added = [
        AddedToken(token, special=kind == CONTROL, normalized=False)
        for token, kind in zip(tokens, types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    if added:
        tokenizer.add_tokens(added)
    return tokenizer
