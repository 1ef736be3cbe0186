"""Progress of a batch job: a one-line bar on a terminal, plain periodic log lines otherwise.

It moves before any row finishes: a row counts as prefilled when its first token comes (its
prompt is in), and tokens count as they are drawn. The ETA counts the rows in flight too, by the
tokens they have drawn (done_fraction): counting finished rows alone, a job of many rows decoding
side by side looked hours long when its first row ended, as if the rows ran one at a time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.25  # a bar redraws at most this often between rows (it is told of every token)


class Progress:
    def __init__(
        self,
        total_rows: int,
        mode: str = "auto",
        stream: TextIO | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.stream = stream if stream is not None else sys.stderr
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.mode = ("bar" if is_tty else "log") if mode == "auto" else mode
        self.total = total_rows
        self.rows = 0  # finished
        self.tokens = 0  # drawn, finished rows' and live ones'
        self.finished_tokens = 0  # of the finished rows
        self.prefilled = 0  # rows whose prompt is in (first token seen, or finished)
        self.prompt_tokens = 0  # of the prefilled rows
        self.live: dict[Hashable, int] = {}  # rows decoding: tokens drawn so far
        self.clock = clock
        self.start = clock()
        self.interval_s = interval_s
        self.last_log = self.last_draw = self.start

    # ---- what the runner reports ----
    def start_row(self, key: Hashable, prompt_tokens: int) -> None:
        """A row's first token came: its prefill is done."""
        self.live[key] = 0
        self.prefilled += 1
        self.prompt_tokens += prompt_tokens
        self.show()

    def add_token(self, key: Hashable, prompt_tokens: int = 0) -> None:
        """A token drawn for row `key`; its first says the row's prompt (`prompt_tokens`) is in."""
        if key not in self.live:
            self.start_row(key, prompt_tokens)
        self.live[key] += 1
        self.tokens += 1
        if self.mode != "off":
            self.show()

    def finish_row(self, key: Hashable, tokens: int, prompt_tokens: int = 0) -> None:
        """A row ended with `tokens` tokens (those seen by add_token already counted)."""
        if key in self.live:
            self.tokens += tokens - self.live.pop(key)
        else:  # ended before its first token was reported (a stop id first, an error)
            self.tokens += tokens
            self.prefilled += 1
            self.prompt_tokens += prompt_tokens
        self.rows += 1
        self.finished_tokens += tokens
        self.show(row_done=True)

    def update(self, rows: int = 0, tokens: int = 0) -> None:
        """Rows that finished elsewhere (a Ray worker), with their tokens: counted whole."""
        self.rows += rows
        self.prefilled += rows
        self.tokens += tokens
        self.finished_tokens += tokens
        self.show(row_done=bool(rows))

    # ---- what is shown ----
    def show(self, row_done: bool = False) -> None:
        if self.mode == "off":
            return
        now = self.clock()
        if self.mode == "bar":
            if row_done or now - self.last_draw >= REDRAW_S:
                self.last_draw = now
                self.stream.write("\r" + self.describe(now, bar=True))
                self.stream.flush()
        elif self.mode == "log" and (now - self.last_log >= self.interval_s or (row_done and self.rows == self.total)):
            self.last_log = now
            print("mlxcel: " + self.describe(now, bar=False), file=self.stream, flush=True)

    def done_fraction(self) -> float:
        """The share of the job's work done: finished rows whole, a row in flight by its tokens
        against the finished rows' mean length, and at most half done (the rows that finish first
        are the short ones). NaN before any row finished: no length to go by."""
        if not self.total:
            return 1.0
        if not self.rows:
            return float("nan")
        mean = self.finished_tokens / self.rows
        partial = sum(drawn / max(mean, 2 * drawn) for drawn in self.live.values() if drawn)
        return min(1.0, (self.rows + partial) / self.total)

    def describe(self, now: float, bar: bool) -> str:
        elapsed = max(now - self.start, 1e-9)
        done = self.done_fraction()
        eta = elapsed / done - elapsed if done > 0 else float("nan")  # (NaN > 0 is False)
        text = f"{self.rows}/{self.total} rows"
        if self.prefilled > self.rows:  # rows in flight (a Ray job reports finished rows only)
            text += f" | {self.prefilled}/{self.total} prefilled ({self.prompt_tokens} prompt tok)"
        text += f" | {self.tokens} tok, {self.tokens / elapsed:.1f} tok/s | ETA {format_seconds(eta)}"
        if not bar:
            return text
        filled = int(BAR_WIDTH * (self.rows / self.total if self.total else 1.0))
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
