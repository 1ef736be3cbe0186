"""Progress of a batch job: a one-line bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    def __init__(self, total_rows: int, mode: str = "auto", stream: TextIO | None = None, interval_s: float = 10.0):
        self.stream = stream if stream is not None else sys.stderr
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.mode = ("bar" if is_tty else "log") if mode == "auto" else mode
        self.total = total_rows
        self.rows = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self.interval_s = interval_s
        self.last_log = self.start

    def update(self, rows: int = 0, tokens: int = 0) -> None:
        self.rows += rows
        self.tokens += tokens
        now = time.perf_counter()
        if self.mode == "bar":
            self.stream.write("\r" + self.describe(now, bar=True))
            self.stream.flush()
        elif self.mode == "log" and rows and (now - self.last_log >= self.interval_s or self.rows == self.total):
            self.last_log = now
            print("mlxcel: " + self.describe(now, bar=False), file=self.stream, flush=True)

    def describe(self, now: float, bar: bool) -> str:
        elapsed = max(now - self.start, 1e-9)
        done = self.rows / self.total if self.total else 1.0
        eta = elapsed / done - elapsed if done > 0 else float("nan")
        text = f"{self.rows}/{self.total} rows | {self.tokens / elapsed:.1f} tok/s | ETA {format_seconds(eta)}"
        if not bar:
            return text
        filled = int(BAR_WIDTH * done)
        return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {text}"

    def close(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()


def format_seconds(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):  # NaN: nothing finished yet
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
