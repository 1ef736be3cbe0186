"""The side-by-side benchmark (python -m mlxcel.bench) on a tiny checkpoint.

The tests that run mlx-lm skip without it: it is the `bench` extra, which CI does not install
(`.[cpu,test]`), so on CI only the tests that need no mlx-lm run.
"""

from __future__ import annotations

import importlib.util
import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.bench import __main__ as bench_cli
from mlxcel.bench.checkpoints import (
    RANDOM_SHAPES,
    list_weight_shapes,
    prepare_checkpoint,
    unpermute_from_llama_cpp,
)
from mlxcel.bench.harness import (
    METRICS,
    bench_model,
    compare_token_ids,
    format_agreement,
    format_table,
    make_table_rows,
)
from tests.helpers import requires_smollm2

requires_mlx_lm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="needs mlx-lm, the bench extra (not installed on CI): pip install -e '.[bench]'",
)


@requires_mlx_lm
def test_bench_runs_both_engines_and_they_agree(tiny_llama, tmp_path):
    folder = prepare_checkpoint(str(tiny_llama), tmp_path, mx.float32)
    assert json.loads((folder / "config.json").read_text())["rope_theta"] == 10000.0  # mlx-lm reads only this key
    results = bench_model("tiny", folder, [12], [1, 2], gen=4, reps=1, dtype=mx.float32, warm_each_case=False)

    rows = make_table_rows(results)
    assert [(r["batch"], r["prompt"], r["metric"]) for r in rows] == [
        (batch, 12, label) for batch in (1, 2) for label, _ in METRICS.values()
    ]
    for row in rows:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        assert row["mlxcel"] > 0 and row["mlx-lm"] > 0, row
    for case in results:
        assert case.agreement() == "agree"  # fp32, same weights: the same greedy tokens
        assert all(len(ids) == 4 for run in case.runs.values() for ids in run[0].token_ids)
        assert len(case.runs["mlx-lm"][0].token_ids) == case.batch
    table = format_table(results)
    assert table.splitlines()[0].split() == ["model", "batch", "prompt", "metric", "mlxcel", "mlx-lm", "ratio"]
    assert "tiny batch 2 prompt 12: agree" in format_agreement(results)
    json.dumps([case.to_dict() for case in results])  # what --json writes


def test_without_mlx_lm_the_bench_says_how_to_install_it(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlx_lm" else real_find_spec(name, *a)
    )
    assert bench_cli.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e '.[bench]'" in err


def test_cli_defaults_and_explicit_flags():
    args = bench_cli.parse_args(["--quick", "--batch-sizes", "1,4"])
    assert (args.models, args.prompt_lengths, args.batch_sizes, args.gen, args.reps) == (
        ["smollm2"],
        [64],
        [1, 4],
        8,
        1,
    )
    args = bench_cli.parse_args(["--models", "smollm2, qwen2.5-0.5b", "--gen", "32"])
    assert args.models == ["smollm2", "qwen2.5-0.5b"] and args.gen == 32
    with pytest.raises(SystemExit):
        bench_cli.parse_args(["--prompt-lengths", "0"])


def test_first_token_mismatch_is_located():
    assert compare_token_ids([[1, 2, 3]], [[1, 2, 3]]) == "agree"
    assert (
        compare_token_ids([[1, 2], [5, 6, 7]], [[1, 2], [5, 9, 7]]) == "row 1 differs at token 1 (mlxcel 6, mlx-lm 9)"
    )


def test_unpermute_undoes_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    # convert_hf_to_gguf.py's LlamaModel.permute (as tests/test_gguf_families.py writes it)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(np.array(unpermute_from_llama_cpp(mx.array(permuted), heads)), w)


def test_random_shapes_have_the_published_parameter_counts():
    counts = {
        name: sum(math.prod(s) for s in list_weight_shapes(shape).values()) for name, shape in RANDOM_SHAPES.items()
    }
    assert round(counts["qwen2.5-0.5b"] / 1e6) == 494  # Qwen2.5-0.5B: 0.49B
    assert round(counts["llama-3.2-1b"] / 1e6) == 1236  # Llama-3.2-1B: 1.24B


@pytest.mark.slow
@requires_smollm2
def test_smollm2_export_matches_the_gguf(tmp_path):
    """The exported folder (dequantized, Q/K un-permuted, standard RoPE) computes what mlxcel
    computes from the GGUF file itself (dequantized, interleaved RoPE)."""
    from mlxcel.checkpoints.loader import load_model

    folder = prepare_checkpoint("smollm2", tmp_path, mx.float32)
    tokens = mx.array([[(17 * i + 3) % 30000 + 100 for i in range(24)]])
    logits = []
    for path, weights in ((str(folder), "auto"), ("embedded:smollm2", "dequantize")):
        model = load_model(path, dtype="float32", gguf_weights=weights).model
        logits.append(np.array(model(tokens, model.make_cache())))
    assert np.abs(logits[0] - logits[1]).max() <= 1e-3


def test_policy_bench_tables_every_dtype_and_chunk(tiny_llama, tmp_path):
    from mlxcel.bench import policy

    args = policy.parse_args(
        [
            "--model",
            str(tiny_llama),
            "--dtypes",
            "float32,bfloat16",
            "--dtype-prompt-len",
            "12",
            "--chunks",
            "4,16",
            "--chunk-prompt-len",
            "16",
            "--gen",
            "3",
            "--reps",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    dtype_table, chunk_table = (
        policy.measure_dtypes(str(tiny_llama), args),
        policy.measure_chunks(str(tiny_llama), args),
    )
    assert [row.split("|")[1].strip() for row in dtype_table[3:]] == ["float32 (auto)", "bfloat16"]
    chunk_rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in chunk_table[3:]]
    assert [(row[0], row[1]) for row in chunk_rows] == [("4", "4"), ("16", "1")]
    assert all(float(value) > 0 for row in chunk_rows for value in row[2:])
    with pytest.raises(SystemExit):
        policy.parse_args(["--dtypes", "fp8"])
