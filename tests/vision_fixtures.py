"""What the VLM families' tests share: greedy decoding after an image prefill, a mixed JSONL batch
through mlxcel-run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.helpers import by_key, read_rows, run_cli, write_rows


def assert_batch_rows_equal_their_runs_alone(
    tmp_path: Path, args: tuple[str, ...], rows: list[dict], failing: dict[str, str]
) -> dict:
    """Run `rows` as one batch (`args` + prompt=jsonl), then every row not in `failing` alone:
    each failing row's error holds its text, each other row gives the same tokens as alone.
    Returns the batch's rows by (id, sample)."""
    common = (*args, "prompt=jsonl")
    (tmp_path / "batch").mkdir()
    result = run_cli(
        tmp_path / "batch",
        *common,
        f"prompt.file={write_rows(tmp_path / 'rows.jsonl', rows)}",
        f"runner.max_rows={len(rows)}",
    )
    assert result.returncode == 0, result.stderr
    got = by_key(read_rows(tmp_path / "batch" / "run"))
    for row in rows:
        key = (row["id"], 0)
        if row["id"] in failing:
            assert got[key]["finish_reason"] == "error" and failing[row["id"]] in got[key]["error"], got[key]
            continue
        (tmp_path / "alone" / row["id"]).mkdir(parents=True)
        alone = run_cli(
            tmp_path / "alone" / row["id"],
            *common,
            f"prompt.file={write_rows(tmp_path / (row['id'] + '.jsonl'), [row])}",
        )
        assert alone.returncode == 0, alone.stderr
        assert got[key]["token_ids"] == read_rows(tmp_path / "alone" / row["id"] / "run")[0]["token_ids"], row["id"]
    return got


def mlxcel_greedy_after(model, logits: np.ndarray, cache, n: int) -> list[int]:
    """n greedy tokens: the first from a prefill's logits [L, V], the rest decoded on its cache."""
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(mx.argmax(model(mx.array([tokens[-1]])[None], cache)[0, -1]).item()))
    return tokens


def assert_config_issues(error, expected: dict[str, tuple[str, str]]) -> None:
    """A ConfigError (exit 2) holding exactly the `expected` keys, each line naming the legal
    range and the bad value: {key: (text of the legal range, repr of the value)}."""
    text = str(error)
    assert len(error.issues) == len(expected), text
    for key, (legal, got) in expected.items():
        line = next(line for line in text.splitlines() if line.startswith(key + ":"))
        assert legal in line and f"(got {got})" in line, line
    assert error.exit_code == 2


def build_once(tmp_path_factory, build: Callable[[Path, str], Any]) -> Callable[[str], tuple]:
    """For a module-scoped fixture: name -> (folder, *build(folder, name)), each checkpoint written
    once into its own temporary folder (a non-tuple result counts as one item)."""

    @functools.cache
    def get(name: str) -> tuple:
        folder = tmp_path_factory.mktemp(name)
        made = build(folder, name)
        return (folder, *(made if isinstance(made, tuple) else (made,)))

    return get
