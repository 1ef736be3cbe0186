"""OpenAI batch files as jobs (prompt.format=openai_batch, or auto): request lines become rows with
their own settings, a bad line is an error result for that line, batch_output.jsonl holds a result
per request in the Batch API's format, and a resume goes by custom_id. A tiny random Llama."""

from __future__ import annotations

import json

import pytest

from mlxcel.batch_files import detect_format, read_batch_rows
from mlxcel.sampling.config import SamplerConfig
from tests.helpers import by_key, job_args, read_rows, run_cli, write_rows


def chat_line(custom_id, content, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(custom_id, prompt, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "t", "prompt": prompt, **body},
    }


LINES = [
    chat_line("capital", "What is the capital of France?"),
    completion_line("story", "Once upon a time", temperature=0.9, seed=3, n=2, logprobs=2),
    chat_line("unknown", "Hi", frobnicate=True),
    chat_line("sampled", "Name a color.", temperature=1.0, top_p=0.9, seed=11, logprobs=True, top_logprobs=3),
    chat_line("capital", "a repeated custom_id"),
    chat_line("wrong_url", "Hi"),
]
LINES[5]["url"] = "/v1/embeddings"


def test_lines_become_rows_with_their_own_settings_and_bad_lines_error_rows(tmp_path):
    path = write_rows(tmp_path / "batch.jsonl", LINES, extra_lines=("{not json",))
    assert detect_format(path) == "openai_batch"
    assert detect_format(write_rows(tmp_path / "rows.jsonl", [{"prompt": "hi"}])) == "rows"
    rows = read_batch_rows(path, None, SamplerConfig.model_validate({"selector": {"kind": "greedy"}}))
    assert [r.id for r in rows] == ["capital", "story", "unknown", "sampled", "line-5", "wrong_url", "line-7"]
    story = rows[1]
    assert story.raw and story.n == 2 and story.seed == 3 and story.logprobs == 2
    assert story.sampler["processors"]["temperature"]["value"] == 0.9
    assert story.sampler["selector"]["kind"] == "categorical"
    assert rows[0].sampler is None and not rows[0].raw  # nothing set: the job's own sampler
    errors = {r.id: r.batch.get("error") for r in rows if r.batch.get("error")}
    assert set(errors) == {"unknown", "line-5", "wrong_url", "line-7"}
    assert "frobnicate" in errors["unknown"] and "earlier line" in errors["line-5"]
    assert "/v1/embeddings" in errors["wrong_url"] and "not valid JSON" in errors["line-7"]


@pytest.mark.slow  # starts mlxcel-run in a subprocess
def test_a_batch_file_job_writes_batch_output_and_resumes_by_custom_id(tmp_path, tiny_llama):
    path = write_rows(tmp_path / "batch.jsonl", LINES)
    args = job_args(tiny_llama, path, "runner.max_rows=3")
    result = run_cli(tmp_path, *args, run="full")
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in (tmp_path / "full" / "batch_output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["capital", "story", "unknown", "sampled", None, "wrong_url"]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 400, 200, 400, 400]
    capital, story, _, sampled = (o["response"]["body"] for o in out[:4])
    assert capital["object"] == "chat.completion" and capital["model"] == "tiny"
    assert capital["usage"]["completion_tokens"] == 6  # decode.max_tokens (job_args), ignore_eos
    assert [c["index"] for c in story["choices"]] == [0, 1] and story["choices"][0]["text"] != story["choices"][1][
        "text"
    ]
    assert (
        len(story["choices"][0]["logprobs"]["tokens"]) == 6
        and len(story["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    )
    assert len(sampled["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    assert "frobnicate" in out[2]["response"]["body"]["error"]["message"]
    # the chat request answers as the same prompt in a rows job does (greedy, the job's sampler)
    rows_file = write_rows(tmp_path / "rows.jsonl", [{"id": "capital", "prompt": "What is the capital of France?"}])
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="rows").returncode == 0
    assert capital["choices"][0]["message"]["content"] == read_rows(tmp_path / "rows")[0]["text"]

    # a crash after two rows: the resume runs the rest by custom_id, none twice, the same answers
    assert run_cli(tmp_path, *args, run="crashed").returncode == 0
    crashed = tmp_path / "crashed"
    lines = (crashed / "generations.jsonl").read_text().splitlines()
    (crashed / "generations.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (crashed / "batch_output.jsonl").unlink()
    resumed = run_cli(tmp_path, *args, "runner.resume=true", run="crashed")
    assert resumed.returncode == 0, resumed.stderr
    rows = read_rows(crashed)
    assert len(rows) == len(read_rows(tmp_path / "full"))
    full_rows = by_key(read_rows(tmp_path / "full"))
    assert {k: r["token_ids"] for k, r in by_key(rows).items()} == {k: r["token_ids"] for k, r in full_rows.items()}
    again = [json.loads(line) for line in (crashed / "batch_output.jsonl").read_text().splitlines()]
    assert without_created(again) == without_created(out)


def without_created(lines: list[dict]) -> list[dict]:
    return [{**o, "response": {**o["response"], "body": {**o["response"]["body"], "created": 0}}} for o in lines]
