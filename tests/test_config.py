"""RunConfig schema: defaults, every error line, env resolution, and the real conf/ composed by Hydra."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlxcel.config import RunConfig, SamplerConfig, make_hint, validate_config
from mlxcel.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
BASE = {"model": {"path": "embedded:smollm2"}, "prompt": {"text": "Hi"}}


def with_values(**groups: dict) -> dict:
    data = copy.deepcopy(BASE)
    for group, values in groups.items():
        data.setdefault(group, {}).update(values)
    return data


ENV_HINT = "fix: unset the environment variable or give it a valid value"


def issue_lines(data: dict, hints: tuple[str, ...] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    lines = info.value.format().splitlines()
    if hints is None:  # the hint names the first bad key
        hints = (make_hint(lines[0].split(":")[0], unknown=lines[0].split(": ", 1)[1].startswith("unknown key")),)
    assert tuple(lines[-len(hints) :]) == hints
    return lines[: -len(hints)]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MLXCEL_PREFILL_CHUNK", raising=False)
    monkeypatch.delenv("MLXCEL_FORCE_SYNC", raising=False)


def test_defaults_fill_every_group():
    cfg = validate_config(BASE)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.dtype == "auto" and cfg.model.gguf_weights == "auto" and cfg.model.max_context is None
    assert (cfg.tokenizer.kind, cfg.tokenizer.path) == ("auto", None)
    assert (cfg.template.kind, cfg.template.text, cfg.template.file) == ("auto", None, None)
    assert (cfg.sampler.seed, cfg.sampler.min_keep, cfg.sampler.processors) == (0, 0, {})
    assert cfg.sampler.selector.kind == "categorical"
    assert (cfg.prefill.chunk_size, cfg.prefill.tile_size) == (None, "auto")
    assert cfg.prefill.resolved_chunk_size() == 2048
    assert (cfg.decode.max_tokens, cfg.decode.stop_token_ids, cfg.decode.ignore_eos) == (256, [], False)
    assert cfg.decode.pipeline is True and cfg.decode.use_pipeline() is True
    assert (cfg.runner.name, cfg.runner.device) == ("default", "auto")
    assert cfg.prompt.to_messages() == [{"role": "user", "content": "Hi"}]


def test_processor_params_are_filled_and_chain_is_ordered():
    sampler = SamplerConfig.model_validate(
        {"processors": {"temperature": {"value": 0.5}}, "selector": {"kind": "categorical"}}
    )
    assert sampler.processors == {"temperature": {"value": 0.5, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0}}
    assert sampler.effective_chain() == [
        {"stage": "temperature", "value": 0.5, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0},
        {"stage": "draw", "kind": "categorical"},
    ]
    present = SamplerConfig.model_validate({"processors": {"temperature": None}})  # present = on, defaults
    assert present.effective_chain()[0] == {
        "stage": "temperature",
        "value": 0.8,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
    }


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_temperature_at_or_below_zero_is_a_greedy_draw(value):
    sampler = SamplerConfig.model_validate(
        {"processors": {"temperature": {"value": value}}, "selector": {"kind": "categorical"}}
    )
    assert sampler.effective_chain() == [{"stage": "draw", "kind": "greedy"}]


def test_prompt_messages_put_system_first():
    data = with_values(
        prompt={
            "text": None,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        }
    )
    assert validate_config(data).prompt.to_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    assert validate_config(with_values(prompt={"system": ""})).prompt.to_messages()[0] == {
        "role": "system",
        "content": "",
    }


ERROR_CASES = [
    (
        {"model": {"path": None}},
        "model.path: required: a model folder, a .gguf file, a Hub repo id (org/name) or embedded:smollm2 "
        "(e.g. model=hf model.path=/path/to/model)",
    ),
    (
        {"model": {"path": None, "families": ["qwen3"], "hub_ids": ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-4B"]}},
        "model.path: required: a model folder, a .gguf file or a Hub repo id, e.g. model.path=Qwen/Qwen3-0.6B "
        "(this family's usual repos: Qwen/Qwen3-0.6B, Qwen/Qwen3-4B)",
    ),
    (
        {"model": {"path": "embedded:foo"}},
        "model.path: unknown embedded model; known: embedded:smollm2, embedded:gemma3-270m (got 'embedded:foo')",
    ),
    ({"model": {"dtype": "fp8"}}, "model.dtype: must be one of: auto, float32, float16, bfloat16 (got 'fp8')"),
    ({"model": {"gguf_weights": "q4"}}, "model.gguf_weights: must be one of: auto, quantized, dequantize (got 'q4')"),
    ({"model": {"max_context": 0}}, "model.max_context: must be > 0 (got 0)"),
    (
        {"model": {"colour": 1}},
        "model.colour: unknown key; valid keys: path, dtype, gguf_weights, max_context, quantize, families, "
        "hub_ids, fuse, adapter, adapters, merge_adapter (got 1)",
    ),
    (
        {"runner": {"batch_size": 4}},
        "runner.batch_size: renamed to runner.max_rows (rows decoding at once); fix: runner.max_rows=N (got 4)",
    ),
    ({"prefill": {"tile_size": 0}}, "prefill.tile_size: must be an integer in [1, 1024], 'auto' or null (got 0)"),
    ({"model": {"quantize": {"bits": 7}}}, "model.quantize.bits: must be one of: 2, 3, 4, 5, 6, 8 (got 7)"),
    ({"decode": {"kv_bits": 7}}, "decode.kv_bits: must be one of: 2, 3, 4, 5, 6, 8 (got 7)"),
    ({"decode": {"kv_group_size": 48}}, "decode.kv_group_size: must be one of: 32, 64, 128 (got 48)"),
    (
        {"tokenizer": {"kind": "bpe"}},
        "tokenizer.kind: must be one of: auto, hf, sentencepiece, tiktoken, gguf (got 'bpe')",
    ),
    ({"template": {"text": "a", "file": "b"}}, "template.file: set template.text or template.file, not both (got 'b')"),
    (
        {"template": {"kind": "none", "text": "x"}},
        "template.text: must be null with template.kind=none (no template) (got 'x')",
    ),
    ({"sampler": {"seed": -1}}, "sampler.seed: must be >= 0 (got -1)"),
    ({"sampler": {"min_keep": 1.5}}, "sampler.min_keep: must be an integer >= 0 (got 1.5)"),
    ({"sampler": {"processors": {"top_k": {"k": 4.5}}}}, "sampler.processors.top_k.k: must be an integer (got 4.5)"),
    (
        {"sampler": {"processors": {"top_p": {"p": 1.5}}}},
        "sampler.processors.top_p.p: must be in [0.0, 1.0]; 1.0 turns top-p off (got 1.5)",
    ),
    (
        {"sampler": {"processors": {"penalties": {"repeat": 0.0}}}},
        "sampler.processors.penalties.repeat: must be > 0; 1.0 turns it off (got 0.0)",
    ),
    (
        {"sampler": {"processors": {"dry": {"last_n": -2}}}},
        "sampler.processors.dry.last_n: must be in [-1, 1048576]; -1 = the whole history, 0 = off (got -2)",
    ),
    (
        {"sampler": {"processors": {"dry": {"breakers": [""]}}}},
        "sampler.processors.dry.breakers: each breaker must be a string of 1 to 40 characters (got '')",
    ),
    (
        {"sampler": {"processors": {"logit_bias": {"bias": {"x": 1.0}}}}},
        "sampler.processors.logit_bias.bias: keys must be token ids (integers in [0, 1048576)) (got 'x')",
    ),
    (
        {"sampler": {"processors": {"xtc": {"threshold": 2.0}}}},
        "sampler.processors.xtc.threshold: must be in [0.0, 1.0]; values above 0.5 turn XTC off (got 2.0)",
    ),
    (
        {"sampler": {"processors": {"top_q": {}}}},
        "sampler.processors.top_q: unknown sampler stage; known: logit_bias, penalties, dry, top_n_sigma, top_k, "
        "typical_p, top_p, min_p, xtc, temperature (got {})",
    ),
    (
        {"sampler": {"processors": {"temperature": {"value": "hot"}}}},
        "sampler.processors.temperature.value: must be a number (got 'hot')",
    ),
    (
        {"sampler": {"processors": {"temperature": {"valu": 1.0}}}},
        "sampler.processors.temperature.valu: unknown key (did you mean sampler.processors.temperature.value?); "
        "valid keys: value, dynatemp_range, dynatemp_exponent (got 1.0)",
    ),
    (
        {"sampler": {"processors": {"temperature": {"dynatemp_range": -0.5}}}},
        "sampler.processors.temperature.dynatemp_range: must be >= 0.0; 0.0 turns dynamic temperature off (got -0.5)",
    ),
    ({"sampler": {"processors": {"temperature": 0.5}}}, "sampler.processors.temperature: must be a mapping (got 0.5)"),
    ({"sampler": {"processors": [1]}}, "sampler.processors: must be a mapping (got [1])"),
    (
        {"sampler": {"processors": {"top_k": {}}, "selector": {"kind": "mirostat_v2"}}},
        "sampler.processors.top_k: cannot be combined with sampler.selector.kind=mirostat_v2 "
        "(mirostat does its own truncation); "
        "remove it with '~sampler.processors.top_k' or choose another selector (got {'k': 40})",
    ),
    (
        {"sampler": {"selector": {"kind": "mirostat_v2", "tau": -1.0}}},
        "sampler.selector.tau: must be >= 0.0 (got -1.0)",
    ),
    (
        {"sampler": {"selector": {"kind": "adaptive_p", "decay": 1.0}}},
        "sampler.selector.decay: must be in [0.0, 0.99] (got 1.0)",
    ),
    (
        {"sampler": {"selector": {"kind": "mirostat_v1", "target": 0.5}}},
        "sampler.selector.target: unknown key; valid keys: kind, tau, eta (got 0.5)",
    ),
    (
        {"sampler": {"selector": {"kind": "beam"}}},
        "sampler.selector.kind: unknown selector; known: greedy, categorical, mirostat_v1, mirostat_v2, "
        "adaptive_p (got 'beam')",
    ),
    (
        {"sampler": {"selector": {"kind": "greedy", "tau": 5.0}}},
        "sampler.selector.tau: unknown key; valid keys: kind (got 5.0)",
    ),
    ({"prefill": {"chunk_size": 0}}, "prefill.chunk_size: must be > 0 (got 0)"),
    ({"prefill": {"tile_size": "x"}}, "prefill.tile_size: must be an integer in [1, 1024], 'auto' or null (got 'x')"),
    ({"decode": {"max_tokens": "abc"}}, "decode.max_tokens: must be an integer > 0 (got 'abc')"),
    ({"decode": {"max_tokens": True}}, "decode.max_tokens: must be an integer > 0 (got True)"),
    ({"decode": {"stop_token_ids": [1, -2]}}, "decode.stop_token_ids.1: must be >= 0 (got -2)"),
    ({"decode": {"stop_token_ids": 5}}, "decode.stop_token_ids: must be a list (got 5)"),
    ({"decode": {"ignore_eos": "yes"}}, "decode.ignore_eos: must be true or false (got 'yes')"),
    ({"prompt": {"text": "  \n"}}, "prompt.text: must not be empty or only whitespace (got '  \\n')"),
    (
        {"prompt": {"text": None}},
        "prompt.text: required: set prompt.text, prompt.messages, prompt.file (JSONL) or prompt.rows",
    ),
    (
        {"prompt": {"messages": [{"role": "user", "content": "x"}]}},
        "prompt.messages: set only one of prompt.text, prompt.messages, prompt.file, prompt.rows "
        "(got text, messages); give one (prompt.file alone runs a batch job: the default text steps aside)",
    ),
    (
        {"prompt": {"text": None, "messages": [{"role": "bot", "content": "x"}]}},
        "prompt.messages.0.role: must be one of: system, user, assistant, tool (got 'bot')",
    ),
    (
        {"prompt": {"text": None, "messages": [{"role": "user", "content": ""}]}},
        "prompt.messages.0.content: must not be empty or only whitespace (got '')",
    ),
    (
        {"prompt": {"text": None, "messages": [{"role": "user"}]}},
        "prompt.messages.0.content: required (only an assistant message with tool_calls may omit it)",
    ),
    (
        {"prompt": {"text": None, "system": "s", "messages": [{"role": "system", "content": "t"}]}},
        "prompt.system: prompt.messages already has a system message; set one or the other (got 's')",
    ),
    ({"runner": {"name": "a/b"}}, "runner.name: must match [A-Za-z0-9._-]+ (got 'a/b')"),
    (
        {"runner": {"name": ".."}},
        "runner.name: must name a folder: letters, digits, '.', '_', '-', not '.' or '..' (got '..')",
    ),
    ({"runner": {"device": "tpu"}}, "runner.device: must be one of: auto, cpu, gpu (got 'tpu')"),
    (
        {"extra": {"x": 1}},
        "extra: unknown key; valid keys: model, tokenizer, template, sampler, prefill, decode, prompt, runner, serve "
        "(got {'x': 1})",
    ),
    ({"decode": None}, "decode: must be a mapping (got None)"),
]


@pytest.mark.parametrize(
    "groups, line", ERROR_CASES, ids=[line.split(":")[0] + f"-{i}" for i, (_, line) in enumerate(ERROR_CASES)]
)
def test_each_error_is_one_exact_line(groups, line):
    data = copy.deepcopy(BASE)
    for group, values in groups.items():
        if isinstance(values, dict) and isinstance(data.get(group), dict):
            data[group].update(values)
        else:
            data[group] = values
    assert issue_lines(data) == [line]


def test_all_errors_are_reported_at_once():
    data = with_values(
        model={"dtype": "fp8"},
        decode={"max_tokens": 0, "stop_token_ids": [-1]},
        sampler={"processors": {"top_p": {"p": 1.9}, "temperature": {"value": "x"}}},
        runner={"name": "a b"},
    )
    assert issue_lines(data) == [
        "model.dtype: must be one of: auto, float32, float16, bfloat16 (got 'fp8')",
        "sampler.processors.top_p.p: must be in [0.0, 1.0]; 1.0 turns top-p off (got 1.9)",
        "sampler.processors.temperature.value: must be a number (got 'x')",
        "decode.max_tokens: must be > 0 (got 0)",
        "decode.stop_token_ids.0: must be >= 0 (got -1)",
        "runner.name: must match [A-Za-z0-9._-]+ (got 'a b')",
    ]


def test_missing_groups_report_their_fields():
    assert issue_lines({}) == [
        "model.path: required: a model folder, a .gguf file, a Hub repo id (org/name) or embedded:smollm2 "
        "(e.g. model=hf model.path=/path/to/model)",
        "prompt.text: required: set prompt.text, prompt.messages, prompt.file (JSONL) or prompt.rows",
    ]


def test_named_files_must_exist(tmp_path):
    assert issue_lines(
        with_values(model={"path": str(tmp_path / "nope.gguf")}, template={"file": "missing.jinja"})
    ) == [
        f"model.path: no such file or directory (got '{tmp_path / 'nope.gguf'}')",
        "template.file: no such file or directory (got 'missing.jinja')",
    ]
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    cfg = validate_config(with_values(model={"path": str(tmp_path)}, template={"file": str(tmp_path / "t.jinja")}))
    assert cfg.model.path == str(tmp_path)


def test_prefill_chunk_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MLXCEL_PREFILL_CHUNK", "512")
    assert validate_config(BASE).prefill.resolved_chunk_size() == 512
    assert validate_config(with_values(prefill={"chunk_size": 64})).prefill.resolved_chunk_size() == 64
    monkeypatch.setenv("MLXCEL_PREFILL_CHUNK", "")
    assert validate_config(BASE).prefill.resolved_chunk_size() == 2048


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5"])
def test_bad_prefill_chunk_env_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("MLXCEL_PREFILL_CHUNK", raw)
    assert issue_lines(BASE, (ENV_HINT,)) == [
        f"MLXCEL_PREFILL_CHUNK: environment variable: must be a positive integer (got {raw!r})"
    ]
    cfg = RunConfig.model_validate(BASE)  # built without validate_config: the method checks too
    with pytest.raises(ConfigError, match="MLXCEL_PREFILL_CHUNK"):
        cfg.prefill.resolved_chunk_size()


def test_force_sync_turns_the_pipeline_off(monkeypatch):
    assert validate_config(with_values(decode={"pipeline": False})).decode.use_pipeline() is False
    monkeypatch.setenv("MLXCEL_FORCE_SYNC", "1")
    cfg = validate_config(BASE)
    assert cfg.decode.pipeline is True and cfg.decode.use_pipeline() is False
    monkeypatch.setenv("MLXCEL_FORCE_SYNC", "0")
    assert cfg.decode.use_pipeline() is True
    monkeypatch.setenv("MLXCEL_FORCE_SYNC", "maybe")
    assert issue_lines(BASE, (ENV_HINT,)) == ["MLXCEL_FORCE_SYNC: environment variable: must be 1 or 0 (got 'maybe')"]
    assert issue_lines(with_values(decode={"max_tokens": 0}), (make_hint("decode.max_tokens"), ENV_HINT)) == [
        "decode.max_tokens: must be > 0 (got 0)",
        "MLXCEL_FORCE_SYNC: environment variable: must be 1 or 0 (got 'maybe')",
    ]


def test_resolved_dict_is_json_with_the_chain(monkeypatch):
    monkeypatch.setenv("MLXCEL_PREFILL_CHUNK", "128")
    data = validate_config(with_values(sampler={"processors": {"temperature": {}}})).resolved_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["prefill"]["resolved_chunk_size"] == 128 and data["decode"]["use_pipeline"] is True
    assert [stage["stage"] for stage in data["sampler"]["chain"]] == ["temperature", "draw"]


# ---- the shipped conf/ composed by Hydra, validated by the schema ----
def compose_run(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def group_options() -> list[tuple[str, str]]:
    return sorted((p.parent.name, p.stem) for p in CONF_DIR.glob("*/*.yaml") if p.parent.name != "hydra")


def test_every_group_has_options():
    groups = {group for group, _ in group_options()}
    stages = {"model", "tokenizer", "template", "sampler", "prefill", "decode", "prompt", "runner"}
    assert groups == stages | {"serve", "convert"}  # (the last two: mlxcel-serve's and mlxcel-convert's own)


@pytest.mark.parametrize("group, option", group_options())
def test_every_option_composes_and_validates(group, option, tmp_path):
    # (serve, convert: mlxcel-serve and mlxcel-convert compose them in)
    overrides = [f"{'+' if group in ('serve', 'convert') else ''}{group}={option}"]
    if group == "model" and option != "smollm2":  # hf and the family presets require model.path
        overrides.append(f"model.path={tmp_path}")
    if (group, option) == ("prompt", "jsonl"):
        (tmp_path / "rows.jsonl").write_text('{"prompt": "hi"}\n')
        overrides.append(f"prompt.file={tmp_path / 'rows.jsonl'}")
    data = compose_run(overrides)
    assert "hydra" not in data
    if group == "convert":  # (mlxcel-convert validates its group on its own, with the output it requires)
        from mlxcel.convert import validate_convert_config

        assert validate_convert_config({**data.pop("convert"), "output": str(tmp_path / "out")}).quantize is None
    cfg = validate_config(data)
    if group == "prompt" and option == "jsonl":
        assert cfg.prompt.is_batch and cfg.prompt.text is None
    else:
        assert cfg.prompt.text == "What is the capital of France?"


def test_jsonl_preset_requires_the_file():
    with pytest.raises(Exception, match="prompt.file"):
        compose_run(["prompt=jsonl"])


def test_default_composition():
    cfg = validate_config(compose_run([]))
    assert cfg.model.path == "embedded:smollm2"
    assert cfg.sampler.effective_chain() == [{"stage": "draw", "kind": "greedy"}]
    assert cfg.template.kind == "auto" and cfg.decode.max_tokens == 256


def test_temperature_preset_and_overrides():
    cfg = validate_config(
        compose_run(["sampler=temperature", "sampler.processors.temperature.value=0.2", "decode.max_tokens=8"])
    )
    assert cfg.sampler.effective_chain() == [
        {"stage": "temperature", "value": 0.2, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0},
        {"stage": "draw", "kind": "categorical"},
    ]
    assert cfg.decode.max_tokens == 8
    removed = validate_config(compose_run(["sampler=temperature", "~sampler.processors.temperature"]))
    assert removed.sampler.processors == {}


def test_stage_added_with_plus_plus_takes_the_other_defaults():
    cfg = validate_config(
        compose_run(["sampler=temperature", "++sampler.processors.top_k.k=5", "++sampler.processors.min_p.p=0.1"])
    )
    assert [stage["stage"] for stage in cfg.sampler.effective_chain()] == ["top_k", "min_p", "temperature", "draw"]
    assert cfg.sampler.processors["top_k"] == {"k": 5}


def test_hf_model_without_path_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        validate_config(compose_run(["model=hf"]))
    assert info.value.issues[0].path == "model.path"


def test_hydra_settings():
    from mlxcel.cli import register_resolvers

    register_resolvers()  # ${mlxcel.pid:} in folder names
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["runner.name=exp-1"], return_hydra_config=True)
    hydra = cfg.hydra
    stamp = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+"  # date, time, the process id
    assert re.fullmatch(f"outputs/exp-1/runs/{stamp}", hydra.run.dir)
    assert re.fullmatch(f"outputs/exp-1/multiruns/{stamp}", hydra.sweep.dir)
    assert OmegaConf.to_container(hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert hydra.job.chdir is False
    assert hydra.runtime.choices["hydra/job_logging"] == "none"
    assert hydra.runtime.choices["hydra/hydra_logging"] == "none"
