"""python -m mlxcel.bench.adapters and python -m mlxcel.bench --draft: the benches run end to end on
a tiny checkpoint and print what they measure (figures are the GPU's to give: docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from mlxcel.bench import adapters as bench_adapters

pytestmark = pytest.mark.usefixtures("on_the_cpu")


def test_the_adapter_bench_runs_base_merged_and_mixed(tiny_llama, tmp_path, capsys):
    out = tmp_path / "adapters.json"
    args = ["--model", str(tiny_llama), "--rows", "4", "--adapters", "2", "--rank", "4", "--max-rows", "2"]
    args += ["--prompt-tokens", "4,12", "--output-tokens", "2,6", "--work-dir", str(tmp_path), "--json", str(out)]
    assert bench_adapters.main(args) == 0
    printed = capsys.readouterr().out
    assert "2 adapters of rank 4 on every projection" in printed and "mixed / merged:" in printed
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {f"{model} {run}" for model in ("base", "merged", "mixed") for run in ("first", "again")}
    assert all(run["generated_tokens"] == runs["base first"]["generated_tokens"] > 0 for run in runs.values())
    assert "first run" in printed and "again" in printed
    written = sorted(p.name for p in tmp_path.glob("adapter-*"))
    assert len(written) == 2 and (tmp_path / written[0] / "adapter_config.json").exists()


def test_the_draft_bench_makes_an_extraction_prompt():
    from mlxcel.bench.draft import INSTRUCTION, make_document

    document = make_document(3)
    assert document.count("\n") == 14 and "EUR" in INSTRUCTION
    assert make_document(3) == document != make_document(4)  # (a seed's documents)
