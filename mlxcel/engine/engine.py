"""The decode engine's split stages: start (prefill), submit (queue the next step),
finish_rows (materialise a step and apply stop rules), and step (the synchronous form).

A batch is left-padded to one length; the KV cache carries the batch dimension and each
row's padding, so every row computes what it would compute alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxcel.config import resolve_decode_step
from mlxcel.engine.compiled import CompiledDecoder
from mlxcel.engine.request import GenerationRequest, GenerationTimings, RowResult
from mlxcel.engine.segmented import SegmentedDecoder
from mlxcel.errors import MlxcelError
from mlxcel.models.cache import plan_capacity
from mlxcel.models.quantized_cache import quantize_caches
from mlxcel.prefill_plan import PrefillPlan, plan_prefill
from mlxcel.sampling import BatchSampler, RowKey
from mlxcel.vision.stage import merge_embeddings

OnToken = Callable[[int, int], "bool | None"]  # (row index, token id) -> False to stop that row
OnRowDone = Callable[[int, RowResult], None]  # (row index, its finished result)


class PromptTooLongError(MlxcelError):
    pass


def apply_token(
    result: RowResult, row: int, token: int, logprobs: dict | None, stop_ids, max_tokens: int, on_token: OnToken
) -> None:
    """One drawn token's stop rules, shared by both engines: a stop id ends the row unemitted;
    otherwise the token is kept and streamed, and the row ends if the callback cancels it or it
    reached max_tokens."""
    if token in stop_ids:
        result.finish_reason = "stop"
        return
    result.token_ids.append(token)
    if logprobs is not None:
        result.logprobs.append({"token": token, **logprobs})
    if on_token(row, token) is False:
        result.finish_reason = "cancelled"
    elif len(result.token_ids) >= max_tokens:
        result.finish_reason = "length"


def check_prompt(index: int, prompt_ids: list[int], max_context: int) -> str | None:
    """Why a row's prompt cannot run, or None."""
    if not prompt_ids:
        return f"row {index}: empty prompt (no tokens to prefill)"
    if len(prompt_ids) >= max_context:
        return (
            f"row {index}: prompt has {len(prompt_ids)} tokens; the model's context is {max_context} "
            "(shorten the prompt or raise model.max_context if the model supports it)"
        )
    return None


def choose_decode_step(model, requested: str = "auto") -> str:
    """decode.step (`requested`) as config.resolve_decode_step resolves it ($MLXCEL_DECODE_STEP
    overrides it; auto: segmented on a GPU, eager on the CPU). A family whose step cannot be traced
    once (longrope) says so and runs eager; a compiled step that cannot drive a request's caches
    (`can_drive`) leaves that request eager."""
    step = resolve_decode_step(requested)
    if step == "compiled" and picks_adapters_per_row(model):
        return "eager"  # (its traced step keeps its first call's adapter picks; segmented takes them as inputs)
    return step if getattr(model, "supports_compiled_decode", True) else "eager"


def picks_adapters_per_row(model) -> bool:
    """model.adapters: each row (token) of a call takes its own adapter (models/adapters.py)."""
    control = getattr(model, "adapter_control", None)
    return control is not None and control.default < 0


def select_adapters(model, adapters, logits_at=None) -> None:
    """The adapter each row ([B]) or token ([B, L]) of the model's next forward call takes (-1:
    none). Where none takes one, every token takes the model's default (its one unmerged adapter,
    or the base model). `logits_at`: the call's, for a [B, L] index."""
    control = getattr(model, "adapter_control", None)
    if control is None:
        return
    index = np.asarray(adapters, dtype=np.int32)
    if index.size == 0 or (index < 0).all():
        control.clear()
    else:
        control.set_tokens(index, logits_at)


def get_decoder(model, step: str):
    """One compiled step per model and kind, kept across requests (tracing costs more than a step)."""
    decoders = model.__dict__.setdefault("_mlxcel_decoders", {})
    if step not in decoders:
        decoders[step] = (SegmentedDecoder if step == "segmented" else CompiledDecoder)(model)
    return decoders[step]


@dataclass
class BatchState:
    request: GenerationRequest
    cache: list
    plan: PrefillPlan
    results: list[RowResult]
    row_keys: list[RowKey]
    timings: GenerationTimings
    max_tokens: list[int]
    inflight: deque = field(default_factory=deque)  # lazy Draws (tokens [B], logprobs), oldest first
    next_input: mx.array | None = None
    produced_steps: int = 0  # token steps queued so far (materialised or in flight)
    sampling: BatchSampler | None = None  # the rows' sampler state (keys, history, mirostat mu, ...) on the device
    decoder: object | None = None  # the compiled step driving this request's caches; None: eager

    @property
    def active_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r.finish_reason is None]


class Engine:
    def __init__(self, model, max_context: int, decode_step: str = "auto"):
        self.model = model
        self.max_context = max_context
        step = choose_decode_step(model, decode_step)
        self.decoder = None if step == "eager" else get_decoder(model, step)

    def start(self, request: GenerationRequest) -> BatchState:
        """Prefill every row (left-padded to one length) and queue the first token."""
        rows = request.rows
        for index, row in enumerate(rows):
            problem = check_prompt(index, row.prompt_ids, self.max_context)
            if problem is not None:
                raise (PromptTooLongError if row.prompt_ids else MlxcelError)(problem)
        timings = GenerationTimings(start=time.perf_counter())
        length = max(len(r.prompt_ids) for r in rows)
        left_pad = [length - len(r.prompt_ids) for r in rows]
        tokens = mx.array([[request.pad_token_id] * pad + r.prompt_ids for pad, r in zip(left_pad, rows)])
        cache = self.model.make_cache(len(rows), left_pad)
        if request.kv_bits:
            cache = quantize_caches(cache, request.kv_bits, request.kv_group_size)
        max_tokens = [r.max_tokens or request.max_tokens for r in rows]
        plan_capacity(cache, length, max(max_tokens), self.max_context)
        with_images = any(r.images is not None for r in rows)
        plan = plan_prefill(
            length,
            chunk_size=request.chunk_size,
            history_boundary=rows[0].history_tokens if len(rows) == 1 else 0,
            tile_size=None if with_images else request.tile_size,  # padding pieces would need pad embeddings
            # a family whose image tokens attend to each other (Gemma 3) prefills image prompts whole
            supports_multi_piece=self.model.supports_multi_piece_prefill
            and not (with_images and getattr(self.model, "prefill_in_one_piece", False)),
            supports_padded=self.model.supports_padded_prefill,
        )
        state = BatchState(
            request=request,
            cache=cache,
            plan=plan,
            results=[
                RowResult(prompt_tokens=len(r.prompt_ids), logprobs=[] if request.logprobs else None) for r in rows
            ],
            row_keys=[RowKey(r.row_id, r.sample_index, r.seed) for r in rows],
            timings=timings,
            max_tokens=max_tokens,
        )
        state.sampling = request.sampler.start(state.row_keys, [r.prompt_ids for r in rows], request.logprobs)
        select_adapters(self.model, [r.adapter for r in rows])  # (the batch's rows stay together to the end)
        if with_images:
            embeddings = self._embed_images(rows, tokens, left_pad, timings)
            extras, shifts = self._prefill_extras(rows, left_pad)
            logits = self._run_prefill(tokens, cache, plan, timings, embeddings, extras)
            if any(shifts):  # M-RoPE: decoding continues at each row's own position
                for layer_cache in cache:
                    layer_cache.position_shift = mx.array(shifts, dtype=mx.int32)
        else:
            logits = self._run_prefill(tokens, cache, plan, timings)
        if self.decoder is not None and self.decoder.can_drive(cache):
            state.decoder = self.decoder
        self.model.after_prefill()
        self._queue_tokens(state, logits)
        return state

    def _embed_images(self, rows: list, tokens: mx.array, left_pad: list[int], timings: GenerationTimings) -> mx.array:
        """The batch's input embeddings with each image row's features at its placeholders."""
        model, began = self.model, time.perf_counter()
        embedded = model.embed_tokens(tokens)
        merged = []
        for index, (row, pad) in enumerate(zip(rows, left_pad)):
            if row.images is None:
                merged.append(embedded[index : index + 1])
            else:  # the ids are on the host already: -1 marks padding, never an image token
                ids = [-1] * pad + row.prompt_ids
                merged.append(
                    merge_embeddings(
                        embedded[index : index + 1], ids, model.image_token_id, model.encode_images(row.images)
                    )
                )
        embeddings = mx.concatenate(merged, axis=0)
        mx.eval(embeddings)
        timings.vision_encode_ms += (time.perf_counter() - began) * 1000
        return embeddings

    def _prefill_extras(self, rows: list, left_pad: list[int]) -> tuple[dict[str, mx.array], list[int]]:
        """Per-token inputs a family takes beside the embeddings (`model.make_prefill_extras`:
        Qwen2-VL's M-RoPE ids, Gemma 3's image blocks), each row's left-padded and batched on axis
        -2 (the last is the token axis, sliced per prefill piece), and each row's decode position shift."""
        make = getattr(self.model, "make_prefill_extras", None)
        if make is None:
            return {}, [0] * len(rows)
        made = [make(row.prompt_ids, row.images, pad) for row, pad in zip(rows, left_pad)]
        return {name: mx.concatenate([extras[name] for extras, _ in made], axis=-2) for name in made[0][0]}, [
            shift for _, shift in made
        ]

    def _run_prefill(
        self,
        tokens: mx.array,
        cache: list,
        plan: PrefillPlan,
        timings: GenerationTimings,
        embeddings: mx.array | None = None,
        extras: dict[str, mx.array] | None = None,
    ) -> mx.array:
        """Every piece of the plan through the model: token ids, or (images) input embeddings
        with the family's per-token extras sliced to the piece."""
        for index, piece in enumerate(plan.pieces):
            began = time.perf_counter()
            is_last = index == len(plan.pieces) - 1
            logits_at = piece.length - 1 if is_last else None
            if embeddings is not None:
                extra = {name: value[..., piece.start : piece.end] for name, value in (extras or {}).items()}
                logits = self.model.forward_with_embeddings(
                    embeddings[:, piece.start : piece.end], cache, logits_at=logits_at, **extra
                )
            else:
                chunk = tokens[:, piece.start : piece.end]
                if piece.pad:
                    chunk = mx.concatenate([chunk, mx.zeros((chunk.shape[0], piece.pad), chunk.dtype)], axis=1)
                logits = self.model(chunk, cache, logits_at=logits_at)
            if piece.pad:
                for layer_cache in cache:
                    layer_cache.trim(piece.pad)
            # Each piece is materialised before the next: the graph per piece stays small, the
            # logits of inner pieces are never built, and after_prefill sees the whole prefill.
            # The piece's time is how long other rows' decoding would wait for it (the server's
            # 512-token chunks while a batch decodes; docs/design.md).
            mx.eval([c.state for c in cache])
            elapsed_ms = round((time.perf_counter() - began) * 1000, 3)
            timings.prefill_pieces.append({"start": piece.start, "end": piece.end, "pad": piece.pad, "ms": elapsed_ms})
        return logits[:, -1, :]

    def _queue_tokens(self, state: BatchState, logits: mx.array) -> None:
        draw = state.sampling.sample(logits)  # lazy: the sampler's state stays on the device
        mx.async_eval(draw.arrays() + state.sampling.state_arrays())
        state.inflight.append(draw)
        state.next_input = draw.tokens
        state.produced_steps += 1

    def can_submit(self, state: BatchState) -> bool:
        """Another step is worth queueing: some row may still need it and the context has room."""
        if state.cache[0].offset + 1 > self.max_context:
            return False
        return any(state.max_tokens[i] > state.produced_steps for i in state.active_rows)

    def submit(self, state: BatchState) -> None:
        """Queue the forward pass and draw for the next token (asynchronous)."""
        if state.decoder is not None:
            logits = state.decoder(state.next_input, state.cache)
        else:
            select_adapters(self.model, [r.adapter for r in state.request.rows])
            logits = self.model(state.next_input[:, None], state.cache)[:, -1, :]
        self._queue_tokens(state, logits)

    def finish_rows(self, state: BatchState, on_token: OnToken, on_row_done: OnRowDone | None = None) -> bool:
        """Materialise the oldest queued step (the one sync point), apply stop rules, stream
        tokens, report rows that finished. Returns whether any row is still generating."""
        active = state.active_rows
        if not state.inflight:
            self._finish_all(state, "length")  # the context is full
        else:
            self._apply_step(state, *state.inflight.popleft().to_host(), on_token)
            if state.active_rows and not state.inflight and not self.can_submit(state):
                self._finish_all(state, "length")
        if on_row_done is not None:
            for i in active:
                if state.results[i].finish_reason is not None:
                    on_row_done(i, state.results[i])
        return bool(state.active_rows)

    def _apply_step(self, state: BatchState, tokens: list[int], logprobs: list[dict] | None, on_token: OnToken) -> None:
        if state.timings.first_token is None:
            state.timings.first_token = time.perf_counter()
            mx.clear_cache()  # hand prefill's intermediate buffers back before decoding
        stop_ids = state.request.stop_token_ids
        for i in state.active_rows:
            apply_token(
                state.results[i],
                i,
                tokens[i],
                logprobs[i] if logprobs is not None else None,
                stop_ids,
                state.max_tokens[i],
                on_token,
            )
        state.timings.end = time.perf_counter()

    def step(self, state: BatchState, on_token: OnToken, on_row_done: OnRowDone | None = None) -> bool:
        """The synchronous form: finish the current step, then compute the next one fully."""
        if not self.finish_rows(state, on_token, on_row_done):
            return False
        if self.can_submit(state):
            self.submit(state)
            mx.eval(state.inflight[-1].arrays())
        return True

    def _finish_all(self, state: BatchState, reason: str) -> None:
        for i in state.active_rows:
            state.results[i].finish_reason = reason
