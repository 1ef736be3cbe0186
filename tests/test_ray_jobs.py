"""runner.backend=ray on a local Ray cluster of 2 CPU workers: the job equals the local run (every
id once, the same tokens), a worker killed mid-job has its rows run again on the other, and a
cluster that cannot hold or reach a worker is one clear error."""

from __future__ import annotations

import json
import os

import pytest

from mlxcel.config import validate_config
from mlxcel.errors import ConfigError
from mlxcel.runner import run
from tests.helpers import read_rows, write_rows

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SAMPLER = {"processors": {"temperature": {"value": 1.0}}, "selector": {"kind": "categorical"}, "seed": 3}


@pytest.fixture(scope="module")
def cluster():
    from mlxcel.ray_jobs import describe_worker_environment

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": describe_worker_environment(dict(os.environ))},
    )
    yield
    ray.shutdown()


def make_rows(count: int) -> list[dict]:
    # ragged: prompts and answers of different lengths
    return [{"id": f"r{i}", "prompt": "word " * (3 + 7 * (i % 5)), "max_tokens": 4 + 9 * (i % 4)} for i in range(count)]


def run_job(tmp_path, tiny_llama, rows, name: str, **runner):
    path = write_rows(tmp_path / f"{name}.jsonl", rows)
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 256},
            "template": {"kind": "none"},
            "prompt": {"file": str(path)},
            "decode": {"max_tokens": 40},
            "sampler": SAMPLER,
            "runner": {"max_rows": 2, "progress": "off", **runner},
        }
    )
    run(cfg, tmp_path / name, stream=None, log=None)
    stats = json.loads((tmp_path / name / "stats.json").read_text())
    return {r["id"]: r for r in read_rows(tmp_path / name)}, stats, len(read_rows(tmp_path / name))


def test_a_job_on_two_workers_equals_the_local_run(tmp_path, tiny_llama, cluster):
    rows = make_rows(12)
    local, _, _ = run_job(tmp_path, tiny_llama, rows, "local")
    remote, stats, lines = run_job(tmp_path, tiny_llama, rows, "ray", backend="ray", ray={"workers": 2})
    assert lines == len(rows) and set(remote) == {r["id"] for r in rows}
    assert {k: r["token_ids"] for k, r in remote.items()} == {k: r["token_ids"] for k, r in local.items()}
    assert {k: r["text"] for k, r in remote.items()} == {k: r["text"] for k, r in local.items()}
    assert stats["status"] == "completed" and stats["backend"] == "ray"
    workers = stats["ray"]["workers"]
    assert len(workers) == 2 and sum(w["rows"] for w in workers) == len(rows)
    assert all(w["rows"] > 0 for w in workers)  # handed out to both
    assert stats["generated_tokens"] == sum(len(r["token_ids"]) for r in local.values())
    # the workers ran side by side: the job's times are the longest worker's, not their sum
    assert stats["decode_time_ms"] == max(b["decode_time_ms"] for b in stats["batches"])
    assert stats["peak_memory_gb"] == max(w["peak_memory_gb"] for w in workers) > 0
    assert (stats["max_rows"], stats["max_rows_auto"]) == (2, False) and all(w["max_rows"] == 2 for w in workers)


def test_a_small_job_is_spread_over_every_worker(tmp_path, tiny_llama, cluster):
    # 3 rows fit one worker's queue (2 x max_rows): a fair share sends some to the other too
    remote, stats, _ = run_job(tmp_path, tiny_llama, make_rows(3), "small", backend="ray", ray={"workers": 2})
    assert len(remote) == 3 and sorted(w["rows"] for w in stats["ray"]["workers"]) == [1, 2]


def test_the_jobs_bench_runs_on_ray_workers(tmp_path, tiny_llama, cluster, capsys):
    from mlxcel.bench import jobs

    out = tmp_path / "bench.json"
    argv = ["--models", str(tiny_llama), "--rows", "6", "--prompt-tokens", "3,12", "--output-tokens", "1,6"]
    argv += ["--max-rows", "2", "--dtype", "float32", "--work-dir", str(tmp_path), "--json", str(out)]
    assert jobs.main([*argv, "--backend", "ray", "--workers", "1,2"]) == 0
    printed = capsys.readouterr().out
    (model,) = json.loads(out.read_text())["models"]
    one, two = model["ray"]
    assert (one["workers"], two["workers"]) == (1, 2) and len(two["worker_figures"]) == 2
    expected = sum(json.loads(out.read_text())["job"]["output_lengths"])
    for result in (one, two):
        assert result["metrics"]["generated_tokens"] == expected and result["metrics"]["gen_tok_s"] > 0
        assert sum(f["rows"] for f in result["worker_figures"]) == 6
        assert all(0 < f["occupancy"] <= 2 and f["warm_up_s"] > 0 for f in result["worker_figures"])
    assert "6/6 rows the same with 1, 2 worker(s)" in printed and "0 rows off their output length" in printed


def test_a_worker_killed_mid_job_has_its_rows_run_on_the_other(tmp_path, tiny_llama, cluster, monkeypatch):
    import mlxcel.ray_jobs as ray_jobs

    hand_out = ray_jobs.hand_out

    def kill_after_three_rows(ray_module, workers, samples, max_rows, record, progress, log):
        victim = next(h for h, d in workers.items() if d["name"] == "worker-0")
        written = []

        def record_then_kill(row):
            record(row)
            written.append(row)
            if len(written) == 3:
                ray_module.kill(victim)

        return hand_out(ray_module, workers, samples, max_rows, record_then_kill, progress, log)

    monkeypatch.setattr(ray_jobs, "hand_out", kill_after_three_rows)
    rows = make_rows(16)
    local, _, _ = run_job(tmp_path, tiny_llama, rows, "local")
    remote, stats, lines = run_job(tmp_path, tiny_llama, rows, "killed", backend="ray", ray={"workers": 2})
    assert lines == len(rows)  # every id exactly once
    assert {k: r["token_ids"] for k, r in remote.items()} == {k: r["token_ids"] for k, r in local.items()}
    deaths = stats["ray"]["deaths"]
    assert [d["worker"] for d in deaths] == ["worker-0"] and deaths[0]["rows_rerun"] > 0
    assert [w["name"] for w in stats["ray"]["workers"]] == ["worker-1"]


def test_a_worker_no_node_can_hold_is_a_config_error(tmp_path, tiny_llama, cluster):
    with pytest.raises(ConfigError, match="runner.ray: no node of the cluster can hold a worker of 64 CPUs"):
        run_job(tmp_path, tiny_llama, make_rows(2), "big", backend="ray", ray={"cpus_per_worker": 64})


def test_a_cluster_that_cannot_be_reached_is_a_config_error(tmp_path, tiny_llama):
    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(ConfigError, match="runner.ray.address: no Ray cluster could be reached"):
        run_job(tmp_path, tiny_llama, make_rows(2), "nowhere", backend="ray", ray={"address": "127.0.0.1:1"})


def test_sigterm_to_the_driver_keeps_its_rows_and_a_resume_finishes_the_job(tmp_path, tiny_llama):
    """mlxcel-run on Ray (its own local cluster) stopped by SIGTERM once rows are written: exit
    143, the rows kept; runner.resume=true writes the others, every id once,
    with the tokens of a local run."""
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO, stop_cli_after_rows

    rows = make_rows(10)
    path = write_rows(tmp_path / "rows.jsonl", rows)
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny_llama}", "model.max_context=256", "template=none", f"prompt.file={path}"]
    args += ["decode.max_tokens=40", "sampler=temperature", "sampler.seed=3", "runner.max_rows=1"]
    args += ["runner.backend=ray", "runner.ray.workers=1", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    code, stderr = stop_cli_after_rows(tmp_path, args, run_dir, 2, signal.SIGTERM, env)
    assert code == 143, stderr[-2000:]
    kept = read_rows(run_dir)
    assert 2 <= len(kept) < len(rows)
    assert json.loads((run_dir / "stats.json").read_text())["status"] == "interrupted"

    resumed = subprocess.run(
        [sys.executable, "-m", "mlxcel", *args, "runner.resume=true"], cwd=tmp_path, env=env, capture_output=True
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    ids = [r["id"] for r in read_rows(run_dir)]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every id once
    local_dir = tmp_path / "local"
    local_args = [a for a in args if not a.startswith(("runner.backend", "runner.ray", "hydra.run.dir"))]
    local = subprocess.run(
        [sys.executable, "-m", "mlxcel", *local_args, f"hydra.run.dir={local_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
    )
    assert local.returncode == 0
    tokens = {r["id"]: r["token_ids"] for r in read_rows(run_dir)}
    assert tokens == {r["id"]: r["token_ids"] for r in read_rows(local_dir)}
