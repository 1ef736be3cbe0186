"""Sweeps on Hydra's launchers: joblib (jobs side by side, each claiming its own GPU, here with a
faked GPU count), submitit's local executor and Ray on a local cluster give the same sweep summary
as the basic launcher; the launchers' settings that would run code are config errors; a job's GPU
claim is exclusive and dies with its process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.devices import FAKE_GPU_COUNT, claim_gpu
from mlxcel.errors import ConfigError
from mlxcel.hydra_guard import check_hydra_settings

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
COMPARED = ("job", "overrides", "params", "status", "tokens_sha256", "prompt_tokens", "generated_tokens")


# ---- GPU claims ----
def test_jobs_claim_their_own_gpu_and_share_only_when_all_are_taken(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPU_COUNT, "2")
    first, second = claim_gpu(tmp_path, 0), claim_gpu(tmp_path, 1)
    assert (first.index, second.index) == (0, 1) and not first.shared and not second.shared
    third = claim_gpu(tmp_path, 2)  # both taken: it runs next to job 0 on GPU 0
    assert (third.index, third.shared) == (0, True)
    first.release()
    fourth = claim_gpu(tmp_path, 3)  # job 3's own GPU (1) is taken: the next free one
    assert (fourth.index, fourth.shared) == (0, False)
    assert fourth.describe() == {"gpu": 0, "gpus": 2, "shared": False, "faked": True}
    for claim in (second, third, fourth):
        claim.release()


def test_a_claim_dies_with_its_process(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPU_COUNT, "2")
    # the child claims GPU 1 and exits without releasing it: the OS drops the lock
    code = "import os, sys; from mlxcel.devices import claim_gpu; c = claim_gpu(sys.argv[1], 1)\n"
    code += "print(c.index, flush=True); os._exit(0)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert child.stdout.strip() == "1", child.stderr
    claim = claim_gpu(tmp_path, 1)
    assert (claim.index, claim.shared) == (1, False)
    claim.release()


def test_one_gpu_or_none_claims_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPU_COUNT, "1")
    assert claim_gpu(tmp_path, 0) is None and not (tmp_path / ".gpus").exists()


# ---- what a launcher config may say ----
@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["hydra/launcher=slurm", "+hydra.launcher.setup=[touch /tmp/x]"], "hydra.launcher.setup"),
        (
            ["hydra/launcher=slurm", "++hydra.launcher.additional_parameters={export: 'LD_PRELOAD=/x.so'}"],
            "hydra.launcher.additional_parameters.export",
        ),
        (["hydra/launcher=slurm", "hydra.launcher.submitit_folder=/etc/x"], "hydra.launcher.submitit_folder"),
        (["hydra/launcher=ray_cluster", "+hydra.launcher.ray.init.runtime_env={pip: [x]}"], "runtime_env"),
        (["hydra/launcher=ray_cluster", "+hydra.launcher.ray.remote.runtime_env={}"], "runtime_env"),
        (["hydra/launcher=ray_aws"], "hydra.launcher._target_"),
    ],
)
def test_launcher_settings_that_run_code_are_config_errors(args, key):
    with pytest.raises(ConfigError) as error:
        check_hydra_settings(["-m", *args], CONF)
    assert key in str(error.value)


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "slurm", "ray_cluster", "basic"])
def test_the_shipped_launcher_configs_pass_the_guard(launcher):
    args = ["-m", f"hydra/launcher={launcher}", "++hydra.launcher.additional_parameters={mail-type: END}"]
    check_hydra_settings(args if launcher == "slurm" else args[:2], CONF)


# ---- the same sweep on each launcher ----
def run_sweep(
    tmp_path: Path, tiny_llama: Path, name: str, *launcher: str, env: dict | None = None, code: int = 0
) -> tuple[Path, str]:
    sweep = tmp_path / name
    full_env = {k: v for k, v in os.environ.items() if k not in ("MLXCEL_DEBUG", "HYDRA_FULL_ERROR")}
    full_env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", **(env or {}))
    args = [f"model.path={tiny_llama}", "template=none", "prompt.text=Hello there", "decode.max_tokens=3,6"]
    args += ["sampler=temperature", "sampler.seed=1,2", f"hydra.sweep.dir={sweep}", *launcher]
    result = subprocess.run(
        [sys.executable, "-m", "mlxcel", "-m", *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-3000:]
    return sweep, result.stderr


def read_summary(sweep: Path) -> list[dict]:
    rows = [json.loads(line) for line in (sweep / "summary.jsonl").read_text().splitlines()]
    return sorted(({k: row[k] for k in COMPARED} for row in rows), key=lambda row: row["job"])


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory, tiny_llama):
    return run_sweep(tmp_path_factory.mktemp("basic"), tiny_llama, "basic")[0]


@pytest.mark.slow
def test_a_joblib_sweep_runs_jobs_side_by_side_each_on_its_own_gpu(tmp_path, tiny_llama, basic_sweep):
    sweep, _ = run_sweep(
        tmp_path, tiny_llama, "joblib", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", env={FAKE_GPU_COUNT: "2"}
    )
    summary = read_summary(sweep)
    assert summary == read_summary(basic_sweep) and len(summary) == 4
    assert len({row["tokens_sha256"] for row in summary}) > 1  # the seeds and lengths do change the tokens
    claims = [json.loads((sweep / str(job) / "stats.json").read_text())["gpu_claim"] for job in range(4)]
    assert all(c["gpus"] == 2 and c["faked"] and not c["shared"] and c["gpu"] in (0, 1) for c in claims), claims
    assert (sweep / "summary.csv").read_text().count("\n") == 5  # header + 4 jobs, whole


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plugin", "launcher"),
    [
        ("hydra_submitit_launcher", ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"]),
        ("hydra_ray_launcher", ["hydra/launcher=ray_cluster", "hydra.launcher.ray.init.num_cpus=2"]),
    ],
    ids=["submitit-local", "ray"],
)
def test_a_sweep_on_another_launcher_gives_the_same_summary(tmp_path, tiny_llama, basic_sweep, plugin, launcher):
    pytest.importorskip(f"hydra_plugins.{plugin}")
    sweep, _ = run_sweep(tmp_path, tiny_llama, plugin, *launcher)
    assert read_summary(sweep) == read_summary(basic_sweep)


@pytest.mark.slow
def test_a_failed_job_on_joblib_is_counted_and_the_others_run(tmp_path, tiny_llama):
    # a job's error comes back pickled from its process: the sweep still names the count and exits 1
    sweep, stderr = run_sweep(
        tmp_path, tiny_llama, "failing", "hydra/launcher=joblib", "prefill.chunk_size=4,0", code=1
    )
    assert stderr.splitlines()[-1] == f"mlxcel: 4 of 8 jobs failed; summary: {sweep / 'summary.csv'}"
    statuses = [row["status"] for row in read_summary(sweep)]
    assert statuses.count("failed") == 4 and statuses.count("completed") == 4


def test_a_faked_gpu_count_that_is_not_a_count_is_an_error(tmp_path, monkeypatch):
    from mlxcel.errors import MlxcelError

    monkeypatch.setenv(FAKE_GPU_COUNT, "two")
    with pytest.raises(MlxcelError, match="must be a count of GPUs"):
        claim_gpu(tmp_path, 0)
