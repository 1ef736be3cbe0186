"""Progress: a redrawn bar on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import io

from mlxcel.progress import Progress, format_seconds


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_redraws_one_line():
    stream = FakeTerminal()
    progress = Progress(4, "auto", stream)
    progress.update(rows=1, tokens=10)
    progress.update(rows=1, tokens=10)
    progress.close()
    text = stream.getvalue()
    assert progress.mode == "bar" and text.count("\r") == 2 and text.endswith("\n")
    assert "[############------------] 2/4 rows" in text and "tok/s" in text and "ETA 0:00:0" in text


def test_log_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(3, "auto", stream, interval_s=3600)
    for _ in range(3):
        progress.update(rows=1, tokens=5)
    lines = stream.getvalue().splitlines()
    assert (
        progress.mode == "log" and lines == [lines[0]] and lines[0].startswith("mlxcel: 3/3 rows")
    )  # throttled, last always shown


def test_off_prints_nothing_and_eta_formats():
    stream = FakeTerminal()
    progress = Progress(2, "off", stream)
    progress.update(rows=2, tokens=1)
    progress.close()
    assert stream.getvalue() == ""
    assert format_seconds(3725) == "1:02:05" and format_seconds(float("nan")) == "?"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedLines(io.StringIO):
    """A stream that notes the (fake) time of each line (or redrawn bar, with `tty`)."""

    def __init__(self, clock: FakeClock, tty: bool = False) -> None:
        super().__init__()
        self.clock, self.lines, self.tty = clock, [], tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        if text.strip():
            self.lines.append((self.clock.now, text.strip()))
        return super().write(text)


def read_eta(line: str) -> float | None:
    shown = line.rpartition("ETA ")[2]
    if shown == "?":
        return None
    hours, minutes, seconds = (int(part) for part in shown.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def test_progress_moves_while_prompts_prefill():
    """Rows whose prompt is in (their first token came) and tokens are shown before any row ends."""
    clock = FakeClock()
    stream = TimedLines(clock)
    progress = Progress(3, "log", stream, interval_s=10, clock=clock)
    progress.start_row("a", 1200)
    clock.now = 4.0
    progress.start_row("b", 800)
    assert stream.lines == []  # (log lines are throttled)
    clock.now = 11.0
    for _ in range(5):
        progress.add_token("a")
    assert [line for _, line in stream.lines] == [
        "mlxcel: 0/3 rows | 2/3 prefilled (2000 prompt tok) | 1 tok, 0.1 tok/s | ETA ?"
    ]
    progress.add_token("b")
    progress.finish_row("a", 7)  # 5 of its tokens were counted as they came
    progress.finish_row("b", 1)
    progress.finish_row("c", 0, prompt_tokens=30)  # ended before a token (a stop id first)
    assert stream.lines[-1][1].startswith("mlxcel: 3/3 rows | 8 tok")
    assert (progress.prefilled, progress.prompt_tokens, progress.tokens) == (3, 2030, 8)


def test_bar_redraws_between_rows_at_most_every_quarter_second():
    clock = FakeClock()
    stream = FakeTerminal()
    progress = Progress(2, "bar", stream, clock=clock)
    progress.start_row(0, 10)
    for _ in range(100):
        progress.add_token(0)  # at one instant: no redraw
    clock.now = 1.0
    progress.add_token(0)
    progress.finish_row(0, 101)
    assert stream.getvalue().count("\r") == 2  # the token a second on, and the row's end
    assert "1/2 rows" in stream.getvalue().rpartition("\r")[2]


def simulate_job(progress: Progress, clock: FakeClock, rows: int, slots: int, step_s: float) -> float:
    """A continuous-batching job on a fake clock: `slots` rows decode side by side, one token a
    step each, a free slot is refilled at once; rows are 100 to 299 tokens long. Returns its end."""
    lengths = [100 + (i * 37) % 200 for i in range(rows)]
    waiting, live = list(range(rows)), {}
    while waiting or live:
        while waiting and len(live) < slots:
            live[waiting.pop(0)] = 0
        clock.now += step_s
        for row in list(live):
            if live[row] == 0:
                progress.start_row(row, 50)
            live[row] += 1
            progress.add_token(row)
            if live[row] == lengths[row]:
                del live[row]
                progress.finish_row(row, lengths[row])
    return clock.now


def test_the_first_eta_is_minutes_for_a_job_of_minutes():
    """1000 rows, 64 at a time, 10 s a row: about 3 minutes. Counting finished rows only, the
    first row's end (5 s in, 1 of 1000) made the ETA 5 s x 999: over an hour."""
    for mode in ("log", "bar"):
        clock = FakeClock()
        stream = TimedLines(clock, tty=mode == "bar")
        progress = Progress(1000, "auto", stream, interval_s=10, clock=clock)
        end = simulate_job(progress, clock, rows=1000, slots=64, step_s=0.05)
        assert 120 < end < 240
        shown = [(at, read_eta(line)) for at, line in stream.lines if "ETA" in line]
        shown = [(at, eta) for at, eta in shown if eta is not None]
        first_at, first_eta = shown[0]
        assert first_at < 11, mode  # the first ETA comes with the first rows' end
        for at, eta in shown:
            remaining = end - at
            assert 0.5 * remaining - 10 <= eta <= 1.5 * remaining + 10, (mode, at, eta, remaining)


def test_a_job_reports_rows_prefilled_before_any_row_ends(tmp_path, tiny_llama, monkeypatch):
    """The runner tells the progress of each row's first token and of every token, not only of
    finished rows: with rows decoding side by side, all are prefilled before the first ends."""
    from mlxcel import runner
    from mlxcel.api import load_config

    events: list[tuple] = []

    class Recording(Progress):
        def start_row(self, key, prompt_tokens):
            events.append(("prefilled", key, prompt_tokens))
            super().start_row(key, prompt_tokens)

        def finish_row(self, key, tokens, prompt_tokens=0):
            events.append(("finished", key, tokens))
            super().finish_row(key, tokens, prompt_tokens)

    monkeypatch.setattr(runner, "Progress", Recording)
    rows = [{"id": f"r{i}", "prompt": f"Question number {i}?"} for i in range(3)]
    cfg = load_config(
        {"model": {"path": str(tiny_llama)}, "prompt": {"rows": rows}},
        ["decode.max_tokens=5", "decode.ignore_eos=true", "runner.max_rows=4", "runner.progress=off"],
    )
    result = runner.run(cfg, tmp_path / "run", stream=None, log=None)
    assert result.status == "completed"
    kinds = [kind for kind, *_ in events]
    assert kinds == ["prefilled"] * 3 + ["finished"] * 3, events
    assert all(tokens > 0 for kind, _, tokens in events if kind == "prefilled")  # their prompt tokens
    assert sorted(key for kind, key, _ in events if kind == "finished") == [(f"r{i}", 0) for i in range(3)]
