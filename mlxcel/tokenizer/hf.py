"""HF tokenizer folders: tokenizer.json + tokenizer_config.json (+ chat_template.jinja).

encode() adds bos/eos exactly when transformers 5's `AutoTokenizer` does for the folder: when a
tokenizer.json exists, transformers drops `add_bos_token`/`add_eos_token` from the config
(`_from_pretrained`) and tokenizer.json's post-processor alone decides. So we use that file as
is and read the flags nowhere. (transformers 4's LlamaTokenizerFast applied the flags; v5 not.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.fast import FastTokenizer

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_hf_tokenizer(folder: Path) -> FastTokenizer:
    """Build the tokenizer of an HF model folder (the file `tokenizer.json` must exist)."""
    path = folder / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise MlxcelError(f"{path}: cannot read the tokenizer ({exc})") from exc
    config = load_tokenizer_config(folder)
    apply_config_added_tokens(tokenizer, config)
    bos = read_token_string(config.get("bos_token"))
    eos = read_token_strings(config.get("eos_token"))
    return FastTokenizer(
        tokenizer,
        backend="hf",
        bos_token=bos,
        eos_tokens=eos,
        unk_token=read_token_string(config.get("unk_token")),
        pad_token=read_token_string(config.get("pad_token")),
        chat_templates=load_chat_templates(folder, config),
    )


def load_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json filling named tokens it lacks."""
    config = read_json(folder / "tokenizer_config.json")
    for name, value in read_json(folder / "special_tokens_map.json").items():
        config.setdefault(name, value)
    return config


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MlxcelError(f"{path}: cannot read JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def read_token_string(value: Any) -> str | None:
    """A token given as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_token_strings(value: Any) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [s for s in (read_token_string(v) for v in values) if s is not None]


def make_added_token(value: Any, special: bool) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        fields.setdefault("special", special)
        return AddedToken(value["content"], **fields)
    return None


def apply_config_added_tokens(tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    """Add the tokens the config names that tokenizer.json does not have as added tokens.

    transformers does the same on load: `added_tokens_decoder` entries, then named special
    tokens (a named token already in the base vocabulary becomes an added token at its id, so it
    is matched whole in text and dropped by skip_special_tokens).
    """
    present = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder") or {}
    wanted: list[AddedToken] = []
    for _, value in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        token = make_added_token(value, special=bool(isinstance(value, dict) and value.get("special")))
        if token is not None and token.content not in present:
            wanted.append(token)
    named = [config.get(name) for name in _NAMED_SPECIALS]
    named += list(config.get("additional_special_tokens") or []) + list(config.get("extra_special_tokens") or [])
    for value in named:
        token = make_added_token(value, special=True)
        if token is not None and token.content not in present | {t.content for t in wanted}:
            token.special = True
            wanted.append(token)
    if wanted:
        tokenizer.add_tokens(wanted)


def load_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """Every template of the folder by name ("default" for the unnamed one).

    As in transformers: the config's `chat_template` (a string, or named templates
    [{"name", "template"}]), overridden by chat_template.json, overridden by chat_template.jinja;
    additional_chat_templates/NAME.jinja adds NAME.
    """
    templates = read_named_templates(config.get("chat_template"))
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        templates.update(read_named_templates(read_json(json_file).get("chat_template")))
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    for path in sorted(extra.glob("*.jinja")) if extra.is_dir() else ():
        templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def read_named_templates(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        pairs = (t for t in value if isinstance(t, dict))
        return {
            t["name"]: t["template"]
            for t in pairs
            if isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if isinstance(v, str)}
    return {}
