"""BatchScheduler: continuous batching over a paged KV cache.

Rows wait in arrival order. A row is admitted when a row slot is free (`max_rows`) and the KV
pool has the blocks for its prompt and every token it may generate (reserved up front: no row is
ever preempted, and admission never exceeds the budget). Each iteration:
1. admits what fits, then prefills new rows in pieces (2048 tokens when no row decodes, 512
   while rows decode; `prefill.chunk_size` pins both), at most PIECES_PER_STEP pieces an
   iteration (IDLE_PIECES_PER_STEP when no row decodes; fewer on a CPU: pieces_per_iteration), so
   a long prompt delays the running rows by a bounded amount;
2. runs one decode step for every decoding row, ragged (each row at its own length);
3. draws the next token of every decoding row and of each row whose prefill just ended;
4. reads the previous iteration's draw (one step of lookahead: the device computes step t+1
   while the host handles step t), applies stop rules, and lets finished rows go: their slots
   and blocks serve the next admissions.
Every decision depends on the rows, their tokens and the config, never on timing, so a rerun
forms the same batches.

A server runs the same loop open-ended: `steps(..., feed=)` polls a RowFeed every iteration for
new rows and cancellations (a client that went away), and waits on it when nothing runs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlxcel.engine.draft_model import DraftModel
from mlxcel.engine.drafts import RowDrafts, count_accepted, make_row_drafts
from mlxcel.engine.engine import (
    OnRowDone,
    OnToken,
    apply_token,
    check_prompt,
    choose_decode_step,
    get_decoder,
    select_adapters,
)
from mlxcel.engine.prefix_reuse import PrefixReuse
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.request import GenerationRequest, GenerationTimings, RowRequest, RowResult
from mlxcel.errors import MlxcelError
from mlxcel.models import llama, paged_attention
from mlxcel.models.cache import ChunkedKVCache, KVCache
from mlxcel.models.invariant import find_invariance_problem, set_batch_invariant, sliced_matmuls
from mlxcel.models.paged_cache import BLOCK_SIZE, PagedKVCache, PageTable, count_blocks
from mlxcel.models.paged_layers import make_paged_caches
from mlxcel.models.paged_packed import PACKED_ALIGN, begin_packed
from mlxcel.models.recurrent import RecurrentCache
from mlxcel.models.rotating_cache import RotatingKVCache
from mlxcel.prefill_plan import BUSY_CHUNK_SIZE, DEFAULT_CHUNK_SIZE
from mlxcel.sampling import RowKey
from mlxcel.sampling.processors import apply_token_bitmask
from mlxcel.sampling.rows import GroupedRowsSampler
from mlxcel.structured.matcher import MaskBuffer, consume_token, is_satisfied
from mlxcel.vision.stage import merge_embeddings

KV_BUDGET_SHARE = 0.4  # of device memory (RAM on the CPU) for the KV cache by default
# Prefill pieces per iteration, while rows decode and when none does. A forward call costs a few
# ms however few its tokens, so more tokens a call admit rows sooner for little delay to the
# decoding rows (8 beat 4 on the H200's ragged job: docs/benchmarks.md). Idle iterations keep 4
# pieces of 2048: one call of 16k tokens is all activations and no decode to hide behind.
PIECES_PER_STEP = 8
IDLE_PIECES_PER_STEP = 4
# On a CPU a call costs its tokens (~300 a second for SmolLM2 on two cores): 4 idle pieces of 2048
# held a server's first draw for the whole queue's prefill. 2-core VM, SmolLM2, bench.serve: at 32
# streams 1 idle / 2 busy pieces gave TTFT p50 8.5 s against 12.0 s (106.5 vs 105.1 tok/s; 1 / 1:
# 98.2 tok/s), at 8 streams 2.85 s against 3.38 s (70.7 vs 65.2 tok/s); the ragged job the same.
CPU_PIECES_PER_STEP = 2
CPU_IDLE_PIECES_PER_STEP = 1
MIN_RAGGED_WIDTH = 64  # the narrowest line of a ragged prefill call (fewer distinct shapes below it cost little)
# Structured output: a constrained step's masks need the last step's tokens on the host, so these
# batches keep no lookahead. With at least THREADED_MASK_ROWS constrained rows the last draw is read
# first and a thread computes the masks while the forward pass is queued (H200, batch 32: 0.87 of
# free throughput against 0.65 with masks after the forward). Fewer rows take FEW_ROWS_ORDER:
# "split", the forward pass's first half queued before the draw is read (the device runs it
# meanwhile, so the read does not stall it), the masks on the thread while the second half is
# queued, so they leave the host's critical path; "after" queues the whole forward pass, then
# computes the masks on this thread. H200, batch 1, 2026-12-04 (`bench.structured --orders
# split,thread,after --repeats 5`): split 0.937 of free throughput, thread 0.802, after 0.835.
THREADED_MASK_ROWS = 8
FEW_ROWS_ORDER = "split"
# Batch-invariant mode: a row's prompt is prefilled in pieces that end on multiples of this, one
# row a call, whatever the chunk size, budget or history boundary: its pieces are the row's own
# (a multiple of invariant.ROWS, and of paged_cache.ALIGNED_START for cuDNN's causal fast path)
INVARIANT_PIECE = 512
OPEN_POOL_POSITIONS = 4096  # an open loop's first KV pool (plain MLX pools grow as rows need: PageTable.grow)
# Speculative decoding: the most positions a verify call holds (its rows' lines, padded to the
# longest), where a step stops being bound by launches and weight reads. CPU (2-core x86_64 VM,
# SmolLM2, the bench's 8-row extraction job, 16-token lookup drafts, decode seconds in two
# alternating rounds): plain 12.9 / 12.4, 16 positions 9.0 / 7.4, 32 7.9 / 6.8, 64 8.4 / 8.1; with
# lines of up to 17 (64 positions counted unpadded) the job ran 0.48x plain. GPU: a guess to measure.
VERIFY_TOKENS = {"cpu": 32, "gpu": 512}
# ... and a verify call as a decode step whose rows are the drafted positions (verify_as_rows), where
# a decode step runs the compiled segments and the paged kernel. Off: on an H100 at batch 1 it gained
# ~5% over the ragged call, and in bf16 its drafted tokens parted from plain decoding's (benchmarks.md).
VERIFY_AS_ROWS = os.environ.get("MLXCEL_VERIFY_AS_ROWS", "0") == "1"
SEGMENTED_ROWS = 8  # decode steps of at most this many rows run the segmented (compiled) step where it is the default


@dataclass
class Row:
    index: int  # position in the request
    request: RowRequest
    result: RowResult
    limit: int  # tokens it may draw: its max_tokens, less what the context cannot hold
    error: str | None = None
    slot: int = -1
    last_draw: int = 0  # sequence number of the last draw it took part in
    prefilled: int = 0  # prompt positions in the cache
    embeddings: mx.array | None = None  # [1, L, hidden] with its images' features, while it prefills
    extras: dict | None = None  # the family's per-token prefill inputs (M-RoPE ids), sliced per piece
    matcher: object = None  # structured output: the row's llguidance matcher (RowRequest.constraint)
    drafts: RowDrafts | None = None  # speculative decoding: the row's draft source (decode.draft)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids


@dataclass
class FeedUpdate:
    """What a RowFeed hands the running loop."""

    rows: list[tuple[int, RowRequest]] = field(default_factory=list)  # new rows: (index, request)
    cancelled: list[int] = field(default_factory=list)  # indices of rows to stop now
    closed: bool = False  # no more rows: the loop ends once the running ones have


class RowFeed(Protocol):
    def poll(self, idle: bool) -> FeedUpdate:
        """New rows and cancellations since the last poll; `idle` (nothing runs): block until
        there are some, or the feed closes."""


@dataclass
class PendingDraw:
    """A queued draw and the rows it drew for, in batch order."""

    draw: object
    rows: list[Row]


@dataclass
class ScheduleState:
    """What a scheduled request gives back (the fields stats.measure_batch reads)."""

    request: GenerationRequest
    results: list[RowResult]
    timings: GenerationTimings
    rows: list[Row] = field(default_factory=list)
    kv_budget_bytes: int = 0
    kv_peak_bytes: int = 0
    kv_peak_blocks: int = 0
    state_bytes: int = 0  # rows' fixed-size state (recurrent states, sliding rings): every slot's, for the run
    decode_steps: int = 0
    rows_decoding_sum: int = 0  # summed over decode steps: occupancy = this / decode_steps
    iterations: int = 0
    prompt_cache: dict | None = None  # PrefixReuse.summary(): the cache's entries, size and evictions
    wait_seconds: float = 0.0  # the host blocked on the device (reading draws, queueing work); the rest is host work
    mask_seconds: float = 0.0  # structured output: computing the rows' token masks (overlaps the forward pass)
    mask_wait_seconds: float = 0.0  # structured output: waiting for the masks after queueing the forward pass
    idle_seconds: float = 0.0  # an open loop blocked on its feed with no rows to run, after its first rows
    draw_gap_seconds: float = 0.0  # structured output: from the forward pass queued to its draw queued
    forward_calls: int = 0  # the model's forward calls (packed: one an iteration; else a decode step, pieces)
    call_shapes: set = field(default_factory=set)  # their distinct shapes (count_call)
    verify_steps: int = 0  # speculative decoding: decode steps that verified drafts
    draft_off: str | None = None  # why decode.draft does not run here (one line), where it is set

    @property
    def host_seconds(self) -> float:
        """Host work (building steps, scheduling, per-row text work): the run less its waits."""
        return (self.timings.end or time.perf_counter()) - self.timings.start - self.wait_seconds

    @property
    def host_ms_per_iteration(self) -> float:
        """Below the device's time per step, the device bounds the job."""
        return 1000 * self.host_seconds / max(self.iterations, 1)


def supports_scheduling(model, request: GenerationRequest) -> bool:
    """The paged path covers full-attention and sliding-window layers, their KV cache quantized or
    not, and images in families that merge their features into the embeddings (LLaVA, Idefics3,
    Pixtral), with M-RoPE positions (Qwen2-VL) or image blocks that attend both ways (Gemma 3),
    longrope, and Phi-4-multimodal's vision LoRA on its image rows (set per forward call).
    $MLXCEL_SCHEDULER=0 sends everything to the batch engine (to compare the two)."""
    if os.environ.get("MLXCEL_SCHEDULER", "1") == "0":
        return False
    if not hasattr(model, "forward_with_embeddings"):
        return False
    # (Longrope picks each row's factors from its own positions, which the paged cache gives; a
    # row that passes the switch runs its sequence again: BatchScheduler.decode_step. A family
    # whose step cannot be compiled runs the scheduler's eager step: choose_decode_step.)
    images = any(r.images is not None for r in request.rows)
    known = (
        getattr(model, "prefill_extras_are_positions", False)
        or hasattr(model, "image_blocks")
        or hasattr(model, "lora_control")
    )
    if images and hasattr(model, "make_prefill_extras") and not known:
        return False  # per-token prefill inputs the scheduler does not know
    return all(type(c) in (KVCache, RotatingKVCache, ChunkedKVCache, RecurrentCache) for c in model.make_cache(1))


def layer_windows(model) -> list[int | None]:
    """Each cache entry's sliding window (None: full attention, or a recurrent layer), as the
    family's own caches say: one entry per layer that keeps something."""
    return [getattr(c, "window", None) for c in model.make_cache(1)]


def layer_chunks(model) -> list[int | None]:
    """Each cache entry's attention chunk (Llama 4's chunked layers; None: not chunked). Chunked
    layers keep a ring of one chunk per row on every path (models/paged_window.py)."""
    return [getattr(c, "chunk", None) for c in model.make_cache(1)]


def recurrent_layers(model) -> list[bool]:
    """Which cache entries are a recurrent layer's fixed-size state (models/recurrent.py)."""
    return [isinstance(c, RecurrentCache) for c in model.make_cache(1)]


def state_bytes_per_row(model) -> int:
    """A row's recurrent states in every recurrent layer: the same at any position."""
    return model.state_bytes_per_row() if hasattr(model, "state_bytes_per_row") else 0


def attention_module(model):
    """The first attention layer's attention (a hybrid's first layers may be recurrent)."""
    return next(layer.self_attn for layer in model.model.layers if "self_attn" in layer)


def cache_attentions(model) -> list:
    """Each cache entry's attention module (None for a recurrent entry): a family whose entries
    are not one per layer, or whose layers' heads differ (Gemma 4's sliding and global layers),
    names them itself (`cache_attentions`)."""
    if hasattr(model, "cache_attentions"):
        return model.cache_attentions()
    recurrent, layers = recurrent_layers(model), model.model.layers
    if len(layers) == len(recurrent):
        return [None if r else layer.self_attn for layer, r in zip(layers, recurrent)]
    attention = attention_module(model)  # (entries for some blocks only: their attentions are alike)
    return [None if r else attention for r in recurrent]


def uses_kernels(model) -> tuple[bool, bool]:
    """(pool writes in place, decode attention in place): the paged kernels where they run
    (paged_attention.is_available, for every attention layer's head size and query heads a KV
    head); the decode kernel also needs llama's attend, which hands a PagedDecode mask to it."""
    attentions = [a for a in cache_attentions(model) if a is not None]
    in_place = all(writes_in_place(a) for a in attentions)
    plain_attend = all(type(a).attend is llama.Attention.attend for a in attentions)
    return in_place, in_place and plain_attend and all(len(set(cache_widths(a))) == 1 for a in attentions)


def writes_in_place(attention) -> bool:
    """Whether the kernels can write this layer's pool in place: where its decode kernel runs, and
    for MLA's latent and RoPE key (widths apart: written in place, attended to over the gathered
    rows, as its absorbed attention takes them; $MLXCEL_MLA_IN_PLACE=0 turns it off: the H100 passed
    tests/test_paged_attention.py::test_mla_pools_are_written_in_place, bench.lone_step 283 -> 321 tok/s)."""
    widths = cache_widths(attention)
    if len(set(widths)) > 1:
        return os.environ.get("MLXCEL_MLA_IN_PLACE", "1") == "1" and paged_attention.writes_available(*widths)
    group = getattr(attention, "n_heads", 1) // getattr(attention, "n_kv_heads", 1)
    return paged_attention.is_available(attention.head_dim, group)


def supports_packed_calls(model) -> bool:
    """Whether a family's forward call can carry packed tokens (models/paged_packed.py): llama's
    forward (per-token layers around attention, logits at any positions) and, in every layer,
    llama's attention call with llama's RoPE step (its own projections and attend are fine: they
    see each part as the scheduler's steps do). Not hybrids (a recurrent layer's scan needs a row's tokens in a row),
    per-row RoPE factors (longrope, M-RoPE) or a per-row adapter."""
    if type(model).forward_with_embeddings is not llama.Model.forward_with_embeddings:
        return False
    if any(hasattr(model, name) for name in ("longrope_limit", "lora_control", "make_prefill_extras")):
        return False
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        attention = layer["self_attn"] if "self_attn" in layer else None
        if attention is None or not isinstance(attention, llama.Attention):
            return False
        kind = type(attention)
        if kind.__call__ is not llama.Attention.__call__ or kind.prepare is not llama.Attention.prepare:
            return False
    return bool(layers)


def kv_bytes_per_position(model, kv_bits: int | None = None, kv_group_size: int = 64, rings: bool = False) -> int:
    """Keys and values of one position in every attention layer: in the model's dtype, or with
    `kv_bits` packed with a scale and a bias per group in full-attention layers. `rings`: sliding
    layers keep their window per row instead (ring_bytes_per_row), nothing per position; chunked
    layers always do."""
    dtype_size = compute_dtype_size(model)
    total = 0
    for attention, window, chunk in zip(cache_attentions(model), layer_windows(model), layer_chunks(model)):
        if attention is None or chunk is not None or (rings and window is not None):
            continue
        for dim in cache_widths(attention):
            full = dim * dtype_size
            quantized = dim * kv_bits // 8 + 2 * (dim // kv_group_size) * dtype_size if kv_bits else full
            total += attention.n_kv_heads * (full if window is not None else quantized)
    return total


def cache_widths(attention) -> tuple[int, int]:
    """The widths of what a layer caches per position and KV head: its keys' and its values'
    (an MLA layer's latent and shared RoPE key differ: `cache_dims`)."""
    return getattr(attention, "cache_dims", None) or (attention.head_dim, attention.head_dim)


def ring_bytes_per_row(model, rings: bool = True) -> int:
    """The rings' keys and values a row (models/paged_window.py): each chunked layer's chunk, and
    with `rings` each sliding layer's window."""
    total = 0
    for attention, window, chunk in zip(cache_attentions(model), layer_windows(model), layer_chunks(model)):
        positions = chunk if chunk is not None else window if rings and window is not None else 0
        if attention is not None and positions:
            total += positions * attention.n_kv_heads * sum(cache_widths(attention)) * compute_dtype_size(model)
    return total


def compute_dtype_size(model) -> int:
    """Bytes of an activation (the caches' dtype): the embeddings', or 2 for quantized weights
    (activations, and the cache, are in the compute dtype then)."""
    dtype = model.model.embed_tokens.weight.dtype
    return 2 if dtype.size == 1 or str(dtype).startswith("mlx.core.uint") else dtype.size


def device_memory_bytes() -> int:
    """The GPU's memory, or the machine's RAM on the CPU."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        total = info.get("memory_size") or info.get("total_memory") or 0
        if total:
            return int(total)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_kv_budget_bytes() -> int:
    return int(device_memory_bytes() * KV_BUDGET_SHARE)


class BatchScheduler:
    def __init__(
        self,
        model,
        max_context: int,
        max_rows: int,
        kv_budget_bytes: int | None = None,
        pipeline: bool = True,
        chunk_size: int | None = None,
        decode_step: str = "auto",
        prompt_cache: PromptCache | None = None,
        keep_answers: bool = False,
        snapshot_all: bool = False,
        batch_invariant: bool = False,
        window_rings: bool = True,
        draft_model: DraftModel | None = None,
    ):
        self.model = model
        self.draft_model = draft_model  # decode.draft.method=model: its pool is made per run (make_draft_pool)
        # each row's tokens as it alone would draw them, whatever shares its batch (docs/jobs.md)
        self.batch_invariant = batch_invariant
        if batch_invariant and (problem := find_invariance_problem(model)):
            family = type(model).__module__.rsplit(".", 1)[-1]
            raise MlxcelError(
                f"runner.batch_invariant=true cannot run {family}: {problem}; set runner.batch_invariant=false"
            )
        set_batch_invariant(model, batch_invariant)
        self.prompt_cache = prompt_cache
        self.hybrid = any(recurrent_layers(model))  # rows keep a fixed-size state (set again per run: steps)
        self.window_rings = window_rings  # sliding layers keep their window only (use_window_rings)
        self.keep_answers = keep_answers  # snapshot finished rows' answers too (a chat's next turn starts with them)
        # every prompt into the cache, not only what this job's rows share (a chat, a cache folder)
        self.snapshot_all = snapshot_all or keep_answers
        self.reuse: PrefixReuse | None = None
        self.max_context = max_context
        self.max_rows = max_rows
        self.kv_budget_bytes = kv_budget_bytes or default_kv_budget_bytes()
        self.pipeline = pipeline
        # None: 2048 idle, 512 while rows decode; batch-invariant: the rows' own pieces (plan_piece)
        self.pinned_chunk = INVARIANT_PIECE if batch_invariant else chunk_size
        # the batch engine's step for small decode batches
        self.segmented = choose_decode_step(model, decode_step) == "segmented" and not batch_invariant
        # pieces of several rows in one padded call (group_ragged); None: where the kernels run.
        # $MLXCEL_RAGGED_PREFILL=0 turns it off (each row's piece in a call of its own), to compare.
        self._mask_worker: ThreadPoolExecutor | None = None  # structured output's masks (advance_matchers)
        ragged_off = os.environ.get("MLXCEL_RAGGED_PREFILL", "1") == "0" or batch_invariant
        self.ragged_prefill: bool | None = False if ragged_off else None
        # decode rows and prefill pieces in one forward call an iteration (models/paged_packed.py);
        # $MLXCEL_PACKED=0 turns it off (a call for the decode rows and one a group of pieces), to compare
        packed_off = os.environ.get("MLXCEL_PACKED", "1") == "0" or batch_invariant
        self.packed = not packed_off and supports_packed_calls(model)
        self.drafting = False  # decode.draft runs in this request (set per request: steps)
        self.verifies_as_rows = False  # ... and its verify calls are decode steps (can_verify_as_rows; per run)
        self.drafts_from_model = False  # ... and its drafts come from the draft model

    def generate(
        self,
        request: GenerationRequest,
        on_token: OnToken = lambda row, token: True,
        on_row_done: OnRowDone | None = None,
    ) -> ScheduleState:
        """Generate every row; `on_token(row, token)` streams each token as it reaches the host
        (False cancels that row), `on_row_done(row, result)` reports each row as it finishes.
        A row that cannot run (empty, longer than the context, more KV than the budget) ends
        with finish_reason "error" and the others run."""
        state = None
        for state in self.steps(request, on_token, on_row_done):  # noqa: B007 (the last state is the result)
            pass
        return state

    def steps(
        self,
        request: GenerationRequest,
        on_token: OnToken,
        on_row_done: OnRowDone | None = None,
        feed: RowFeed | None = None,
    ) -> Iterator[ScheduleState]:
        """generate() as a generator: yields after every iteration (stopping early abandons the rest).
        With a `feed` it runs until the feed closes, taking rows as they come; their results are
        reported through the callbacks only (the state keeps none, so a server's memory stays flat)."""
        timings = GenerationTimings(start=time.perf_counter())
        # speculative decoding: rows that can draft do, the others decode as before (find_draft_problem)
        draft_off = self.find_draft_problem(request) if request.draft is not None else None
        self.drafting = request.draft is not None and draft_off is None
        self.draft_chunk = min((c for c in layer_chunks(self.model) if c), default=None)  # (draft_room)
        rows = [self.make_row(i, r, request) for i, r in enumerate(request.rows)]
        state = ScheduleState(request, [r.result for r in rows], timings, rows, kv_budget_bytes=self.kv_budget_bytes)
        state.draft_off = draft_off
        kernels = (False, False) if request.kv_bits else uses_kernels(self.model)  # the kernels read unquantized pools
        # (drafting: a ring would lose the positions a rejected draft overwrote)
        rings = self.use_window_rings(request, kernels[0]) and not self.drafting
        per_position = kv_bytes_per_position(self.model, request.kv_bits, request.kv_group_size, rings)
        self.per_block = max(1, per_position * BLOCK_SIZE)  # (every layer a ring: blocks count positions only)
        # A row's fixed-size state (a hybrid's recurrent layers', sliding layers' rings) per row slot:
        # the slots' states come out of the budget first, for as many rows as fit with a block each.
        self.state_bytes = state_bytes_per_row(self.model) + ring_bytes_per_row(self.model, rings)
        # a draft model's pool comes out of the same budget: a block of it beside each of the model's
        # (its drafts' overhang per slot on top), its recurrent states beside each slot's
        self.drafts_from_model = self.drafting and request.draft.method == "model"
        draft_block, draft_state = self.draft_pool_bytes() if self.drafts_from_model else (0, 0)
        self.slots = self.max_rows
        if self.state_bytes or draft_state:
            row_bytes = self.state_bytes + draft_state + self.per_block + draft_block
            self.slots = max(1, min(self.max_rows, self.kv_budget_bytes // row_bytes))
        state.state_bytes = self.slots * self.state_bytes
        overhang = self.slots * (self.draft_overhang(request) * draft_block + draft_state) if draft_block else 0
        blocks_budget = max(self.kv_budget_bytes - state.state_bytes - overhang, self.per_block)
        runnable = self.check_rows(rows, request, on_row_done)
        if feed is None:
            # The pool holds what the job can use at once: its max_rows largest reservations, within the budget.
            sizes = sorted((count_blocks(self.reserved_positions(r, request)) for r in runnable), reverse=True)
        else:  # rows to come: room for max_rows rows of the whole context, within the budget
            sizes = [count_blocks(self.max_context + (request.tile_size or 0))] * self.slots
        per_block = self.per_block
        num_blocks = max(1, min(sum(sizes[: self.slots]), blocks_budget // (per_block + draft_block)))
        most = num_blocks
        if feed is not None and not kernels[0]:  # plain pools start small, grow as rows arrive (PageTable.grow)
            num_blocks = min(num_blocks, count_blocks(OPEN_POOL_POSITIONS))
        positions = self.max_context + (request.tile_size or 0) + BLOCK_SIZE
        table = PageTable(num_blocks, self.slots, positions, *kernels, max_blocks=most, invariant=self.batch_invariant)
        windows, recurrent, chunks = layer_windows(self.model), recurrent_layers(self.model), layer_chunks(self.model)
        caches = make_paged_caches(
            len(windows), table, windows, request.kv_bits, request.kv_group_size, recurrent, rings, chunks
        )
        # rows keep a fixed-size state: pieces end where they share a prefix, so the prompt cache records it there
        self.hybrid = any(hasattr(c, "row_states") for c in caches)
        self.verifies_as_rows = self.drafting and self.can_verify_as_rows(caches)
        if self.drafts_from_model:
            self.make_draft_pool(runnable, request, feed is not None, table.max_blocks)
        self.reuse = None
        if self.prompt_cache is not None:
            # with kv_bits a row's pieces are its own chunk size, so an adopted prefix ends on one
            # (rounding to cuDNN's aligned starts where the kernels run was slower on the H200: more
            # tokens to compute for a mask-free piece; docs/benchmarks.md)
            # (batch-invariant: an adopted prefix ends where the row's own piece would)
            align = (self.pinned_chunk or request.chunk_size) if request.kv_bits or self.batch_invariant else 1
            self.reuse = PrefixReuse(self.prompt_cache, table, caches, self.model, runnable, align, self.snapshot_all)
        try:
            for _ in self.run_rows(state, deque(runnable), table, caches, request, on_token, on_row_done, feed):
                state.kv_peak_bytes = state.kv_peak_blocks * per_block
                yield state
        finally:  # an interrupted job leaves no pinned cache entries behind
            if self.reuse is not None:
                self.reuse.release_all()
        state.kv_peak_bytes = state.kv_peak_blocks * per_block
        state.prompt_cache = self.reuse.summary() if self.reuse is not None else None
        timings.end = timings.end or time.perf_counter()
        yield state

    # ---- rows ----
    def make_row(self, index: int, request: RowRequest, job: GenerationRequest) -> Row:
        wants_logprobs = job.logprobs or request.logprobs
        result = RowResult(prompt_tokens=len(request.prompt_ids), logprobs=[] if wants_logprobs else None)
        limit = min(request.max_tokens or job.max_tokens, self.max_context - len(request.prompt_ids) + 1)
        matcher = request.constraint.new_matcher() if request.constraint is not None else None
        row = Row(
            index,
            request,
            result,
            max(limit, 1),
            error=check_prompt(index, request.prompt_ids, self.max_context),
            matcher=matcher,
        )
        if self.drafting and self.can_draft(row, job):
            row.drafts = make_row_drafts(job.draft)
            result.draft = row.drafts.describe()
        return row

    # ---- speculative decoding (engine/drafts.py) ----
    def find_draft_problem(self, request: GenerationRequest) -> str | None:
        """Why this model or request cannot verify drafts (the rows then decode as they would), or None."""
        if request.draft.method == "model" and self.draft_model is None:
            return "decode.draft.method=model but no draft model was loaded (decode.draft.model_path)"
        if request.kv_bits:
            return "decode.kv_bits is set (a quantized pool takes no ragged calls)"
        if self.batch_invariant:
            return "runner.batch_invariant=true (a verify call's shape would change a row's numerics)"
        if getattr(self.model, "longrope_limit", None) is not None:
            return "its longrope scaling switches factors at a position a draft could cross"
        return None

    def make_draft_pool(self, rows: list[Row], request: GenerationRequest, open_feed: bool, target_blocks: int):
        """The draft model's paged pool for this run: the same slots, each row's reservation plus the
        positions its drafts write past it, never more positions than the model's own pool holds
        (`target_blocks`, within runner.kv_budget_gb) and its rows' overhang; a plain pool starts
        small and grows as rows come."""
        draft = self.draft_model.model
        if open_feed:
            sizes = [count_blocks(self.max_context + (request.tile_size or 0) + request.draft.tokens)] * self.slots
        else:
            sizes = sorted((count_blocks(self.draft_positions(r, request)) for r in rows), reverse=True)
        most = max(1, min(sum(sizes[: self.slots]), target_blocks + self.slots * self.draft_overhang(request)))
        kernels = uses_kernels(draft)
        blocks = most if kernels[0] else min(most, count_blocks(OPEN_POOL_POSITIONS))
        positions = self.max_context + (request.tile_size or 0) + request.draft.tokens + BLOCK_SIZE
        table = PageTable(blocks, self.slots, positions, *kernels, max_blocks=most)
        windows, chunks = layer_windows(draft), layer_chunks(draft)
        caches = make_paged_caches(len(windows), table, windows, None, 64, recurrent_layers(draft), False, chunks)
        self.draft_model.start(table, caches)

    @staticmethod
    def draft_overhang(request: GenerationRequest) -> int:
        """Blocks a row's drafts may write past its reservation in the draft model's pool."""
        return count_blocks(request.draft.tokens) + 1

    def draft_pool_bytes(self) -> tuple[int, int]:
        """(a block of the draft model's pool, a row's recurrent states in it) in bytes."""
        draft = self.draft_model.model
        return max(1, kv_bytes_per_position(draft) * BLOCK_SIZE), state_bytes_per_row(draft)

    def draft_positions(self, row: Row, request: GenerationRequest) -> int:
        """Positions a row's drafts may write in the draft model's pool."""
        return self.reserved_positions(row, request) + request.draft.tokens

    def admit_draft(self, row: Row, request: GenerationRequest) -> None:
        """A drafting row's slot in the draft model's pool; without room there it decodes plainly."""
        positions = self.draft_positions(row, request)
        if self.draft_model.table.grow(count_blocks(positions)):
            self.draft_model.admit(row.slot, positions)
        else:
            row.drafts = row.result.draft = None

    def can_draft(self, row: Row, request: GenerationRequest) -> bool:
        """Rows whose next tokens a verify call gives exactly: a chain that is a function of the
        logits and the step's random key (greedy or sampled; no penalties, DRY or mirostat, whose
        state a drafted token would advance), no logprobs, no images. A constrained row drafts what
        its matcher accepts (fit_drafts)."""
        chain = row.request.sampler or request.sampler
        plain = not (request.logprobs or row.request.logprobs)
        return not chain.is_stateful and plain and row.request.images is None

    def check_rows(self, rows: list[Row], request: GenerationRequest, on_row_done) -> list[Row]:
        """The rows that can run; the others end now with finish_reason "error" (reported)."""
        for row in rows:
            needed = count_blocks(self.reserved_positions(row, request)) * self.per_block + self.state_bytes
            if row.error is None and needed > self.kv_budget_bytes:
                state = f" and {self.state_bytes / 1e9:.3f} GB of per-row state" if self.state_bytes else ""
                row.error = (
                    f"needs {(needed - self.state_bytes) / 1e9:.3f} GB of KV cache{state} (prompt {len(row.prompt)} + "
                    f"up to {row.limit} tokens); runner.kv_budget_gb is {self.kv_budget_bytes / 1e9:.3f}: raise it or "
                    "lower max_tokens"
                )
            if row.error is not None:
                row.result.finish_reason, row.result.error = "error", row.error
                if on_row_done is not None:
                    on_row_done(row.index, row.result)
        return [r for r in rows if r.error is None]

    def reserved_positions(self, row: Row, request: GenerationRequest) -> int:
        """Positions a row can ever write: its prompt (plus a tile of padding) and every drawn
        token but the last."""
        return len(row.prompt) + (request.tile_size or 0) + row.limit - 1

    # ---- the loop ----
    def run_rows(
        self,
        state: ScheduleState,
        waiting: deque,
        table: PageTable,
        caches: list,
        request: GenerationRequest,
        on_token: OnToken,
        on_row_done,
        feed: RowFeed | None = None,
    ) -> Iterator[ScheduleState]:
        """The loop of the module docstring; yields after every iteration."""
        sampler = GroupedRowsSampler(request.sampler, request.logprobs)
        batch = DecodeBatch()
        ragged = table.decode_kernel if self.ragged_prefill is None else self.ragged_prefill
        packed = self.packed and not request.kv_bits and not self.tile_size(request)
        prefilling: deque[Row] = deque()
        free_slots = list(range(self.slots))
        inflight: deque[PendingDraw] = deque()
        leaving: list[Row] = []  # done drawing; their slot goes back once their tokens are read
        draws_queued = draws_read = 0
        verified_last = False  # the last iteration verified drafts (speculative decoding)
        self.live: dict[int, Row] = {}  # a feed's rows by index, until they end
        self.cancelling: set[int] = set()  # decoding rows that end at their next token
        self._mask_buffer: MaskBuffer | None = None  # structured output's masks, written in place
        open_feed = feed is not None
        fed = bool(state.rows)  # an open loop's clock starts with its first rows
        while waiting or prefilling or len(batch) or inflight or open_feed:
            if open_feed:
                idle = not (waiting or prefilling or len(batch) or inflight)
                polled = time.perf_counter()
                update = feed.poll(idle=idle)
                # blocked with nothing to run: not host work, nor the loop's busy time. Before its
                # first rows the loop's clock has not started (a Ray worker waits there for the
                # others to load); a wait that ends the loop comes after timings.end, the last read.
                if idle and (update.rows or not update.closed):
                    waited = time.perf_counter() - polled
                    if not fed:
                        state.timings.start += waited
                    else:
                        state.wait_seconds += waited
                        state.idle_seconds += waited
                fed = fed or bool(update.rows)
                open_feed = not update.closed
                new = [self.make_row(index, r, request) for index, r in update.rows]
                for row in self.check_rows(new, request, on_row_done):
                    self.live[row.index] = row
                    waiting.append(row)
                self.cancel_rows(update.cancelled, waiting, prefilling, table, caches, free_slots, on_row_done)
                if not (waiting or prefilling or len(batch) or inflight):
                    state.iterations += 1
                    yield state
                    continue
            # 1. admissions, in arrival order: a free slot and the blocks for everything the row
            # may write; a row whose prefix another row is prefilling waits to adopt it
            reuse = self.reuse
            for row in list(waiting) if free_slots else ():  # (no copy of the queue while every slot is busy)
                if not free_slots:
                    break
                if reuse is not None and reuse.should_wait(row):
                    continue
                if not table.grow(count_blocks(self.reserved_positions(row, request))):
                    break
                waiting.remove(row)
                row.slot = free_slots.pop(0)
                table.reserve(row.slot, self.reserved_positions(row, request))
                if self.drafts_from_model and row.drafts is not None:
                    self.admit_draft(row, request)
                row.admitted_at = time.perf_counter()
                if reuse is not None:
                    row.prefilled = row.result.cached_tokens = reuse.adopt(row)
                prefilling.append(row)
            state.kv_peak_blocks = max(state.kv_peak_blocks, table.num_blocks - table.free_blocks)
            # 1b. speculative decoding: every queued draw read, the rows' drafts verified in one call
            # (a row without one takes its plain step in it); while rows prefill, every other
            # iteration is a plain one, so their pieces go on
            if self.drafting and len(batch) and not (prefilling and verified_last) and self.wants_drafts(batch):
                ended = []
                while inflight:
                    ended += self.read_draw(inflight.popleft(), request, state, on_token, on_row_done)
                    draws_read += 1
                leaving += self.drop_ended(batch, ended, sampler, draws_queued)
                drafts = self.fit_drafts(batch, self.propose_drafts(batch, table), table)
                drafts = self.budget_drafts(batch, drafts) if drafts is not None else None
                if drafts is not None:
                    verify = (table, caches, batch, drafts, sampler, request, state)
                    ended = self.verify_drafts(*verify, on_token, on_row_done)
                    draws_queued += 1
                    draws_read += 1
                    leaving += self.keep(batch, batch.drawn < batch.limits, sampler, draws_queued)
                    leaving += self.drop_ended(batch, ended, sampler, draws_queued)
                    verified_last = True
                    self.free_rows(leaving, draws_read, table, caches, free_slots, state)
                    state.iterations += 1
                    yield state
                    continue
            verified_last = False
            # 2. the decode step, then prefill pieces within the iteration's token budget: in one
            # packed call where the family and request allow it (models/paged_packed.py)
            logits_parts, joined = [], []
            piece = self.pinned_chunk or (BUSY_CHUNK_SIZE if len(batch) else DEFAULT_CHUNK_SIZE)
            if request.kv_bits:
                # a later piece attends to the earlier ones' quantized keys, so where pieces end
                # changes a row's tokens: with kv_bits they are the row's own, as in the batch engine
                piece = self.pinned_chunk or request.chunk_size
            budget = pieces_per_iteration(decoding=len(batch) > 0) * piece
            group = self.pick_pieces(prefilling, piece, budget, request) if packed and prefilling else None
            if group is not None:
                logits, done = self.step_packed(table, caches, batch, *group, request, state)
                budget = 0  # one call an iteration
                if logits is not None:
                    logits_parts.append(logits)
                joined += done
                self.end_prefills(done, prefilling)
            elif len(batch):
                logits_parts.append(self.decode_step(table, caches, batch))
                self.count_call(state, ("decode", len(batch)))
            if len(batch):
                state.decode_steps += 1
                state.rows_decoding_sum += len(batch)
            while prefilling and budget > 0:
                if budget < min(piece, len(prefilling[0].prompt) - prefilling[0].prefilled):
                    # No piece is cut short by the iteration's budget: pieces start on multiples of
                    # the piece size, which the paged kernels' fast path needs (paged_cache.ALIGNED_START),
                    # and with kv_bits a row's pieces must be its own chunk size.
                    break
                group = self.group_ragged(prefilling, piece, budget, request) if ragged else None
                if group:
                    logits, spent, done = self.prefill_ragged(table, caches, *group, request, state)
                else:
                    rows, plan = self.group_pieces(prefilling, piece, budget, request)
                    logits, spent = self.prefill_piece(table, caches, rows, plan, request, state)
                    done = rows if logits is not None else []
                if spent == 0:
                    break  # what is left of the budget is less than a tile
                budget -= spent
                if done:
                    logits_parts.append(logits)
                    joined += done
                    self.end_prefills(done, prefilling)
            # 3. one draw for the decoding rows and the rows whose prefill ended
            if logits_parts:
                for row in joined:
                    key = RowKey(row.request.row_id, row.request.sample_index, row.request.seed)
                    sampler.add(key, row.prompt, row.request.sampler, row.request.logprobs)
                batch.join(joined)
                bitmask, ended, read_later = None, [], None
                constrained = sum(row.matcher is not None for row in batch.rows)
                order = "thread" if constrained >= THREADED_MASK_ROWS else FEW_ROWS_ORDER
                if constrained and len(inflight) == 1:
                    # Structured output: the masks need the last step's tokens. Read them (after:
                    # once the forward pass is queued; split: once its first half is), advance the
                    # matchers and compute the masks: on a thread (llguidance and MLX's async_eval
                    # release the GIL) while this one queues the forward pass, whose encoding is
                    # host work on a GPU, or here (after). The rows' own work with those tokens
                    # (text, stop strings) waits until the draw is queued.
                    if order == "split":
                        submit(first_half(caches), state)
                    elif order == "after":
                        submit(logits_parts, state)
                        forward_queued = time.perf_counter()
                    pending = inflight.popleft()
                    host = self.read_tokens(pending, state)
                    # (the loop's buffer is free: every queued draw has been read; the thread order
                    # makes a new array a step, as in the runs that met the batch-32 target)
                    fill = self.mask_buffer(request).fill if order != "thread" else None
                    advance = (pending, host[0], batch.rows, request, self.cancelling, fill)
                    if order == "after":
                        problems, bitmask, seconds = advance_matchers(*advance)
                    else:
                        masking = self.mask_worker().submit(advance_matchers, *advance)
                        submit(logits_parts, state)
                        waited = forward_queued = time.perf_counter()
                        problems, bitmask, seconds = masking.result()
                        state.mask_wait_seconds += time.perf_counter() - waited
                    state.mask_seconds += seconds
                    read_later = (pending, host, problems)
                elif constrained:
                    # no one draw to read first (none, when rows first join; or two): masks after
                    # the forward pass, every queued draw read first
                    submit(logits_parts, state)
                    forward_queued = time.perf_counter()
                    while inflight:
                        ended += self.read_draw(inflight.popleft(), request, state, on_token, on_row_done)
                        draws_read += 1
                    bitmask = self.compute_masks(batch.rows, request, state)
                logits = logits_parts[0] if len(logits_parts) == 1 else mx.concatenate(logits_parts)
                draw = sampler.sample(logits, bitmask)
                if constrained:  # (a device done with the forward pass idles this long, at most)
                    state.draw_gap_seconds += time.perf_counter() - forward_queued
                submit(draw.arrays() + sampler.state_arrays(), state)
                inflight.append(PendingDraw(draw, list(batch.rows)))
                draws_queued += 1
                batch.next_input = draw.tokens
                batch.drawn += 1
                if read_later is not None:  # (the matchers are advanced: read_draw only applies the tokens)
                    pending, host, problems = read_later
                    ended += self.read_draw(pending, request, state, on_token, on_row_done, host, problems)
                    draws_read += 1
                # rows that drew their last token leave the decode batch now (no wasted step)
                leaving += self.keep(batch, batch.drawn < batch.limits, sampler, draws_queued)
                leaving += self.drop_ended(batch, ended, sampler, draws_queued)
            # 4. read the oldest draw (pipelined: one step behind), apply stop rules
            if inflight and (len(inflight) > 1 or not self.pipeline or not (len(batch) or prefilling)):
                ended = self.read_draw(inflight.popleft(), request, state, on_token, on_row_done)
                draws_read += 1
                leaving += self.drop_ended(batch, ended, sampler, draws_queued)
            # slots and blocks of rows whose every queued step has been read go back
            self.free_rows(leaving, draws_read, table, caches, free_slots, state)
            state.iterations += 1
            # (held across the yield, they would keep the last step's logits and tokens alive
            # while an open loop waits for rows)
            logits_parts = logits = draw = None
            yield state

    def free_rows(
        self, leaving: list[Row], draws_read: int, table: PageTable, caches: list, free_slots: list, state
    ) -> None:
        """The slots and blocks of the rows in `leaving` whose every queued step has been read go back."""
        for row in [row for row in leaving if row.last_draw <= draws_read]:
            leaving.remove(row)
            if self.keep_answers and self.reuse is not None:
                # every fed position: the prompt and each token drawn but the last
                fed = len(row.prompt) + len(row.result.token_ids) - 1
                submit(self.reuse.record(row, min(int(table.lengths[row.slot]), fed)), state)
            release_slot(table, caches, row.slot)
            if self.draft_model is not None and self.drafts_from_model:
                self.draft_model.release(row.slot)
            free_slots.append(row.slot)
            row.slot = -1
            if self.reuse is not None:
                self.reuse.forget(row)
        free_slots.sort()

    def cancel_rows(
        self,
        indices: list[int],
        waiting: deque,
        prefilling: deque,
        table: PageTable,
        caches: list,
        free_slots: list,
        on_row_done,
    ) -> None:
        """A feed's rows that must stop: waiting or prefilling ones end now (their slot and blocks
        go back); decoding ones at their next token (read_draw), so none is read half-applied."""
        for index in indices:
            row = self.live.get(index)
            if row is None or row.result.finish_reason is not None:
                continue
            if row in waiting:
                waiting.remove(row)
            elif row in prefilling:
                prefilling.remove(row)
                if self.reuse is not None:
                    self.reuse.finish_prefill(row)
                    self.reuse.forget(row)
                release_slot(table, caches, row.slot)
                if self.draft_model is not None and self.drafts_from_model:
                    self.draft_model.release(row.slot)
                free_slots.append(row.slot)
                row.slot = -1
            else:
                self.cancelling.add(index)
                continue
            del self.live[index]
            row.result.finish_reason = "cancelled"
            if on_row_done is not None:
                on_row_done(row.index, row.result)

    def wants_drafts(self, batch: DecodeBatch) -> bool:
        """Whether a row of the batch drafts this step (counting down paused rows' pauses)."""
        wants = False
        for row in batch.rows:
            drafts = row.drafts
            if drafts is not None:
                if drafts.paused:
                    drafts.paused -= 1
                else:
                    wants = True
        return wants

    def draft_room(self, batch: DecodeBatch, i: int, table: PageTable) -> int:
        """The most tokens row i may draft: what its limit leaves after the step's own token, and,
        where layers keep a ring of one attention chunk (Llama 4), what keeps its line within its
        input's chunk (a rejected token past it would overwrite positions the row still attends to)."""
        room = int(batch.limits[i] - batch.drawn[i]) - 1
        if self.draft_chunk:
            room = min(room, self.draft_chunk - 1 - int(table.lengths[batch.rows[i].slot]) % self.draft_chunk)
        return room

    def budget_drafts(self, batch: DecodeBatch, drafts: list[list[int]]) -> list[list[int]] | None:
        """A verify call holds at most VERIFY_TOKENS[device] positions: past that the step is bound
        by arithmetic, where a drafted token costs what a plain step's does. The ragged call pads
        every row's line to the longest, so a line holds at most its share; then (where lines are
        not padded) rows whose drafts were accepted most keep theirs first (ties: batch order), so
        the choice is the rows' own."""
        positions = VERIFY_TOKENS["gpu" if mx.default_device() == mx.gpu else "cpu"]
        if not self.verifies_as_rows:
            share = positions // len(batch) - 1
            drafts = [draft[: max(share, 0)] for draft in drafts]
        budget = positions - len(batch)
        if sum(map(len, drafts)) <= budget:
            return drafts if any(drafts) else None

        def rate(i: int) -> float:
            figures = batch.rows[i].drafts
            return figures.accepted / figures.drafted if figures is not None and figures.drafted else 1.0

        kept = [[] for _ in drafts]
        for i in sorted(range(len(drafts)), key=lambda i: -rate(i)):
            kept[i] = drafts[i][: max(budget, 0)]
            budget -= len(kept[i])
        return kept if any(kept) else None

    def fit_drafts(self, batch: DecodeBatch, drafts: list[list[int]] | None, table: PageTable):
        """Structured output: a constrained row's draft cut to what its matcher accepts; a row with no
        draft takes the tokens its grammar forces next (the masked draw can only pick those)."""
        constrained = [i for i, row in enumerate(batch.rows) if row.matcher is not None and row.drafts is not None]
        if not constrained:
            return drafts
        drafts = drafts or [[] for _ in batch.rows]
        for i in constrained:
            matcher, draft = batch.rows[i].matcher, drafts[i]
            if matcher.is_stopped() or matcher.is_error():
                drafts[i] = []
                continue
            if draft:
                drafts[i] = draft[: matcher.validate_tokens(draft)]
            elif not batch.rows[i].drafts.paused:
                drafts[i] = list(matcher.compute_ff_tokens())[: max(self.draft_room(batch, i, table), 0)]
        return drafts if any(drafts) else None

    def propose_drafts(self, batch: DecodeBatch, table: PageTable) -> list[list[int]] | None:
        """Each decoding row's draft (empty for rows without one; at most what its limit leaves
        after the step's own token), or None when no row has one. Where layers keep a ring of one
        attention chunk (Llama 4), a line stays within its input's chunk: a rejected token past it
        would have overwritten positions the row still attends to."""
        drafts, asks = [], []
        for i, row in enumerate(batch.rows):
            room = self.draft_room(batch, i, table)
            ready = row.drafts is not None and not row.drafts.paused and room > 0
            if ready and self.drafts_from_model:
                asks.append((i, min(room, row.drafts.size or row.drafts.tokens)))
                ready = False
            drafts.append(row.drafts.propose(row.prompt, row.result.token_ids, room) if ready else [])
        if asks:  # the draft model's, for every asking row at once
            rows = [(batch.rows[i].slot, batch.rows[i].prompt, batch.rows[i].result.token_ids, n) for i, n in asks]
            for (i, _), draft in zip(asks, self.draft_model.propose(rows, pad_id=0)):
                drafts[i] = draft
        return drafts if any(drafts) else None

    def verify_drafts(
        self,
        table: PageTable,
        caches: list,
        batch: DecodeBatch,
        drafts: list[list[int]],
        sampler: GroupedRowsSampler,
        request: GenerationRequest,
        state: ScheduleState,
        on_token: OnToken,
        on_row_done,
    ) -> list[Row]:
        """One call over every decoding row's line (its next input, then its draft; rows end together
        as in a ragged piece): the sampler draws each row's next token from its first position, as a
        plain step would; a drafting row's chain (a function of the logits: can_draft) gives the
        target's token after each drafted one. A row keeps its draft up to the first token the
        target disagrees with, and takes the target's token there: exactly plain decoding's tokens.
        The pool's rejected positions go back (the row's length); returns the rows that ended."""
        sizes = np.array([len(d) for d in drafts], dtype=np.int32)
        inputs = batch.next_input.tolist()
        starts = table.lengths[batch.slots].copy()
        recurrent = [c for c in caches if hasattr(c, "snapshot")]  # a hybrid's: states to go back to
        saved = [c.snapshot(batch.slots) for c in recurrent]
        # logits [N, V] of the call's positions, and the index of each row's input among them
        if self.verifies_as_rows:
            logits, firsts = self.verify_as_rows(table, caches, batch, inputs, drafts, sizes)
            self.count_call(state, ("verify rows", len(logits)))
        else:
            width = int(sizes.max()) + 1
            leads = (width - 1 - sizes).astype(np.int32)
            lines = [[request.pad_token_id] * int(lead) + [inp] + d for lead, inp, d in zip(leads, inputs, drafts)]
            self.set_adapter_rows(table, batch.slots, prefill=False)
            select_adapters(self.model, batch.adapters)
            table.begin(batch.slots, width, leads)
            logits = self.model(mx.array(lines, dtype=mx.int32), caches)  # [B, width, V]
            table.end()
            self.count_call(state, ("verify", len(batch), width))
            logits, firsts = logits.reshape(-1, logits.shape[-1]), np.arange(len(batch)) * width + leads
        masks = self.mask_drafts(batch, drafts, request) if any(r.matcher is not None for r in batch.rows) else None
        first_mask = mx.array(masks[0]) if masks is not None else None
        draw = sampler.sample(logits[mx.array(firsts)], first_mask)  # each row's first position
        # the targets after the drafted tokens: each drafting row's chain on its later positions, with
        # the random keys its plain steps would have drawn them with (the sampler's step counts)
        picks = [(i, j) for i in np.nonzero(sizes)[0].tolist() for j in range(1, sizes[i] + 1)]
        later = logits[mx.array([int(firsts[i]) + j for i, j in picks])]
        if masks is not None:  # each later position under its row's mask after the drafted tokens before it
            later = apply_token_bitmask(later, mx.array(np.stack([masks[1][i][j - 1] for i, j in picks])))
        targets = mx.zeros((len(picks),), mx.uint32)
        places = sampler.locate()
        groups: dict[int, list[int]] = {}
        for k, (i, _) in enumerate(picks):
            groups.setdefault(id(places[i][0]), []).append(k)
        for ks in groups.values():
            group = places[picks[ks[0]][0]][0]
            # (the first position's draw advanced the steps: position j draws at step + j - 1)
            keys = group.keys_ahead([places[picks[k][0]][1] for k in ks], [picks[k][1] - 1 for k in ks])
            drawn, _ = group.chain.run_draw(later[mx.array(ks)], keys, {})
            targets[mx.array(ks)] = drawn.astype(mx.uint32)
        waited = time.perf_counter()
        mx.eval(draw.arrays(), targets)  # one wait for both (each read would be its own sync)
        first, logprobs = draw.to_host()
        after = targets.tolist()
        state.wait_seconds += time.perf_counter() - waited
        emitted, kept, at = [], [], 0
        for i, row in enumerate(batch.rows):
            tokens = [first[i]] + after[at : at + sizes[i]]
            at += sizes[i]
            accepted = count_accepted(drafts[i], tokens) if sizes[i] else 0
            emitted.append(tokens[: accepted + 1])
            kept.append(accepted)
            if sizes[i]:
                row.drafts.record(int(sizes[i]), accepted)
                row.result.draft = row.drafts.describe()
                if accepted:
                    group, place = places[i]
                    group.advance(place, accepted)
            table.lengths[row.slot] = starts[i] + 1 + accepted  # the input and the accepted drafts stay
        cut = [i for i in range(len(batch)) if kept[i] < sizes[i]]
        if recurrent and cut:
            kept_lines = [[inputs[i]] + drafts[i][: kept[i]] for i in cut]
            self.replay_kept(table, caches, batch, cut, kept_lines, starts, recurrent, saved, state)
        state.decode_steps += 1
        state.rows_decoding_sum += len(batch)
        state.verify_steps += 1
        ended = []
        for j in range(max(map(len, emitted))):
            rows = [i for i, tokens in enumerate(emitted) if len(tokens) > j]
            host = ([emitted[i][j] for i in rows], [logprobs[i] for i in rows] if j == 0 and logprobs else None)
            pending = PendingDraw(None, [batch.rows[i] for i in rows])
            ended += self.read_draw(pending, request, state, on_token, on_row_done, host)
        batch.drawn = batch.drawn + np.array([len(tokens) for tokens in emitted])
        batch.next_input = mx.array([tokens[-1] for tokens in emitted], dtype=batch.next_input.dtype)
        return ended

    def can_verify_as_rows(self, caches: list) -> bool:
        """Whether a verify call can be a decode step of one row a drafted position (verify_as_rows):
        attention layers of llama's kind over plain paged pools (no recurrent state, which a row's
        positions must advance in order; no rings, quantized pools or latent attention)."""
        if not VERIFY_AS_ROWS or self.hybrid or any(type(c) is not PagedKVCache for c in caches):
            return False
        layers = self.model.model.layers
        return all(isinstance(layer.self_attn, llama.Attention) for layer in layers if "self_attn" in layer)

    def verify_as_rows(
        self, table: PageTable, caches: list, batch: DecodeBatch, inputs: list[int], drafts: list[list[int]], sizes
    ) -> tuple[mx.array, np.ndarray]:
        """The verify call as a decode step: each row's input and drafted tokens are rows of their
        own on the row's slot, a position apart, so the step takes the decode path (on a GPU the
        compiled segments and the paged kernel). Returns the logits [P, V] and each row's first."""
        widths = sizes + 1
        firsts = np.cumsum(widths) - widths
        offsets = np.arange(int(widths.sum()), dtype=np.int32) - np.repeat(firsts, widths).astype(np.int32)
        tokens = mx.array([t for inp, d in zip(inputs, drafts) for t in [inp, *d]], dtype=batch.next_input.dtype)
        select_adapters(self.model, np.repeat(batch.adapters, widths))
        return self.step_rows(table, caches, np.repeat(batch.slots, widths), tokens, offsets), firsts

    def mask_drafts(self, batch: DecodeBatch, drafts: list[list[int]], request: GenerationRequest):
        """Structured output's masks for a verify call: (the rows' masks at their first position
        [B, W], and per row [k, W] the masks after each drafted token: its matcher advanced through
        its draft, then rolled back; read_draw advances it by what is emitted)."""
        constraints = request.constraints
        first = constraints.fill_masks([row.matcher for row in batch.rows])
        later = {}
        for i, row in enumerate(batch.rows):
            matcher, draft = row.matcher, drafts[i]
            if matcher is None or not draft:
                later[i] = np.full((len(draft), constraints.mask_words), -1, dtype=np.int32)
                continue
            steps = []
            for token in draft:
                matcher.consume_token(token)  # (fit_drafts checked the matcher takes them)
                steps.append(constraints.fill_masks([matcher])[0])
            matcher.rollback(len(draft))
            later[i] = np.stack(steps)
        return first, later

    def replay_kept(
        self,
        table: PageTable,
        caches: list,
        batch: DecodeBatch,
        cut: list[int],
        kept_lines: list[list[int]],
        starts: np.ndarray,
        recurrent: list,
        saved: list[dict],
        state: ScheduleState,
    ) -> None:
        """A hybrid's rows whose drafts were cut short ran their recurrent layers past the tokens
        they keep: their states go back to before the verify call and the kept tokens run again
        (the attention layers write the same keys and values again), in one ragged call."""
        slots = batch.slots[cut]
        for cache, states in zip(recurrent, saved):
            for slot in slots.tolist():
                cache.restore(slot, states[slot])
        width = max(map(len, kept_lines))
        leads = np.array([width - len(line) for line in kept_lines], dtype=np.int32)
        lines = mx.array([[0] * int(lead) + line for lead, line in zip(leads, kept_lines)], dtype=mx.int32)
        table.lengths[slots] = starts[cut]
        select_adapters(self.model, batch.adapters[cut])
        table.begin(slots, width, leads)
        self.model(lines, caches, logits_at=width - 1)
        table.end()
        self.count_call(state, ("replay", len(cut), width))
        submit([a for c in caches for a in c.state], state)

    def compute_masks(self, rows: list[Row], request: GenerationRequest, state: ScheduleState) -> mx.array:
        """[B, ceil(V / 32)] structured output's bitmasks for a draw over `rows` (batch order);
        rows without a constraint, or already finished (their draw is not read), allow every token."""
        began = time.perf_counter()
        matchers = [row.matcher if row.result.finish_reason is None else None for row in rows]
        masks = self.mask_buffer(request).fill(matchers)
        state.mask_seconds += time.perf_counter() - began
        return masks

    def mask_buffer(self, request: GenerationRequest) -> MaskBuffer:
        """The loop's MaskBuffer, for the after and split orders: their masks are made once every
        queued draw has been read, so none still reads it (batch 1 on the H200, masks after: 0.95
        of free throughput against 0.87 with a new array a step, one lease, docs/benchmarks.md)."""
        if self._mask_buffer is None:
            self._mask_buffer = MaskBuffer(request.constraints, self.max_rows)
        return self._mask_buffer

    def drop_ended(
        self, batch: DecodeBatch, ended: list[Row], sampler: GroupedRowsSampler, last_draw: int
    ) -> list[Row]:
        """The rows of `ended` leave the decode batch (keep)."""
        if not ended or not len(batch):
            return []
        return self.keep(batch, ~np.isin(batch.indices, [row.index for row in ended]), sampler, last_draw)

    def end_prefills(self, done: list[Row], prefilling: deque) -> None:
        """Rows whose prompts are prefilled: out of the queue, their shared prefixes' waits over."""
        for row in done:
            prefilling.remove(row)
            if self.reuse is not None:
                self.reuse.finish_prefill(row)

    def keep(self, batch: DecodeBatch, mask: np.ndarray, sampler: GroupedRowsSampler, last_draw: int) -> list[Row]:
        """Only the rows where `mask` holds go on decoding; returns the others, which took part
        in draws up to `last_draw` (their slot is free once that one is read)."""
        if mask.all():
            return []
        keep = np.nonzero(mask)[0]
        sampler.keep(keep.tolist())
        dropped = batch.keep(keep)
        for row in dropped:
            row.last_draw = last_draw
        return dropped

    def decode_step(self, table: PageTable, caches: list, batch: DecodeBatch) -> mx.array:
        """Logits [B, V] of every decoding row's next position, in batch order."""
        crossing = self.find_longrope_crossings(batch)
        select_adapters(self.model, batch.adapters)
        if not crossing.any():
            return self.step_rows(table, caches, batch.slots, batch.next_input)
        # A row whose sequence passes longrope's switch now gets the long factors for every
        # position, so its whole sequence runs again in one piece (as the batch engine does).
        parts, order = [], []
        rest = np.nonzero(~crossing)[0]
        if len(rest):
            select_adapters(self.model, batch.adapters[rest])
            parts.append(
                self.step_rows(table, caches, batch.slots[rest], batch.next_input[mx.array(rest.astype(np.int32))])
            )
            order += rest.tolist()
        for i in np.nonzero(crossing)[0].tolist():
            row = batch.rows[i]
            select_adapters(self.model, batch.adapters[i : i + 1])
            generated = mx.array(row.result.token_ids[: batch.drawn[i] - 1], dtype=batch.next_input.dtype)
            generated = mx.concatenate([generated, batch.next_input[i : i + 1]])
            table.lengths[row.slot] = 0
            self.set_adapter_rows(
                table, np.array([row.slot]), prefill=False
            )  # decoding: added per row, as in the batch engine
            if row.embeddings is not None:  # an image row: its prompt's embeddings, kept for this
                embeddings = mx.concatenate([row.embeddings, self.model.embed_tokens(generated[None])], axis=1)
                table.begin(np.array([row.slot]), embeddings.shape[1])
                logits = self.model.forward_with_embeddings(embeddings, caches, logits_at=embeddings.shape[1] - 1)
                row.embeddings = None
            else:
                ids = mx.concatenate([mx.array(row.prompt, dtype=generated.dtype), generated])[None]
                table.begin(np.array([row.slot]), ids.shape[1])
                logits = self.model(ids, caches, logits_at=ids.shape[1] - 1)
            parts.append(logits[:, -1, :])
            table.end()
            order.append(i)
        logits = mx.concatenate(parts)
        return logits[mx.array(np.argsort(order).astype(np.int32))]

    def may_cross_longrope(self, row: Row) -> bool:
        """Whether the row's decode can pass longrope's switch (its prompt ends at or before it)."""
        limit = getattr(self.model, "longrope_limit", None)
        return limit is not None and len(row.prompt) <= limit < len(row.prompt) + row.limit - 1

    def find_longrope_crossings(self, batch: DecodeBatch) -> np.ndarray:
        """Which decoding rows pass longrope's switch with this step (their positions go from
        the limit to one past it)."""
        limit = getattr(self.model, "longrope_limit", None)
        if limit is None:
            return np.zeros(len(batch), dtype=bool)
        return batch.prompt_lengths + batch.drawn == limit + 1

    def set_adapter_rows(self, table: PageTable, slots: np.ndarray, prefill: bool) -> None:
        """Phi-4-multimodal's vision LoRA applies to its image rows only: which of this call's rows
        take it, and whether it may be merged into the weights (a prefill of adapted rows only,
        as the batch engine merges it; decode adds it per row)."""
        control = getattr(self.model, "lora_control", None)
        if control is None:
            return
        flags = table.adapted[slots]
        dtype = self.model.model.norm.weight.dtype
        control.rows = mx.array(flags.astype(np.float32), dtype=dtype).reshape(-1, 1, 1) if flags.any() else None
        control.fused = prefill and bool(flags.all())

    def step_rows(
        self, table: PageTable, caches: list, slots: np.ndarray, tokens: mx.array, offsets: np.ndarray | None = None
    ) -> mx.array:
        """Logits [B, V] of one decode step; `offsets`: rows that many positions past their slots'
        lengths (a slot may come several times: PageTable.begin), for verify_as_rows."""
        self.set_adapter_rows(table, slots, prefill=False)
        table.begin(slots, 1, decoding=True, offsets=offsets)
        if self.batch_invariant:  # rows meet in the step's matmuls: ROWS rows a call (models/invariant.py)
            with sliced_matmuls():
                logits = self.model(tokens[:, None], caches)[:, -1, :]
        elif len(slots) <= SEGMENTED_ROWS and self.segmented:
            # few rows: the host's per-op cost bounds a step, as in the batch engine; each batch
            # size is traced once, so only small batches (where the ragged tail lives) use it
            logits = get_decoder(self.model, "segmented")(tokens, caches)
        else:
            logits = self.model(tokens[:, None], caches)[:, -1, :]
        table.end()
        return logits

    def use_window_rings(self, request: GenerationRequest, in_place: bool) -> bool:
        """Whether sliding layers keep a ring of their window per row (models/paged_window.py) rather
        than every position in the shared pool: on the plain path (not where the CUDA kernels write
        the pool in place), not batch-invariant (a row must meet the kernels it meets alone), not for
        a model whose image tokens attend both ways (Gemma 3: its image blocks are masked in the
        shared pool's masks; a server's image rows arrive after the caches are made), and not with
        a prompt-cache folder (its files hold positions, not rings)."""
        if not self.window_rings or in_place or self.batch_invariant or hasattr(self.model, "image_blocks"):
            return False
        return any(w is not None and w < self.max_context for w in layer_windows(self.model))

    def tile_size(self, request: GenerationRequest) -> int | None:
        """The request's tile, where the model's pieces may be padded: a padding token would
        advance a recurrent layer's state, or overwrite a ring's positions that the row's next
        queries still see (sliding and chunked rings), so then pieces are never padded."""
        padded = getattr(self.model, "supports_padded_prefill", True) and not self.hybrid
        return request.tile_size if padded else None

    def plan_piece(self, row: Row, budget: int, request: GenerationRequest) -> tuple[int, int, int]:
        """(start, end, pad) of the row's next piece of at most `budget` tokens; end == start when
        the budget holds no whole tile. Pieces end at the history boundary (never padded there)
        and are padded to whole tiles where a tile is set; an image row is never padded."""
        total, start, tile = len(row.prompt), row.prefilled, self.tile_size(request)
        if row.request.images is not None or getattr(self.model, "longrope_limit", None) is not None:
            tile = None  # padding would need pad embeddings; it would count toward longrope's switch
        boundaries = [row.request.history_tokens]
        if self.hybrid and self.reuse is not None:
            # a prefix is adoptable only where its recurrent states were recorded: at a piece's
            # end, so a piece also ends where the row's shared prefix does (PrefixReuse)
            boundaries.append(self.reuse.snapshot_limit(row))
        boundary = min((b for b in boundaries if start < b < total), default=0)
        span_end = boundary or total
        size = min(span_end - start, budget)
        if self.batch_invariant:  # the row's own pieces: ending on multiples of INVARIANT_PIECE, never padded
            tile, size = None, min(total, (start // INVARIANT_PIECE + 1) * INVARIANT_PIECE) - start
        if row.request.images is not None and getattr(self.model, "prefill_in_one_piece", False):
            size = total - start  # an image block must not be cut between pieces: the whole prompt at once
        if tile and size < span_end - start:
            size = size // tile * tile
        if size <= 0:
            return start, start, 0
        end = start + size
        limit = getattr(self.model, "longrope_limit", None)
        if limit is not None and 0 < start <= limit < end:
            start = 0  # the piece passes longrope's switch: the prompt so far runs again with it, in one piece
        return start, end, (-(end - start)) % tile if tile and end != boundary else 0

    def group_pieces(
        self, prefilling: deque, piece: int, budget: int, request: GenerationRequest
    ) -> tuple[list[Row], tuple[int, int, int]]:
        """The first waiting row's next piece (at most `piece` tokens), and the rows after it whose
        next piece is the same span of their own prompt (text rows, all within the iteration's
        `budget`): one forward call prefills them all, as many rows at once cost less than one
        at a time (a uniform batch's prompts)."""
        head = prefilling[0]
        plan = self.plan_piece(head, min(piece, budget), request)
        start, end, pad = plan
        group = [head]
        if head.request.images is None and end > start and not self.batch_invariant:  # (invariant: a row a call)
            for row in list(prefilling)[1:]:
                if row.request.images is not None or (len(group) + 1) * (end - start + pad) > budget:
                    break
                if self.plan_piece(row, min(piece, budget), request) != plan or (len(row.prompt) == end) != (
                    len(head.prompt) == end
                ):
                    break
                group.append(row)
        return group, plan

    def group_ragged(
        self, prefilling: deque, piece: int, budget: int, request: GenerationRequest
    ) -> tuple[list[Row], list[tuple[int, int]], int] | None:
        """Where the paged kernels run: the first waiting rows' next pieces, whatever their
        lengths and starts, as one [rows, width] forward call (each row's tokens at the end of
        its line, after padding), or None where the head row's piece cannot be one (images, tiles,
        longrope, quantized pools). On a GPU a call of 128 tokens costs about what one of 512
        does, and 16 rows of 128 about what one row of 2048 does (docs/benchmarks.md), while a
        ragged job's rows each bring a piece of their own length: one call each would bound the
        job. Widths are powers of two, so the attention meets few shapes (cuDNN builds a graph
        for each)."""
        group = self.pick_pieces(prefilling, piece, budget, request)
        if group is None or (len(group[0]) == 1 and group[1][0][1] - group[1][0][0] == group[2]):
            return None  # nothing to pad: the piece runs as it is (prefill_piece)
        # A lone row's piece is padded too: cuDNN builds a graph for every new query length
        # (docs/benchmarks.md), and a ragged job's last pieces come in every length.
        return group

    def pick_pieces(
        self, prefilling: deque, piece: int, budget: int, request: GenerationRequest
    ) -> tuple[list[Row], list[tuple[int, int]], int] | None:
        """The first waiting rows' next pieces that one ragged call (or packed call's attention)
        takes: (rows, their spans, the line's width), or None where the head row's piece cannot
        be one (images, tiles, longrope, quantized pools, no whole piece within the budget)."""
        if request.kv_bits or self.tile_size(request) or getattr(self.model, "longrope_limit", None) is not None:
            return None
        rows, spans, width = [], [], 0
        for row in prefilling:
            if row.request.images is not None or min(piece, len(row.prompt) - row.prefilled) > budget:
                break  # (no piece cut short by the budget, as in run_rows)
            start, end, pad = self.plan_piece(row, min(piece, budget), request)
            if end == start or pad:
                break
            wider = max(width, 1 << (end - start - 1).bit_length(), MIN_RAGGED_WIDTH)
            if rows and (len(rows) + 1) * wider > budget:
                break
            rows.append(row)
            spans.append((start, end))
            width = wider
        return (rows, spans, width) if rows else None

    def step_packed(
        self,
        table: PageTable,
        caches: list,
        batch: DecodeBatch,
        rows: list[Row],
        spans: list[tuple[int, int]],
        width: int,
        request: GenerationRequest,
        state: ScheduleState,
    ) -> tuple[mx.array | None, list[Row]]:
        """The decode rows' step and the pieces `spans` of `rows` in one forward call (models/
        paged_packed.py): (logits of the decode rows, then of the rows whose prompts are done, or
        None if neither; those rows)."""
        began = time.perf_counter()
        # Where the CUDA kernels run, the line is padded to a multiple of PACKED_ALIGN and its pieces'
        # width is a power of two, so cuBLAS and cuDNN meet few shapes; on the plain path a padded
        # token costs what a real one does, and no shape costs a build.
        align = PACKED_ALIGN if table.decode_kernel else 1
        if not table.decode_kernel:
            width = max(end - start for start, end in spans)
        step = begin_packed(table, batch.slots, np.array([r.slot for r in rows]), spans, width, align)
        pieces = [t for r, (start, end) in zip(rows, spans) for t in r.prompt[start:end]]
        tokens = mx.array(pieces + [request.pad_token_id] * (step.length - step.tokens), dtype=mx.int32)
        if len(batch):
            tokens = mx.concatenate([batch.next_input.astype(mx.int32), tokens])
        done = [i for i, (r, (_, end)) in enumerate(zip(rows, spans)) if end == len(r.prompt)]
        wanted = len(batch) + len(done)
        logits_at = step.last_positions(done) if wanted else step.length - 1
        adapters = [batch.adapters] + [[r.request.adapter] * (end - start) for r, (start, end) in zip(rows, spans)]
        adapters.append([-1] * (step.length - step.tokens))
        select_adapters(self.model, np.concatenate(adapters)[None], logits_at)
        logits = self.model(tokens[None], caches, logits_at=logits_at)[0]
        table.end()
        self.count_call(state, ("packed", step.length, len(rows), width))
        self.finish_call(caches, rows, spans, [0] * len(rows), began, state)
        return (logits if wanted else None), [rows[i] for i in done]

    def count_call(self, state: ScheduleState, shape: tuple) -> None:
        """A forward call and its shape (what the device's plans and graphs are built for)."""
        state.forward_calls += 1
        state.call_shapes.add(shape)

    def prefill_ragged(
        self,
        table: PageTable,
        caches: list,
        rows: list[Row],
        spans: list[tuple[int, int]],
        width: int,
        request: GenerationRequest,
        state: ScheduleState,
    ):
        """The pieces `spans` of `rows` in one call of `width` tokens a row, each row's tokens
        last (after `width - size` padding tokens, which are neither cached nor attended to), so
        their last positions line up: (logits of the rows whose prompts are done, tokens spent,
        those rows)."""
        began = time.perf_counter()
        leads = np.array([width - (end - start) for start, end in spans], dtype=np.int32)
        chunk = mx.array(
            [[request.pad_token_id] * lead + r.prompt[start:end] for r, lead, (start, end) in zip(rows, leads, spans)]
        )
        slots = np.array([r.slot for r in rows])
        self.set_adapter_rows(table, slots, prefill=True)
        select_adapters(self.model, [r.request.adapter for r in rows])
        table.begin(slots, width, leads)
        logits = self.model(chunk, caches, logits_at=width - 1)[:, -1, :]
        table.end()
        self.count_call(state, ("ragged", len(rows), width))
        self.finish_call(caches, rows, spans, leads.tolist(), began, state)
        done = [i for i, (r, (_, end)) in enumerate(zip(rows, spans)) if end == len(r.prompt)]
        if not done:
            return None, width * len(rows), []
        picked = logits if len(done) == len(rows) else logits[mx.array(np.array(done, dtype=np.int32))]
        return picked, width * len(rows), [rows[i] for i in done]

    def prefill_piece(
        self,
        table: PageTable,
        caches: list,
        rows: list[Row],
        plan: tuple[int, int, int],
        request: GenerationRequest,
        state: ScheduleState,
    ):
        """One piece (`plan`: start, end, pad) of each of `rows` in one forward call: (logits of
        their last positions if their prompts are done else None, tokens spent)."""
        start, end, pad = plan
        if end == start:
            return None, 0
        row, size = rows[0], end - start
        for r in rows:
            table.lengths[r.slot] = start  # below what it holds only when longrope's switch recomputes the row
        if row.request.images is not None and row.embeddings is None:
            row.embeddings = self.embed_images(row, state)
            table.adapted[row.slot] = hasattr(self.model, "lora_control")  # the vision LoRA: image rows only
            if getattr(self.model, "prefill_extras_are_positions", False):
                row.extras, table.shifts[row.slot] = self.model.make_prefill_extras(row.prompt, row.request.images, 0)
        began = time.perf_counter()
        slots = np.array([r.slot for r in rows])
        self.set_adapter_rows(table, slots, prefill=True)
        select_adapters(self.model, [r.request.adapter for r in rows])
        table.begin(slots, size + pad)
        if row.request.images is not None and getattr(self.model, "prefill_in_one_piece", False):
            table.step.image_blocks = np.array(self.model.image_blocks(row.prompt)[start:end])
        is_last = end == len(row.prompt)
        if row.embeddings is not None:
            extras = {name: value[..., start:end] for name, value in (row.extras or {}).items()}
            logits = self.model.forward_with_embeddings(
                row.embeddings[:, start:end], caches, logits_at=size - 1 if is_last else None, **extras
            )
            # kept past the prompt only where longrope's switch may run the row's sequence again
            row.embeddings = None if is_last and not self.may_cross_longrope(row) else row.embeddings
        else:
            chunk = mx.array([r.prompt[start:end] + [request.pad_token_id] * pad for r in rows])
            logits = self.model(chunk, caches, logits_at=size - 1 if is_last else None)
        table.end(padding=pad)
        self.count_call(state, ("piece", len(rows), size + pad))
        self.finish_call(caches, rows, [(start, end)] * len(rows), [pad] * len(rows), began, state)
        return (logits[:, -1, :] if is_last else None), (size + pad) * len(rows)

    def finish_call(
        self,
        caches: list,
        rows: list[Row],
        spans: list[tuple[int, int]],
        pads: list[int],
        began: float,
        state: ScheduleState,
    ) -> None:
        """Queue a prefill call's work, and record each row's piece. Each call is submitted on its
        own: one submission an iteration (pieces with the draw) was a quarter slower on CUDA, as
        larger, ever-different graphs (docs/benchmarks.md)."""
        snapshots = [a for r, (_, end) in zip(rows, spans) for a in self.reuse.record(r, end)] if self.reuse else []
        submit([a for c in caches for a in c.state] + snapshots, state)
        ms = round((time.perf_counter() - began) * 1000, 3)
        for r, (start, end), pad in zip(rows, spans, pads):
            r.prefilled = end
            state.timings.prefill_pieces.append(
                {
                    "row": r.index,
                    "step": state.decode_steps,
                    "start": start,
                    "end": end,
                    "pad": int(pad),
                    "rows": len(rows),
                    "ms": ms,
                }
            )

    def embed_images(self, row: Row, state: ScheduleState) -> mx.array:
        """The row's input embeddings with its images' features at their placeholders."""
        began = time.perf_counter()
        embedded = self.model.embed_tokens(mx.array([row.prompt]))
        merged = merge_embeddings(
            embedded, row.prompt, self.model.image_token_id, self.model.encode_images(row.request.images)
        )
        mx.eval(merged)
        state.timings.vision_encode_ms += (time.perf_counter() - began) * 1000
        return merged

    def mask_worker(self):
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-masks")
        return self._mask_worker

    def read_tokens(self, pending: PendingDraw, state: ScheduleState) -> tuple[list[int], list | None]:
        """A queued draw's tokens and logprobs on the host (waiting for the device counts as waiting)."""
        waited = time.perf_counter()
        host = pending.draw.to_host()
        state.wait_seconds += time.perf_counter() - waited
        return host

    def read_draw(
        self,
        pending: PendingDraw,
        request: GenerationRequest,
        state: ScheduleState,
        on_token: OnToken,
        on_row_done,
        host: tuple | None = None,
        problems: dict[int, str | None] | None = None,
    ) -> list[Row]:
        """Apply one step's tokens (the per-row work that overlaps the next step); returns the
        rows that finished. `host`: the tokens, already read; `problems`: the rows' matchers,
        already advanced by them (advance_matchers)."""
        ended = []
        tokens, logprobs = host if host is not None else self.read_tokens(pending, state)
        now = time.perf_counter()
        if state.timings.first_token is None:
            state.timings.first_token = now
        stop_ids = request.stop_token_ids
        for i, row in enumerate(pending.rows):
            result = row.result
            if result.finish_reason is not None:
                continue  # a step queued before the row was known to have finished
            token = tokens[i]
            if row.first_token_at is None:
                row.first_token_at = now
            if row.index in self.cancelling:
                self.cancelling.discard(row.index)
                result.finish_reason = "cancelled"
            elif (
                row.matcher is not None
                and token not in stop_ids
                and (problem := consume_token(row.matcher, token) if problems is None else problems.get(row.index))
            ):
                result.finish_reason, result.error = "error", problem
            elif row.matcher is not None and token in row.request.constraint.end_ids:
                result.finish_reason = "stop"  # the grammar's end (a job with decode.ignore_eos stops here too)
            else:
                token_logprobs = logprobs[i] if logprobs is not None else None
                apply_token(result, row.index, token, token_logprobs, stop_ids, row.limit, on_token)
            if result.finish_reason is not None and row.matcher is not None:  # (the text: judge_returned_text)
                result.constraint_satisfied = is_satisfied(row.matcher)
            if result.finish_reason is not None:
                self.live.pop(row.index, None)
                row.finished_at = now
                result.timing = measure_row(row, state.timings.start)
                ended.append(row)
                if on_row_done is not None:
                    on_row_done(row.index, result)
        state.timings.end = now
        return ended


def advance_matchers(
    pending: PendingDraw,
    tokens: list[int],
    rows: list[Row],
    request: GenerationRequest,
    cancelling: set[int],
    fill=None,
) -> tuple[dict[int, str | None], mx.array, float]:
    """Structured output's host work for one step (on the mask thread, or the scheduler's in the
    after order): advance each live row's matcher by its token of `pending` (as read_draw would),
    then compute the next draw's masks over `rows` with `fill` (the loop's MaskBuffer's), or as a
    new device array. Returns (each advanced row's problem or None, by index; the masks; seconds)."""
    began = time.perf_counter()
    problems = {}
    for row, token in zip(pending.rows, tokens):
        live = row.result.finish_reason is None and row.index not in cancelling
        if live and row.matcher is not None and token not in request.stop_token_ids:
            problems[row.index] = consume_token(row.matcher, token)
    # (rows that end at this read have masks too: their next draw is not read)
    live = [row.result.finish_reason is None and not problems.get(row.index) for row in rows]
    matchers = [row.matcher if alive else None for row, alive in zip(rows, live)]
    # (the thread order's new device array is made here too: made on the scheduler's thread it cost
    # ~0.3 ms of its host time a step at batch 32 on the H200, ratio 0.84 -> 0.89)
    masks = fill(matchers) if fill is not None else mx.array(request.constraints.fill_masks(matchers))
    return problems, masks, time.perf_counter() - began


def release_slot(table: PageTable, caches: list, slot: int) -> None:
    """A row's blocks go back to the pool, and its recurrent states (if any) are dropped."""
    table.release(slot)
    for cache in caches:
        if hasattr(cache, "forget"):
            cache.forget(slot)


def pieces_per_iteration(decoding: bool) -> int:
    """Prefill pieces an iteration takes, while rows decode or when none does (on a GPU a call costs
    a few ms however few its tokens; on a CPU, its tokens)."""
    if mx.default_device() == mx.gpu:
        return PIECES_PER_STEP if decoding else IDLE_PIECES_PER_STEP
    return CPU_PIECES_PER_STEP if decoding else CPU_IDLE_PIECES_PER_STEP


def first_half(caches: list) -> list[mx.array]:
    """What evaluating the queued forward pass's first half means: the middle layer's cache, written
    by every layer before it (each family's layers write their caches in order)."""
    return caches[len(caches) // 2].state


def submit(arrays: list, state: ScheduleState) -> None:
    """Queue work on the device. MLX blocks here while too much is in flight (the CPU backend
    caps its queued tasks), so this counts as waiting, not host work."""
    began = time.perf_counter()
    mx.async_eval(arrays)
    state.wait_seconds += time.perf_counter() - began


def measure_row(row: Row, start: float) -> dict:
    """Milliseconds from the request's start: until admission (queue), to the first token on the
    host (TTFT) and to the last (latency); decode tok/s after the first token."""
    first, end = row.first_token_at or row.finished_at, row.finished_at
    after_first = len(row.result.token_ids) - 1
    return {
        "queue_ms": round((row.admitted_at - start) * 1000, 3),
        "ttft_ms": round((first - start) * 1000, 3),
        "latency_ms": round((end - start) * 1000, 3),
        "decode_tok_per_sec": round(after_first / (end - first), 3) if after_first > 0 and end > first else None,
    }


class DecodeBatch:
    """The decoding rows in the sampler's order, with per-row arrays so a step is built
    without a Python loop over rows."""

    def __init__(self):
        self.rows: list[Row] = []
        self.slots = np.zeros(0, dtype=np.int32)
        self.indices = np.zeros(0, dtype=np.int64)
        self.drawn = np.zeros(0, dtype=np.int64)
        self.limits = np.zeros(0, dtype=np.int64)
        self.prompt_lengths = np.zeros(0, dtype=np.int64)
        self.adapters = np.zeros(0, dtype=np.int32)  # each row's adapter (RowRequest.adapter; -1: none)
        self.next_input: mx.array | None = None  # the last draw's tokens, aligned with rows

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[Row]) -> None:
        if rows:
            self.rows = self.rows + rows
            self.slots = np.append(self.slots, [r.slot for r in rows]).astype(np.int32)
            self.indices = np.append(self.indices, [r.index for r in rows])
            self.drawn = np.append(self.drawn, [0] * len(rows))
            self.limits = np.append(self.limits, [r.limit for r in rows])
            self.prompt_lengths = np.append(self.prompt_lengths, [len(r.prompt) for r in rows])
            self.adapters = np.append(self.adapters, [r.request.adapter for r in rows]).astype(np.int32)

    def keep(self, keep: np.ndarray) -> list[Row]:
        """Keep the rows at these positions; returns the rows dropped."""
        kept = set(keep.tolist())
        dropped = [row for i, row in enumerate(self.rows) if i not in kept]
        self.rows = [self.rows[i] for i in keep]
        self.slots, self.indices = self.slots[keep], self.indices[keep]
        self.drawn, self.limits, self.prompt_lengths = self.drawn[keep], self.limits[keep], self.prompt_lengths[keep]
        self.adapters = self.adapters[keep]
        self.next_input = self.next_input[mx.array(keep.astype(np.int32))] if len(keep) else None
        return dropped
