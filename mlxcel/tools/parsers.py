"""Tool calls and reasoning in a model's output: each family's call syntax parsed into OpenAI's
`tool_calls`, and its thinking into `reasoning_content` (docs/tools.md).

Syntaxes (`template.tool_parser`, auto: from the chat template):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call (Qwen 2.5,
  Qwen 3 and 3.5, SmolLM3, Hermes);
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (v3 tokenizers), or
  `[TOOL_CALLS]name[ARGS]{...}` a call (v11 and later);
- llama3_json: the answer is a JSON object {"name": ..., "parameters": {...}} (or several joined
  by ';'), after an optional `<|python_tag|>` (Llama 3.1-3.3);
- harmony: gpt-oss's messages, `<|channel|>analysis<|message|>...<|end|><|start|>assistant` then
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (a call) or
  `<|channel|>final<|message|>...` (the answer); HarmonyParser.
Reasoning: `<think>...</think>` (Qwen 3, DeepSeek R1, SmolLM3); an answer whose prompt ended inside
`<think>` starts in it; harmony's analysis channel.

`OutputParser` takes the text as it streams and gives deltas: content, reasoning, and whole tool
calls once their closing mark (or the end) is read. Text that may still become a mark is held back
until it cannot. A call that does not parse (bad JSON, no name) comes back as the text it was,
never as a broken tool_calls entry. A forced call (tool_choice required or a named function: the
grammar makes it parse) streams as OpenAI streams calls instead: its name and id once the name is
written (call_start), then its arguments as they are written (call_arguments), then call_end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
# a message's body ends at <|end|>; <|call|> and <|return|> are stop tokens (not in the text) but end it too
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


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
    # content, reasoning, tool_call (a whole call); a forced call's call_start (its name and id),
    # call_arguments (a piece of its arguments' text) and call_end (the whole call, already sent)
    kind: str
    text: str = ""
    call: ToolCall | None = None


# a call object's opening, up to its arguments' value (the grammar writes "name" first), by syntax
ARGUMENTS_OPENING = {
    "hermes": re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:'),
    "llama3_json": re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:'),
    "mistral": re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:|([\w.-]+)\[ARGS\]'),
}


class ArgumentStream:
    """A forced call's arguments as they are written: each call's opening found in the call's text
    (several in one body: Mistral's), then its JSON value scanned to its end, bracket by bracket."""

    def __init__(self, syntax: str):
        self.opening = ARGUMENTS_OPENING[syntax]
        self.syntax = syntax
        self.pos = 0  # how far the body is read
        self.in_value = False
        self.depth, self.in_string, self.escaped, self.began = 0, False, False, False
        self.started: list[ToolCall] = []

    def read(self, body: str) -> list[Delta]:
        out: list[Delta] = []
        while self.pos < len(body):
            if not self.in_value:
                match = self.opening.search(body, self.pos)
                if match is None:
                    return out
                name = match.group(1) if match.group(1) is not None else match.group(2)
                call = ToolCall(json.loads(f'"{name}"') if match.group(1) is not None else name, "")
                if self.syntax == "mistral":
                    call.id = mistral_call_id()
                self.started.append(call)
                out.append(Delta("call_start", call=call))
                self.pos, self.in_value = match.end(), True
                self.depth, self.in_string, self.escaped, self.began = 0, False, False, False
                continue
            start, fresh = self.pos, not self.began
            end = self.scan(body)
            text = body[start:end].lstrip() if fresh else body[start:end]  # (not the space before the value)
            if text:
                out.append(Delta("call_arguments", text))
            if self.in_value:
                return out
        return out

    def scan(self, body: str) -> int:
        """Advance over the value; where it ends (or the body does)."""
        while self.pos < len(body):
            char = body[self.pos]
            self.pos += 1
            if not self.began:
                if char.isspace():
                    continue
                self.began = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:  # (a value that is a string)
                        self.in_value = False
                        return self.pos
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.in_value = False
                    return self.pos
        return self.pos


def mistral_call_id() -> str:
    """Mistral's templates refuse any id but 9 letters and digits."""
    return uuid.uuid4().hex[:9]


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
    if HARMONY_CHANNEL in source:  # (harmony's channels are the whole answer's format)
        return "harmony"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return None


def reasoning_format(template_source: str | None) -> str | None:
    """How the template's model thinks: "harmony" (an analysis channel), "think" (<think> blocks) or None."""
    source = template_source or ""
    if HARMONY_CHANNEL in source:
        return "harmony"
    return "think" if THINK_CLOSE in source else None


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


class AnswerReader:
    """One answer's text, piece by piece (feed), then finish(): deltas in order. A reader's step()
    makes one move over its buffer (None: it waits for more text); close() ends what is open."""

    buffer: str
    content: list[str]
    thinking: list[str]
    calls: list[ToolCall]

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while (step := self.step(final=False)) is not None:
            out += step
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while (step := self.step(final=True)) is not None:
            out += step
        return out + self.close()

    def result(self) -> ParsedOutput:
        reasoning = "".join(self.thinking) if self.thinking else None
        return ParsedOutput("".join(self.content), reasoning, list(self.calls))

    def step(self, final: bool) -> list[Delta] | None:
        raise NotImplementedError

    def close(self) -> list[Delta]:
        return []


class OutputParser(AnswerReader):
    """The call syntaxes but harmony, and <think> reasoning."""

    def __init__(
        self, tool_parser: str | None, reasoning: bool = False, in_reasoning: bool = False, forced: bool = False
    ):
        self.syntax = tool_parser
        self.forced = forced and tool_parser in ARGUMENTS_OPENING  # (stream its arguments: ArgumentStream)
        self.arguments: ArgumentStream | None = None
        self.reasoning = reasoning
        self.mode = "reasoning" if reasoning and in_reasoning else "content"
        self.buffer = ""
        self.started = False  # any content seen yet (llama3_json: a call is the whole answer)
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []
        self.after_think = False  # the newlines templates put after </think> are not content
        self.mark = ""  # the mark that opened the call being read (it is the text again if the call is bad)

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
        llama3_json to the end of the answer (their calls end it). A forced call's arguments stream
        as they are written."""
        streamed = []
        if self.forced and not final:
            self.arguments = self.arguments or ArgumentStream(self.syntax)
            body = self.buffer
            if self.syntax == "hermes" and "</tool_call>" in body:
                body = body[: body.find("</tool_call>")]
            streamed = self.arguments.read(body)
        if self.syntax == "hermes":
            at = self.buffer.find("</tool_call>")
            if at < 0 and not final:
                return streamed or None
            body = self.buffer[:at] if at >= 0 else self.buffer
            self.buffer = self.buffer[at + len("</tool_call>") :] if at >= 0 else ""
            self.mode = "content"
            calls = [read_call(parse_json(body.strip()))]
            closing = "</tool_call>" if at >= 0 else ""
            return streamed + self.emit_calls(calls, f"<tool_call>{body}{closing}")
        if not final:
            return streamed or None
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
        started, self.arguments = (self.arguments.started if self.arguments else []), None
        if not calls or any(c is None for c in calls):
            return self.emit("content", raw)  # a malformed call stays the text it was
        self.calls += calls
        self.started = True
        if started and len(started) == len(calls):  # (streamed: the ids the client has)
            for call, sent in zip(calls, started):
                call.id = sent.id
            return [Delta("call_end", call=c) for c in calls]
        if self.syntax == "mistral":
            for call in calls:
                call.id = mistral_call_id()
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


def make_output_parser(
    tool_parser: str | None, reasoning: bool | str | None = False, in_reasoning: bool = False, forced: bool = False
):
    """The reader of one answer: harmony's (the template's format, whether or not calls are read),
    else OutputParser for the call syntax and <think> reasoning. `forced`: the answer is a
    constrained call (its arguments stream)."""
    if tool_parser == "harmony" or reasoning == "harmony":
        return HarmonyParser(reads_calls=tool_parser == "harmony", forced=forced)
    return OutputParser(tool_parser, bool(reasoning), in_reasoning, forced)


def parse_output(text: str, tool_parser: str | None, reasoning: bool | str | None = False, in_reasoning: bool = False):
    """A whole answer at once."""
    parser = make_output_parser(tool_parser, reasoning, in_reasoning)
    parser.feed(text)
    parser.finish()
    return parser.result()


class HarmonyParser(AnswerReader):
    """gpt-oss's harmony format, piece by piece: a sequence of messages, each a header (`assistant`
    after `<|start|>`, `<|channel|>` and its name, a ` to=` recipient, a content type) up to
    `<|message|>`, then a body up to `<|end|>` (or the end of the answer: `<|call|>` and `<|return|>`
    are stop tokens). The analysis channel is reasoning; final and recipient-less commentary (the
    preambles) are content; commentary to `functions.NAME` is a call, read when its body ends. An
    answer that does not open with a header is content as it is; a call that cannot be read (bad
    JSON, calls not asked for, a built-in tool) is content as the text it was."""

    def __init__(self, reads_calls: bool = True, forced: bool = False):
        self.reads_calls = reads_calls
        self.forced = forced and reads_calls  # a constrained call: its arguments stream as written
        self.sent: ToolCall | None = None  # the forced call whose start was sent
        self.buffer = ""
        self.mode = "header"  # header, body, between (after a body's end), plain (not harmony at all)
        self.first = True  # the answer's first header (its prompt ended in `<|start|>assistant`)
        self.header = ""  # the message's header as written (with its <|start|>, after the first)
        self.channel: str | None = None
        self.recipient: str | None = None
        self.arguments: list[str] = []  # a call's body so far
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []

    def close(self) -> list[Delta]:
        # cut inside a body (length): what it holds so far ends it
        return self.end_message() if self.mode == "body" else []

    def step(self, final: bool) -> list[Delta] | None:
        if not self.buffer:
            return None
        if self.mode == "plain":
            text, self.buffer = self.buffer, ""
            return self.emit("content", text)
        if self.mode == "header":
            return self.read_header(final)
        if self.mode == "between":
            return self.read_between(final)
        return self.read_body(final)

    def read_header(self, final: bool) -> list[Delta] | None:
        at = self.buffer.find(HARMONY_MESSAGE)
        if self.first and not starts_header(self.buffer, final and at < 0):
            self.mode = "plain"  # a model that does not write harmony: its text is the answer
            return []
        if at < 0:
            if final:  # cut inside a header: no message began, nothing to show
                self.buffer = ""
            return None
        header, self.buffer = self.buffer[:at], self.buffer[at + len(HARMONY_MESSAGE) :]
        self.header = header if self.first else HARMONY_START + header
        self.first, self.mode = False, "body"
        channel = re.search(r"<\|channel\|>\s*([\w-]+)", self.header)
        recipient = re.search(r"\bto=([^\s<]+)", self.header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        name = (self.recipient or "").removeprefix("functions.")
        if self.forced and self.recipient and self.recipient.startswith("functions.") and name:
            self.sent = ToolCall(name, "")
            return [Delta("call_start", call=self.sent)]
        return []

    def read_body(self, final: bool) -> list[Delta] | None:
        found = [(self.buffer.find(mark), mark) for mark in HARMONY_ENDS if mark in self.buffer]
        if found:
            at, mark = min(found)
            text, self.buffer = self.buffer[:at], self.buffer[at + len(mark) :]
            return self.body_text(text) + self.end_message()
        keep = 0 if final else held_back(self.buffer, HARMONY_ENDS)
        text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return self.body_text(text) if text else None

    def read_between(self, final: bool) -> list[Delta] | None:
        """After a body's end: the next message's `<|start|>` (text outside any message is content)."""
        at = self.buffer.find(HARMONY_START)
        if at >= 0:
            text, self.buffer = self.buffer[:at], self.buffer[at + len(HARMONY_START) :]
            self.mode = "header"
            return self.emit("content", text) if text.strip() else []
        keep = 0 if final else held_back(self.buffer, (HARMONY_START,))
        text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if not text:
            return None
        return self.emit("content", text) if text.strip() else []

    def body_text(self, text: str) -> list[Delta]:
        if self.recipient is not None:
            self.arguments.append(text)
            return [Delta("call_arguments", text)] if self.sent is not None and text else []
        return self.emit("reasoning" if self.channel == "analysis" else "content", text)

    def end_message(self) -> list[Delta]:
        self.mode = "between"
        if self.recipient is None:
            return []
        body, self.arguments = "".join(self.arguments), []
        name = self.recipient.removeprefix("functions.")
        call = None
        if self.reads_calls and self.recipient.startswith("functions.") and name:
            call = read_call({"name": name, "arguments": parse_json(body.strip())})
        sent, self.sent = self.sent, None
        if call is None:  # the text it was
            return self.emit("content", f"{self.header}{HARMONY_MESSAGE}{body}")
        self.calls.append(call)
        if sent is not None:
            call.id = sent.id
            return [Delta("call_end", call=call)]
        return [Delta("tool_call", call=call)]

    def emit(self, kind: str, text: str) -> list[Delta]:
        if not text:
            return []
        (self.thinking if kind == "reasoning" else self.content).append(text)
        return [Delta(kind, text)]


def starts_header(text: str, whole: bool) -> bool:
    """Whether an answer's text opens with a harmony header (or may still: a prefix of one)."""
    stripped = text.lstrip()
    for opening in (HARMONY_CHANNEL, " to=", HARMONY_START):
        if stripped.startswith(opening.strip()) or (not whole and opening.strip().startswith(stripped)):
            return True
    return False
