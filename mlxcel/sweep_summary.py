"""Sweep summaries: one row per job of a multirun in <sweep dir>/summary.jsonl, .csv and .png.

The Hydra callback (hydra_callbacks.py) adds a row after every job, failed jobs too, and rewrites
the CSV and the plot from summary.jsonl each time: Hydra does not call on_multirun_end after a
failed job, so the files must be complete after every job. No Hydra import here: the callback
hands over plain data (the job's overrides already parsed into `params`).
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxcel.outputs import HEADLINE_FIELDS

JSONL_FILE, CSV_FILE, PNG_FILE = "summary.jsonl", "summary.csv", "summary.png"


def read_job_stats(job_dir: Path) -> dict | None:
    """The job's stats.json (the runner and cli.run_job write it, also for failed runs)."""
    try:
        return json.loads((Path(job_dir) / "stats.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def make_summary_row(
    job: int,
    overrides: list[str],
    params: dict,
    swept: list[str],
    job_dir: Path,
    stats: dict | None,
    job_error: BaseException | None = None,
    job_status: str | None = None,
) -> dict:
    """One summary row. stats.json decides the status; without one (the job died before it
    could write it) Hydra's job status and the exception it caught do."""
    stats = stats or {}
    error = stats.get("error") if isinstance(stats.get("error"), dict) else None
    status = stats.get("status") or ("failed" if job_error is not None else job_status or "unknown")
    if error is None and job_error is not None:
        error = {"type": type(job_error).__name__, "message": str(job_error)}
    row: dict[str, Any] = {
        "job": job,
        "overrides": list(overrides),
        "params": dict(params),
        "swept": list(swept),
        "status": status,
        "error_type": error.get("type") if error else None,
        "error": error.get("message") if error else None,
    }
    row.update({name: stats.get(name) for name in HEADLINE_FIELDS})
    row["tokens_sha256"] = hash_tokens(job_dir)
    row["plan_sha256"] = hash_plan(stats)
    row["job_dir"] = str(job_dir)
    return row


def hash_tokens(job_dir: Path) -> str | None:
    """Every row's token ids, in (id, sample) order: equal hashes, equal generations."""
    import hashlib

    try:
        lines = (Path(job_dir) / "generations.jsonl").read_text(encoding="utf-8").splitlines()
        rows = sorted((json.loads(line) for line in lines), key=lambda r: (str(r.get("id")), r.get("sample", 0)))
    except (OSError, ValueError):
        return None
    data = [[str(r.get("id")), r.get("sample", 0), r.get("token_ids")] for r in rows]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16] if rows else None


def hash_plan(stats: dict) -> str | None:
    """The prefill pieces the job ran (where, how long, padded how), without their timings."""
    import hashlib

    pieces = [
        {k: v for k, v in p.items() if k != "ms"}
        for b in stats.get("batches") or []
        for p in b.get("prefill_pieces") or []
    ]
    return hashlib.sha256(json.dumps(pieces, sort_keys=True).encode()).hexdigest()[:16] if pieces else None


def describe_unchanged(rows: list[dict], swept: list[str]) -> str | None:
    """A warning when every completed job ran the same prefill plan and drew the same tokens: the
    swept keys changed nothing, and the figures' differences are noise (chunk sizes on a chat
    prompt, whose history boundary makes one piece whatever the chunk)."""
    done = [r for r in rows if r.get("status") == "completed" and r.get("tokens_sha256")]
    if len(done) < 2 or not swept:
        return None
    if len({r["tokens_sha256"] for r in done}) == 1 and len({r.get("plan_sha256") for r in done}) == 1:
        return (
            f"mlxcel: warning: the swept {', '.join(swept)} changed neither the prefill plan nor the tokens of "
            f"{len(done)} jobs: their figures differ by noise only"
        )
    return None


@contextmanager
def lock_summary(sweep_dir: Path) -> Iterator[None]:
    """One job at a time adds its row and rewrites the files: a launcher (joblib, submitit, Ray)
    ends jobs in several processes at once."""
    with open(Path(sweep_dir) / ".summary.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # (closing the file drops the lock)


def append_summary_row(sweep_dir: Path, row: dict) -> None:
    with open(Path(sweep_dir) / JSONL_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_summary_rows(sweep_dir: Path) -> list[dict]:
    """The rows of summary.jsonl by job number; a job written twice keeps its last row."""
    rows: dict[int, dict] = {}
    path = Path(sweep_dir) / JSONL_FILE
    if not path.is_file():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line from a killed process: skip it, keep the rest
            continue
        if isinstance(row, dict) and isinstance(row.get("job"), int):
            rows[row["job"]] = row
    return [rows[job] for job in sorted(rows)]


def find_swept_keys(rows: list[dict]) -> list[str]:
    """The swept parameters: those the sweep declared, then any other override whose value
    differs between jobs (in order of first appearance)."""
    keys: list[str] = []
    for row in rows:
        keys += [key for key in row.get("swept") or [] if key not in keys]
    seen: dict[str, set] = {}
    for row in rows:
        for key, value in (row.get("params") or {}).items():
            seen.setdefault(key, set()).add(json.dumps(value, sort_keys=True, default=str))
    all_params = [key for row in rows for key in row.get("params") or {}]
    for key in dict.fromkeys(all_params):
        present = sum(key in (row.get("params") or {}) for row in rows)
        if key not in keys and (len(seen[key]) > 1 or present < len(rows)):
            keys.append(key)
    return keys


def write_summary_csv(rows: list[dict], swept: list[str], path: Path) -> None:
    columns = [
        "job",
        *swept,
        "status",
        "tokens_as_first",
        *HEADLINE_FIELDS,
        "error_type",
        "error",
        "overrides",
        "job_dir",
    ]
    first = next((r.get("tokens_sha256") for r in rows if r.get("tokens_sha256")), None)
    tmp = Path(path).with_suffix(".csv.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            params = row.get("params") or {}
            digest = row.get("tokens_sha256")
            same = (
                None if digest is None or first is None else ("same" if digest == first else "differ")
            )  # token ids vs the first job's
            values = [row.get("job"), *(format_cell(params.get(key)) for key in swept), row.get("status"), same]
            values += [row.get(name) for name in HEADLINE_FIELDS]
            error = "; ".join((row.get("error") or "").splitlines())  # a config error's lines, one cell line
            values += [row.get("error_type"), error, " ".join(row.get("overrides") or []), row.get("job_dir")]
            writer.writerow(["" if value is None else value for value in values])
    os.replace(tmp, path)


def format_cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def write_summary(sweep_dir: Path) -> list[dict]:
    """Rewrite summary.csv and summary.png from summary.jsonl; returns the rows."""
    from mlxcel.plot import draw_sweep_plot  # Pillow only when there is something to draw

    sweep_dir = Path(sweep_dir)
    rows = read_summary_rows(sweep_dir)
    swept = find_swept_keys(rows)
    write_summary_csv(rows, swept, sweep_dir / CSV_FILE)
    tmp = sweep_dir / (PNG_FILE + ".tmp")
    draw_sweep_plot(rows, swept, tmp, title="mlxcel sweep " + "/".join(sweep_dir.parts[-3:]))
    os.replace(tmp, sweep_dir / PNG_FILE)
    return rows


def clear_summary(sweep_dir: Path) -> None:
    """A sweep started again in the same folder: its old rows would describe overwritten jobs."""
    for name in (JSONL_FILE, CSV_FILE, PNG_FILE):
        (Path(sweep_dir) / name).unlink(missing_ok=True)
