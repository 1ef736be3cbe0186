"""The ragged-job benchmark (python -m mlxcel.bench.jobs) on a tiny checkpoint.

The mlx-lm side needs the `bench` extra, which CI does not install: that test skips without it.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from mlxcel.bench import jobs
from mlxcel.bench.jobs import METRICS, draw_job
from tests.test_bench import ATTENTION_SHAPES, HYBRID_SHAPES, build_tiny_attention, build_tiny_hybrid

requires_mlx_lm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="needs mlx-lm, the bench extra (not installed on CI): pip install -e '.[bench]'",
)
TINY_JOB = ["--rows", "5", "--prompt-tokens", "3,12", "--output-tokens", "1,6", "--max-rows", "2", "--dtype", "float32"]


def run_tiny_job(tiny_llama, tmp_path, capsys, engines: str, *extra: str) -> tuple[dict, list[str]]:
    out = tmp_path / "out.json"
    argv = [
        "--models",
        str(tiny_llama),
        *TINY_JOB,
        "--engines",
        engines,
        "--work-dir",
        str(tmp_path),
        "--json",
        str(out),
        *extra,
    ]
    assert jobs.main(argv) == 0
    return json.loads(out.read_text()), capsys.readouterr().out.splitlines()


def test_rows_are_drawn_from_the_seed():
    job = draw_job(20, (3, 9), (1, 4), vocab_size=1000, special_ids=[200, 201], seed=3)
    assert job == draw_job(20, (3, 9), (1, 4), vocab_size=1000, special_ids=[200, 201], seed=3)
    assert job != draw_job(20, (3, 9), (1, 4), vocab_size=1000, special_ids=[200, 201], seed=4)
    assert all(3 <= len(p) <= 9 for p in job.prompts) and all(1 <= n <= 4 for n in job.output_lengths)
    ids = {i for p in job.prompts for i in p}
    assert min(ids) >= 100 and max(ids) < 1000 and not ids & {200, 201}  # no low (special) ids, no config specials
    other_vocab = draw_job(20, (3, 9), (1, 4), vocab_size=50000, special_ids=[], seed=3)
    assert list(map(len, other_vocab.prompts)) == list(map(len, job.prompts))  # every model gets the same lengths
    assert other_vocab.output_lengths == job.output_lengths


def test_mlxcel_rows_generate_their_drawn_lengths(tiny_llama, tmp_path, capsys):
    report, lines = run_tiny_job(tiny_llama, tmp_path, capsys, "mlxcel")
    (model,) = report["models"]
    assert (
        model["rows"]["mlxcel"]["generated_tokens"] == report["job"]["output_lengths"]
    )  # no EOS stop, per-row max_tokens
    assert len(report["job"]["prompt_lengths"]) == 5 and all(t > 0 for t in model["rows"]["mlxcel"]["ttft_s"])
    assert model["ratio"] is None
    scheduler = model["scheduler"]  # the scheduler's own figures: rows decoding, host work, KV
    assert 0 < scheduler["occupancy"] <= 5 and scheduler["host_ms_per_step"] > 0 and "kv_peak_gb" in scheduler
    top = next(i for i, line in enumerate(lines) if line.startswith("model "))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("ratio = "))
    assert lines[top].split() == ["model", "metric", "mlxcel", "mlx-lm", "ratio"]
    rows = lines[top + 2 : bottom]
    assert [line.split("  ")[1].strip() for line in rows] == [label for label, _ in METRICS.values()]
    assert all(line.startswith(tiny_llama.name) for line in rows)
    assert rows[0].split()[-2:] == ["-", "-"]  # no mlx-lm column, no ratio
    assert f"{tiny_llama.name} mlxcel: 0 rows off their output length" in lines


@requires_mlx_lm
def test_both_engines_run_the_job_and_agree(tiny_llama, tmp_path, capsys):
    report, lines = run_tiny_job(tiny_llama, tmp_path, capsys, "mlxcel,mlx-lm")
    (model,) = report["models"]
    assert model["rows"]["mlx-lm"]["generated_tokens"] == report["job"]["output_lengths"]
    assert model["rows_agree"] == 5 and model["token_ids_agree"] == "agree"  # fp32, same weights
    assert all(ratio > 0 for ratio in model["ratio"].values())
    assert f"{tiny_llama.name} greedy token ids: 5/5 rows agree" in lines


def test_hybrid_rows_generate_their_drawn_lengths_through_the_scheduler(tmp_path, capsys):
    folder = build_tiny_hybrid("qwen3.5-0.8b", tmp_path / "qwen3.5")
    report, lines = run_tiny_job(folder, tmp_path, capsys, "mlxcel")
    (model,) = report["models"]
    assert model["rows"]["mlxcel"]["generated_tokens"] == report["job"]["output_lengths"]
    assert model["scheduler"]["occupancy"] > 0  # the scheduler ran the rows, not the batch engine
    assert f"{folder.name} mlxcel: 0 rows off their output length" in lines


@requires_mlx_lm
@pytest.mark.parametrize("name", HYBRID_SHAPES)
def test_both_engines_run_the_hybrid_job_and_agree(name, tmp_path, capsys):
    report, lines = run_tiny_job(build_tiny_hybrid(name, tmp_path / name), tmp_path, capsys, "mlxcel,mlx-lm")
    (model,) = report["models"]
    assert model["rows"]["mlx-lm"]["generated_tokens"] == report["job"]["output_lengths"]
    assert model["rows_agree"] == 5 and model["token_ids_agree"] == "agree"  # fp32, same weights


@requires_mlx_lm
@pytest.mark.parametrize("name", ATTENTION_SHAPES)
def test_both_engines_run_the_attention_job_and_agree(name, tmp_path, capsys):
    """gpt-oss (sinks, 8-token windows, MXFP4 experts) and Gemma 4 (PLE, shared KV) through the job path,
    prompts and outputs past the window."""
    report, lines = run_tiny_job(build_tiny_attention(name, tmp_path / name), tmp_path, capsys, "mlxcel,mlx-lm")
    (model,) = report["models"]
    assert model["rows"]["mlxcel"]["generated_tokens"] == report["job"]["output_lengths"]
    assert model["scheduler"]["occupancy"] > 0  # the scheduler ran the rows, not the batch engine
    assert model["rows_agree"] == 5 and model["token_ids_agree"] == "agree"  # fp32, same weights


def test_bad_ranges_and_engines_are_refused():
    for argv in (["--prompt-tokens", "9,3"], ["--output-tokens", "4"], ["--engines", "mlxcel,vllm"]):
        with pytest.raises(SystemExit):
            jobs.parse_args(argv)


def test_the_uniform_job_has_the_mean_lengths_and_the_peak_ratio_is_printed(tiny_llama, tmp_path, capsys):
    job = draw_job(6, (3, 20), (1, 9), vocab_size=1000, special_ids=[], seed=5)
    uniform = jobs.make_uniform(job)
    prompt, output = round(sum(map(len, job.prompts)) / 6), round(sum(job.output_lengths) / 6)
    assert [len(p) for p in uniform.prompts] == [prompt] * 6 and uniform.output_lengths == [output] * 6
    assert all(set(u) <= set(p) for u, p in zip(uniform.prompts, job.prompts))  # each row keeps its own ids

    report, lines = run_tiny_job(tiny_llama, tmp_path, capsys, "mlxcel", "--uniform")
    (model,) = report["models"]
    ratio = model["metrics"]["mlxcel"]["peak_gb"] / model["uniform"]["peak_gb"]
    assert any(
        line.startswith(f"{tiny_llama.name} mlxcel peak memory, ragged / uniform") and line.endswith(f"= {ratio:.2f}")
        for line in lines
    ), lines


def test_reruns_count_the_rows_that_repeat_their_token_ids(tiny_llama, tmp_path, capsys):
    report, lines = run_tiny_job(tiny_llama, tmp_path, capsys, "mlxcel", "--reruns", "2")
    (model,) = report["models"]
    # greedy on the CPU in fp32: every row repeats exactly
    assert model["reruns"] == f"{model['model']} mlxcel reruns: 5/5 rows drew the same token ids in all 3 runs"
    assert model["reruns"] in lines
