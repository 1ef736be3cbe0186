"""One row of a job (a JSONL line, an inline row, a batch file's request, a server request),
and its hash: the type the job readers (jobs, batch_files) and the engines share."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class JobRow:
    id: str | int
    messages: list[dict]
    max_tokens: int | None = None
    seed: int | None = None
    n: int = 1
    tools: list[dict] | None = None  # the row's own tool definitions, if any
    # a batch file's request (mlxcel.batch_files): its own settings, and what its result line needs
    raw: bool = False  # a completion: the text as it is, no chat template
    sampler: dict | None = None  # its own sampler config (None: the job's)
    stop: list[str] | None = None  # its own stop strings (None: decode.stop_strings)
    logprobs: int = 0  # its tokens' logprobs and this many alternatives
    batch: dict | None = None  # custom_id, endpoint, model, ...; "error": the line cannot run
    constraint: dict | None = None  # structured output: the row's own spec (mlxcel.structured.spec); None: the job's
    constraint_error: str | None = None  # why the row's own constraint cannot be read: the row is an error row
    adapter: str | None = None  # one of model.adapters' names: the LoRA adapter this row runs with (None: the base)
    tool_choice: str | dict | None = None  # as OpenAI's (None: auto where the row has tools)
    parallel_tool_calls: bool = True


def hash_row(row: JobRow) -> str:
    """What a row asks for (its messages and its own settings), as a hash kept with its
    generation: a resume checks that the input still asks for what was answered."""
    import hashlib

    content = {
        "id": str(row.id),
        "messages": row.messages,
        "max_tokens": row.max_tokens,
        "seed": row.seed,
        "n": row.n,
        "tools": row.tools,
    }
    if row.batch is not None:  # (only then: the hashes of earlier folders' rows stay as they were)
        content.update(raw=row.raw, sampler=row.sampler, stop=row.stop, logprobs=row.logprobs, batch=row.batch)
    if row.constraint is not None:
        content["constraint"] = row.constraint
    if row.adapter is not None:
        content["adapter"] = row.adapter
    if row.tool_choice is not None:
        content["tool_choice"] = row.tool_choice
        content["parallel_tool_calls"] = row.parallel_tool_calls
    if row.constraint_error is not None:  # (a fixed row then asks for something else)
        content["constraint_error"] = row.constraint_error
    return hashlib.sha256(
        json.dumps(content, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    ).hexdigest()
