"""runner.max_rows=auto (the default): 8 on the CPU; on a GPU as many rows as the KV budget holds
for the job's rows (their mean positions, each row's states included), at most 256 and at most
the job's rows; a server sizes for decode.max_tokens after a long prompt. An explicit number is
kept, a bad value is one config error, and stats.json records the rows chosen and whether auto
chose them: jobs, chat, the server."""

from __future__ import annotations

import io
import json
import sys

import pytest

from mlxcel.config import validate_config
from mlxcel.engine import auto_rows
from mlxcel.engine.auto_rows import CPU_ROWS, GPU_ROWS_CAP, OPEN_PROMPT_TOKENS, choose_max_rows
from mlxcel.engine.scheduler import kv_bytes_per_position
from mlxcel.models.paged_cache import BLOCK_SIZE, count_blocks
from mlxcel.runner import run
from tests.helpers import first_config_error, read_rows, write_rows

ROWS = [{"id": f"r{i}", "prompt": "word " * (2 + 3 * i), "max_tokens": 3 + i} for i in range(5)]


@pytest.fixture(scope="module")
def model(tiny_llama):
    from mlxcel.checkpoints.loader import load_model

    return load_model(str(tiny_llama), "float32").model


@pytest.fixture
def on_a_gpu(monkeypatch):
    """auto resolves as on a GPU (the model still runs on the CPU)."""
    monkeypatch.setattr(auto_rows, "on_gpu", lambda: True)


def test_the_default_is_auto_and_the_cpu_resolves_it_to_8(model, on_the_cpu):
    cfg = validate_config({"model": {"path": "embedded:smollm2"}, "prompt": {"text": "hi"}})
    assert cfg.runner.max_rows == "auto"
    assert choose_max_rows("auto", model, 100, 10**15) == CPU_ROWS == 8  # (the budget would hold millions)
    assert choose_max_rows("auto", model, 100, 10**15, gpu=False) == 8


def test_a_gpu_takes_the_rows_the_budget_holds_at_most_256(model, on_a_gpu, monkeypatch):
    row = 100 * kv_bytes_per_position(model)  # one row of 100 positions
    assert choose_max_rows("auto", model, 100, 5 * row + row // 2) == 5
    assert choose_max_rows("auto", model, 100, row // 2) == 1  # (a row that does not fit: admission says so)
    assert choose_max_rows("auto", model, 100, 1000 * row) == GPU_ROWS_CAP == 256
    assert choose_max_rows("auto", model, 100, 1000 * row, rows=12) == 12  # no slots past the job's rows
    # a row's fixed-size state (a hybrid's recurrent layers) counts once a row
    monkeypatch.setattr(auto_rows, "state_bytes_per_row", lambda m: row)
    assert choose_max_rows("auto", model, 100, 5 * 2 * row) == 5
    # a quantized cache holds more rows in the same budget
    assert choose_max_rows("auto", model, 100, 10 * row, kv_bits=4, kv_group_size=32) > 5


def test_an_explicit_number_is_kept(model, on_a_gpu):
    assert choose_max_rows(3, model, 100, 10**15) == 3
    assert choose_max_rows(300, model, 100, 1) == 300
    data = {"model": {"path": "embedded:smollm2"}, "prompt": {"text": "hi"}, "runner": {"max_rows": 4096}}
    assert validate_config(data).runner.max_rows == 4096


@pytest.mark.parametrize("value", [0, 4097, -1, True, 2.0, "8", "Auto", None])
def test_a_bad_value_is_one_config_error(value):
    assert first_config_error(runner={"max_rows": value}) == (
        f"runner.max_rows: must be an integer in [1, 4096] or 'auto' (got {value!r})"
    )


def run_job(tmp_path, tiny_llama, name: str, monkeypatch, **runner) -> tuple[dict, list[int]]:
    """(stats.json, the max_rows each BatchScheduler was given)."""
    import mlxcel.pipeline as pipeline

    given = []

    class Spy(pipeline.BatchScheduler):
        def __init__(self, model, max_context, max_rows, *args, **kwargs):
            given.append(max_rows)
            super().__init__(model, max_context, max_rows, *args, **kwargs)

    monkeypatch.setattr(pipeline, "BatchScheduler", Spy)
    path = write_rows(tmp_path / f"{name}.jsonl", ROWS)
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 256, "dtype": "float32"},
            "template": {"kind": "none"},
            "prompt": {"file": str(path)},
            "runner": {"progress": "off", "device": "cpu", **runner},
        }
    )
    run(cfg, tmp_path / name, stream=None, log=None)
    return json.loads((tmp_path / name / "stats.json").read_text()), given


def test_stats_json_records_the_rows_chosen(tmp_path, tiny_llama, monkeypatch):
    stats, given = run_job(tmp_path, tiny_llama, "cpu", monkeypatch)
    assert (stats["max_rows"], stats["max_rows_auto"], given) == (8, True, [8])
    stats, given = run_job(tmp_path, tiny_llama, "pinned", monkeypatch, max_rows=3)
    assert (stats["max_rows"], stats["max_rows_auto"], given) == (3, False, [3])
    assert stats["occupancy"] <= 3


def test_a_gpu_job_gets_what_its_budget_holds(tmp_path, tiny_llama, model, monkeypatch, on_a_gpu):
    stats, given = run_job(tmp_path, tiny_llama, "roomy", monkeypatch)  # (40% of memory: every row)
    assert (stats["max_rows"], stats["max_rows_auto"], given) == (len(ROWS), True, [len(ROWS)])
    # a budget of 2.5 mean rows (their prompts and tokens in whole blocks, as the scheduler reserves them)
    rows = read_rows(tmp_path / "roomy")
    blocks = sum(count_blocks(r["prompt_tokens"] + r["generated_tokens"]) for r in rows) / len(rows)
    budget = 2.5 * blocks * BLOCK_SIZE * kv_bytes_per_position(model)
    stats, given = run_job(tmp_path, tiny_llama, "tight", monkeypatch, kv_budget_gb=budget / 1e9)
    assert (stats["max_rows"], stats["max_rows_auto"], given) == (2, True, [2])
    assert stats["finish_reasons"] == {"length": len(ROWS)} and stats["occupancy"] <= 2


def test_a_chat_session_records_its_rows(tmp_path, tiny_llama, monkeypatch, on_the_cpu):
    from mlxcel.chat import chat

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\n"), encoding="utf-8"))
    args = [f"model.path={tiny_llama}", "model.dtype=float32", "runner.device=cpu", "decode.max_tokens=2"]
    assert chat([*args, f"hydra.run.dir={tmp_path / 'chat'}"], io.StringIO(), io.StringIO()) == 0
    stats = json.loads((tmp_path / "chat" / "stats.json").read_text())
    assert (stats["max_rows"], stats["max_rows_auto"]) == (8, True)


def test_the_server_records_its_rows(tmp_path):
    from tests.serve_fixtures import running_server

    with running_server(tmp_path / "serve") as server:
        stats = json.loads((tmp_path / "serve" / "stats.json").read_text())
        assert (server.engine.max_rows, stats["max_rows"], stats["max_rows_auto"]) == (8, 8, True)


def test_a_gpu_server_sizes_for_max_tokens_after_a_long_prompt(tmp_path, on_a_gpu):
    from tests.serve_fixtures import running_server

    with running_server(tmp_path / "serve", "runner.kv_budget_gb=1", "decode.max_tokens=256") as server:
        model = server.engine.pipeline.loaded.model
        positions = OPEN_PROMPT_TOKENS + 256  # (a whole number of blocks)
        expected = int(1e9 // (positions * kv_bytes_per_position(model)))
        assert 1 < expected < GPU_ROWS_CAP
        stats = json.loads((tmp_path / "serve" / "stats.json").read_text())
        assert server.engine.max_rows == stats["max_rows"] == server.engine.scheduler.max_rows == expected
        assert stats["max_rows_auto"] is True


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_a_ray_worker_resolves_auto_as_a_server_does(tmp_path, tiny_llama, monkeypatch, gpu):
    """A Ray worker's loop is fed as it goes: on its device it sizes as a server does, and says so
    to the driver (its description's max_rows sets its queue: ray_jobs.hand_out)."""
    from mlxcel.ray_jobs import JobWorker

    monkeypatch.setattr(auto_rows, "on_gpu", lambda: gpu)
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 512, "dtype": "float32"},
            "template": {"kind": "none"},
            "prompt": {"file": str(write_rows(tmp_path / "rows.jsonl", ROWS))},
            "decode": {"max_tokens": 64},
            "runner": {"progress": "off", "device": "cpu", "kv_budget_gb": 0.01},
        }
    )
    worker = JobWorker(cfg, "worker-0")
    try:
        # 512 positions (the context: below the long prompt) of 512 bytes: 38 rows in 10 MB
        expected = int(1e7 // (512 * kv_bytes_per_position(worker.pipeline.loaded.model))) if gpu else 8
        assert worker.describe()["max_rows"] == expected == (38 if gpu else 8)
    finally:
        worker.close()


def test_the_batch_engine_keeps_8_on_a_gpu(tmp_path, tiny_llama, monkeypatch, on_a_gpu):
    """What the scheduler does not run yet has no KV budget to size by: auto stays 8 there."""
    monkeypatch.setenv("MLXCEL_SCHEDULER", "0")
    stats, given = run_job(tmp_path, tiny_llama, "dense", monkeypatch)
    assert (stats["max_rows"], stats["max_rows_auto"], given) == (8, True, [])
