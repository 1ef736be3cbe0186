"""The Python API: the runner's pipeline for scripts and notebooks.

from mlxcel import load_generator
gen = load_generator(overrides=["decode.max_tokens=64"])        # CLI-style overrides
gen = load_generator({"model": {"path": "/models/qwen2.5"}})     # or a (partial) config dict
out = gen.generate("What is the capital of France?")             # -> Generation
outs = gen.generate(["Hi", [{"role": "user", "content": "Yo"}]]) # a batch -> [Generation]
for text in gen.stream("Tell me a story"):                      # text as it is generated
    print(text, end="")
out = gen.generate("Name a color", constraint={"choice": ["red", "blue"]})  # structured output
gen.stats                                                        # GenerationStats of the last call
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from mlxcel.blas import advise_api_blas
from mlxcel.config import RunConfig, validate_config
from mlxcel.devices import select_device
from mlxcel.engine import RowResult
from mlxcel.generation_rows import read_answer
from mlxcel.jobs import JobRow, Sample
from mlxcel.pipeline import Pipeline, PreparedSample
from mlxcel.stats import GenerationStats, make_generation_stats, measure_batch
from mlxcel.structured.matcher import judge_returned_text
from mlxcel.tokenizer import TextStream

Prompt = str | list[dict]  # a user message, or a conversation of {role, content}


@dataclass
class Generation:
    id: object
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    error: str | None = None
    constraint_satisfied: bool | None = None  # with a constraint: whether the answer is whole
    # read for tools and reasoning (docs/tools.md), where the prompt has tools or the template thinks:
    content: str | None = None  # the text less its reasoning and tool calls
    reasoning: str | None = None
    tool_calls: list[dict] | None = None  # OpenAI's shape: [{"id", "type": "function", "function": {...}}]


def load_config(config: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The CLI's composition (conf/ defaults + overrides), with `config` merged on top, validated."""
    from mlxcel.cli import compose_config  # the Hydra side stays in cli.py

    return validate_config(compose_config(list(overrides), config or {}))


def load_generator(config: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Generator:
    cfg = load_config(config, overrides)
    select_device(cfg.runner.device)
    if mx.default_device() == mx.cpu and (tip := advise_api_blas()):
        print(tip, file=sys.stderr)
    return Generator(Pipeline.load(cfg))


class Generator:
    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.stats: GenerationStats | None = None

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        max_tokens: int | None = None,
        seed: int | None = None,
        constraint: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
    ) -> Generation | list[Generation]:
        """One prompt -> one Generation; a list of prompts -> a list, at most runner.max_rows decoding at once.
        `constraint`: what every answer must match (docs/structured.md): {"json_schema": {...}},
        {"regex": ...}, {"choice": [...]}, {"grammar": ...}, or OpenAI's response_format. `tools`,
        `tool_choice`: as OpenAI's chat API (docs/tools.md); the calls come back in tool_calls."""
        single = isinstance(prompts, str) or is_conversation(prompts)
        batch = [prompts] if single else list(prompts)
        start = time.perf_counter()
        prepared = self.prepare(batch, max_tokens, seed, constraint, tools, tool_choice)
        results: dict[int, Generation] = {}
        measured = []
        runnable = [(i, p) for i, p in enumerate(prepared) if not p.error]
        for chunk in self.pipeline.group_rows(runnable):
            streams = [self.pipeline.make_text_stream(streaming=False) for _ in chunk]
            state = self.pipeline.generate([p for _, p in chunk], make_on_token(streams))
            measured.append(measure_batch(state))
            for (index, p), result, stream in zip(chunk, state.results, streams):
                results[index] = self.make_generation(p, result, stream)
        for index, p in enumerate(prepared):
            if p.error:
                results[index] = Generation(p.sample.row.id, "", [], "error", 0, p.error)
        outputs = [results[i] for i in range(len(prepared))]
        self.stats = make_generation_stats(measured, start, count_reasons(outputs), **self.pipeline.describe_max_rows())
        return outputs[0] if single else outputs

    def stream(
        self, prompt: Prompt, max_tokens: int | None = None, seed: int | None = None, constraint: dict | None = None
    ) -> Iterator[str]:
        """Yield text as it is generated (never a broken UTF-8 character); stats after the end."""
        start = time.perf_counter()
        (prepared,) = self.prepare([prompt], max_tokens, seed, constraint)
        if prepared.error:
            from mlxcel.errors import MlxcelError

            raise MlxcelError(prepared.error)
        detokenizer = self.pipeline.make_text_stream()
        pending: list[str] = []
        state = None

        def on_token(row: int, token: int) -> bool:
            pending.append(detokenizer.add_token(token))
            return not detokenizer.stopped  # a stop string ends the row

        for state in self.pipeline.steps([prepared], on_token):  # noqa: B007 (the last state is the run's)
            if pending:
                yield "".join(pending)
                pending.clear()
        tail = detokenizer.finalize()
        if tail:
            yield tail
        if detokenizer.stopped:
            state.results[0].finish_reason = "stop"
        self.stats = make_generation_stats(
            [measure_batch(state)], start, {state.results[0].finish_reason: 1}, **self.pipeline.describe_max_rows()
        )

    def prepare(
        self,
        prompts: list[Prompt],
        max_tokens: int | None,
        seed: int | None,
        constraint: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
    ) -> list[PreparedSample]:
        cfg = self.pipeline.cfg.prompt
        spec = read_constraint(constraint)
        rows = []
        for number, prompt in enumerate(prompts, start=1):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            messages = cfg.with_system(messages)
            rows.append(
                Sample(
                    JobRow(number, messages, max_tokens, seed, tools=tools, constraint=spec, tool_choice=tool_choice)
                )
            )
        return self.pipeline.prepare(rows)

    def make_generation(self, prepared: PreparedSample, result: RowResult, stream: TextStream) -> Generation:
        text = stream.text + stream.finalize()  # equals decode(token_ids), cut at a stop string
        if stream.stopped:
            result.finish_reason = "stop"
        judge_returned_text(prepared.constraint, result, text)
        answer = read_answer(prepared.reader, text)
        return Generation(
            prepared.sample.row.id,
            text,
            result.token_ids,
            result.finish_reason,
            result.prompt_tokens,
            result.error,
            result.constraint_satisfied,
            answer.get("content"),
            answer.get("reasoning"),
            answer.get("tool_calls"),
        )


def make_on_token(streams: list[TextStream]):
    """Feed each row's text stream; a stop string ends its row."""

    def on_token(row: int, token: int) -> bool:
        streams[row].add_token(token)
        return not streams[row].stopped

    return on_token


def read_constraint(constraint: dict | None) -> dict | None:
    """A constraint in decode.constraint's shape, or OpenAI's response_format (it has a "type")."""
    from mlxcel.structured.spec import read_spec

    if isinstance(constraint, dict) and "type" in constraint:
        return read_spec(response_format=constraint)
    return read_spec(constraint)


def is_conversation(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def count_reasons(generations: list[Generation]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in generations:
        counts[g.finish_reason] = counts.get(g.finish_reason, 0) + 1
    return counts
