"""The rows generations.jsonl holds: one per sample, written by a local job (runner), a Ray
worker (ray_jobs) and a chat session alike."""

from __future__ import annotations

from mlxcel.engine import RowResult
from mlxcel.job_row import hash_row
from mlxcel.pipeline import PreparedSample
from mlxcel.structured.matcher import judge_returned_text


def make_generation_row(prepared: PreparedSample, result: RowResult, text: str) -> dict:
    sample, prompt = prepared.sample, prepared.prompt
    judge_returned_text(prepared.constraint, result, text)  # (a text a stop string cut is judged itself)
    return {
        "id": sample.row.id,
        "sample": sample.index,
        "messages": sample.row.messages,
        **({"adapter": sample.row.adapter} if sample.row.adapter is not None else {}),  # model.adapters' name
        "input_sha256": hash_row(sample.row),  # what the row asked; a resume checks the input still asks it
        "prompt": prompt.text,
        "text": text,
        "token_ids": result.token_ids,
        "prompt_token_ids": prompt.token_ids,
        "history_tokens": prompt.history_tokens,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,  # of prompt_tokens, adopted from the prompt cache
        "generated_tokens": len(result.token_ids),
        **({"logprobs": result.logprobs} if result.logprobs is not None else {}),  # decode.logprobs > 0
        **({"error": result.error} if result.error else {}),  # a row the engine could not run
        # structured output: False when the row ended (max_tokens, a stop string) before its answer was whole
        **({"constraint_satisfied": result.constraint_satisfied} if result.constraint_satisfied is not None else {}),
        # speculative decoding: the row's drafted and accepted tokens, and its verify steps
        **({"draft": result.draft} if result.draft is not None else {}),
        **(result.timing or {}),  # the scheduler's queue_ms, ttft_ms, latency_ms, decode_tok_per_sec
        **read_answer(prepared.reader, text),
    }


def read_answer(reader: tuple | None, text: str) -> dict:
    """A chat answer read for tool calls and reasoning (docs/tools.md): its `content` (the text less
    both), `reasoning` and `tool_calls` (OpenAI's shape), where the row has tools or the template thinks."""
    if reader is None:
        return {}
    from mlxcel.tools.parsers import parse_output

    parsed = parse_output(text, *reader)
    out = {"content": parsed.content}
    if parsed.reasoning is not None:
        out["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        out["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return out


def make_error_row(prepared: PreparedSample) -> dict:
    sample = prepared.sample
    return {
        "id": sample.row.id,
        "sample": sample.index,
        "messages": sample.row.messages,
        **({"adapter": sample.row.adapter} if sample.row.adapter is not None else {}),
        "input_sha256": hash_row(sample.row),
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "error": prepared.error,
    }
