"""The families added for issues 40 and 41 through the user's paths, each on its tiny random
checkpoint (the family tests' own builders; their parity with transformers is checked there):
the Python API as a user loads it (the prompt cache on, the default), where a batch of prompts and
a conversation give the tokens each gives alone, and a JSON-schema row answers in its schema; and
the OpenAI server, whose chat completion is the API's answer. fp32 on the CPU, greedy."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from mlxcel import load_generator
from tests.serve_fixtures import request_json, running_server

pytest.importorskip("torch")

PROMPTS = ["def add(a, b):", "The capital of Italy is", "Numbers 0123456789 and symbols"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, world!"},
    {"role": "assistant", "content": "How are you today?"},
    {"role": "user", "content": "I am fine, thank you."},
]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
OVERRIDES = ["model=hf", "model.dtype=float32", "runner.device=cpu", "decode.max_tokens=10", "decode.ignore_eos=true"]


def build(family: str, folder: Path) -> Path:
    """The family test's own tiny checkpoint (with a tokenizer and a ChatML template)."""
    if family == "nemotron_h":
        from tests.test_families_nemotron_h import write_nemotron_h

        return write_nemotron_h(folder)
    if family in ("qwen3_5_moe_text", "qwen3_next"):
        from tests.test_families_qwen3_5 import make_checkpoint

        return make_checkpoint(folder, family)
    if family == "gpt_oss":
        from tests.test_families_gpt_oss import make_checkpoint

        return make_checkpoint(folder)
    if family in ("glm4", "glm4_moe"):
        from tests.test_families_glm import make_checkpoint

        return make_checkpoint(folder, family)
    if family in ("olmo2", "olmo3"):
        from tests.test_families_olmo import write_olmo

        return write_olmo(folder, family)
    if family == "smollm3":
        from tests.test_families_smollm3 import write_smollm3

        return write_smollm3(folder)
    if family == "gemma4":
        from tests.test_families_gemma4 import make_checkpoint

        return make_checkpoint(folder, "ple")
    raise AssertionError(family)


FAMILIES = [
    "nemotron_h",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gpt_oss",
    "glm4",
    "glm4_moe",
    "olmo2",
    "olmo3",
    "smollm3",
    "gemma4",
]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory, on_the_cpu) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def test_the_api_gives_each_row_its_own_tokens_and_a_schema_row_its_schema(checkpoint):
    generator = load_generator({"model": {"path": str(checkpoint)}}, overrides=OVERRIDES)
    together = generator.generate([*PROMPTS, CONVERSATION])
    alone = [generator.generate(p).token_ids for p in [*PROMPTS, CONVERSATION]]
    assert [o.token_ids for o in together] == alone
    assert all(len(t) == 10 for t in alone) and len({tuple(t) for t in alone}) > 1
    constrained = generator.generate(PROMPTS[1], max_tokens=40, constraint={"json_schema": SCHEMA})
    assert constrained.finish_reason == "stop", constrained
    jsonschema.validate(json.loads(constrained.text), SCHEMA)


@pytest.mark.parametrize("family", ["nemotron_h", "gpt_oss", "gemma4"])
def test_the_server_answers_as_the_api(family, tmp_path):
    folder = build(family, tmp_path / family)
    expected = load_generator({"model": {"path": str(folder)}}, overrides=OVERRIDES).generate(CONVERSATION)
    with running_server(tmp_path / "run", f"model.path={folder}", *OVERRIDES, "serve.model_name=m") as server:
        status, body, _ = request_json(f"{server.url}/chat/completions", {"model": "m", "messages": CONVERSATION})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
