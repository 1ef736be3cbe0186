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
