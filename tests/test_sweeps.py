"""Sweep summaries: a real multirun on a tiny model (one job per chunk size x seed, some failing),
and the summary/plot functions on synthetic rows."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from mlxcel import sweep_summary
from mlxcel.hydra_callbacks import SweepSummary, parse_overrides, read_swept_keys
from mlxcel.plot import COLORS, draw_sweep_plot, group_lines, make_x_scale

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. Hello, world! How are you today?"


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLXCEL_DEBUG", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---- a real sweep ----
@pytest.mark.slow
def test_sweep_writes_a_summary_row_per_job_and_exits_1_when_a_job_fails(tiny_llama, tmp_path):
    sweep = tmp_path / "sweep"
    # chunk_size=0 fails validation: jobs 4 and 5 fail, the other four must still run.
    result = run_cli(
        # template=none: a chat prompt up to its generation prompt is one piece whatever the chunk size
        [
            "-m",
            f"model.path={tiny_llama}",
            "template=none",
            "decode.max_tokens=4",
            "decode.ignore_eos=true",
            f"prompt.text={PROMPT}",
            "prefill.chunk_size=4,16,0",
            "sampler.seed=1,2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == f"mlxcel: 2 of 6 jobs failed; summary: {sweep / 'summary.csv'}"
    assert "Traceback" not in result.stderr

    rows = read_jsonl(sweep / "summary.jsonl")
    assert [r["job"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [(r["params"]["prefill.chunk_size"], r["params"]["sampler.seed"]) for r in rows] == [
        (4, 1),
        (4, 2),
        (16, 1),
        (16, 2),
        (0, 1),
        (0, 2),
    ]
    assert all(r["swept"] == ["prefill.chunk_size", "sampler.seed"] for r in rows)
    for row in rows[:4]:
        assert row["status"] == "completed" and row["error"] is None
        assert row["generated_tokens"] == 4 and row["prompt_tokens"] > 16
        assert all(isinstance(row[f], (int, float)) for f in sweep_summary.HEADLINE_FIELDS)
        assert Path(row["job_dir"]) == sweep / str(row["job"])
    for row in rows[4:]:
        assert row["status"] == "failed" and row["error_type"] == "ConfigError"
        assert "prefill.chunk_size: must be > 0" in row["error"] and row["prefill_tok_per_sec"] is None

    with open(sweep / "summary.csv", newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [t["job"] for t in table] == [str(r["job"]) for r in rows]
    assert [t["prefill.chunk_size"] for t in table] == ["4", "4", "16", "16", "0", "0"]
    assert [t["sampler.seed"] for t in table] == ["1", "2", "1", "2", "1", "2"]
    assert [t["status"] for t in table] == [r["status"] for r in rows]
    assert [t["prefill_tok_per_sec"] for t in table] == [str(r["prefill_tok_per_sec"] or "") for r in rows]
    assert "prefill.chunk_size: must be > 0" in table[4]["error"] and "\n" not in table[4]["error"]
    assert [t["tokens_as_first"] for t in table] == ["same"] * 4 + [""] * 2  # greedy: chunking never changes tokens
    assert "model.path=" not in "".join(table[0].keys())  # constant overrides are not columns

    with Image.open(sweep / "summary.png") as image:
        image.verify()
    with Image.open(sweep / "summary.png") as image:
        assert image.format == "PNG" and image.width >= 1000 and 400 <= image.height <= 1000

    # greedy: chunking changes how the prompt is cut, never the tokens
    generations = [read_jsonl(Path(r["job_dir"]) / "generations.jsonl") for r in rows[:4]]
    token_ids = [g[0]["token_ids"] for g in generations]
    assert len(token_ids[0]) == 4 and all(ids == token_ids[0] for ids in token_ids)
    prompt_tokens = rows[0]["prompt_tokens"]
    pieces = [count_prefill_pieces(json.loads((Path(r["job_dir"]) / "stats.json").read_text())) for r in rows[:4]]
    assert pieces == [-(-prompt_tokens // 4)] * 2 + [-(-prompt_tokens // 16)] * 2  # the chunk sizes took effect


@pytest.mark.slow
def test_a_sweep_that_changed_nothing_says_so(tiny_llama, tmp_path):
    """Pipelined or not, the plan and the tokens are the same: the figures differ by noise only."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        [
            "-m",
            f"model.path={tiny_llama}",
            "template=none",
            "decode.max_tokens=4",
            "decode.ignore_eos=true",
            f"prompt.text={PROMPT}",
            "decode.pipeline=true,false",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "mlxcel: warning: the swept decode.pipeline changed neither the prefill plan nor the tokens of 2 jobs"
        in result.stderr
    )
    changed = run_cli(
        [
            "-m",
            f"model.path={tiny_llama}",
            "template=none",
            "decode.ignore_eos=true",
            f"prompt.text={PROMPT}",
            "decode.max_tokens=3,4",
            f"hydra.sweep.dir={tmp_path / 'other'}",
        ],
        tmp_path,
    )
    assert changed.returncode == 0 and "warning" not in changed.stderr, changed.stderr
    with open(tmp_path / "other" / "summary.csv", newline="", encoding="utf-8") as f:
        assert [t["tokens_as_first"] for t in csv.DictReader(f)] == ["same", "differ"]


def count_prefill_pieces(stats: dict) -> int:
    """Prefill pieces of the (one-row) run, wherever stats.json keeps them (per batch, or top level)."""
    pieces = stats.get("prefill_pieces")
    if pieces is None:
        pieces = [piece for batch in stats.get("batches", []) for piece in batch.get("prefill_pieces", [])]
    return len(pieces)


@pytest.mark.slow
def test_single_run_writes_no_summary(tiny_llama, tmp_path):
    result = run_cli([f"model.path={tiny_llama}", "decode.max_tokens=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "stats.json").is_file() and not list(tmp_path.rglob("summary.*"))


# ---- the callback's pieces ----
def test_swept_keys_come_from_the_sweeper_params_then_the_command_line():
    config = OmegaConf.create(
        {
            "hydra": {
                "sweeper": {"params": {"sampler.processors.temperature.value": "0.2,0.7"}},
                "overrides": {
                    "task": ["model.path=/m", "prefill.chunk_size=16,64", "sampler=greedy,temperature", "+x=1"]
                },
            }
        }
    )
    assert read_swept_keys(config) == ["sampler.processors.temperature.value", "prefill.chunk_size", "sampler"]


def test_overrides_are_parsed_with_hydra_types():
    params = parse_overrides(
        ["prefill.chunk_size=16", "decode.pipeline=false", "prompt.text='a, b'", "++sampler.seed=3", "model.path=null"]
    )
    assert params == {
        "prefill.chunk_size": 16,
        "decode.pipeline": False,
        "prompt.text": "a, b",
        "sampler.seed": 3,
        "model.path": None,
    }


def make_job_config(tmp_path: Path, num: int, mode: str = "MULTIRUN") -> OmegaConf:
    job_dir = tmp_path / "sweep" / str(num)
    job_dir.mkdir(parents=True, exist_ok=True)
    return OmegaConf.create(
        {
            "hydra": {
                "mode": mode,
                "sweep": {"dir": str(tmp_path / "sweep")},
                "runtime": {"output_dir": str(job_dir)},
                "job": {"num": num},
                "overrides": {"task": [f"prefill.chunk_size={16 * (num + 1)}"]},
                "sweeper": {"params": {}},
            }
        }
    )


def test_callback_adds_a_row_per_job_also_without_stats(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus

    callback = SweepSummary()
    ok = make_job_config(tmp_path, 0)
    (tmp_path / "sweep" / "0" / "stats.json").write_text(
        json.dumps({"status": "completed", "prefill_tok_per_sec": 10.0, "ttft_ms": 5.0})
    )
    callback.on_job_end(ok, JobReturn(status=JobStatus.COMPLETED))
    quiet = make_job_config(tmp_path, 2)  # completed without a stats.json (a stubbed runner)
    callback.on_job_end(quiet, JobReturn(status=JobStatus.COMPLETED))
    crashed = make_job_config(tmp_path, 1)  # no stats.json: the exception Hydra caught says why
    callback.on_job_end(crashed, JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom")))
    rows = sweep_summary.read_summary_rows(tmp_path / "sweep")
    assert [(r["job"], r["status"], r["error"]) for r in rows] == [
        (0, "completed", None),
        (1, "failed", "boom"),
        (2, "completed", None),
    ]
    assert rows[1]["error_type"] == "RuntimeError"
    assert (tmp_path / "sweep" / "summary.csv").is_file() and (tmp_path / "sweep" / "summary.png").is_file()


def test_callback_finds_a_relative_sweep_dir_from_the_launch_dir(tmp_path):
    from mlxcel.hydra_callbacks import find_sweep_dir

    config = OmegaConf.create({"hydra": {"sweep": {"dir": "multi/x"}, "runtime": {"cwd": str(tmp_path)}}})
    assert find_sweep_dir(config) == tmp_path / "multi" / "x"  # not the job's folder under hydra.job.chdir


def test_callback_does_nothing_in_a_single_run_and_never_raises(tmp_path, capsys):
    callback = SweepSummary()
    callback.on_job_end(make_job_config(tmp_path, 0, mode="RUN"), None)
    assert not list(tmp_path.rglob("summary.*"))
    callback.on_job_end(OmegaConf.create({"hydra": {"mode": "MULTIRUN"}}), None)  # a broken config
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mlxcel: warning: sweep summary not updated: ")


def test_a_new_sweep_in_the_same_folder_starts_a_new_summary(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "summary.jsonl").write_text('{"job": 0, "status": "completed"}\n')
    config = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep)}, "sweeper": {"params": {}}, "overrides": {"task": ["a=1,2"]}}}
    )
    callback = SweepSummary()
    callback.on_multirun_start(config)
    assert callback.swept == ["a"] and not (sweep / "summary.jsonl").exists()


# ---- summary rows, CSV and plot on synthetic rows ----
def make_rows() -> list[dict]:
    rows = []
    for job, (chunk, seed) in enumerate([(c, s) for s in (1, 2, 3) for c in (16, 64, 2048)]):
        failed = (chunk, seed) == (64, 2)
        stats = (
            None
            if failed
            else {
                "status": "completed",
                "prefill_tok_per_sec": 100.0 + chunk / 10 + seed,
                "decode_tok_per_sec": 50.0 + seed,
                "ttft_ms": 4000.0 / (1 + chunk / 64),
            }
        )
        rows.append(
            sweep_summary.make_summary_row(
                job,
                [f"prefill.chunk_size={chunk}", f"sampler.seed={seed}", "model.path=/m"],
                {"prefill.chunk_size": chunk, "sampler.seed": seed, "model.path": "/m"},
                ["prefill.chunk_size", "sampler.seed"],
                Path(f"/s/{job}"),
                stats,
                job_error=ValueError("bad\nsecond line") if failed else None,
            )
        )
    return rows


def test_rows_round_trip_and_the_last_write_of_a_job_wins(tmp_path):
    rows = make_rows()
    for row in rows:
        sweep_summary.append_summary_row(tmp_path, row)
    sweep_summary.append_summary_row(tmp_path, {**rows[0], "status": "failed"})
    with open(tmp_path / "summary.jsonl", "a") as f:
        f.write('{"job": 99, "sta')  # a torn line from a killed process
    read = sweep_summary.read_summary_rows(tmp_path)
    assert [r["job"] for r in read] == list(range(9)) and read[0]["status"] == "failed" and read[1:] == rows[1:]


def test_swept_keys_are_declared_or_varying():
    rows = make_rows()
    assert sweep_summary.find_swept_keys(rows) == ["prefill.chunk_size", "sampler.seed"]
    undeclared = [{**r, "swept": []} for r in rows]
    assert sweep_summary.find_swept_keys(undeclared) == ["prefill.chunk_size", "sampler.seed"]  # model.path is constant


def test_csv_has_every_job_with_swept_columns_and_errors(tmp_path):
    rows = make_rows()
    sweep_summary.write_summary_csv(rows, ["prefill.chunk_size", "sampler.seed"], tmp_path / "s.csv")
    with open(tmp_path / "s.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[:4] == ["job", "prefill.chunk_size", "sampler.seed", "status"]
    assert len(table) == 9 and table[4]["status"] == "failed" and table[4]["error"] == "bad; second line"
    assert table[4]["error_type"] == "ValueError" and table[4]["prefill_tok_per_sec"] == ""
    assert table[0]["overrides"] == "prefill.chunk_size=16 sampler.seed=1 model.path=/m"


def count_color(image: Image.Image, hex_color: str) -> int:
    rgb = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return sum(count for count, color in image.getcolors(maxcolors=1 << 20) if color == rgb)


def test_plot_draws_one_line_per_other_value_and_skips_failed_rows(tmp_path):
    rows = make_rows()
    draw_sweep_plot(rows, ["prefill.chunk_size", "sampler.seed"], tmp_path / "p.png")
    lines = group_lines(rows, "prefill.chunk_size", ["sampler.seed"])
    assert list(lines) == ["sampler.seed=1", "sampler.seed=2", "sampler.seed=3"]
    assert [x for x, _ in lines["sampler.seed=2"]] == [16, 2048]  # the failed job is not plotted
    with Image.open(tmp_path / "p.png") as image:
        image = image.convert("RGB")
        assert image.size[0] == 1500
        assert all(count_color(image, color) > 200 for color in COLORS[:3])  # three lines, three panels
        assert count_color(image, COLORS[3]) == 0  # no fourth line


def test_plot_of_only_failed_jobs_is_still_a_png(tmp_path):
    rows = [{**r, "status": "failed"} for r in make_rows()]
    draw_sweep_plot(rows, ["prefill.chunk_size", "sampler.seed"], tmp_path / "p.png")
    with Image.open(tmp_path / "p.png") as image:
        assert count_color(image.convert("RGB"), COLORS[0]) == 0


def test_x_axis_numeric_log_linear_and_categorical():
    position, ticks, kind = make_x_scale([16, 64, 2048, 64])
    assert kind == "log" and [label for _, label in ticks] == ["16", "64", "2048"]
    assert position(16) < position(64) < position(2048) and position(64) - position(16) > 0.2  # log spacing
    _, ticks, kind = make_x_scale([0.2, 0.7, 1.0])
    assert kind == "linear" and [label for _, label in ticks] == ["0.2", "0.7", "1"]
    position, ticks, kind = make_x_scale(["temperature", "greedy", True])
    assert kind == "categorical" and [label for _, label in ticks] == ["temperature", "greedy", "true"]
    assert position("temperature") < position("greedy") < position(True)


def test_categorical_sweep_plot(tmp_path):
    rows = [
        {
            "job": i,
            "status": "completed",
            "params": {"sampler": s, "decode.pipeline": p},
            "prefill_tok_per_sec": 10.0 + i,
            "decode_tok_per_sec": 5.0,
            "ttft_ms": 100.0,
        }
        for i, (p, s) in enumerate([(p, s) for p in (True, False) for s in ("greedy", "temperature")])
    ]
    sweep_summary.append_summary_row(tmp_path, rows[0])
    for row in rows[1:]:
        sweep_summary.append_summary_row(tmp_path, row)
    written = sweep_summary.write_summary(tmp_path)
    assert len(written) == 4
    with Image.open(tmp_path / "summary.png") as image:
        image = image.convert("RGB")
        assert count_color(image, COLORS[0]) > 100 and count_color(image, COLORS[1]) > 100
    header = (tmp_path / "summary.csv").read_text().splitlines()[0]
    assert header.startswith("job,sampler,decode.pipeline,status,")
