"""python -m mlxcel.bench.structured on the embedded SmolLM2: free and constrained runs, in each
order of a constrained step asked for, give figures; an unknown order is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (Python in a subprocess)


def run_bench(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mlxcel.bench.structured", "--model", "smollm2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_each_order_asked_for_gives_a_ratio(tmp_path):
    out = tmp_path / "structured.json"
    done = run_bench(
        *("--batch-sizes", "2", "--output-tokens", "10", "--schemas", "records", "--orders", "split,after"),
        *("--json", str(out), "--work-dir", str(tmp_path / "work")),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["schema"] for r in results] == ["records@split", "records@after"]
    for r in results:
        free, constrained = r["free"], r["constrained"]
        assert r["ratio"] == constrained["decode_tok_s"] / free["decode_tok_s"] > 0
        assert constrained["mask_ms_per_step"] > 0 and free["mask_ms_per_step"] == 0
    assert "records@split" in done.stdout and "records@after" in done.stdout


def test_an_unknown_order_is_refused_by_name(tmp_path):
    done = run_bench("--orders", "split,sideways", "--work-dir", str(tmp_path))
    assert done.returncode != 0
    assert "--orders: sideways unknown; choose from split, thread, after" in done.stderr
