"""Configs someone else wrote, as the security issue found them passing the old guard: a config
folder given by --config-path, payloads carried by interpolations, a pickled rerun, shell lines in
launcher values, folders that leave the run folder, environment reads, YAML and interpolation
bombs. Each is refused before Hydra acts on it; what mlxcel ships still passes."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import pytest

from mlxcel.cli import find_conf_dir, quote_free_text, read_job_config, use_recipe
from mlxcel.errors import ConfigError
from mlxcel.hydra_guard import check_hydra_settings
from tests.helpers import run_mlxcel as run_in


def check(*args: str):
    return check_hydra_settings(use_recipe(quote_free_text(list(args))), find_conf_dir())


def refused_key(*args: str) -> str:
    with pytest.raises(ConfigError) as raised:
        check(*args)
    return raised.value.issues[0].path


def write_recipe(tmp_path: Path, body: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text("defaults:\n  - config\n  - _self_\n" + body)
    return path


class Canary:
    """A pickle that creates `path` when it is loaded: proof that a config ran code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def write_canary_pickle(tmp_path: Path) -> tuple[Path, Path]:
    canary = tmp_path / "canary"
    payload = tmp_path / "evil.pkl"
    payload.write_bytes(pickle.dumps(Canary(canary)))
    return payload, canary


# ---- 1. the config Hydra composes is the one checked: --config-path / -cp / --config-name ----
@pytest.mark.parametrize("flags", [("--config-path", "--config-name"), ("-cp", "-cn")])
def test_a_config_folder_given_by_config_path_is_checked(tmp_path, flags):
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "evil.yaml").write_text(
        "hydra:\n  callbacks:\n    x:\n      _target_: joblib.load\n      filename: evil.pkl\n"
    )
    assert refused_key(flags[0], str(folder), flags[1], "evil") == "hydra.callbacks.x._target_"


# ---- 2. interpolations carry payloads: what Hydra will use is checked, resolved ----
def test_a_callback_interpolated_from_a_recipe_is_refused(tmp_path):
    recipe = write_recipe(
        tmp_path,
        "template:\n  kwargs:\n    payload:\n      _target_: joblib.load\n      filename: evil.pkl\n"
        "hydra:\n  callbacks:\n    evil: ${template.kwargs.payload}\n",
    )
    assert refused_key(f"recipe={recipe}").startswith("hydra.callbacks.evil")


def test_a_callback_interpolated_on_the_command_line_is_refused():
    key = refused_key(
        "+hydra.callbacks.evil=${template.kwargs.p}", "+template.kwargs.p={_target_:joblib.load,filename:x}"
    )
    assert key.startswith("hydra.callbacks.evil")


def test_a_logging_factory_interpolated_from_a_recipe_is_refused(tmp_path):
    recipe = write_recipe(
        tmp_path,
        "template:\n  kwargs:\n    handler:\n      (): os.system\n"
        "hydra:\n  job_logging:\n    handlers:\n      h: ${template.kwargs.handler}\n",
    )
    assert refused_key(f"recipe={recipe}") == "hydra.job_logging.handlers.h.()"


def test_environment_set_from_sweep_parameters_is_refused(tmp_path):
    recipe = write_recipe(
        tmp_path,
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      PYTHONPATH: /tmp/evil\n"
        "  job:\n    env_set: ${hydra.sweeper.params}\n",
    )
    assert refused_key(f"recipe={recipe}") == "hydra.job.env_set.PYTHONPATH"


@pytest.mark.parametrize(
    "override",
    [
        "hydra.overrides.hydra=['hydra.job.env_set.PYTHONPATH=/tmp/evil']",  # each sweep job is composed with these
        "+hydra.env.x=1",
        "hydra.job.num=-1",
    ],
)
def test_settings_off_the_allow_list_are_refused(override):
    assert refused_key(override, "prompt.text=hi") == override.lstrip("+").split("=")[0]


def test_a_recipe_cannot_prefill_the_record_of_the_command_line(tmp_path):
    recipe = write_recipe(tmp_path, "hydra:\n  overrides:\n    hydra:\n      - hydra.job.env_set.LD_PRELOAD=/x.so\n")
    assert refused_key(f"recipe={recipe}") == "hydra.overrides.hydra"


# ---- 3. --experimental-rerun unpickles its file ----
def test_experimental_rerun_is_refused(tmp_path):
    payload, canary = write_canary_pickle(tmp_path)
    assert refused_key("--experimental-rerun", str(payload)) == "--experimental-rerun"
    assert not canary.exists()


# ---- 4. launcher values are single-line plain values ----
@pytest.mark.parametrize(
    "override",
    [
        "hydra.launcher.partition='gpu\ntouch /tmp/pwned'",
        "hydra.launcher.comment='a\rb'",
        "++hydra.launcher.additional_parameters={mail-user: 'me\nexport X=1'}",
    ],
)
def test_launcher_values_with_newlines_are_refused(override):
    assert refused_key("-m", "hydra/launcher=slurm", override).startswith("hydra.launcher.")


# ---- 5. folders stay where they belong, also when built from interpolations ----
@pytest.mark.parametrize(
    "body, key",
    [
        ("template:\n  kwargs:\n    sub: ../../escaped\nhydra:\n  sweep:\n    subdir: ${template.kwargs.sub}\n", "sub"),
        ("template:\n  kwargs:\n    sub: ../../escaped\nhydra:\n  output_subdir: ${template.kwargs.sub}\n", "out"),
        (
            "template:\n  kwargs:\n    f: ../../../home/.bashrc\nhydra:\n  job_logging:\n    version: 1\n"
            "    handlers:\n      f:\n        class: logging.FileHandler\n"
            "        filename: ${hydra.runtime.output_dir}/${template.kwargs.f}\n",
            "log",
        ),
        ("template:\n  kwargs:\n    n: ../../x\nhydra:\n  job:\n    name: ${template.kwargs.n}\n", "name"),
    ],
)
def test_folders_built_from_interpolations_cannot_leave_the_run_folder(tmp_path, body, key):
    expected = {
        "sub": "hydra.sweep.subdir",
        "out": "hydra.output_subdir",
        "log": "hydra.job_logging.handlers.f.filename",
        "name": "hydra.job.name",
    }
    assert refused_key(f"recipe={write_recipe(tmp_path, body)}") == expected[key]


def test_each_sweep_job_is_checked_where_its_folder_comes_from_its_overrides(tmp_path):
    recipe = write_recipe(tmp_path, "hydra:\n  sweep:\n    subdir: ${hydra.job.override_dirname}\n")
    assert check("-m", f"recipe={recipe}", "decode.max_tokens=2,3") is None  # folders like decode.max_tokens=2
    assert refused_key("-m", f"recipe={recipe}", "+template.kwargs.x=ok,../../../escaped") == "hydra.sweep.subdir"
    swept = write_recipe(
        tmp_path,
        "template:\n  kwargs:\n    sub: a\nhydra:\n  sweep:\n    subdir: ${template.kwargs.sub}\n",
        name="swept.yaml",
    )
    assert refused_key("-m", f"recipe={swept}", "template.kwargs.sub=a,../../b") == "hydra.sweep.subdir"


def test_shipped_settings_and_plain_changes_pass():
    assert check("prompt.text=hi", "hydra.run.dir=somewhere/else", "hydra.job.name=my-job") is not None
    assert (
        check("-m", "decode.max_tokens=2,3", "hydra.sweep.dir=sweeps/x", "hydra.sweep.subdir=job_${hydra.job.num}")
        is None
    )
    assert check("prompt.text=hi", "hydra.verbose=true", "+hydra.job.env_set.OMP_NUM_THREADS=2") is not None
    assert check("-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "decode.max_tokens=2,3") is None


# ---- 7. environment reads need the user's say on the command line ----
def test_environment_reads_from_a_recipe_are_refused_wherever_they_land(tmp_path, monkeypatch):
    monkeypatch.setenv("MYSECRET", "s3cret-value")
    recipe = write_recipe(
        tmp_path, "template:\n  kwargs:\n    p: ${oc.env:MYSECRET}\nprompt:\n  text: ${template.kwargs.p}\n"
    )
    composed = check(f"recipe={recipe}")
    with pytest.raises(Exception, match="MYSECRET, which the command line did not name") as raised:
        read_job_config(composed)
    assert "s3cret-value" not in str(raised.value)
    rows = write_recipe(
        tmp_path, "prompt:\n  text: null\n  rows:\n    - prompt: ${oc.env:MYSECRET}\n", name="rows.yaml"
    )
    with pytest.raises(Exception, match="MYSECRET"):
        read_job_config(check(f"recipe={rows}"))


def test_an_environment_read_the_user_types_is_read(monkeypatch):
    monkeypatch.setenv("MODELS_DIR", "/models")
    composed = check("model.path=${oc.env:MODELS_DIR}/llama", "prompt.text=hi")
    assert read_job_config(composed)["model"]["path"] == "/models/llama"


def test_sweep_parameters_cannot_read_the_environment(tmp_path):
    recipe = write_recipe(tmp_path, "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      +x: ${oc.env:HOME},b\n")
    assert refused_key(f"recipe={recipe}") == "hydra.sweeper.params.+x"


# ---- 8. one rule for run folders in mlxcel-run, mlxcel-chat and mlxcel-serve ----
@pytest.mark.parametrize("value", [".", "", "..", "/"])
def test_chat_and_serve_refuse_the_current_folder_as_their_run_folder(value):
    from mlxcel.outputs import split_run_dir

    with pytest.raises(ConfigError, match="hydra.run.dir"):
        split_run_dir([f"hydra.run.dir={value}", "prompt.text=hi"])


def test_chat_and_serve_refuse_a_file_as_their_run_folder(tmp_path):
    from mlxcel.outputs import split_run_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        split_run_dir([f"hydra.run.dir={tmp_path / 'file'}"])
    assert split_run_dir([f"hydra.run.dir={tmp_path / 'new'}", "x=1"]) == (tmp_path / "new", ["x=1"])


# ---- 6. a run never writes over its input, whatever the path's spelling ----
def test_an_input_named_through_dotdot_or_a_symlink_is_refused(tmp_path):
    from mlxcel.outputs import check_not_input

    (tmp_path / "dry").mkdir()
    (tmp_path / "dry" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "dry")
    for run_dir, input_file in [
        (tmp_path / "dry", tmp_path / "dry" / ".." / "dry" / "prompts.jsonl"),
        (tmp_path / "link", tmp_path / "dry" / "prompts.jsonl"),
        (tmp_path / "dry", tmp_path / "link" / "prompts.jsonl"),
    ]:
        with pytest.raises(ConfigError, match="is a file this run writes"):
            check_not_input(run_dir, [input_file])


# ---- 11, 12: bombs and unset variables ----
def test_a_yaml_alias_bomb_in_a_recipe_is_refused(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(
        "defaults:\n  - config\n  - _self_\ntemplate:\n  kwargs:\n" + "".join(f"    {x}\n" for x in lines)
    )
    with pytest.raises(ConfigError, match=r"recipe: .*bomb.yaml: its aliases expand to more than"):
        use_recipe([f"recipe={recipe}"])


def test_a_yaml_alias_bomb_in_a_config_folder_is_refused(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    assert refused_key("--config-dir", str(tmp_path), "prompt.text=hi") == "--config-dir"


def test_doubling_interpolations_are_refused_before_they_resolve(tmp_path):
    body = "template:\n  kwargs:\n    a0: xx\n" + "".join(
        f"    a{i}: ${{.a{i - 1}}}${{.a{i - 1}}}\n" for i in range(1, 31)
    )
    body += "prompt:\n  text: ${template.kwargs.a30}\n"
    key = refused_key(f"recipe={write_recipe(tmp_path, body)}")
    assert key.startswith("template.kwargs.a") or key == "prompt.text"


def test_an_unset_variable_in_env_copy_is_a_config_error():
    assert refused_key("hydra.job.env_copy=[MLXCEL_SURELY_UNSET]", "prompt.text=hi") == "hydra.job.env_copy"


def test_env_copy_from_a_recipe_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MYSECRET", "s3cret-value")
    recipe = write_recipe(tmp_path, "hydra:\n  job:\n    env_copy: [MYSECRET]\n")
    assert refused_key(f"recipe={recipe}") == "hydra.job.env_copy"


# ---- end to end: the canary stays unmade, no folder is created ----
def run_mlxcel(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(tmp_path, *args, env={"MYSECRET": "s3cret-value"})


@pytest.mark.slow  # a subprocess
def test_hostile_configs_run_nothing_end_to_end(tmp_path):
    payload, canary = write_canary_pickle(tmp_path)
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "config.yaml").write_text(
        f"hydra:\n  callbacks:\n    x:\n      _target_: joblib.load\n      filename: {payload}\n"
    )
    recipe = write_recipe(
        tmp_path,
        f"template:\n  kwargs:\n    payload:\n      _target_: joblib.load\n      filename: {payload}\n"
        "hydra:\n  callbacks:\n    evil: ${template.kwargs.payload}\n",
    )
    for args in (
        ["--config-path", str(folder), "--config-name", "config"],
        [f"recipe={recipe}", "runner.dry_run=true"],
        ["--experimental-rerun", str(payload)],
        [
            "+hydra.callbacks.evil=${template.kwargs.p}",
            f"+template.kwargs.p={{_target_:joblib.load,filename:'{payload}'}}",
            "runner.dry_run=true",
        ],
    ):
        result = run_mlxcel(tmp_path, *args)
        assert result.returncode == 2 and result.stderr.startswith("mlxcel: config error:"), (args, result.stderr)
        assert not canary.exists(), args
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow  # a subprocess
def test_a_dry_run_never_writes_over_its_input_through_dotdot(tmp_path):
    (tmp_path / "dry").mkdir()
    (tmp_path / "dry" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    result = run_mlxcel(
        tmp_path,
        "prompt=jsonl",
        "prompt.file=dry/../dry/prompts.jsonl",
        "runner.dry_run=true",
        f"hydra.run.dir={tmp_path / 'dry'}",
    )
    assert result.returncode == 2 and "prompt.file: is a file this run writes" in result.stderr
    assert sorted(p.name for p in (tmp_path / "dry").iterdir()) == ["prompts.jsonl"]
    assert (tmp_path / "dry" / "prompts.jsonl").read_text() == '{"prompt": "hi"}\n'


def test_doubling_interpolations_from_the_api_are_refused_too():
    from mlxcel.cli import compose_config

    overrides = [
        "+template.kwargs.a0=xx",
        *(f"+template.kwargs.a{i}=${{.a{i - 1}}}${{.a{i - 1}}}" for i in range(1, 31)),
    ]
    with pytest.raises(ConfigError, match="would resolve to more than"):
        compose_config([*overrides, "prompt.text=hi"])
