"""Tool calls and reasoning in a model's output: each family's call syntax parsed into OpenAI's
`tool_calls`, and its thinking into `reasoning_content` (docs/tools.md).

Syntaxes (`template.tool_parser`, auto: from the chat template):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call (Qwen 2.5,
  Qwen 3 and 3.5, SmolLM3, Hermes);
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (v3 tokenizers), or
  `[TOOL_CALLS]name[ARGS]{...}` a call (v11 and later);
- llama3_json: the answer is a JSON object {"name": ..., "parameters": {...}} (or several joined
  by ';'), after an optional `<|python_tag|>` (Llama 3.1-3.3).
Reasoning: `<think>...</think>` (Qwen 3, DeepSeek R1, SmolLM3); an answer whose prompt ended inside
`<think>` starts in it.

`OutputParser` takes the text as it streams and gives deltas: content, reasoning, and whole tool
calls once their closing mark (or the end) is read. Text that may still become a mark is held back
until it cannot. A call that does not parse (bad JSON, no name) comes back as the text it was,
never as a broken tool_calls entry.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class Delta:
    kind: str  # "content", "reasoning" or "tool_call"
    text: str = ""
    call: ToolCall | None = None


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]


def choose_tool_parser(setting: str, template_source: str | None) -> str | None:
    """template.tool_parser: a syntax by name, none, or auto (what the chat template writes)."""
    if setting != "auto":
        return None if setting == "none" else setting
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return None


def uses_reasoning(template_source: str | None) -> bool:
    return THINK_CLOSE in (template_source or "")


def read_call(data) -> ToolCall | None:
    """A call object as the families write it: name plus arguments (or parameters)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # (some write the arguments as JSON text already)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def parse_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def held_back(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `marks`."""
    if not marks:
        return 0
    for size in range(min(len(text), max(map(len, marks))), 0, -1):
        tail = text[-size:]
        if any(mark.startswith(tail) for mark in marks):
            return size
    return 0


class OutputParser:
    """One answer's text, piece by piece (feed), then finish(): deltas in order."""

    def __init__(self, tool_parser: str | None, reasoning: bool = False, in_reasoning: bool = False):
        self.syntax = tool_parser
        self.reasoning = reasoning
        self.mode = "reasoning" if reasoning and in_reasoning else "content"
        self.buffer = ""
        self.started = False  # any content seen yet (llama3_json: a call is the whole answer)
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []
        self.after_think = False  # the newlines templates put after </think> are not content
        self.mark = ""  # the mark that opened the call being read (it is the text again if the call is bad)

    # ---- feeding ----
    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            step = self.step(final=False)
            if step is None:
                return out
            out += step

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self.buffer:
            step = self.step(final=True)
            if step is None:
                break
            out += step
        return out

    def result(self) -> ParsedOutput:
        reasoning = "".join(self.thinking) if self.thinking else None
        return ParsedOutput("".join(self.content), reasoning, list(self.calls))

    # ---- one move over the buffer; None: wait for more text ----
    def step(self, final: bool) -> list[Delta] | None:
        if not self.buffer:
            return None
        if self.mode == "reasoning":
            return self.read_until(THINK_CLOSE, "reasoning", final, then="content")
        if self.mode == "call":
            return self.read_call(final)
        if self.after_think:
            stripped = self.buffer.lstrip("\n")
            if not stripped and not final:
                return None
            self.buffer, self.after_think = stripped, False
            if not self.buffer:
                return None
        marks = self.content_marks()
        found = [(self.buffer.find(m), m) for m in marks if m in self.buffer]
        if found:
            at, mark = min(found)
            before, self.buffer = self.buffer[:at], self.buffer[at + len(mark) :]
            out = self.emit("content", before)
            if mark == THINK_OPEN:
                self.mode = "reasoning"
            else:
                self.mode, self.mark = "call", mark
            return out
        if self.syntax == "llama3_json" and not self.started:
            stripped = self.buffer.lstrip()
            if stripped.startswith("{") or (not stripped and not final):
                self.mode, self.mark = "call", ""
                return [] if stripped else None
        keep = 0 if final else held_back(self.buffer, marks)
        text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        out = self.emit("content", text)
        return out if text else None

    def content_marks(self) -> tuple[str, ...]:
        marks = []
        if self.reasoning and not self.started and not self.thinking:
            marks.append(THINK_OPEN)
        if self.syntax == "hermes":
            marks.append("<tool_call>")
        elif self.syntax == "mistral":
            marks.append("[TOOL_CALLS]")
        elif self.syntax == "llama3_json":
            marks.append("<|python_tag|>")
        return tuple(marks)

    def read_until(self, close: str, kind: str, final: bool, then: str) -> list[Delta] | None:
        at = self.buffer.find(close)
        if at >= 0:
            text, self.buffer = self.buffer[:at], self.buffer[at + len(close) :]
            self.mode = then
            self.after_think = kind == "reasoning"
            return self.emit(kind, text)
        keep = 0 if final else held_back(self.buffer, (close,))
        text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if final and not text:
            return None
        return self.emit(kind, text) if text else None

    def read_call(self, final: bool) -> list[Delta] | None:
        """The text after a call's mark, once it is whole: hermes to </tool_call>; mistral and
        llama3_json to the end of the answer (their calls end it)."""
        if self.syntax == "hermes":
            at = self.buffer.find("</tool_call>")
            if at < 0 and not final:
                return None
            body = self.buffer[:at] if at >= 0 else self.buffer
            self.buffer = self.buffer[at + len("</tool_call>") :] if at >= 0 else ""
            self.mode = "content"
            calls = [read_call(parse_json(body.strip()))]
            closing = "</tool_call>" if at >= 0 else ""
            return self.emit_calls(calls, f"<tool_call>{body}{closing}")
        if not final:
            return None
        body, self.buffer, self.mode = self.buffer, "", "content"
        if self.syntax == "mistral":
            return self.emit_calls(read_mistral_calls(body), f"[TOOL_CALLS]{body}")
        return self.emit_calls(read_llama_calls(body), f"{self.mark}{body}")

    # ---- output ----
    def emit(self, kind: str, text: str) -> list[Delta]:
        if not text:
            return []
        if kind == "content":
            if not self.started and not text.strip() and self.syntax == "llama3_json":
                return []  # (leading blank space before a possible call is not content yet)
            self.started = True
            self.content.append(text)
        else:
            self.thinking.append(text)
        return [Delta(kind, text)]

    def emit_calls(self, calls: list[ToolCall | None], raw: str) -> list[Delta]:
        if not calls or any(c is None for c in calls):
            return self.emit("content", raw)  # a malformed call stays the text it was
        self.calls += calls
        self.started = True
        return [Delta("tool_call", call=c) for c in calls]


def read_mistral_calls(body: str) -> list[ToolCall | None]:
    """v3: a JSON array of calls; v11+: name[ARGS]{...} (several, each after its own [TOOL_CALLS])."""
    text = body.strip()
    data = parse_json(text)
    if isinstance(data, list):
        return [read_call(item) for item in data] or [None]
    if isinstance(data, dict):
        return [read_call(data)]
    calls = []
    for part in text.split("[TOOL_CALLS]"):
        name, sep, arguments = part.partition("[ARGS]")
        if not sep:
            return [None]
        calls.append(read_call({"name": name.strip(), "arguments": parse_json(arguments.strip())}))
    return calls


def read_llama_calls(body: str) -> list[ToolCall | None]:
    """One JSON object, or several joined by ';'."""
    text = body.strip()
    data = parse_json(text)
    if data is not None:
        return [read_call(data)]
    return [read_call(parse_json(part.strip())) for part in text.split(";") if part.strip()] or [None]


def parse_output(text: str, tool_parser: str | None, reasoning: bool = False, in_reasoning: bool = False):
    """A whole answer at once."""
    parser = OutputParser(tool_parser, reasoning, in_reasoning)
    parser.feed(text)
    parser.finish()
    return parser.result()
