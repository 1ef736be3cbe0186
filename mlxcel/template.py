"""Chat templates: choose the template, render it as transformers does, find the history boundary.

Rendering follows transformers' `apply_chat_template` (Jinja2 sandbox with trim_blocks and
lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`, `{% generation %}` and loop
controls; the tokenizer's special-token strings as variables), so templates written for HF
behave the same. A rendered prompt is encoded without added special tokens: the template
writes bos itself where the model wants it (transformers does the same with tokenize=True).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.base import MlxcelTokenizer

_NO_TEMPLATE_HINT = "set template=none for a raw completion, or give one with template.text=... or template.file=..."
_TEMPLATE_VARS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateSource(str):
    """A template string that remembers where it came from, for error messages."""

    origin: str = "chat template"

    def __new__(cls, text: str, origin: str) -> TemplateSource:
        source = super().__new__(cls, text)
        source.origin = origin
        return source


@dataclass(frozen=True)
class PromptTokens:
    text: str
    token_ids: list[int]
    history_tokens: int  # leading ids that encode the messages without the generation prompt


def load_template_source(tokenizer: MlxcelTokenizer, text: str | None = None, file: str | Path | None = None) -> str | None:
    """The template to render: an override string, else an override file, else the tokenizer's."""
    if text is not None and file is not None:
        raise MlxcelError("template.text and template.file are both set; set only one")
    if text is not None:
        return TemplateSource(text, "template.text")
    if file is not None:
        path = Path(file).expanduser()
        if not path.is_file():
            raise MlxcelError(f"template.file={file}: no such file")
        return TemplateSource(path.read_text(encoding="utf-8"), f"template.file={file}")
    if tokenizer.chat_template is None:
        return None
    return TemplateSource(tokenizer.chat_template, f"the {tokenizer.backend} tokenizer's chat template")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in transformers): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers: drop None values; expose reasoning under the names templates read."""
    out = []
    for message in messages:
        message = {k: v for k, v in dict(message).items() if v is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_prompt(
    source: str, messages: list[dict[str, Any]], tokenizer: MlxcelTokenizer, add_generation_prompt: bool = True, **kwargs: Any
) -> str:
    """Render `messages` with the template; extra kwargs become template variables."""
    origin = getattr(source, "origin", "chat template")
    variables = {name: getattr(tokenizer, name, None) for name in _TEMPLATE_VARS}
    variables = {k: v for k, v in variables.items() if v is not None}
    variables.update(kwargs)  # caller's variables win, as in transformers
    try:
        template = compile_template(str(source))
        return template.render(messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateSyntaxError as exc:
        raise MlxcelError(f"{origin}: invalid Jinja template at line {exc.lineno}: {exc.message}") from exc
    except Exception as exc:  # a template can raise anything: raise_exception, TypeError, UndefinedError...
        raise MlxcelError(f"{origin}: failed to render: {type(exc).__name__}: {exc}") from exc


def build_prompt(
    tokenizer: MlxcelTokenizer, messages: list[dict[str, Any]], template_source: str | None, enabled: bool = True
) -> PromptTokens:
    """Render and encode a prompt, and find its history boundary.

    With `enabled=False` (template=none, raw completion) the text is the user messages' content
    joined by newlines, encoded with the tokenizer's own special tokens (bos if it adds one).
    A system or assistant message then is an error rather than silently dropped or glued on:
    raw completion has no place for roles.
    """
    if not enabled:
        text = join_user_contents(messages)
        return PromptTokens(text=text, token_ids=tokenizer.encode(text, add_special_tokens=True), history_tokens=0)
    if template_source is None:
        raise MlxcelError(f"the tokenizer has no chat template; {_NO_TEMPLATE_HINT}")
    text = render_prompt(template_source, messages, tokenizer, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    history = tokenizer.encode(render_prompt(template_source, messages, tokenizer, add_generation_prompt=False), add_special_tokens=False)
    history_tokens = len(history) if ids[: len(history)] == history else 0
    return PromptTokens(text=text, token_ids=ids, history_tokens=history_tokens)


def join_user_contents(messages: list[dict[str, Any]]) -> str:
    roles = sorted({str(m.get("role")) for m in messages} - {"user"})
    if roles:
        raise MlxcelError(
            f"template=none renders user messages only, but the prompt has {', '.join(roles)} message(s); "
            "drop them (e.g. prompt.system) or use a chat template"
        )
    return "\n".join(read_text_content(m.get("content")) for m in messages)


def read_text_content(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)
