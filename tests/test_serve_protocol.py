"""The server's request checks and field mapping, without a server: unknown fields are 400s naming
them, ignored fields pass, the OpenAI sampling fields land on our chain's stages, API keys come
from the file and the variable."""

from __future__ import annotations

import pytest

from mlxcel.openai_protocol import ApiError, ChatRequest, CompletionRequest, make_sampler_config, parse_request
from mlxcel.sampling.config import SamplerConfig
from mlxcel.serve.cli import add_serve_group, load_api_keys

GREEDY = SamplerConfig.model_validate({"selector": {"kind": "greedy"}})
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_request(ChatRequest, {"model": "m", "messages": MESSAGES, **fields})


def test_unknown_fields_are_refused_by_name_and_ignored_ones_pass():
    with pytest.raises(ApiError) as err:
        chat(presence_boost=1)
    assert err.value.status == 400 and err.value.param == "presence_boost"
    assert chat(user="u", metadata={"k": "v"}, store=True, service_tier="auto").model == "m"
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"})
    assert err.value.param == "suffix"
    with pytest.raises(ApiError) as err:
        chat(stream_options={"include_usage": True})  # without stream
    assert err.value.param == "stream_options"
    with pytest.raises(ApiError):
        parse_request(ChatRequest, ["not", "an", "object"])


def test_sampling_fields_map_onto_the_chain():
    assert make_sampler_config(GREEDY, chat(), 100) is None  # the server's own chain
    config = make_sampler_config(GREEDY, chat(temperature=0.7, top_p=0.9, frequency_penalty=0.5), 100)
    chain = {stage["stage"]: stage for stage in config.effective_chain()}
    assert chain["draw"]["kind"] == "categorical" and chain["temperature"]["value"] == 0.7
    assert chain["top_p"]["p"] == 0.9 and chain["penalties"]["frequency"] == 0.5
    zero = make_sampler_config(GREEDY, chat(temperature=0.0), 100)
    assert zero.effective_chain()[-1]["kind"] == "greedy"  # temperature 0 is greedy, as OpenAI's
    biased = make_sampler_config(GREEDY, chat(logit_bias={"5": -100}), 100)
    assert biased.processors["logit_bias"]["bias"] == {5: -100.0}
    with pytest.raises(ApiError) as err:
        make_sampler_config(GREEDY, chat(logit_bias={"100": 1}), 100)
    assert "[0, 100)" in err.value.message
    ours = make_sampler_config(GREEDY, chat(mlxcel={"sampler": {"selector": {"kind": "mirostat_v2", "tau": 3.0}}}), 100)
    assert ours.effective_chain()[-1] == {"stage": "draw", "kind": "mirostat_v2", "tau": 3.0, "eta": 0.1}
    with pytest.raises(ApiError) as err:
        make_sampler_config(GREEDY, chat(mlxcel={"sampler": {"processors": {"top_p": {"p": 2.0}}}}), 100)
    assert "top_p.p" in err.value.message and err.value.param == "mlxcel.sampler"


def test_logprobs_fields():
    assert chat(logprobs=True).logprobs_wanted() == 1  # the token's own logprob at least
    assert chat(logprobs=True, top_logprobs=5).logprobs_wanted() == 5
    with pytest.raises(ApiError):
        chat(top_logprobs=21, logprobs=True)
    completion = parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2, 3], "logprobs": 0})
    assert completion.prompts() == [[1, 2, 3]] and completion.logprobs_wanted() == 1


def test_api_keys_come_from_the_file_and_the_variable(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-one\n\n  sk-two  \n")
    monkeypatch.setenv("MLXCEL_API_KEYS", "sk-three, sk-four")
    assert load_api_keys(str(keys)) == {"sk-one", "sk-two", "sk-three", "sk-four"}
    monkeypatch.delenv("MLXCEL_API_KEYS")
    assert load_api_keys(None) == set()


def test_the_serve_group_is_composed_in():
    assert add_serve_group(["serve.port=9"]) == ["+serve=default", "serve.port=9"]
    assert add_serve_group(["serve=mine", "x=1"]) == ["+serve=mine", "x=1"]
