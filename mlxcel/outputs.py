"""The run folder: config.resolved.json, generations.jsonl (one line per finished row,
flushed as it lands), stats.json (written atomically, also when a run fails)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.resolved.json"
GENERATIONS_FILE = "generations.jsonl"
STATS_FILE = "stats.json"


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class RunOutputs:
    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, resolved: dict) -> None:
        write_json_atomic(self.dir / CONFIG_FILE, resolved)

    def append_generation(self, row: dict) -> None:
        with open(self.dir / GENERATIONS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_stats(self, stats: dict) -> None:
        write_json_atomic(self.dir / STATS_FILE, stats)


def describe_error(exc: BaseException) -> dict:
    import traceback

    return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(traceback.format_exception(exc))}


def write_failure_stats(out_dir: Path, exc: BaseException, report: dict | None = None) -> None:
    """stats.json for a run that did not complete: `status` says how it ended, `error` why."""
    report = dict(report or {})
    report["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    report["error"] = describe_error(exc)
    RunOutputs(out_dir).write_stats(report)
