"""Batch job inputs: the rows of prompt.file (JSONL) or prompt.rows, checked all at once.

Every bad line is reported with its line number, in one ConfigError; ids default to the line
(item) number, from 1, and must be unique. A row with `n` > 1 becomes n samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from mlxcel.config import PromptConfig, PromptRow, check_regular_file, format_errors
from mlxcel.errors import ConfigError, ConfigIssue, RepeatedKeyError, refuse_repeated_keys
from mlxcel.job_row import JobRow, hash_row  # noqa: F401 (hash_row: re-exported for the resume check)


def input_files(prompt: PromptConfig) -> list[Path]:
    """The files a job reads its rows from (a run never writes over them)."""
    return [Path(prompt.file)] if prompt.file else []


@dataclass(frozen=True)
class Sample:
    """One generation to run: a row and which of its n samples."""

    row: JobRow
    index: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (str(self.row.id), self.index)


def load_job_rows(prompt: PromptConfig, sampler=None, adapters: list[str] | None = None) -> list[JobRow]:
    """`sampler`: the job's sampler config, under a batch file's per-request settings; `adapters`:
    model.adapters' names, which a row's `adapter` must be one of."""
    if prompt.file is not None:
        from mlxcel.batch_files import detect_format, read_batch_rows

        issue = check_regular_file("prompt.file", prompt.file)  # a FIFO or /dev/zero: no end to read
        if issue is not None:
            raise ConfigError(issue)
        path = Path(prompt.file)
        if prompt.format == "openai_batch" or (prompt.format == "auto" and detect_format(path) == "openai_batch"):
            return read_batch_rows(path, prompt.system, sampler)
        return check_rows(read_jsonl_rows(path), prompt, f"prompt.file={prompt.file}", adapters)
    if prompt.rows is not None:
        items = [(index, row.model_dump(exclude_unset=True)) for index, row in enumerate(prompt.rows, start=1)]
        return check_rows(items, prompt, "prompt.rows", adapters)
    return [JobRow(id=1, messages=prompt.to_messages())]


def read_jsonl_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed object) for every non-blank line; bad JSON is collected, not raised."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(ConfigIssue("prompt.file", f"cannot read: {exc}", str(path))) from exc
    items, issues = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            items.append((number, json.loads(line, object_pairs_hook=refuse_repeated_keys)))
        except json.JSONDecodeError as exc:
            issues.append(
                ConfigIssue(
                    f"prompt.file line {number}", f"not valid JSON ({exc.msg} at column {exc.colno})", line[:80]
                )
            )
        except RecursionError:
            issues.append(ConfigIssue(f"prompt.file line {number}", "nested too deeply to read", line[:80]))
        except RepeatedKeyError as exc:
            issues.append(
                ConfigIssue(
                    f"prompt.file line {number}",
                    f"the key {exc.args[0]!r} appears twice (JSON would keep the last silently)",
                    line[:80],
                )
            )
    if issues:
        raise ConfigError(issues, hint=f"fix: correct those lines of {path}")
    if not items:
        raise ConfigError(ConfigIssue("prompt.file", "has no rows (every line is blank)", str(path)))
    return items


def check_rows(
    items: list[tuple[int, object]], prompt: PromptConfig, source: str, adapters: list[str] | None = None
) -> list[JobRow]:
    label = "line" if source.startswith("prompt.file") else "item"
    rows, issues, seen = [], [], {}
    for number, data in items:
        where = f"{source.split('=')[0]} {label} {number}"
        if not isinstance(data, dict):
            issues.append(ConfigIssue(where, "must be a JSON object with 'prompt' or 'messages'", data))
            continue
        try:
            row = PromptRow.model_validate(data)
        except ValidationError as err:
            for issue in format_errors(PromptRow, err.errors()):
                issues.append(ConfigIssue(f"{where}: {issue.path}", issue.message, issue.value, issue.has_value))
            continue
        row_id = row.id if row.id is not None else number
        if str(row_id) in seen:
            issues.append(ConfigIssue(where, f"duplicate id (first used at {label} {seen[str(row_id)]})", row_id))
            continue
        seen[str(row_id)] = number
        if row.adapter is not None and row.adapter not in (adapters or []):
            known = f"model.adapters has {', '.join(adapters)}" if adapters else "model.adapters is not set"
            issues.append(ConfigIssue(f"{where}: adapter", f"names no adapter ({known})", row.adapter))
            continue
        messages = row.to_messages()
        constraint, constraint_error = read_row_constraint(row)
        rows.append(
            JobRow(
                row_id,
                prompt.with_system(messages),
                row.max_tokens,
                row.seed,
                row.n,
                row.tools,
                constraint=constraint,
                constraint_error=constraint_error,
                adapter=row.adapter,
                tool_choice=row.tool_choice,
                parallel_tool_calls=row.parallel_tool_calls,
            )
        )
    if issues:
        raise ConfigError(issues, hint=f"fix: correct those rows of {source}")
    return rows


def read_row_constraint(row: PromptRow) -> tuple[dict | None, str | None]:
    """A row's own spec, or why it cannot be read (both `constraint` and `response_format`, a bad
    shape): that row's error, as a constraint that does not compile is, and the other rows run."""
    from mlxcel.structured.spec import ConstraintError

    try:
        return row.to_constraint(), None
    except ConstraintError as exc:
        return None, str(exc)


def expand_samples(rows: list[JobRow]) -> list[Sample]:
    return [Sample(row, index) for row in rows for index in range(row.n)]


def hash_samples(samples: list[Sample]) -> dict[tuple[str, int], str]:
    """Each sample's (id, sample) -> hash_row of its row."""
    return {s.key: hash_row(s.row) for s in samples}
