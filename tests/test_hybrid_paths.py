"""A hybrid model through every user path (issue 40, items 1 and 4): the Python API, a JSONL job
(structured and plain rows), resume after a kill, chat, the server, a Ray worker, a sweep, KV
quantization and batch-invariant mode. The tiny Qwen 3.5 (three Gated DeltaNet layers to one
attention layer) that transformers writes, greedy on the CPU in fp32: every path gives the
tokens the API gives without a prompt cache, which are transformers' own; with the cache (on by
default) rows adopt prefixes, and the recurrent states at their ends, and still draw them.
In-process, but for the kill and the sweep (subprocesses)."""

from __future__ import annotations

import csv
import io
import json
import signal
import sys
from pathlib import Path

import jsonschema
import pytest

from mlxcel import load_config, load_generator
from mlxcel.runner import run
from tests.helpers import by_key, drive_job_worker, read_rows, run_mlxcel, stop_cli_after_rows, write_rows
from tests.serve_fixtures import request_json, running_server

pytest.importorskip("torch")

TOKENS = 12
MODEL = ("model=hf", "model.dtype=float32", "runner.device=cpu")
GREEDY = (f"decode.max_tokens={TOKENS}", "decode.ignore_eos=true")
PROMPTS = ["def add(a, b):", "The capital of Italy is", "Numbers 0123456789 and symbols"]
# two conversations that share a long system prompt: a job's rows adopt it from one another
SYSTEM = {"role": "system", "content": " ".join(["The capital of France is Paris. Hello, world!"] * 6)}
SHARING = [[SYSTEM, {"role": "user", "content": "def add(a, b):"}], [SYSTEM, {"role": "user", "content": "Rome?"}]]
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


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, on_the_cpu) -> Path:
    from tests.test_scheduler_hybrid import write_qwen3_5

    return write_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


def make_generator(folder: Path, *overrides: str):
    return load_generator({"model": {"path": str(folder)}}, overrides=[*MODEL, *GREEDY, *overrides])


@pytest.fixture(scope="module")
def answers(qwen3_5) -> dict:
    """Greedy tokens and texts without a prompt cache, each prompt and the conversation run
    together; the other tests' oracle (the first test checks it against transformers)."""
    outs = make_generator(qwen3_5, "runner.prompt_cache=false").generate([*PROMPTS, *SHARING, CONVERSATION])
    chat = outs[-1]
    return {
        "prompts": [o.token_ids for o in outs[: len(PROMPTS)]],
        "sharing": [o.token_ids for o in outs[len(PROMPTS) : -1]],
        "conversation": chat.token_ids,
        "text": chat.text,
        "prompt_tokens": chat.prompt_tokens,
    }


@pytest.fixture(scope="module")
def generator(qwen3_5):
    """The API as a user loads it: the prompt cache on (the default)."""
    return make_generator(qwen3_5)


def check_prompt_cache(cache: dict, adopted: int | None = None) -> None:
    """stats.json's prompt_cache on a hybrid: the cache ran (at 966da63 it was off for hybrids and
    stats.json said nothing); `adopted`: the prompt tokens rows adopted, at least one row's."""
    assert {"rows_adopted", "adopted_tokens", "entries"} <= set(cache), cache
    if adopted is not None:
        assert cache["adopted_tokens"] == adopted > 0 and cache["rows_adopted"] >= 1, cache


def test_the_api_runs_a_batch_as_each_row_alone_and_as_transformers(qwen3_5, generator, answers):
    from transformers import AutoTokenizer

    from tests.family_fixtures import reference_greedy
    from tests.helpers import load_reference

    expected = [*answers["prompts"], answers["conversation"]]
    assert len({tuple(t) for t in expected}) == len(expected)  # rows that differ: a mix-up would show
    # transformers on its own rendering of the same prompts
    tokenizer, reference = AutoTokenizer.from_pretrained(qwen3_5), load_reference(qwen3_5)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS] + [CONVERSATION]
    for messages, tokens in zip(conversations, expected):
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        assert reference_greedy(reference, ids, TOKENS) == tokens, messages
    # with the prompt cache: the batch, then each alone (later calls may adopt what earlier ones cached)
    outs = generator.generate([*PROMPTS, CONVERSATION])
    assert [o.token_ids for o in outs] == expected
    assert generator.stats.rows == 4 and generator.stats.row_state_gb > 0  # the scheduler ran them
    check_prompt_cache(generator.stats.prompt_cache)
    alone = []
    for prompt in [*PROMPTS, CONVERSATION]:
        alone.append(generator.generate(prompt).token_ids)
        check_prompt_cache(generator.stats.prompt_cache)
    assert alone == expected
    assert "".join(generator.stream(CONVERSATION)) == answers["text"]


def test_kv_bits_quantizes_the_attention_layers_through_the_pipeline(qwen3_5, answers):
    """decode.kv_bits=8: the attention layer's keys and values take ~a third of fp32's bytes, the
    recurrent states stay as they are, and the greedy tokens stay the same."""
    states = {}
    for name, extra in (("fp32", ()), ("8-bit", ("decode.kv_bits=8", "decode.kv_group_size=32"))):
        gen = make_generator(qwen3_5, "runner.prompt_cache=false", *extra)
        states[name] = gen.pipeline.generate(gen.prepare(PROMPTS, None, None))
    assert [r.token_ids for r in states["8-bit"].results] == answers["prompts"]
    assert states["8-bit"].state_bytes == states["fp32"].state_bytes > 0
    assert 0 < states["8-bit"].kv_peak_bytes < 0.5 * states["fp32"].kv_peak_bytes


def test_batch_invariant_rows_equal_the_default_on_the_cpu(qwen3_5, answers):
    invariant = make_generator(qwen3_5, "runner.batch_invariant=true")
    outs = invariant.generate([*PROMPTS, CONVERSATION])
    assert [o.token_ids for o in outs] == [*answers["prompts"], answers["conversation"]]


def job_config(folder: Path, rows_file: Path, *extra: str):
    return load_config(
        {"model": {"path": str(folder)}},
        [*MODEL, *GREEDY, "prompt=jsonl", f"prompt.file={rows_file}", "runner.max_rows=2", *extra],
    )


def test_a_jsonl_job_with_a_structured_row_beside_plain_ones(qwen3_5, answers, tmp_path):
    """Rows join and leave two slots, prefilled in pieces of 32 that carry the recurrent states
    on; two rows share a long system prompt, and the later one adopts it up to a piece's end,
    where the states were recorded."""
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.insert(1, {"id": "json", "prompt": "Answer in JSON.", "max_tokens": 40, "constraint": {"json_schema": SCHEMA}})
    rows += [{"id": "chat", "messages": CONVERSATION}, *({"id": f"s{i}", "messages": m} for i, m in enumerate(SHARING))]
    cfg = job_config(qwen3_5, write_rows(tmp_path / "rows.jsonl", rows), "prefill.chunk_size=32")
    result = run(cfg, tmp_path / "run", None, None)
    written = by_key(read_rows(tmp_path / "run"))
    assert sorted(written) == sorted((r["id"], 0) for r in rows) and len(result.generations) == len(rows)
    assert [written[(f"p{i}", 0)]["token_ids"] for i in range(len(PROMPTS))] == answers["prompts"]
    assert written[("chat", 0)]["token_ids"] == answers["conversation"]
    assert [written[(f"s{i}", 0)]["token_ids"] for i in range(len(SHARING))] == answers["sharing"]
    structured = written[("json", 0)]
    assert structured["finish_reason"] == "stop" and structured["constraint_satisfied"] is True, structured
    jsonschema.validate(json.loads(structured["text"]), SCHEMA)
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["rows"] == len(rows)
    assert stats["constraints"]["rows"] == 1 and stats["constraints"]["satisfied"] == 1
    check_prompt_cache(stats["prompt_cache"], sum(r["cached_tokens"] for r in written.values()))


def test_rows_sharing_prefixes_in_pairs_draw_what_they_draw_without_the_cache(qwen3_5, tmp_path):
    """Raw prompts, three pairs that share 8, 10 and 18 tokens, through two slots: the later row
    of each pair adopts the earlier one's prefix and draws the same tokens. (The scheduler ends a
    piece where a shared prefix ends: here each row's last piece is one token.)"""
    rows_file = write_rows(tmp_path / "rows.jsonl", [{"id": i, "prompt": f"{PROMPTS[i % 3]} {i}"} for i in range(6)])
    runs = {}
    for name, extra in (("cache", ()), ("no-cache", ("runner.prompt_cache=false",))):
        run(job_config(qwen3_5, rows_file, "template=none", *extra), tmp_path / name, None, None)
        runs[name] = by_key(read_rows(tmp_path / name))
    assert len(runs["cache"]) == 6 and sorted(runs["cache"]) == sorted(runs["no-cache"])
    assert {k: r["token_ids"] for k, r in runs["cache"].items()} == {
        k: r["token_ids"] for k, r in runs["no-cache"].items()
    }
    stats = json.loads((tmp_path / "cache" / "stats.json").read_text())
    adopted = sum(r["cached_tokens"] for r in runs["cache"].values())
    check_prompt_cache(stats["prompt_cache"], adopted)


def test_a_one_token_prompt_joins_while_another_row_decodes(qwen3_5, tmp_path):
    """Its one-token prefill is a call of one new token per row, as a decode step is: the decoding
    row's recurrent state must survive it. Without the prompt cache, as each row alone."""
    rows = [
        {"id": "short", "prompt": PROMPTS[0], "max_tokens": 2},
        {"id": "long", "prompt": PROMPTS[1]},
        {"id": "one", "prompt": "a", "max_tokens": 4},
    ]
    rows_file = write_rows(tmp_path / "rows.jsonl", rows)
    runs = {}
    for slots in (2, 1):
        extra = ("template=none", "runner.prompt_cache=false", f"runner.max_rows={slots}")
        run(job_config(qwen3_5, rows_file, *extra), tmp_path / str(slots), None, None)
        written = by_key(read_rows(tmp_path / str(slots)))
        runs[slots] = {key: (row["prompt_tokens"], row["token_ids"]) for key, row in written.items()}
    assert runs[2][("one", 0)][0] == 1 and len(runs[2]) == 3
    assert runs[2] == runs[1]


@pytest.mark.slow  # a subprocess, killed
def test_a_job_killed_mid_way_resumes_with_each_row_once_and_the_same_tokens(qwen3_5, tmp_path):
    """SIGKILL (no handler runs: a lock left behind, maybe a torn last line) after two rows; the
    resume writes the rest, each row once, the tokens of a run that was never killed."""
    rows_file = write_rows(tmp_path / "rows.jsonl", [{"id": i, "prompt": f"{i}: {PROMPTS[i % 3]}"} for i in range(6)])
    job = [*MODEL, "decode.max_tokens=160", "decode.ignore_eos=true", "prompt=jsonl", f"prompt.file={rows_file}"]
    job += ["runner.max_rows=2", "template=none"]
    killed = tmp_path / "killed"
    code, stderr = stop_cli_after_rows(
        tmp_path, [f"model.path={qwen3_5}", *job, f"hydra.run.dir={killed}"], killed, 2, signal.SIGKILL
    )
    assert code == -signal.SIGKILL, stderr
    kept = (killed / "generations.jsonl").read_text().split("\n")[:-1]  # (a torn last line: not kept)
    assert 2 <= len(kept) < 6
    model = {"model": {"path": str(qwen3_5)}}
    run(load_config(model, job), tmp_path / "whole", stream=None, log=None)
    run(load_config(model, [*job, "runner.resume=true"]), killed, stream=None, log=None)
    resumed, whole = read_rows(killed), by_key(read_rows(tmp_path / "whole"))
    assert len(resumed) == len(whole) == 6 and sorted(by_key(resumed)) == sorted(whole)  # none lost, none twice
    assert resumed[: len(kept)] == [json.loads(line) for line in kept]  # the rows written before the kill stay
    assert {k: r["token_ids"] for k, r in by_key(resumed).items()} == {k: r["token_ids"] for k, r in whole.items()}
    assert all(len(r["token_ids"]) == 160 for r in resumed)
    stats = json.loads((killed / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["rows"] == 6


def test_chat_two_turns_answer_as_the_api_without_a_cache(qwen3_5, tmp_path, monkeypatch):
    from mlxcel.chat import chat

    uncached = make_generator(qwen3_5, "runner.prompt_cache=false")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello, world!\nI am fine, thank you.\n")))
    out, log = io.StringIO(), io.StringIO()
    args = [f"model.path={qwen3_5}", *MODEL, *GREEDY, "prompt.system=Be brief.", f"hydra.run.dir={tmp_path / 'chat'}"]
    assert chat(args, out, log) == 0
    turns = read_rows(tmp_path / "chat")
    assert len(turns) == 2 and turns[0]["cached_tokens"] == 0
    first = uncached.generate(CONVERSATION[:2])
    assert turns[0]["token_ids"] == first.token_ids and turns[0]["text"] == first.text
    second = [*CONVERSATION[:2], {"role": "assistant", "content": first.text}, CONVERSATION[3]]
    assert turns[1]["messages"] == second
    assert turns[1]["token_ids"] == uncached.generate(second).token_ids
    assert out.getvalue() == "".join(t["text"] + "\n" for t in turns)  # each answer as it streamed
    stats = json.loads((tmp_path / "chat" / "stats.json").read_text())
    # the second turn starts with the first (its answer too): adopted with the states at its end
    assert stats["turns"] == 2 and stats["status"] == "completed"
    check_prompt_cache(stats["prompt_cache"], turns[1]["cached_tokens"])


def test_the_server_answers_as_the_api_streamed_or_not(qwen3_5, answers, tmp_path):
    with running_server(tmp_path / "run", f"model.path={qwen3_5}", *MODEL, *GREEDY, "serve.model_name=m") as server:
        url = f"{server.url}/chat/completions"
        status, answer, _ = request_json(url, {"model": "m", "messages": CONVERSATION})
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == answers["text"]
        assert answer["usage"]["completion_tokens"] == TOKENS
        assert answer["usage"]["prompt_tokens"] == answers["prompt_tokens"]
        body = {"model": "m", "messages": CONVERSATION, "stream": True, "stream_options": {"include_usage": True}}
        events = [line[6:] for line in send_stream(url, body).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert len(pieces) > 2 and "".join(pieces) == answers["text"]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == TOKENS and usage["prompt_tokens"] == answers["prompt_tokens"]
        # the same conversation again: its prompt adopted from the cache, with the states at its end
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < answers["prompt_tokens"], usage


def send_stream(url: str, body: dict) -> str:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
        return reply.read().decode()


def test_a_ray_worker_runs_the_rows_as_the_api(qwen3_5, answers, tmp_path):
    """The Ray job's worker body (ray_jobs.JobWorker) as a plain object, without Ray, as
    test_ray_worker drives it: rows sent in two parts join the worker's open schedule."""
    from mlxcel.stats import summarize_prompt_cache

    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)] + [{"id": "chat", "messages": CONVERSATION}]
    cfg = job_config(qwen3_5, write_rows(tmp_path / "rows.jsonl", rows), "runner.progress=off")
    got, figures, stats = drive_job_worker(cfg)
    tokens = {r["id"]: r["token_ids"] for r in got}
    assert len(got) == len(rows) == len(tokens) and figures["rows"] == len(rows)
    assert [tokens[f"p{i}"] for i in range(len(PROMPTS))] == answers["prompts"]
    assert tokens["chat"] == answers["conversation"]
    assert stats.state_bytes > 0  # the scheduler's slots
    check_prompt_cache(summarize_prompt_cache([stats]))


@pytest.mark.slow  # Hydra's multirun, in a subprocess
def test_a_sweep_over_the_chunk_size_gives_the_same_tokens(qwen3_5, tmp_path):
    """Pieces of 7, 32 and 128 tokens over a prompt past the gated delta rule's chunk (64): each
    job's pieces carry the recurrent state on, and every job draws the same tokens."""
    prompt = " ".join(PROMPTS * 6)
    sweep = tmp_path / "sweep"
    result = run_mlxcel(
        tmp_path,
        "-m",
        f"model.path={qwen3_5}",
        *MODEL,
        *GREEDY,
        "template=none",
        f"prompt.text={prompt}",
        "prefill.chunk_size=7,32,128",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr
    with open(sweep / "summary.csv", newline="", encoding="utf-8") as f:
        jobs = list(csv.DictReader(f))
    assert [j["prefill.chunk_size"] for j in jobs] == ["7", "32", "128"]
    assert [j["tokens_as_first"] for j in jobs] == ["same", "same", "same"]
    runs = [read_rows(Path(j["job_dir"]))[0] for j in jobs]
    assert len({tuple(r["token_ids"]) for r in runs}) == 1 and len(runs[0]["token_ids"]) == TOKENS
    prompt_tokens = runs[0]["prompt_tokens"]
    assert prompt_tokens > 128
    stats = [json.loads((Path(j["job_dir"]) / "stats.json").read_text()) for j in jobs]
    pieces = [len(s["batches"][0]["prefill_pieces"]) for s in stats]
    assert pieces == [-(-prompt_tokens // size) for size in (7, 32, 128)]  # the chunk sizes took effect
