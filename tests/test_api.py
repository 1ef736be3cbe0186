"""The Python API on a tiny model: same tokens as the CLI, streaming, batches, errors."""

from __future__ import annotations

import json

import pytest

from mlxcel import load_config, load_generator
from mlxcel.errors import ConfigError, MlxcelError
from tests.helpers import read_run, run_cli


@pytest.fixture(scope="module")
def generator(tiny_llama):
    return load_generator(
        {"model": {"path": str(tiny_llama), "max_context": 128}},
        overrides=["decode.max_tokens=8", "decode.ignore_eos=true"],
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_generate_matches_the_cli(generator, tiny_llama, tmp_path):
    out = generator.generate("Hello, world: how are you?")
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert generator.stats.generated_tokens == 8 and generator.stats.prompt_tokens == out.prompt_tokens
    result = run_cli(
        tmp_path,
        f"model.path={tiny_llama}",
        "decode.max_tokens=8",
        "decode.ignore_eos=true",
        "prompt.text=Hello, world: how are you?",
    )
    assert result.returncode == 0, result.stderr
    assert read_run(tmp_path)[1][0]["token_ids"] == out.token_ids


def test_stream_yields_the_same_text(generator):
    chunks = list(generator.stream("The capital of France"))
    whole = generator.generate("The capital of France")
    assert "".join(chunks) == whole.text and len(chunks) > 1
    assert generator.stats.generated_tokens == len(whole.token_ids)


def test_batches_conversations_and_error_rows(generator):
    prompts = [
        "a b c",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "hello world " * 100,
    ]
    outs = generator.generate(prompts, max_tokens=3)
    assert [o.finish_reason for o in outs] == ["length", "length", "error"]
    assert "context of 128" in outs[2].error
    assert [len(o.token_ids) for o in outs[:2]] == [3, 3]
    assert outs[0].token_ids == generator.generate("a b c", max_tokens=3).token_ids  # batch == alone
    assert generator.stats.finish_reasons == {"length": 1}
    with pytest.raises(MlxcelError, match="context of 128"):
        list(generator.stream("hello world " * 100))


def test_config_dict_and_overrides_are_validated(tiny_llama):
    cfg = load_config({"model": {"path": str(tiny_llama)}, "sampler": {"seed": 3}}, overrides=["sampler=temperature"])
    assert cfg.sampler.seed == 3 and cfg.sampler.selector.kind == "categorical"
    with pytest.raises(ConfigError, match=r"decode.max_tokns: unknown key"):
        load_config({"decode": {"max_tokns": 3}})
    with pytest.raises(ConfigError, match="available options in 'sampler'"):
        load_config(overrides=["sampler=nope"])
    resolved = json.loads(json.dumps(cfg.resolved_dict()))  # JSON-ready, as the runner writes it
    assert resolved["sampler"]["chain"][-1] == {"stage": "draw", "kind": "categorical"}


def test_generate_takes_a_constraint(generator):
    """Structured output from Python; the grammar's end ends the row even under decode.ignore_eos."""
    out = generator.generate("Pick one", max_tokens=8, constraint={"choice": ["yes", "no"]})
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.constraint_satisfied is True
    outs = generator.generate(["a", "b"], constraint={"type": "json_object"}, max_tokens=3)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.constraint_satisfied for o in outs] == [False, False] and outs[0].text.startswith("{")
    assert "".join(generator.stream("Pick one", constraint={"regex": "[0-9]{3}"})).isdigit()
    with pytest.raises(MlxcelError, match="exactly one of"):
        generator.generate("x", constraint={"regex": "a", "choice": ["b"]})
