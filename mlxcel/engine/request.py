"""What the engine is asked to do and what it gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxcel.sampling import SamplerChain

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class RowRequest:
    prompt_ids: list[int]
    row_id: object = 0  # the prompt's id: seeds this row's random stream
    sample_index: int = 0
    history_tokens: int = 0  # tokens of the chat without the generation prompt (PrefillPlan rule 2)
    max_tokens: int | None = None  # None: the request's max_tokens
    seed: int | None = None  # None: the sampler's seed
    images: Any = None  # mlxcel.vision.stage.ImageInputs: the prompt's images (prompt_ids expanded)
    sampler: SamplerChain | None = None  # this row's own chain (a server request's); None: the request's
    logprobs: int = 0  # > 0: this row's tokens' logprobs and top-N alternatives, beside the request's setting
    constraint: Any = None  # mlxcel.structured.Constraint: what the answer must match (structured output)
    adapter: int = -1  # the model's adapter this row runs with (models/adapters.py AdapterControl.names); -1: none


@dataclass
class GenerationRequest:
    rows: list[RowRequest]
    sampler: SamplerChain
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()  # merged EOS + stop ids; never emitted
    chunk_size: int = 2048
    tile_size: int | None = None
    pad_token_id: int = 0
    logprobs: int = 0  # > 0: each token's logprob and the top-N alternatives (RowResult.logprobs)
    kv_bits: int | None = None  # quantize the KV cache (QuantizedKVCache); None: model dtype
    kv_group_size: int = 64
    constraints: Any = None  # mlxcel.structured.Constraints: computes the masks of rows with a constraint
    draft: Any = None  # mlxcel.config.DraftConfig: speculative decoding (engine/drafts.py); None: off


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    logprobs: list[dict] | None = None  # per token {token, logprob, top: [[id, logprob], ...]}
    error: str | None = None  # why a row with finish_reason "error" could not run
    cached_tokens: int = 0  # prompt tokens adopted from the prompt cache (not prefilled again)
    timing: dict | None = None  # the scheduler's per-row figures: queue_ms, ttft_ms, latency_ms, decode_tok_per_sec
    constraint_satisfied: bool | None = None  # a constrained row: whether its answer is a whole match
    draft: dict | None = None  # speculative decoding: {drafted, accepted, steps} (a row that can draft)


@dataclass
class GenerationTimings:
    """Host clock (time.perf_counter) marks; a stage ends when its result is on the host."""

    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    prefill_pieces: list[dict] = field(default_factory=list)
    vision_encode_ms: float = 0.0  # the towers and projectors of every image in the batch
