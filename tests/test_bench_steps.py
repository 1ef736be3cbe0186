"""python -m mlxcel.bench.steps on a tiny model: it prints a decode step, both prefill pieces and
the scheduler's loop with its host share."""

from __future__ import annotations

import re

from mlxcel.bench import steps


def test_the_profile_prints_every_figure(tiny_llama, tmp_path, capsys):
    assert (
        steps.main(
            ["--model", str(tiny_llama), "--rows", "3", "--context", "20", "--steps", "4", "--work-dir", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(
        r"decode step, 3 rows of 20 positions on average: [\d.]+ ms \([\d.]+ ms of it building the graph\)", out
    ), out
    assert re.search(r"prefill piece of 512 tokens after 20: [\d.]+ ms", out) and re.search(
        r"prefill piece of 2048 tokens after 20: [\d.]+ ms", out
    )
    run = re.search(
        r"scheduler, 3 rows of 20 prompt tokens x 4 tokens: ([\d.]+) ms per iteration"
        r" .* host work ([\d.]+) ms per iteration",
        out,
    )
    assert run and 0 < float(run.group(2)) <= float(run.group(1)), out
