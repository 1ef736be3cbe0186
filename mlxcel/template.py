"""Chat templates: choose the template, render it as transformers does, find the history boundary.

Rendering follows transformers' `apply_chat_template` (Jinja2 sandbox with trim_blocks and
lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`, `{% generation %}` and loop
controls, `dict`/`namespace`; the tokenizer's special-token strings, `tools`, `documents` and
template.kwargs as variables), so templates written for HF behave the same. A rendered prompt is
encoded without added special tokens: the template writes bos itself where the model wants it
(transformers does the same with tokenize=True). A special token's text inside the messages is the
user's, tokenized as text; the template's own markup keeps its special tokens (build_prompt,
mlxcel/tokenizer/literal.py; template.special_tokens_in_content=special: the rendered text whole).

The template: template.text / template.file, else a built-in (template=chatml|llama3|gemma|
mistral), else the model's own (`tokenizer.chat_templates`: tokenizer_config.json, chat_template
.jinja/.json, GGUF metadata), by name (template.name; "tool_use" when tools are given, as in
transformers; else "default").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError
from mlxcel.tokenizer.base import MlxcelTokenizer
from mlxcel.tokenizer.literal import Escapes, encode_text, find_escapes

NO_TEMPLATE_HINT = (
    "set template=none for a raw completion, template=chatml|llama3|gemma|mistral for a built-in one, "
    "or give one with template.text=... or template.file=..."
)
_TEMPLATE_VARS = ("bos_token", "eos_token", "unk_token", "pad_token")
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython")

# Built-in templates (template=NAME): the published formats of each family, text-only.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{% for message in messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Gemma 3's: a system message becomes the first user turn's prefix.
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}"
        "{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '')"
        " + message['content'] | trim + '<end_of_turn>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # Mistral-7B-Instruct-v0.2's: the system message goes before the first user message.
    "mistral": (
        "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{{ bos_token }}"
        "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{% if loop.first and system_message is defined %}"
        "{{ ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}{% else %}"
        "{{ ' [INST] ' + message['content'] + ' [/INST]' }}{% endif %}{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] + eos_token }}{% else %}"
        "{{ raise_exception('Only user and assistant roles are supported, with the exception of an initial "
        "optional system message!') }}"
        "{% endif %}{% endfor %}"
    ),
}


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
    # where the messages' text holds a special token's text, tokenized as text (sorted [start, end))
    literal_spans: tuple[tuple[int, int], ...] = ()


def load_template_source(
    tokenizer: MlxcelTokenizer,
    text: str | None = None,
    file: str | Path | None = None,
    kind: str = "auto",
    name: str | None = None,
    tools: Any = None,
) -> str | None:
    """The template to render: an override string, else an override file, else a built-in, else
    the tokenizer's (by name; "tool_use" when tools are given and it exists, as transformers)."""
    if text is not None and file is not None:
        raise MlxcelError("template.text and template.file are both set; set only one")
    if text is not None:
        return TemplateSource(text, "template.text")
    if file is not None:
        path = Path(file).expanduser()
        if not path.is_file():
            raise MlxcelError(f"template.file={file}: no such file")
        try:
            return TemplateSource(path.read_text(encoding="utf-8"), f"template.file={file}")
        except (OSError, UnicodeDecodeError) as exc:
            raise MlxcelError(f"template.file={file}: cannot read it as UTF-8 text ({exc})") from exc
    if kind in BUILTIN_TEMPLATES:
        return TemplateSource(BUILTIN_TEMPLATES[kind], f"template={kind} (built-in)")
    named = dict(getattr(tokenizer, "chat_templates", None) or {})
    if not named and tokenizer.chat_template is not None:
        named = {"default": tokenizer.chat_template}
    if name is not None:
        if name not in named:
            available = ", ".join(sorted(named)) or "none"
            raise ConfigError(
                ConfigIssue("template.name", f"the model has no chat template of that name (it has: {available})", name)
            )
        return TemplateSource(named[name], f"the {tokenizer.backend} tokenizer's chat template {name!r}")
    if tools is not None and "tool_use" in named:
        return TemplateSource(named["tool_use"], f"the {tokenizer.backend} tokenizer's chat template 'tool_use'")
    if not named:
        return None
    chosen = "default" if "default" in named else min(named)
    return TemplateSource(named[chosen], f"the {tokenizer.backend} tokenizer's chat template")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in transformers): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class TemplateRaised(jinja2.exceptions.TemplateError):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    if (len(indent) if isinstance(indent, str) else indent or 0) > MAX_JSON_INDENT:
        raise SecurityError(f"tojson(indent=...) past {MAX_JSON_INDENT}: the text of every nested item grows by it")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# A rendered prompt past this many characters cannot fit any model's context (a million tokens of
# ~4 characters); a template that would build one ('a' * 10**10) is stopped as it renders.
MAX_RENDERED_CHARS = 4_000_000
# A template's work: each loop iteration, call and filter use is a step. Models' templates take 1
# to 200 steps a message (tests/data/templates: 10,000 messages in 10,000 to 1.8 million, the
# latter with tools and past MAX_RENDERED_CHARS anyway); nested range(100000) loops that print
# nothing take 10**10. Spending them all takes a few seconds.
MAX_TEMPLATE_STEPS = 2_000_000
# tojson(indent=N) past this multiplies the text of every nested item (transformers' use 2 or 4)
MAX_JSON_INDENT = 16
# str methods and filters whose integer argument sizes what they build: center(10**10)
SIZED_BY_INT = frozenset(["center", "ljust", "rjust", "zfill", "batch", "slice"])
_steps_left: ContextVar[list[int] | None] = ContextVar("template_steps_left", default=None)
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBER = re.compile(r"\d+")


def spend_steps(steps: int = 1) -> None:
    """Count template work against the render's budget (render_bounded sets one)."""
    left = _steps_left.get()
    if left is None:
        return
    left[0] -= steps
    if left[0] < 0:
        raise SecurityError(
            f"the template runs more than {MAX_TEMPLATE_STEPS} loop iterations and calls "
            "(nested loops that print nothing?)"
        )


def check_size(size: int, what: str) -> None:
    if size > MAX_RENDERED_CHARS:
        raise SecurityError(f"the template {what} of {size} characters, past {MAX_RENDERED_CHARS}")


def text_length(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """str % args, str.format and the format filter: no field width or precision past the bound,
    and no format that repeats a long value past it ('{0}{0}...'.format(big))."""
    values = [*args, *kwargs.values()]
    values = [*values, *(values[0].values() if len(values) == 1 and isinstance(values[0], dict) else ())]
    longest = max([len(v) if isinstance(v, (str, list, tuple)) else 0 for v in values], default=0)
    check_size(len(fmt) + (fmt.count("%") + fmt.count("{")) * longest, "formats a text")
    numbers = [int(n) for match in _PERCENT_FIELD.finditer(fmt) for n in match.groups() if n and n != "*"]
    numbers += [int(n) for spec in re.findall(r"\{[^{}]*:([^{}]*)\}", fmt) for n in _NUMBER.findall(spec)]
    if "*" in fmt or re.search(r"\{[^{}]*:[^{}]*\{", fmt):  # a width taken from the arguments
        numbers += [v for v in values if isinstance(v, int)]
    check_size(max(numbers, default=0), "asks for a field width or precision")


def check_growth(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a str method or filter call that would build more than MAX_RENDERED_CHARS before
    it builds it: a memory bomb must not reach the allocator."""
    if name in SIZED_BY_INT:
        sizes = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
        check_size(max(sizes, default=0), f"asks {name}() for a result")
    elif name == "expandtabs" and isinstance(value, str) and args:
        check_size(len(value) + value.count("\t") * int(args[0]), "expands tabs to a text")
    elif name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = width if isinstance(width, int) else text_length(width)
        check_size(len(value) + (value.count("\n") + 1) * width, "indents to a text")
    elif name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = value.count(old) if old else len(value) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        check_size(len(value) + hits * max(0, len(new) - len(old)), "replaces to a text")
    elif name == "join" and isinstance(value, str) and args and isinstance(args[0], (list, tuple)):
        items = args[0]  # sep.join(items)
        check_size(sum(map(text_length, items)) + len(value) * max(0, len(items) - 1), "joins a text")
    elif name == "join_filter" and isinstance(value, (list, tuple)):
        sep = args[0] if args else kwargs.get("d", "")
        check_size(sum(map(text_length, value)) + text_length(sep) * max(0, len(value) - 1), "joins a text")
    elif name in ("format", "format_map") and isinstance(value, str):
        check_format(value, args, kwargs)


def bound_filter(name: str, function: Any) -> Any:
    """A filter that spends a step and refuses to build past the bound (its value follows any
    context argument Jinja passes first)."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
    growth = "join_filter" if name == "join" else name

    @wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        spend_steps()
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        check_growth(growth, value, rest, kwargs)
        return function(*args, **kwargs)

    return bounded


class BoundedCodeGenerator(CodeGenerator):
    """Compiles every for loop's iterable through iterate_bounded and every `~` through
    concat_bounded (environment attributes: a template's own variables cannot shadow them)."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        counted = nodes.Call(nodes.EnvironmentAttribute("iterate_bounded"), [node.iter], [], None, None)
        loop = nodes.For(node.target, counted, node.body, node.else_, node.test, node.recursive, lineno=node.lineno)
        super().visit_For(loop, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.concat_bounded((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus bounds on what a template can make the host build and on its work.
    Sizes: repeated and concatenated strings and lists, padded, formatted, replaced and joined
    text, and powers, are refused past MAX_RENDERED_CHARS before they are built. Work: every
    loop iteration, call and filter use spends a step of MAX_TEMPLATE_STEPS (Jinja bounds
    range() only, and two nested range(100000) loops run 10**10 times)."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = BoundedCodeGenerator

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sequence, count = (left, right) if isinstance(right, int) else (right, left)
            if (
                isinstance(sequence, (str, list, tuple))
                and isinstance(count, int)
                and len(sequence) * count > MAX_RENDERED_CHARS
            ):
                raise SecurityError(
                    f"the template repeats a value to {len(sequence) * count} items, past {MAX_RENDERED_CHARS}"
                )
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * abs(left).bit_length() > 64 * MAX_RENDERED_CHARS
        ):
            raise SecurityError("the template computes a power too large to print")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            check_size(len(left) + len(right), "concatenates a value")
        if operator == "%" and isinstance(left, str):
            check_format(left, right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        spend_steps()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(children): count its iterations
            args = (__self.iterate_bounded(args[0]), *args[1:])
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        if isinstance(getattr(method, "__self__", None), str):
            check_growth(method.__name__, method.__self__, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def iterate_bounded(self, iterable: Any) -> Iterator[Any]:
        """A for loop's items, each spending a step (every loop's iterable is wrapped in this)."""
        for item in iterable:
            spend_steps()
            yield item

    def concat_bounded(self, parts: list[Any]) -> str:
        """`a ~ b`: Jinja's str_join, refused past the bound before it is built."""
        texts = [str(part) for part in parts]
        check_size(sum(map(len, texts)), "concatenates a text")
        return "".join(texts)


def render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """Render within MAX_TEMPLATE_STEPS of work, stopping once the text passes
    MAX_RENDERED_CHARS (loops can build it piecewise)."""
    parts, size = [], 0
    budget = _steps_left.set([MAX_TEMPLATE_STEPS])
    try:
        for part in template.generate(**variables):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise SecurityError(
                    f"the rendered prompt passes {MAX_RENDERED_CHARS} characters, more than any model's context holds"
                )
            parts.append(part)
    finally:
        _steps_left.reset(budget)
    return "".join(parts)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters = {name: bound_filter(name, function) for name, function in env.filters.items()}
    env.filters["tojson"] = bound_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace(...) that refuses underscore attributes (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: self may be a keyword
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"templates cannot store underscore attributes on a namespace ({name!r})"
            )


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


def check_messages(messages: list[Any]) -> None:
    """Each message a mapping with a known role and content (or tool calls); errors name the index."""
    if not messages:
        raise MlxcelError("the conversation has no messages; give at least one user message")
    for index, message in enumerate(messages):
        where = f"message {index} (counting from 0)"
        if not isinstance(message, dict):
            raise MlxcelError(f"{where}: must be a mapping with 'role' and 'content' (got {type(message).__name__})")
        role = message.get("role")
        if role not in KNOWN_ROLES:
            raise MlxcelError(f"{where}: unknown role {role!r}; use one of {', '.join(KNOWN_ROLES)}")
        if message.get("content") is None and not message.get("tool_calls"):
            raise MlxcelError(f"{where} (role {role!r}): missing 'content'; give the message text as content")


def render_prompt(
    source: str,
    messages: list[dict[str, Any]],
    tokenizer: MlxcelTokenizer,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the template; extra kwargs become template variables."""
    origin = getattr(source, "origin", "chat template")
    check_messages(messages)
    variables = {name: getattr(tokenizer, name, None) for name in _TEMPLATE_VARS}
    variables = {k: v for k, v in variables.items() if v is not None}
    variables.update(kwargs)  # caller's variables win, as in transformers
    try:
        template = compile_template(str(source))
        return render_bounded(
            template,
            messages=normalize_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateSyntaxError as exc:
        raise MlxcelError(f"{origin}: invalid Jinja template at line {exc.lineno}: {exc.message}") from exc
    except TemplateRaised as exc:
        raise MlxcelError(f"{origin}: the template refused this conversation: {exc.message}") from exc
    except Exception as exc:  # a template can raise anything: TypeError, UndefinedError...
        line = find_template_line(exc)
        raise MlxcelError(f"{origin}: failed to render{line}: {type(exc).__name__}: {exc}") from exc


def find_template_line(exc: BaseException) -> str:
    """' at line N' of the template, from the traceback frame Jinja compiled it into."""
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line is not None else ""


def build_prompt(
    tokenizer: MlxcelTokenizer,
    messages: list[dict[str, Any]],
    template_source: str | None,
    enabled: bool = True,
    kwargs: dict[str, Any] | None = None,
    literal_content: bool = True,
) -> PromptTokens:
    """Render and encode a prompt, and find its history boundary.

    With `literal_content` (template.special_tokens_in_content=text) a special token's text in
    the messages, tools or documents is tokenized as text; the template's own markup keeps its
    special tokens (mlxcel/tokenizer/literal.py). False: the rendered text is encoded as a whole.

    The history boundary is the token count of the rendering without the generation prompt,
    when those ids are a prefix of the full prompt's ids; otherwise 0 (no history piece: the
    template renders the history differently when a generation prompt follows, or the tokenizer
    merges across the boundary).

    With `enabled=False` (template=none, raw completion) the text is the user messages' content
    joined by newlines, encoded with the tokenizer's own special tokens (bos if it adds one).
    A system or assistant message then is an error rather than silently dropped or glued on:
    raw completion has no place for roles.
    """
    if not enabled:
        text = join_user_contents(messages)
        return PromptTokens(text=text, token_ids=tokenizer.encode(text, add_special_tokens=True), history_tokens=0)
    if template_source is None:
        raise MlxcelError(f"the tokenizer has no chat template; {NO_TEMPLATE_HINT}")
    kwargs = dict(kwargs or {})
    escapes = find_content_escapes(tokenizer, messages, template_source, kwargs) if literal_content else None
    text, spans = render_literal(template_source, messages, tokenizer, True, escapes, kwargs)
    ids = encode_text(tokenizer, text, spans)
    history_text, history_spans = render_literal(template_source, messages, tokenizer, False, escapes, kwargs)
    history = encode_text(tokenizer, history_text, history_spans)
    history_tokens = len(history) if ids[: len(history)] == history else 0
    return PromptTokens(text=text, token_ids=ids, history_tokens=history_tokens, literal_spans=spans)


# Template variables that carry the request's text, as the messages do (the rest are the operator's).
_USER_VARIABLES = ("tools", "documents")


def find_content_escapes(
    tokenizer: MlxcelTokenizer, messages: list[dict[str, Any]], source: str, kwargs: dict[str, Any]
) -> Escapes | None:
    """The sentinels for the control tokens' texts in the messages, tools and documents (None:
    there are none, and the prompt renders and encodes as it always did)."""
    check_messages(messages)  # (its errors name the messages as given, not escaped)
    user = [messages, *(kwargs.get(name) for name in _USER_VARIABLES)]
    template_vars = [getattr(tokenizer, name, None) for name in _TEMPLATE_VARS]
    return find_escapes(tokenizer, user, [str(source), kwargs, template_vars])


def render_literal(
    source: str,
    messages: list[dict[str, Any]],
    tokenizer: MlxcelTokenizer,
    add_generation_prompt: bool,
    escapes: Escapes | None,
    kwargs: dict[str, Any],
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The rendered text, and the spans of the control tokens' texts that came from the user."""
    if escapes is None:
        return render_prompt(source, messages, tokenizer, add_generation_prompt, **kwargs), ()
    escaped = {k: escapes.escape(v) if k in _USER_VARIABLES else v for k, v in kwargs.items()}
    try:
        text = render_prompt(source, escapes.escape(messages), tokenizer, add_generation_prompt, **escaped)
    except MlxcelError as exc:  # (a template's own message may quote the content)
        raise MlxcelError(escapes.unescape(str(exc))[0]) from exc.__cause__
    return escapes.unescape(text)


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
