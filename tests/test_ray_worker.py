"""A Ray job's worker body (ray_jobs.JobWorker) run as a plain object, without Ray: its figures
count the time it ran rows, not the time it waited for them."""

from __future__ import annotations

import time

import pytest

from mlxcel.config import validate_config
from mlxcel.jobs import expand_samples, load_job_rows
from mlxcel.ray_jobs import JobWorker
from tests.helpers import write_rows


def test_a_workers_busy_time_leaves_out_its_waits_for_rows(tmp_path, tiny_llama):
    rows = [{"id": f"r{i}", "prompt": "word " * (3 + i), "max_tokens": 6} for i in range(4)]
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 128},
            "template": {"kind": "none"},
            "prompt": {"file": str(write_rows(tmp_path / "rows.jsonl", rows))},
            "decode": {"max_tokens": 6},
            "sampler": {"selector": {"kind": "greedy"}},
            "runner": {"max_rows": 2, "progress": "off"},
        }
    )
    samples = expand_samples(load_job_rows(cfg.prompt))
    worker = JobWorker(cfg, "worker-0")
    began = time.perf_counter()
    time.sleep(1.0)  # (the driver waits for the other workers to load)
    got = []
    for part in (samples[:2], samples[2:]):
        worker.add(part)
        deadline = time.perf_counter() + 60
        while not {s.row.id for s in part} <= {r["id"] for r in got} and time.perf_counter() < deadline:
            got += worker.take(wait_s=5.0)
        time.sleep(1.0)  # (the driver is slow to send more)
    figures, stats, _ = worker.close()
    elapsed = time.perf_counter() - began
    assert sorted(r["id"] for r in got) == [f"r{i}" for i in range(4)]
    assert figures["rows"] == 4 and figures["generated_tokens"] == 24
    # the two 1 s waits, before and between the rows, are not busy; the loop's clock starts with
    # its first rows (compared with the waits the test made, not with a figure a loaded machine misses)
    assert 0 < figures["busy_s"] <= elapsed - 2.0
    assert stats.prefill_time_ms / 1000 <= elapsed - 2.0
    assert figures["generated_tok_per_sec"] == pytest.approx(24 / figures["busy_s"], rel=0.02)
