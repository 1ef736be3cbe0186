"""The CLI: free-text quoting, error reporting and exit codes, conf lookup (also when installed).

The runner is stubbed: these tests are about argv -> config -> exit code, not about a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import mlxcel
from mlxcel.cli import find_conf_dir, main, quote_free_text
from mlxcel.errors import MlxcelError

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(path.stem for path in (find_conf_dir() / "model").glob("*.yaml"))  # as the error lists them
STUB = """
import json, sys, types
import mlxcel
stub = types.ModuleType("mlxcel.runner")
def run(cfg, out_dir, overrides=None, keep_weights=False, sweep_job=None):
    print(json.dumps({"text": cfg.prompt.text, "system": cfg.prompt.system, "template": cfg.template.text,
                      "out_dir": str(out_dir)}))
    return {"ok": True}
stub.run = run
sys.modules["mlxcel.runner"] = mlxcel.runner = stub
from mlxcel.cli import main
main()
"""

TEXTS = [
    "Hello, world: ça va?  ",
    "it's",
    "say \"hi\", then 'bye'",
    "back\\slash and \\' and \\\" ",
    "ends with a backslash\\",
    "ends with two\\\\",
    "${oops} and \\${x} and $notvar",
    "[1, 2]",
    "{a: 1}",
    "a=b,c=d",
    "choice(a,b)",
    "  leading and trailing  ",
    "two\nlines",
    "tab\there 🎉 日本語",
    "42",
    "true",
    "'half",
    "x'",
    '"quoted" word',
    "{{ messages[0]['content'] }}{% if add_generation_prompt %}<|im_start|>{% endif %}",
]


def compose_args(args: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=quote_free_text(args))
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("text", TEXTS)
def test_free_text_survives_hydra_exactly(text):
    data = compose_args([f"prompt.text={text}", f"+prompt.system={text}", f"++template.text={text}"])
    assert (data["prompt"]["text"], data["prompt"]["system"], data["template"]["text"]) == (text, text, text)


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("prompt.text=Hello, world", "prompt.text='Hello, world'"),
        ("+prompt.system=Be brief: ok", "+prompt.system='Be brief: ok'"),
        ("++template.text=it's", "++template.text='it\\'s'"),
        ("prompt.text=a\\", "prompt.text='a\\\\'"),
        ("prompt.text='already, quoted'", "prompt.text='already, quoted'"),
        ('prompt.text="already, quoted"', "prompt.text='already, quoted'"),  # unquoted once, quoted our way
        ("prompt.text='${oc.env:HOME}'", "prompt.text='\\${oc.env:HOME}'"),  # literal in every quoting form
        ("decode.stop_strings=['${oc.env:HOME}', x]", "decode.stop_strings=['\\${oc.env:HOME}', 'x']"),
        ("prompt.system=null", "prompt.system=null"),
        ("prompt.text=", "prompt.text=''"),
        ("~prompt.system", "~prompt.system"),
        ("prompt.texts=a,b", "prompt.texts=a,b"),
        ("decode.max_tokens=5,6", "decode.max_tokens=5,6"),
        ("runner.name=a,b", "runner.name=a,b"),
        ("--cfg", "--cfg"),
    ],
)
def test_quote_free_text_rewrites_only_free_text_values(arg, expected):
    assert quote_free_text([arg]) == [expected]


def test_hydra_quoted_value_is_unquoted_once_and_null_is_null():
    assert compose_args(["prompt.text='a, b'"])["prompt"]["text"] == "a, b"
    assert compose_args(["prompt.text=\"'kept quotes'\""])["prompt"]["text"] == "'kept quotes'"
    assert compose_args(["prompt.system=Be brief", "prompt.system=null"])["prompt"]["system"] is None


def test_conf_is_found_in_the_checkout():
    assert find_conf_dir() == REPO / "conf"


# ---- main() in process, with the runner stubbed ----
@pytest.fixture
def stub_runner(monkeypatch, tmp_path):
    """Replace mlxcel.runner; run() records its calls and applies the behaviour set in `effect`."""
    calls: list[tuple] = []
    effect: dict = {}

    def run(cfg, out_dir, overrides=None, keep_weights=False, sweep_job=None):
        calls.append((cfg, out_dir))
        effect["overrides"] = overrides
        if "raise" in effect:
            raise effect["raise"]
        return {"ok": True}

    stub = types.ModuleType("mlxcel.runner")
    stub.run = run
    monkeypatch.setitem(sys.modules, "mlxcel.runner", stub)
    monkeypatch.setattr(mlxcel, "runner", stub, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLXCEL_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    return types.SimpleNamespace(calls=calls, effect=effect, cwd=tmp_path)


def run_main(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["mlxcel-run", *args])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code


def test_run_passes_the_validated_config_and_an_output_dir(stub_runner, monkeypatch, capsys):
    assert run_main(monkeypatch, "prompt.text=Hello, world: ça va?  ", "decode.max_tokens=7", "runner.name=exp") == 0
    ((cfg, out_dir),) = stub_runner.calls
    assert cfg.prompt.text == "Hello, world: ça va?  " and cfg.decode.max_tokens == 7
    assert out_dir.parent == stub_runner.cwd / "outputs" / "exp" / "runs"
    assert (out_dir / ".hydra" / "config.yaml").is_file()
    assert not list(out_dir.glob("*.log"))  # quiet: no Hydra log file
    assert os.environ.get("HYDRA_FULL_ERROR") is None  # restored
    assert capsys.readouterr().err == ""


def test_multirun_keeps_free_text_whole(stub_runner, monkeypatch):
    assert run_main(monkeypatch, "-m", "decode.max_tokens=1,2", "prompt.text=a, b") == 0
    assert [(c.decode.max_tokens, c.prompt.text) for c, _ in stub_runner.calls] == [(1, "a, b"), (2, "a, b")]
    assert [d.name for _, d in stub_runner.calls] == ["0", "1"]
    assert stub_runner.calls[0][1].parent.parent == stub_runner.cwd / "outputs" / "default" / "multiruns"


@pytest.mark.parametrize(
    "error, code, line",
    [
        (MlxcelError("prompt too long for the model"), 1, "mlxcel: error: prompt too long for the model"),
        (
            RuntimeError("kaboom\ndetail"),
            1,
            "mlxcel: error: RuntimeError: kaboom (set MLXCEL_DEBUG=1 for the traceback)",
        ),
        (KeyboardInterrupt(), 130, "mlxcel: interrupted"),
    ],
)
def test_run_failures_are_one_line(stub_runner, monkeypatch, capsys, error, code, line):
    stub_runner.effect["raise"] = error
    assert run_main(monkeypatch) == code
    assert capsys.readouterr().err.splitlines() == [line]


def test_debug_shows_the_traceback(stub_runner, monkeypatch, capsys):
    stub_runner.effect["raise"] = RuntimeError("kaboom")
    monkeypatch.setenv("MLXCEL_DEBUG", "1")
    assert run_main(monkeypatch) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "mlxcel: error: RuntimeError: kaboom"


def test_config_errors_exit_2_before_the_runner(stub_runner, monkeypatch, capsys):
    assert run_main(monkeypatch, "decode.max_tokens=0", "sampler.selector.kind=beam") == 2
    assert stub_runner.calls == []
    assert capsys.readouterr().err.splitlines() == [
        (
            "mlxcel: config error: sampler.selector.kind: unknown selector; known: greedy, categorical, "
            "mirostat_v1, mirostat_v2, adaptive_p (got 'beam')"
        ),
        "mlxcel: config error: decode.max_tokens: must be > 0 (got 0)",
        (
            "mlxcel: config error: fix: override it on the command line (e.g. sampler.selector.kind=...) "
            "or edit conf/sampler/ (or your own config)"
        ),
    ]


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["sampler=nope"],
            "could not find config 'sampler/nope'; available options in 'sampler': adaptive_p, default, dry, "
            "dynatemp, greedy, min_p, mirostat, mirostat_v1, penalties, temperature, top_n_sigma, typical, xtc",
        ),
        (
            ["decode.max_tokenz=1"],
            "decode.max_tokenz: unknown key (did you mean decode.max_tokens?); valid keys: max_tokens, "
            "stop_token_ids, stop_strings, ignore_eos, pipeline, logprobs, kv_bits, kv_group_size, step, constraint, "
            "draft",
        ),
        (
            ["runner.batch_size=4"],
            "runner.batch_size: renamed to runner.max_rows (rows decoding at once); fix: runner.max_rows=N",
        ),
        (
            ["foo=1"],
            "foo: unknown key; valid keys: model, tokenizer, template, sampler, prefill, decode, prompt, runner",
        ),  # (no "+foo=1": validation refuses that too)
        (["~sampler.processors.top_p"], "Could not delete from config. 'sampler.processors.top_p' does not exist."),
        (["decode.max_tokens=${oops}"], "decode.max_tokens: Interpolation key 'oops' not found"),
    ],
)
def test_hydra_errors_are_one_line(stub_runner, monkeypatch, capsys, args, line):
    assert run_main(monkeypatch, *args) == 2
    assert capsys.readouterr().err.splitlines() == [f"mlxcel: config error: {line}"]
    assert stub_runner.calls == []


def test_user_config_dir_adds_options(stub_runner, monkeypatch):
    mine = stub_runner.cwd / "myconf" / "sampler"
    mine.mkdir(parents=True)
    (mine / "hot.yaml").write_text("processors:\n  temperature: {value: 1.5}\nselector: {kind: categorical}\n")
    assert run_main(monkeypatch, "--config-dir", "myconf", "sampler=hot") == 0
    ((cfg, _),) = stub_runner.calls
    assert cfg.sampler.effective_chain()[0] == {
        "stage": "temperature",
        "value": 1.5,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
    }


# ---- real processes ----
def run_cli(args: list[str], cwd: Path, stub: bool = True, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLXCEL_DEBUG", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(pythonpath)
    command = [sys.executable, "-c", STUB] if stub else [sys.executable, "-m", "mlxcel"]
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_cfg_job_shows_the_exact_text(tmp_path):
    text = 'Hello, world: ça va? "yes" it\'s  '
    result = run_cli(["--cfg", "job", f"prompt.text={text}", f"prompt.system={text}"], tmp_path, stub=False)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["prompt"]["text"] == text and shown["prompt"]["system"] == text


@pytest.mark.slow
def test_stubbed_run_gets_the_exact_text(tmp_path):
    text = "Hi, you: ça va?  ${x} \\"
    result = run_cli([f"prompt.text={text}", f"template.text={text}"], tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["text"] == text and seen["template"] == text
    assert Path(seen["out_dir"]).parent == tmp_path / "outputs" / "default" / "runs"
    assert result.stderr == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "arg, needle",
    [
        ("sampler=nope", "greedy, min_p, mirostat"),
        ("+decode.max_tokens=5", "++decode.max_tokens=5"),
        ("decode.max_tokens=[1", "cannot parse override 'decode.max_tokens=[1'"),
        ("foo=1", "foo: unknown key"),
    ],
)
def test_hydra_errors_exit_2_with_one_line(tmp_path, arg, needle):
    result = run_cli([arg], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: config error: ") and needle in lines[0]
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert not (tmp_path / "outputs").exists()  # composition failed before any run folder


@pytest.mark.slow
def test_config_error_exits_2_without_traceback(tmp_path):
    result = run_cli(["decode.max_tokens=-1", "model.dtype=fp8"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "mlxcel: config error: model.dtype: must be one of: auto, float32, float16, bfloat16 (got 'fp8')",
        "mlxcel: config error: decode.max_tokens: must be > 0 (got -1)",
        (
            "mlxcel: config error: fix: override it on the command line (e.g. model.dtype=...) "
            "or edit conf/model/ (or your own config)"
        ),
    ]
    assert result.stdout == ""


@pytest.mark.slow
def test_installed_package_finds_its_conf_from_any_directory(tmp_path, installed_mlxcel):
    target = installed_mlxcel
    assert (target / "mlxcel" / "conf" / "sampler" / "temperature.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli(
        ["--cfg", "job", "sampler=temperature", "prompt.text=a, b"], elsewhere, stub=False, pythonpath=target
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["sampler"]["processors"]["temperature"]["value"] == 0.8 and shown["prompt"]["text"] == "a, b"
    where = subprocess.run(
        [sys.executable, "-c", "from mlxcel.cli import find_conf_dir; print(find_conf_dir())"],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()) == target / "mlxcel" / "conf"


def test_a_given_prompt_input_replaces_the_default_text(tmp_path):
    from mlxcel.cli import compose_config, prefer_given_prompt

    assert prefer_given_prompt(["prompt.file=a.jsonl"]) == ["prompt.file=a.jsonl", "prompt.text=null"]
    assert prefer_given_prompt(["prompt.file=a.jsonl", "prompt.text=hi"]) == [
        "prompt.file=a.jsonl",
        "prompt.text=hi",
    ]  # a clash stays one
    assert prefer_given_prompt(["decode.max_tokens=3"]) == ["decode.max_tokens=3"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    assert compose_config([f"prompt.file={rows}"])["prompt"]["text"] is None
    assert compose_config([], {"prompt": {"rows": [{"prompt": "hi"}]}})["prompt"]["text"] is None
    assert compose_config([])["prompt"]["text"] == "What is the capital of France?"


# ---- the command line as people type it (issue 39, item 10) ----
def test_version_is_mlxcels_and_mlxs(stub_runner, monkeypatch, capsys):
    from importlib.metadata import version

    assert run_main(monkeypatch, "--version") == 0
    assert capsys.readouterr().out == f"mlxcel {mlxcel.__version__} (MLX {version('mlx')})\n"
    assert stub_runner.calls == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["What is 2+2?"], ["prompt.text=What is 2+2?"]),
        (["x = 2, y: 3?", "decode.max_tokens=4"], ["decode.max_tokens=4", "prompt.text=x = 2, y: 3?"]),
        (["--prompt", "hi", "--max-tokens", "5"], ["decode.max_tokens=5", "prompt.text=hi"]),
        (["-p", "hi", "-n", "5", "--seed=7"], ["decode.max_tokens=5", "sampler.seed=7", "prompt.text=hi"]),
        (["--system-prompt", "Be brief", "-sys", "x"], ["prompt.system=Be brief", "prompt.system=x"]),
        (["--model", "/m/x.gguf"], ["model.path='/m/x.gguf'"]),
        (["--model=Qwen/Qwen2.5-0.5B"], ["model.path='Qwen/Qwen2.5-0.5B'"]),
        # -m: llama-cli's model when a path follows, Hydra's multirun otherwise
        (["-m", "/m/x.gguf"], ["model.path='/m/x.gguf'"]),
        (["-m", "x.gguf", "hi"], ["model.path='x.gguf'", "prompt.text=hi"]),
        (["-m", "hydra/launcher=joblib", "sampler=a,b"], ["-m", "hydra/launcher=joblib", "sampler=a,b"]),
        (["-m", "decode.max_tokens=1,2", "hi"], ["-m", "decode.max_tokens=1,2", "prompt.text=hi"]),
        (["-m", "~prompt.system"], ["-m", "~prompt.system"]),
        (["-m", "What is 1/2?", "sampler=a,b"], ["-m", "sampler=a,b", "prompt.text=What is 1/2?"]),
        (["-m", "embedded:smollm2"], ["model.path='embedded:smollm2'"]),
        # Hydra's own options and their values stay Hydra's
        (["--cfg", "job", "-p", "sampler"], ["--cfg", "job", "-p", "sampler"]),
        (["--info", "defaults", "-cn", "x"], ["--info", "defaults", "-cn", "x"]),
        (["--config-dir", "my conf", "sampler=hot"], ["--config-dir", "my conf", "sampler=hot"]),
    ],
)
def test_familiar_arguments_become_their_overrides(args, expected):
    from mlxcel.cli import translate_familiar_args

    assert translate_familiar_args(args) == expected


@pytest.mark.parametrize("text", ["What is 2+2? It's 4, ${x}", "null", "'quoted'", '"twice"'])
def test_a_bare_prompt_and_llama_cli_flags_run(stub_runner, monkeypatch, tiny_llama, text):
    assert run_main(monkeypatch, "-m", str(tiny_llama), text, "-n", "3") == 0
    ((cfg, _),) = stub_runner.calls
    assert (cfg.model.path, cfg.prompt.text, cfg.decode.max_tokens) == (str(tiny_llama), text, 3)


def test_a_bare_prompt_in_a_multirun(stub_runner, monkeypatch):
    assert run_main(monkeypatch, "-m", "decode.max_tokens=1,2", "a, b") == 0
    assert [(c.decode.max_tokens, c.prompt.text) for c, _ in stub_runner.calls] == [(1, "a, b"), (2, "a, b")]


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--temp", "0.3"],
            "--temp: mlxcel-run takes overrides: type sampler=temperature sampler.processors.temperature.value=0.3 "
            "(as mlx_lm; llama-cli's chain: sampler=default sampler.processors.temperature.value=0.3)",
        ),
        (["--top-k=3"], "--top-k: mlxcel-run takes overrides: type sampler=default sampler.processors.top_k.k=3"),
        (["--max-tokens"], "--max-tokens: needs a value: --max-tokens VALUE"),
        (
            ["--verbose"],
            "--verbose: not an option of mlxcel-run: settings are KEY=VALUE overrides (mlxcel-run --help; the "
            "README's 'Coming from mlx-lm or llama.cpp' table)",
        ),
        (
            ["What", "is", "2+2?"],
            "prompt.text: give one prompt, as one argument: quote it, e.g. mlxcel-run 'What is 2+2?' (settings are "
            "KEY=VALUE) (got ['What', 'is', '2+2?'])",
        ),
        (
            ["hi", "prompt.text=there"],
            "prompt.text: give one prompt, as one argument: quote it, e.g. mlxcel-run 'What is 2+2?' (settings are "
            "KEY=VALUE) (got ['hi', 'there'])",
        ),
        (["decode.max_tokens", "5"], "decode.max_tokens: an override needs a value: decode.max_tokens=VALUE"),
        (
            ["model=/tmp/x.gguf"],
            "model: '/tmp/x.gguf' is a path, not a model preset: give it as model.path=/tmp/x.gguf "
            f"(presets: {', '.join(PRESETS)})",
        ),
        (
            ["sampler.processors.top_p.p=0.9"],
            "sampler.processors.top_p: this sampler has no top_p stage; pick one that has it: sampler=default "
            "sampler.processors.top_p.p=0.9, or add it to this one: ++sampler.processors.top_p.p=0.9",
        ),
        (
            ["sampler.processors.tempreture.value=0.3"],
            "sampler.processors.tempreture: unknown sampler stage (did you mean sampler.processors.temperature?); "
            "known: logit_bias, penalties, dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature",
        ),
    ],
)
def test_familiar_mistakes_name_the_override(stub_runner, monkeypatch, capsys, args, line):
    assert run_main(monkeypatch, *args) == 2
    assert capsys.readouterr().err.splitlines() == [f"mlxcel: config error: {line}"]
    assert stub_runner.calls == []


def test_a_stage_the_sampler_lacks_names_the_sampler_to_pick(stub_runner, monkeypatch, capsys):
    assert run_main(monkeypatch, "sampler.processors.temperature.value=0.3") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "mlxcel: config error: sampler.processors.temperature: this sampler has no temperature stage; pick one that "
        "has it: sampler=temperature sampler.processors.temperature.value=0.3 (samplers with a temperature stage: "
        "temperature, default, "
    )
    assert line.endswith(", or add it to this one: ++sampler.processors.temperature.value=0.3")
    assert run_main(monkeypatch, "sampler=temperature", "sampler.processors.temperature.value=0.3") == 0
    assert stub_runner.calls[0][0].sampler.effective_chain()[0]["value"] == 0.3


@pytest.mark.parametrize(
    "launcher, plugin", [("joblib", "joblib"), ("ray_cluster", "ray"), ("slurm", "submitit_slurm")]
)
def test_a_launcher_without_its_plugin_names_the_extra(stub_runner, monkeypatch, capsys, launcher, plugin):
    """As without the `ray` extra: Hydra's launcher plugins register their configs when Hydra
    scans hydra_plugins; here they are taken out of the ConfigStore after the scan."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # (the scan, once per process: it does not register them again)
    options = ConfigStore.instance().repo["hydra"]["launcher"]
    for name in ("joblib", "submitit_local", "submitit_slurm", "ray", "ray_aws"):
        monkeypatch.delitem(options, f"{name}.yaml", raising=False)
    assert run_main(monkeypatch, "-m", f"hydra/launcher={launcher}", "decode.max_tokens=1,2") == 2
    package = {"joblib": "hydra-joblib-launcher", "ray": "hydra-ray-launcher"}.get(plugin, "hydra-submitit-launcher")
    assert capsys.readouterr().err.splitlines() == [
        f"mlxcel: config error: hydra/launcher: Hydra's {plugin} launcher ({package}) is not installed; it comes "
        "with mlxcel's ray extra: pip install 'mlxcel[ray]'"
    ]
    assert stub_runner.calls == []
