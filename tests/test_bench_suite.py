"""python -m mlxcel.bench.suite: every comparison in one call, each part in its own time, one table."""

from __future__ import annotations

import json
import sys

import pytest

from mlxcel.bench import suite


def test_an_unknown_part_is_refused_naming_the_parts(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--out", "x", "--parts", "jobs,speed"])
    assert "unknown part 'speed'; the parts are jobs, batch1, readme, structured, families" in capsys.readouterr().err


@pytest.mark.slow  # subprocesses: the bench's own commands on a tiny shape
def test_the_suite_runs_its_parts_and_tables_them(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlx_lm")
    monkeypatch.setenv("MLXCEL_BENCH_DIR", str(tmp_path / "work"))
    out = tmp_path / "out"
    code = suite.main(["--out", str(out), "--shapes", "llama-16x64", "--rows", "4", "--parts", "jobs,readme"])
    table = capsys.readouterr().out
    assert code == 0, (out / "jobs.log").read_text() + (out / "readme.log").read_text()
    result = json.loads((out / "suite.json").read_text())
    assert [p["status"] for p in result["parts"]] == ["completed", "completed"]
    rows = {(row[0], row[2]): row for row in result["table"]}
    assert rows[("jobs", "gen_tok_s")][3] > 0 and rows[("jobs", "gen_tok_s")][4] > 0  # both engines ran
    assert rows[("readme", "gen_tok_s")][3] > 0
    assert "jobs    llama-16x64" in table and "readme" in table
    # the README's job wrote every row once
    assert len((out / "readme-run" / "generations.jsonl").read_text().splitlines()) == 4


def test_a_part_past_its_time_is_cut_and_the_rest_still_run(tmp_path, monkeypatch):
    """A part that overruns its share loses only itself: the next part still gets its time."""
    monkeypatch.setattr(suite, "commands", lambda part, args: [[sys.executable, "-c", "import time; time.sleep(30)"]])
    args = suite.parse_args(["--out", str(tmp_path), "--parts", "jobs,batch1", "--budget", "4"])
    first = suite.run_part("jobs", args, 1.0)
    second = suite.run_part("batch1", args, 1.0)
    assert first["status"] == second["status"] == "cut at 1 s" and first["seconds"] < 10


def test_the_family_halves_run_one_bench_each(tmp_path):
    """families runs both benches a shape; family-batch1 and family-jobs either half (a lease's call
    holds one half of the four shapes)."""
    args = suite.parse_args(["--out", str(tmp_path), "--family-shapes", "a,b"])
    benches = {
        part: [c[2] for c in suite.commands(part, args)] for part in ("families", "family-batch1", "family-jobs")
    }
    assert benches["families"] == ["mlxcel.bench"] * 2 + ["mlxcel.bench.jobs"] * 2
    assert benches["family-batch1"] == ["mlxcel.bench"] * 2 and benches["family-jobs"] == ["mlxcel.bench.jobs"] * 2
    assert [c[4] for c in suite.commands("family-jobs", args)] == ["a", "b"]


def test_the_draft_part_runs_prompt_lookup_both_ways_and_a_draft_model(tmp_path):
    args = suite.parse_args(["--out", str(tmp_path)])
    commands = suite.commands("draft", args)
    assert [c[c.index("--draft") + 1] for c in commands] == ["ngram", "ngram", "model"]
    assert commands[1][:2] == ["env", "MLXCEL_VERIFY_AS_ROWS=1"] and "env" not in commands[0] + commands[2]
