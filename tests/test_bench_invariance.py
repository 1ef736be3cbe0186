"""python -m mlxcel.bench.invariance on small shapes: on the CPU every row count keeps a row's bits
(MLX's CPU kernels reduce in one order), so every check lists every row count."""

from __future__ import annotations

import json

import pytest

from mlxcel.bench import invariance

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


def test_on_the_cpu_every_row_count_keeps_a_rows_bits(tmp_path, capsys):
    out = tmp_path / "invariance.json"
    argv = ["--shapes", "64x96,96x64", "--rows", "1,2,5,64,70", "--dtype", "bfloat16", "--json", str(out)]
    assert invariance.main(argv) == 0
    report = json.loads(out.read_text())
    assert [m["row0_as_at_1"] for m in report["matmul"]] == [[1, 2, 5, 64, 70]] * 2
    assert [m["rows64_as_at_64"] for m in report["matmul"]] == [[64, 70]] * 2
    assert report["rms_norm"] == [1, 2, 5, 64, 70] and report["attention"] == invariance.ATTENTION_BATCHES
    assert "matmul 64x96: row 0 as at M=1 for M in [1, 2, 5, 64, 70]" in capsys.readouterr().out


def test_a_bad_shape_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        invariance.main(["--shapes", "64by96"])
    assert exit_.value.code == 2 and "expected KxN" in capsys.readouterr().err
