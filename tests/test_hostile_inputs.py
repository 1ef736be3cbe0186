"""Configs as a hostile or careless user writes them: each reproduction from the hardening issue
stays here so none comes back. A config may not run code, read the environment into text, or
write outside its run folder; a refused start leaves no folder behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.cli import find_conf_dir, quote_free_text, use_recipe
from mlxcel.errors import ConfigError
from mlxcel.hydra_guard import check_hydra_settings
from tests.helpers import first_config_error as validate
from tests.helpers import run_mlxcel as run_in

REPO = Path(__file__).resolve().parent.parent


def check(*args: str):
    return check_hydra_settings(use_recipe(quote_free_text(list(args))), find_conf_dir())


@pytest.mark.parametrize(
    "override, key",
    [
        ("+hydra.callbacks.x._target_=pathlib.Path.write_text", "hydra.callbacks.x._target_"),
        ("+hydra.callbacks.x._target_=builtins.open", "hydra.callbacks.x._target_"),
        (
            "+hydra.callbacks.sweep_summary.extra._target_=os.system",
            "hydra.callbacks.sweep_summary.extra._target_",
        ),  # nested: instantiate recurses
        ("hydra.launcher._target_=shutil.copy", "hydra.launcher._target_"),
        ("hydra.sweeper._target_=os.symlink", "hydra.sweeper._target_"),
        ("+hydra.job_logging.handlers.x.class=os.system", "hydra.job_logging.handlers.x.class"),
        ("+hydra.hydra_logging.handlers.x.class=pathlib.Path.unlink", "hydra.hydra_logging.handlers.x.class"),
        ("+hydra.job_logging.handlers.x.stream=ext://antigravity", "hydra.job_logging.handlers.x.stream"),
        (
            "+hydra.job_logging.handlers.x.filename=/home/user/.bashrc",
            "hydra.job_logging.handlers.x.filename",
        ),  # appends anywhere
        ("+hydra.job.env_set.LD_PRELOAD=/tmp/evil.so", "hydra.job.env_set.LD_PRELOAD"),
        ("+hydra.job.env_set.PYTHONSTARTUP=/tmp/evil.py", "hydra.job.env_set.PYTHONSTARTUP"),
        ("hydra.run.dir=", "hydra.run.dir"),
        ("hydra.run.dir=.", "hydra.run.dir"),
        ("hydra.run.dir=/dev/null", "hydra.run.dir"),
        ("hydra.sweep.subdir=../../x", "hydra.sweep.subdir"),
        ("hydra.sweep.subdir=/tmp/x", "hydra.sweep.subdir"),
    ],
)
def test_hydra_settings_that_run_code_or_escape_are_config_errors(override, key):
    with pytest.raises(ConfigError) as raised:
        check(override, "prompt.text=hi")
    assert raised.value.issues[0].path == key


def test_factories_in_logging_configs_are_refused(tmp_path):
    """logging.config's `()` key calls any factory; it cannot be written as an override, so a
    --config-dir logging config brings it."""
    folder = tmp_path / "hydra" / "job_logging"
    folder.mkdir(parents=True)
    (folder / "evil.yaml").write_text("version: 1\nformatters:\n  f:\n    (): os.system\n")
    with pytest.raises(ConfigError, match=r"hydra.job_logging.formatters.f.\(\)"):
        check("--config-dir", str(tmp_path), "hydra/job_logging=evil")


def test_what_mlxcel_ships_passes():
    assert check("prompt.text=hi") is not None  # one job: returned for validation
    assert (
        check("hydra/job_logging=default", "prompt.text=hi") is not None
    )  # Hydra's own: a file handler in the run folder
    assert check("-m", "decode.max_tokens=2,3") is None  # a sweep: each job is validated in its folder


def test_hydra_keys_cannot_be_swept():
    with pytest.raises(ConfigError, match="cannot be swept"):
        check("-m", "hydra.job_logging.root.level=INFO,DEBUG")


def test_recipes_are_data(tmp_path):
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(
        "defaults:\n  - config\n  - _self_\nhydra:\n  callbacks:\n    evil:\n      _target_: pathlib.Path.write_text\n"
        f"      self: {tmp_path / 'pwned'}\n      data: x\n"
    )
    with pytest.raises(ConfigError, match="hydra.callbacks.evil._target_"):
        check(f"recipe={recipe}")
    params = tmp_path / "params.yaml"
    params.write_text(
        "defaults:\n  - config\n  - _self_\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      hydra.job_logging.root.level: INFO\n"
    )
    with pytest.raises(ConfigError, match="hydra.sweeper.params"):
        check(f"recipe={params}")


@pytest.mark.parametrize("value", ["/etc/passwd", "/etc/hostname"])
def test_a_recipe_path_must_be_a_yaml_job_file(value, tmp_path):
    with pytest.raises(ConfigError, match=r"recipe: a job file is a \.yaml or \.yml file"):
        use_recipe([f"recipe={value}"])
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("a\nb\n")
    with pytest.raises(ConfigError, match="not a job file"):
        use_recipe([f"recipe={scalar}"])


def run_mlxcel(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(tmp_path, *args, env={"MYSECRET": "s3cret-value"})


@pytest.mark.slow  # a subprocess
def test_a_refused_callback_runs_nothing_and_makes_no_folder(tmp_path):
    target = tmp_path / "written.pth"
    result = run_mlxcel(
        tmp_path,
        "+hydra.callbacks.x._target_=pathlib.Path.write_text",
        f"+hydra.callbacks.x.self={target}",
        "+hydra.callbacks.x.data=import os",
        "prompt.text=hi",
        "runner.dry_run=true",
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "mlxcel: config error: hydra.callbacks.x._target_" in result.stderr
    assert not target.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow  # a subprocess
def test_environment_variables_stay_out_of_text(tmp_path):
    """The command line's text is literal in every quoting form; a YAML file's read is refused."""
    result = run_mlxcel(tmp_path, "prompt.text='${oc.env:MYSECRET}'", "runner.dry_run=true", "hydra.run.dir=run")
    assert result.returncode == 0, result.stderr
    written = (tmp_path / "run" / "prompts.jsonl").read_text()
    assert "${oc.env:MYSECRET}" in written and "s3cret-value" not in written
    recipe = tmp_path / "secret.yaml"
    recipe.write_text("defaults:\n  - config\n  - _self_\nprompt:\n  system: ${oc.env:MYSECRET}\n")
    result = run_mlxcel(tmp_path, f"recipe={recipe}", "runner.dry_run=true", "hydra.run.dir=run2")
    assert result.returncode == 2 and "prompt.system: reads the environment variable MYSECRET" in result.stderr
    assert not (tmp_path / "run2").exists()


# ---- run folders: one run per folder, refused starts touch nothing, inputs are never written ----
def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a subprocess
def test_two_runs_never_share_a_folder(tmp_path):
    from mlxcel.outputs import lock_run_folder, release_run_folder

    folder = tmp_path / "busy"
    lock_run_folder(folder)  # as a running job holds it
    try:
        result = run_mlxcel(tmp_path, "prompt.text=hi", "runner.dry_run=true", f"hydra.run.dir={folder}")
    finally:
        release_run_folder(folder)
    assert result.returncode == 2 and "another mlxcel run is writing to this folder" in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # Hydra never wrote into it


@pytest.mark.slow  # a subprocess
def test_runs_started_together_get_folders_of_their_own(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "prompt.text=hi", "runner.dry_run=true"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    folders = sorted((tmp_path / "outputs" / "default" / "runs").iterdir())
    assert len(folders) == 2 and all((f / "prompts.jsonl").is_file() for f in folders)


@pytest.mark.slow  # a subprocess
def test_a_refused_start_leaves_the_folder_as_it_was(tmp_path, tiny_llama):
    model = f"model.path={tiny_llama}"
    first = run_mlxcel(tmp_path, model, "prompt.text=hi", "decode.max_tokens=2", "hydra.run.dir=run")
    assert first.returncode == 0, first.stderr
    before = snapshot(tmp_path / "run")
    again = run_mlxcel(tmp_path, model, "prompt.text=hi", "decode.max_tokens=2", "hydra.run.dir=run")  # not a resume
    assert again.returncode == 2 and "already holds a run's generations.jsonl" in again.stderr
    changed = run_mlxcel(
        tmp_path, model, "prompt.text=hi", "decode.max_tokens=3", "runner.resume=true", "hydra.run.dir=run"
    )
    assert changed.returncode == 2 and "decode.max_tokens: differs from the run being resumed" in changed.stderr
    assert snapshot(tmp_path / "run") == before  # stats.json and .hydra/overrides.yaml included


@pytest.mark.slow  # a subprocess
def test_a_run_never_writes_over_its_input(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    result = run_mlxcel(
        tmp_path, "prompt=jsonl", "prompt.file=data/prompts.jsonl", "runner.dry_run=true", "hydra.run.dir=data"
    )
    assert result.returncode == 2 and "prompt.file: is a file this run writes" in result.stderr
    assert (
        sorted(p.name for p in data.iterdir()) == ["prompts.jsonl"]
        and (data / "prompts.jsonl").read_text() == '{"prompt": "hi"}\n'
    )


@pytest.mark.slow  # a subprocess
def test_a_resume_refuses_an_input_edited_under_it(tmp_path, tiny_llama):
    """Id-less rows are numbered by line: a line inserted at the top would pair old answers with
    new prompts. Each written row keeps its input's hash; rows written before that resume as they are."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    args = [
        f"model.path={tiny_llama}",
        "prompt=jsonl",
        f"prompt.file={prompts}",
        "decode.max_tokens=2",
        "hydra.run.dir=run",
    ]
    assert run_mlxcel(tmp_path, *args).returncode == 0
    generations = tmp_path / "run" / "generations.jsonl"
    before = snapshot(tmp_path / "run")

    prompts.write_text('{"prompt": "zero"}\n{"prompt": "one"}\n{"prompt": "two"}\n')
    result = run_mlxcel(tmp_path, *args, "runner.resume=true")
    assert result.returncode == 2 and "the input's rows changed since they were answered: ids 1, 2" in result.stderr, (
        result.stderr
    )
    assert snapshot(tmp_path / "run") == before

    prompts.write_text(
        '{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"}\n'
    )  # appended: a resume runs the new row only
    assert run_mlxcel(tmp_path, *args, "runner.resume=true").returncode == 0
    rows = [json.loads(line) for line in generations.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 3] and all(len(r["input_sha256"]) == 64 for r in rows)

    # a folder written before rows kept a hash resumes as before
    generations.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "input_sha256"}) + "\n" for r in rows[:2])
    )
    result = run_mlxcel(tmp_path, *args, "runner.resume=true")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["id"] for line in generations.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow  # a subprocess
def test_stats_after_a_resume_describe_the_whole_job(tmp_path, tiny_llama):
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    args = [
        f"model.path={tiny_llama}",
        "prompt=jsonl",
        f"prompt.file={prompts}",
        "decode.max_tokens=3",
        "decode.ignore_eos=true",
        "hydra.run.dir=run",
    ]
    assert run_mlxcel(tmp_path, *args).returncode == 0
    first = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert run_mlxcel(tmp_path, *args, "runner.resume=true").returncode == 0  # a finished run: nothing to do
    again = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert (again["rows"], again["generated_tokens"], again["prompt_tokens"]) == (2, 6, first["prompt_tokens"])
    assert again["prefill_time_ms"] == first["prefill_time_ms"] and again["finish_reasons"] == {"length": 2}
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three"}\n')
    assert run_mlxcel(tmp_path, *args, "runner.resume=true").returncode == 0
    last = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert (last["rows"], last["generated_tokens"], last["finish_reasons"]) == (3, 9, {"length": 3})
    assert [s["rows"] for s in last["sessions"]] == [2, 0, 1] and last["prefill_time_ms"] > first["prefill_time_ms"]


# ---- endings: every ending writes its status, or nothing at all ----
@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("delay", [0.2, 1.5, 3.0, 5.0])
def test_sigterm_at_any_moment_leaves_a_status_or_nothing(tmp_path, tiny_llama, delay):
    """From `timeout`, SLURM or `docker stop`: before the folder is claimed nothing is left; after,
    stats.json says how the run ended and every written row is whole."""
    import json
    import signal
    import time

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(40)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [
        f"model.path={tiny_llama}",
        "prompt=jsonl",
        f"prompt.file={prompts}",
        "decode.max_tokens=400",
        "decode.ignore_eos=true",
        "runner.max_rows=1",
        "hydra.run.dir=run",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    folder = tmp_path / "run"
    if proc.returncode == -signal.SIGTERM:  # still importing: Python's default action, nothing written
        assert not folder.exists() or not any(folder.iterdir())
        return
    if not folder.exists():  # ended in start-up, before the folder was claimed: nothing written, said so
        assert proc.returncode == 143 and stderr.decode().strip().endswith("mlxcel: terminated"), stderr
        return
    stats = json.loads((folder / "stats.json").read_text())
    if proc.returncode == 0:
        assert stats["status"] == "completed"
        return
    assert proc.returncode == 143 and stderr.decode().strip().endswith("mlxcel: terminated"), stderr
    assert stats["status"] == "interrupted" and stats["error"]["type"] == "Terminated"
    rows = (
        [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]
        if (folder / "generations.jsonl").exists()
        else []
    )
    assert all(len(r["token_ids"]) == 400 for r in rows) and len({r["id"] for r in rows}) == len(rows)


class InterruptingStream:
    """A terminal that takes Ctrl-C after a few chunks of streamed text."""

    def __init__(self, chunks: int):
        self.chunks, self.written = chunks, []

    def write(self, text: str) -> None:
        if len(self.written) == self.chunks:
            raise KeyboardInterrupt
        self.written.append(text)

    def flush(self) -> None:
        pass


def test_a_single_prompt_stopped_by_ctrl_c_keeps_its_partial_row(tmp_path, tiny_llama):
    import json

    from mlxcel.api import load_config
    from mlxcel.runner import run

    cfg = load_config(
        {"model": {"path": str(tiny_llama)}},
        ["prompt.text=Hello there", "decode.max_tokens=40", "decode.ignore_eos=true"],
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "run", stream=InterruptingStream(5), log=None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["finish_reason"] == "interrupted" and 5 <= len(rows[0]["token_ids"]) < 40
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["status"] == "interrupted"
    resumed = load_config(
        {"model": {"path": str(tiny_llama)}},
        ["prompt.text=Hello there", "decode.max_tokens=40", "decode.ignore_eos=true", "runner.resume=true"],
    )
    run(resumed, tmp_path / "run", stream=None, log=None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert (
        len(rows) == 1 and rows[0]["finish_reason"] == "length" and len(rows[0]["token_ids"]) == 40
    )  # run again, in its place


# ---- values that must be checked, exit codes, messages that name the problem ----
@pytest.mark.parametrize(
    "groups, line",
    [
        (
            {"prefill": {"tile_size": 100000}},
            "prefill.tile_size: must be an integer in [1, 1024], 'auto' or null (got 100000)",
        ),
        (
            {"sampler": {"processors": {"temperature": {"value": float("nan")}}}},
            "sampler.processors.temperature.value: must be a finite number (got nan)",
        ),
        (
            {"sampler": {"processors": {"temperature": {"value": float("inf")}}}},
            "sampler.processors.temperature.value: must be a finite number (got inf)",
        ),
        (
            {"sampler": {"processors": {"penalties": {"frequency": float("-inf")}}}},
            "sampler.processors.penalties.frequency: must be a finite number (got -inf)",
        ),
        (
            {"sampler": {"processors": {"logit_bias": {"bias": {5: float("nan")}}}}},
            "sampler.processors.logit_bias.bias: token 5: a bias is a finite number, "
            "or -inf to ban the token (got nan)",
        ),
        ({"decode": {"logprobs": 100000}}, "decode.logprobs: must be <= 20 (got 100000)"),
    ],
)
def test_values_out_of_reason_are_config_errors(groups, line):
    assert validate(**groups) == line


def test_a_row_asking_for_endless_samples_is_refused(tmp_path):
    from mlxcel.config import PromptConfig
    from mlxcel.jobs import load_job_rows

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": "hi", "n": 100000000}\n{"id": [1], "prompt": "x"}\n'
        '{"prompt": 123}\n{"prompt": "a", "prompt": "b"}\n'
    )
    with pytest.raises(ConfigError) as raised:
        load_job_rows(PromptConfig(file=str(rows)))
    lines = raised.value.format().splitlines()
    assert lines[0].startswith("prompt.file line 4: the key 'prompt' appears twice")  # JSON errors first, one line each
    rows.write_text('{"prompt": "hi", "n": 100000000}\n{"id": [1], "prompt": "x"}\n{"prompt": 123}\n')
    with pytest.raises(ConfigError) as raised:
        load_job_rows(PromptConfig(file=str(rows)))
    assert raised.value.format().splitlines()[:3] == [
        "prompt.file line 1: n: must be <= 128 (got 100000000)",
        "prompt.file line 2: id: must be a string or an integer (got [1])",  # one line, not one per type tried
        "prompt.file line 3: prompt: must be a string or null (got 123)",  # never turned into '123'
    ]


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ 'a' * 10000000000 }}", "repeats a value to 10000000000 items"),
        ("{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}", "the rendered prompt passes 4000000 characters"),
        ("{{ 10 ** 100000000 }}", "a power too large to print"),
    ],
)
def test_a_template_cannot_build_an_endless_prompt(source, message):
    from mlxcel.errors import MlxcelError
    from mlxcel.template import render_prompt

    with pytest.raises(MlxcelError, match=message):
        render_prompt(source, [{"role": "user", "content": "hi"}], object())


@pytest.mark.slow  # a subprocess
def test_config_errors_exit_2_before_the_model_loads(tmp_path, tiny_llama):
    model = f"model.path={tiny_llama}"
    for args, env, key in [
        (
            (model, "decode.kv_bits=4", "decode.kv_group_size=32"),
            {},
            "decode.kv_group_size: must divide the model's head size (16)",
        ),
        ((model,), {"MLXCEL_DECODE_STEP": "bogus"}, "MLXCEL_DECODE_STEP: environment variable: must be one of"),
        (("template.name=nope",), {}, "template.name: the model has no chat template of that name"),
    ]:
        result = run_mlxcel_env(tmp_path, env, *args, "prompt.text=hi", "hydra.run.dir=run")
        assert result.returncode == 2 and key in result.stderr and "loading model" not in result.stderr, result.stderr
        assert not (tmp_path / "run").exists()
    failed = run_mlxcel(
        tmp_path,
        model,
        "prompt.text=hi",
        "template.text={{ raise_exception('no') }}",
        "runner.dry_run=true",
        "hydra.run.dir=dry",
    )
    assert (
        failed.returncode == 1 and "the template refused this conversation" in failed.stderr
    )  # a dry run where every prompt failed


def run_mlxcel_env(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full.pop("MLXCEL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        check=False,
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # a subprocess
def test_messages_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    result = run_mlxcel(tmp_path, "model.path=./empty.gguf", "prompt.text=hi", "hydra.run.dir=a")
    assert result.returncode == 1 and "empty.gguf: empty or truncated (0 bytes), not a GGUF file" in result.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{oops")
    result = run_mlxcel(tmp_path, "model.path=./broken", "prompt.text=hi", "hydra.run.dir=b")
    assert result.returncode == 1 and "broken/config.json: not valid JSON" in result.stderr
    result = run_mlxcel(tmp_path, "prompt.txt=hi", "hydra.run.dir=c")
    assert (
        result.returncode == 2 and "(did you mean prompt.text?)" in result.stderr and "+prompt.txt" not in result.stderr
    )


@pytest.mark.slow  # a subprocess
def test_the_blas_rerun_runs_the_code_that_is_running(tmp_path):
    """`python -m mlxcel` from a folder holding another mlxcel would run that one instead."""
    from mlxcel.blas import rerun_command

    impostor = tmp_path / "mlxcel"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("")
    (impostor / "__main__.py").write_text("print('the current folder ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLXCEL_BLAS"] = "off"  # (the rerun itself must not re-execute again)
    result = subprocess.run(
        rerun_command("mlxcel", ["--help"]),
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "mlxcel-run" in result.stdout and "the current folder ran" not in result.stdout, (
        result.stdout + result.stderr
    )


def test_the_api_says_how_to_get_mlxcel_runs_blas():
    from mlxcel.blas import advise_api_blas

    tip = advise_api_blas({"MLXCEL_TEST": "1"})  # a fresh process's environment, nothing preloaded
    if tip is None:
        pytest.skip("not a Linux CPU with the mlx-cpu wheel's reference BLAS")
    assert tip.startswith("mlxcel: tip: ") and ("LD_PRELOAD=" in tip or "install OpenBLAS" in tip)
    assert advise_api_blas({"MLXCEL_BLAS": "off"}) is None
    assert advise_api_blas({"LD_PRELOAD": "/usr/lib/libopenblas.so.0"}) is None  # already fast


@pytest.mark.slow  # a subprocess
def test_bytes_that_are_not_utf8_are_one_config_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "mlxcel", b"prompt.text=caf\xe9", "runner.dry_run=true", "hydra.run.dir=run"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 2 and stderr.count("\n") == 1 and "argument 1: is not valid UTF-8 text" in stderr, (
        stderr
    )
    assert list(tmp_path.iterdir()) == []  # no folder, no .tmp files
