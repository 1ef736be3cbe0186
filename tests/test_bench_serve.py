"""The serving benchmark (python -m mlxcel.bench.serve) on the embedded SmolLM2, tiny settings.

The slow tests start the real servers as subprocesses; the mlx-lm one needs the `bench` extra
and skips without it.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from mlxcel.bench import serve
from mlxcel.bench.serve import METRICS

requires_mlx_lm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="needs mlx-lm, the bench extra (not installed on CI): pip install -e '.[bench]'",
)
TINY_RUN = ["--clients", "2", "--requests", "2", "--max-tokens", "8", "--prompt-tokens", "24", "--dtype", "float32"]


class WordCounter:
    """A tokenizer stand-in: one token per space-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_prompts_are_drawn_from_the_seed():
    prompts = serve.draw_text_prompts(WordCounter(), 6, 40, seed=3)
    assert prompts == serve.draw_text_prompts(WordCounter(), 6, 40, seed=3)
    assert prompts != serve.draw_text_prompts(WordCounter(), 6, 40, seed=4)
    assert len(set(prompts)) == 6  # a prompt per request: the prompt cache cannot answer them all
    assert all(len(p.split()) == 40 for p in prompts)  # filled up to the token count, not past it


def run_bench(tmp_path, servers: str) -> dict:
    out = tmp_path / "out.json"
    argv = [*TINY_RUN, "--servers", servers, "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    assert serve.main(argv) == 0
    return json.loads(out.read_text())


def check_figures(summary: dict) -> None:
    assert summary["requests"] == 2 and summary["errors"] == 0
    assert 0 < summary["tokens"] <= 2 * 8 and summary["throughput_tok_s"] > 0
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p95_ms"]
    if summary["tokens"] > 2:  # a gap needs two content chunks in one request
        assert 0 <= summary["itl_p50_ms"] <= summary["itl_p95_ms"]


@pytest.mark.slow
def test_mlxcel_serve_alone(tmp_path):
    report = run_bench(tmp_path, "mlxcel")
    assert list(report["servers"]) == ["mlxcel"] and report["ratio"] is None
    check_figures(report["servers"]["mlxcel"])
    assert report["run"]["endpoint"] == "chat"  # SmolLM2's folder carries its chat template
    assert report["mlxcel_stats"]["requests"] == {"200": 4}  # the warm-up round's 2, the timed round's 2
    assert all(r["ttft_s"] > 0 for r in report["requests"]["mlxcel"])


@pytest.mark.slow
@requires_mlx_lm
def test_both_servers(tmp_path):
    report = run_bench(tmp_path, "mlxcel,mlx-lm")
    for name in ("mlxcel", "mlx-lm"):
        check_figures(report["servers"][name])
    assert set(report["ratio"]) == set(METRICS) and all(math.isfinite(v) for v in report["ratio"].values())
    flags = ["--max-tokens", "8", "--decode-concurrency", "2", "--prompt-concurrency", "2"]
    assert report["run"]["mlx_lm_flags"] == flags  # our length and row count; its own batching otherwise
