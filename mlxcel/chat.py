"""`mlxcel-chat`: an interactive conversation on the same Hydra config as `mlxcel-run`.

    mlxcel-chat model=hf model.path=Qwen/Qwen2.5-0.5B-Instruct sampler=default

Each turn renders the whole conversation with the model's chat template and runs through the
scheduler like any row; the prompt cache holds the previous turns (answers included), so a turn
prefills only what is new since the last one. Commands: /reset, /system TEXT, /save FILE,
/stats, /help; Ctrl-D ends the session, Ctrl-C stops the current answer (and at the prompt,
clears the line). The session writes a run folder as `mlxcel-run` does: config.resolved.json,
a row per turn in generations.jsonl, stats.json (rewritten after every turn).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import TextIO

HELP = """commands:
  /reset         start the conversation again (the system prompt stays)
  /system TEXT   set the system prompt and start again (/system alone removes it)
  /save FILE     write the conversation as a JSONL row ({"id", "messages"}: mlxcel-run prompt.file=FILE runs it)
  /stats         the last turn's and the session's figures
  /help          this list
  Ctrl-C stops an answer; Ctrl-D ends the session"""


class ChatSession:
    """The conversation, the pipeline it runs on and the run folder it writes."""

    def __init__(self, pipeline, outputs, report: dict, out: TextIO, log: TextIO):
        self.pipeline, self.outputs, self.report = pipeline, outputs, report
        self.out, self.log = out, log
        self.system = pipeline.cfg.prompt.system
        self.messages: list[dict] = []
        self.turns = 0
        self.batches: list = []
        self.finish_reasons: dict[str, int] = {}
        self.started = time.perf_counter()
        self.ttfts_ms: list[float] = []  # each turn's, from its line to its first token
        self.last: dict | None = None
        self.stopping = False  # Ctrl-C during an answer

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    # ---- commands ----
    def handle(self, line: str) -> bool:
        """One line the user typed; False ends the session."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/"):
            self.answer(line)
            return True
        command, _, argument = text.partition(" ")
        argument = argument.strip()
        if command == "/reset":
            self.messages = []
            self.say("conversation cleared")
        elif command == "/system":
            self.system, self.messages = argument or None, []
            self.say("system prompt set; conversation cleared" if argument else "system prompt removed")
        elif command == "/save":
            self.save(argument)
        elif command == "/stats":
            self.say(self.describe_stats())
        elif command in ("/help", "/?"):
            self.say(HELP)
        elif command in ("/quit", "/exit"):
            return False
        else:
            self.say(f"unknown command {command}; /help lists them")
        return True

    def save(self, argument: str) -> None:
        if not argument:
            self.say("/save needs a file name, e.g. /save chat.jsonl")
            return
        path = Path(argument).expanduser()
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"id": f"chat-{self.turns}", "messages": self.conversation()}, ensure_ascii=False))
                f.write("\n")
        except OSError as exc:
            self.say(f"cannot write {path}: {exc.strerror}")
            return
        self.say(f"saved {len(self.conversation())} messages to {path}")

    def describe_stats(self) -> str:
        if self.last is None:
            return "no turn yet"
        last = self.last
        return (
            f"last turn: prompt {last['prompt_tokens']} tokens ({last['cached_tokens']} from the cache), "
            f"ttft {last.get('ttft_ms', 0):.0f} ms, {last['generated_tokens']} tokens at "
            f"{last.get('decode_tok_per_sec') or 0:.1f} tok/s | session: {self.turns} turns"
        )

    # ---- a turn ----
    def answer(self, text: str) -> None:
        """One turn; Ctrl-C at any point of it (rendering, prefill, decoding) stops this answer only."""
        self.stopping = False
        previous = signal.signal(signal.SIGINT, self.stop_answer)
        try:
            self.run_turn(text)
        finally:
            signal.signal(signal.SIGINT, previous)

    def run_turn(self, text: str) -> None:
        from mlxcel.generation_rows import make_generation_row
        from mlxcel.jobs import JobRow, Sample
        from mlxcel.runner import order_report
        from mlxcel.stats import measure_batch

        started = time.perf_counter()
        self.messages.append({"role": "user", "content": text})
        sample = Sample(JobRow(id=self.turns, messages=self.conversation()))
        prepared = self.pipeline.prepare([sample])[0]
        if prepared.error:
            self.messages.pop()
            self.say(f"error: {prepared.error}")
            return
        stream = self.pipeline.make_text_stream()
        shown = AnswerView(self.out, prepared.reader)
        rows: list[dict] = []

        def on_token(row: int, token: int) -> bool:
            shown.write(stream.add_token(token))
            return not (self.stopping or stream.stopped)

        def on_row_done(row: int, result) -> None:
            shown.write(stream.finalize())
            if stream.stopped:
                result.finish_reason = "stop"
            elif self.stopping:
                result.finish_reason = "cancelled"
            shown.end()
            rows.append(make_generation_row(prepared, result, stream.text))

        state = self.pipeline.generate([prepared], on_token, on_row_done)
        row = rows[0]
        # the next turn renders the answer as the template expects it: without its reasoning
        # (harmony's templates refuse channel marks in content)
        self.messages.append({"role": "assistant", "content": row.get("content", row["text"])})
        self.turns += 1
        self.last = row
        self.outputs.append_generation(row)
        self.finish_reasons[row["finish_reason"]] = self.finish_reasons.get(row["finish_reason"], 0) + 1
        self.batches.append(measure_batch(state))
        self.ttfts_ms.append((self.batches[-1].first_token_at - started) * 1000)
        self.report.update(self.make_stats().to_dict())
        self.report["turns"] = self.turns
        self.outputs.write_stats(order_report(self.report))
        if row["finish_reason"] == "cancelled":
            self.say("(stopped)")

    def make_stats(self):
        """The session's figures. Its ttft is the median turn's, each timed from the line the
        user sent: the session's own clock also runs while the user reads and types."""
        from mlxcel.stats import make_generation_stats

        stats = make_generation_stats(
            self.batches, self.started, self.finish_reasons, **self.pipeline.describe_max_rows()
        )
        return dataclasses.replace(stats, ttft_ms=round(statistics.median(self.ttfts_ms), 3))

    def stop_answer(self, signum, frame) -> None:
        self.stopping = True

    def say(self, message: str) -> None:
        print(message, file=self.log, flush=True)


class AnswerView:
    """An answer as the terminal shows it: its text as it streams, or, where the template thinks
    (<think> blocks, harmony's channels), the reasoning after a "[thinking]" label and the answer
    after "[answer]", without the format's marks."""

    def __init__(self, out: TextIO, reader: tuple | None):
        from mlxcel.tools.parsers import make_output_parser

        self.out = out
        self.parser = make_output_parser(*reader) if reader is not None else None
        self.label = None  # the kind of text shown last

    def write(self, piece: str) -> None:
        if not piece:  # (a token that completes no character yet: nothing to show or flush)
            return
        if self.parser is None:
            self.show(piece)
        else:
            for delta in self.parser.feed(piece):
                self.show_delta(delta)
        self.out.flush()

    def end(self) -> None:
        if self.parser is not None:
            for delta in self.parser.finish():
                self.show_delta(delta)
        self.show("\n")
        self.out.flush()

    def show_delta(self, delta) -> None:
        if delta.kind == "reasoning" and self.label != "reasoning":
            self.show("[thinking] ")
        elif delta.kind == "content" and self.label == "reasoning":
            self.show("\n[answer] ")
        self.label = delta.kind
        self.show(delta.text)

    def show(self, text: str) -> None:
        if text:
            self.out.write(text)


def read_line(prompt: str) -> str | None:
    """One line from the user; None at Ctrl-D. Ctrl-C at the prompt clears the line."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("", flush=True)


def find_undecodable(line: str) -> str | None:
    """Why a line read with errors="surrogateescape" is not text (its first byte that did not
    decode), or None: such a line reaches no template or tokenizer."""
    for column, char in enumerate(line, 1):
        if "\udc80" <= char <= "\udcff":
            encoding = (getattr(sys.stdin, "encoding", None) or "utf-8").upper()
            return f"not valid {encoding} (byte {ord(char) - 0xDC00:#04x} at column {column})"
    return None


def chat(args: list[str], out: TextIO = sys.stdout, log: TextIO = sys.stderr) -> int:
    from mlxcel.cli import compose_config
    from mlxcel.config import validate_config
    from mlxcel.devices import select_device
    from mlxcel.outputs import RunOutputs, claim_run_folder, default_run_dir, release_run_folder, split_run_dir
    from mlxcel.pipeline import Pipeline
    from mlxcel.runner import describe_model, order_report
    from mlxcel.stats import format_stats_table, read_environment

    run_dir, overrides = split_run_dir(args)
    cfg = validate_config(compose_config(overrides))
    run_dir = run_dir or default_run_dir(cfg.runner.name, "chats")
    claim_run_folder(run_dir, cfg.resolved_dict(), False, [], {})
    outputs = RunOutputs(run_dir)
    report: dict = {"status": "running", "overrides": overrides, "mode": "chat"}
    try:
        select_device(cfg.runner.device)
        report["environment"] = read_environment()
        outputs.write_config(cfg.resolved_dict())
        pipeline = Pipeline.load(cfg, log=log)
        pipeline.keep_answers = True  # the next turn starts with this one's answer
        report["model"] = describe_model(pipeline)
        report["sampler_chain"] = cfg.sampler.effective_chain()
        session = ChatSession(pipeline, outputs, report, out, log)
        session.say(f"mlxcel-chat: {cfg.model.path}; /help for commands, Ctrl-D to end (run folder: {run_dir})")
        interactive = sys.stdin.isatty()
        if interactive:
            import readline  # noqa: F401 (line editing and history for input())
        if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes fail their own line, not the read
            sys.stdin.reconfigure(errors="surrogateescape")
        number = 0
        while True:
            line = read_line("> " if interactive else "")
            number += 1
            if line is not None and (why := find_undecodable(line)):
                session.say(f"line {number} ignored: {why}")
                continue
            try:
                if line is None or not session.handle(line):
                    break
            except KeyboardInterrupt:  # between the line and the answer's own handler
                session.say("(stopped)")
        report["status"] = "completed"
        if session.batches:
            stats = session.make_stats()
            report.update(stats.to_dict())
            session.say(format_stats_table(stats))
        report["turns"] = session.turns
        outputs.write_stats(order_report(report))
        session.say(f"run folder: {run_dir}")
        return 0
    except BaseException as exc:
        from mlxcel.outputs import write_failure_stats

        write_failure_stats(outputs.dir, exc, report)
        raise
    finally:
        release_run_folder(run_dir)


def entry() -> None:
    """`mlxcel-chat`: OpenBLAS preloaded on a Linux CPU (as mlxcel-run), then `main`."""
    from mlxcel.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv[1:], module="mlxcel.chat")
    main()


def main() -> None:
    from mlxcel.cli import run_command

    run_command(chat)


if __name__ == "__main__":
    main()
