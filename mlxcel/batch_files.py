"""OpenAI batch files as jobs: `prompt.file=batch.jsonl` with `prompt.format=openai_batch` (or
`auto`, which tells the format from the first line).

Each input line is a request as OpenAI's Batch API and vLLM's `run-batch` take it:
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`.
The body is checked as the server checks a request (mlxcel.openai_protocol): its sampling fields
become the row's own sampler chain, `max_tokens`, `seed`, `n`, `stop` and `logprobs` the row's. A
line that cannot run (bad JSON, an unknown field, a repeated custom_id) becomes an error result
for that line; the rest of the job runs. The job's rows are keyed by custom_id, so a resume skips
the requests already answered.

`batch_output.jsonl` holds one result line per request in the Batch API's format, `{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body being the
endpoint's answer; it is rebuilt from generations.jsonl when a job (or a resume) ends, so it always
agrees with it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.job_row import JobRow
from mlxcel.outputs import replace_file

BATCH_OUTPUT_FILE = "batch_output.jsonl"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def is_batch_line(data: object) -> bool:
    return isinstance(data, dict) and "custom_id" in data and "body" in data


def detect_format(path: Path) -> str:
    """'openai_batch' when the first non-blank line is a batch request, else 'rows'."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        return "openai_batch" if is_batch_line(json.loads(line)) else "rows"
                    except (json.JSONDecodeError, RecursionError):
                        return "rows"  # (the rows reader reports the line)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(ConfigIssue("prompt.file", f"cannot read: {exc}", str(path))) from exc
    return "rows"


def read_batch_rows(path: Path, system: str | None, sampler, vocab_size: int | None = None) -> list[JobRow]:
    """Every line of a batch file as a row; a line that cannot run is a row carrying its error."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(ConfigIssue("prompt.file", f"cannot read: {exc}", str(path))) from exc
    rows, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = read_batch_line(line, number, system, sampler, vocab_size)
        if str(row.id) in seen:
            row = make_bad_row(
                f"line-{number}", None, f"line {number}: custom_id {row.id!r} is used by an earlier line"
            )
        seen.add(str(row.id))
        rows.append(row)
    if not rows:
        raise ConfigError(ConfigIssue("prompt.file", "has no requests (every line is blank)", str(path)))
    return rows


def make_bad_row(row_id: str, custom_id: str | None, error: str) -> JobRow:
    return JobRow(row_id, [], batch={"custom_id": custom_id, "error": error})


def read_batch_line(line: str, number: int, system: str | None, sampler, vocab_size: int | None) -> JobRow:
    from mlxcel.openai_protocol import (
        ApiError,
        ChatRequest,
        CompletionRequest,
        make_sampler_config,
        parse_request,
        read_constraint,
    )

    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return make_bad_row(f"line-{number}", None, f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return make_bad_row(f"line-{number}", None, f"line {number}: nested too deeply to read")
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        return make_bad_row(f"line-{number}", None, f"line {number}: custom_id must be a non-empty string")
    url, method = data.get("url"), data.get("method", "POST")
    unknown = sorted(set(data) - {"custom_id", "method", "url", "body"})
    try:
        if unknown:
            raise ApiError(400, f"unknown key {unknown[0]!r} (a line has custom_id, method, url, body)", unknown[0])
        if url not in ENDPOINTS or method != "POST":
            raise ApiError(400, f"url must be POST {' or '.join(ENDPOINTS)} (got {method} {url})", "url")
        endpoint = ENDPOINTS[url]
        request = parse_request(ChatRequest if endpoint == "chat" else CompletionRequest, data["body"])
        if request.stream:
            raise ApiError(400, "stream is not available in a batch file", "stream")
        config = make_sampler_config(sampler, request, vocab_size or 1 << 31)
        messages, raw = read_prompt(request, endpoint, system)
    except ApiError as error:
        return make_bad_row(custom_id, custom_id, f"line {number}: {error.message}")
    request_info = {
        "custom_id": custom_id,
        "endpoint": endpoint,
        "model": request.model,
        "top_logprobs": request.top_logprobs if endpoint == "chat" else request.logprobs,
        "echo": endpoint == "completion" and request.echo,
    }
    return JobRow(
        custom_id,
        messages,
        request.token_limit(),
        request.seed,
        request.n,
        raw=raw,
        sampler=config.model_dump(mode="json") if config is not None else None,
        stop=request.stop_strings(),
        logprobs=request.logprobs_wanted(),
        batch=request_info,
        constraint=read_constraint(request),
    )


def read_prompt(request, endpoint: str, system: str | None) -> tuple[list[dict], bool]:
    """(messages, raw): a chat's messages (prompt.system first unless it has one), or a
    completion's single text prompt as a raw user turn."""
    from mlxcel.openai_messages import convert_messages
    from mlxcel.openai_protocol import ApiError

    if endpoint == "completion":
        prompts = request.prompts()
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise ApiError(400, "a batch line's prompt is one string (a line per prompt)", "prompt")
        return [{"role": "user", "content": prompts[0]}], True
    for i, message in enumerate(request.messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            raise ApiError(400, f"messages[{i}]: only text parts in a batch file (images: our JSONL rows)", "messages")
    messages = convert_messages(request.messages, None, [])  # (as the server reads them)
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return messages, False


# ---- results ----
def write_batch_output(folder: Path, rows: list[JobRow], generations: list[dict], tokenizer) -> int:
    """Rebuild batch_output.jsonl: a line per request whose every sample is in generations.jsonl
    (or that failed), in input order. Returns the lines written."""
    by_key = {(str(g["id"]), int(g.get("sample", 0))): g for g in generations}
    lines = []
    for row in rows:
        samples = [by_key.get((str(row.id), i)) for i in range(max(row.n, 1))]
        error = row.batch.get("error") or next((s["error"] for s in samples if s and s.get("error")), None)
        if error is None and not all(samples):
            continue  # not answered yet (an interrupted job: a resume completes it)
        lines.append(make_result_line(row, samples, error, tokenizer))
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    replace_file(folder / BATCH_OUTPUT_FILE, text.encode("utf-8"))  # (its .tmp is removed if the disk is full)
    return len(lines)


def make_result_line(row: JobRow, samples: list[dict | None], error: str | None, tokenizer) -> dict:
    """The Batch API's result line: the endpoint's answer as the server gives it, or the error."""
    from mlxcel.openai_protocol import ApiError, describe_logprobs, make_answer, make_choice, make_usage

    request_id = uuid.uuid5(uuid.NAMESPACE_OID, f"{row.id}").hex  # stable across resumes
    line = {"id": f"batch_req_{request_id[:24]}", "custom_id": row.batch.get("custom_id")}
    if error is not None:
        response = {"status_code": 400, "request_id": request_id, "body": ApiError(400, error).body()}
        return {**line, "response": response, "error": None}
    info, first = row.batch, samples[0]
    top = info.get("top_logprobs") or 0
    prefix = row.messages[0]["content"] if info.get("echo") else ""
    choices = []
    for index, sample in enumerate(samples):
        logprobs = sample.get("logprobs")
        entries = [describe_logprobs(tokenizer, e, top) for e in logprobs] if logprobs is not None else None
        choices.append(
            make_choice(info["endpoint"], index, prefix + sample["text"], sample["finish_reason"], entries, top)
        )
    generated = sum(s.get("generated_tokens", 0) for s in samples)
    usage = make_usage(first.get("prompt_tokens", 0), generated, first.get("cached_tokens", 0))
    answer_id = f"{'chatcmpl' if info['endpoint'] == 'chat' else 'cmpl'}-{request_id[:24]}"
    body = make_answer(info["endpoint"], answer_id, info["model"], choices, usage, None)
    return {**line, "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
