"""GenerationStats: what every run reports (docs/design.md), plus timing detail.

Definitions: token counts are sums over rows (a stop id is not counted); prefill time runs
from the first prefill piece until the first token is on the host; decode throughput is
generated tokens after each row's first over the time after the first token (mlx-lm's
`generation_tps`). A job of several batches sums tokens and times over its batches; its
`ttft_ms` is the first batch's, from the start of prompt preparation.
"""

from __future__ import annotations

import os
import platform
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np

import mlxcel
from mlxcel.blas import describe_blas
from mlxcel.engine import BatchState
from mlxcel.engine.scheduler import ScheduleState


@dataclass
class BatchStats:
    rows: int
    prompt_tokens: int
    generated_tokens: int
    tokens_after_first: int
    prefill_time_ms: float
    decode_time_ms: float
    prefill_pieces: list[dict]
    first_token_at: float  # perf_counter when the first token reached the host
    visual_tokens: int = 0  # prompt tokens that are image features (counted in prompt_tokens too)
    image_preprocess_ms: float = 0.0  # loading and preprocessing this batch's images (before the engine)
    vision_encode_ms: float = 0.0  # towers + projectors + merge, inside prefill_time_ms
    decode_steps: int = 0
    rows_decoding_sum: int = 0  # rows in each decode step, summed
    kv_budget_bytes: int = 0  # the scheduler's KV cap (0: the batch engine, which has none)
    kv_peak_bytes: int = 0
    state_bytes: int = 0  # rows' fixed-size state, every slot's: recurrent layers' states, sliding layers' rings
    iterations: int = 0  # the scheduler's loop iterations
    forward_calls: int = 0  # the model's forward calls (one an iteration where decode and prefill pack)
    call_shapes: int = 0  # their distinct shapes (each may cost the device a plan or graph build)
    host_ms: float = 0.0  # host work over them (not waiting on the device)
    row_ttft_ms: list[float] = field(default_factory=list)  # the scheduler's rows, from its start
    row_latency_ms: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens adopted from the prompt cache
    rows_adopted: int = 0  # rows that adopted a prefix
    prompt_cache: dict | None = None  # the cache after this batch (PrefixReuse.summary); None: off
    constraint_kinds: dict[str, int] = field(default_factory=dict)  # structured output: rows by kind
    constraints_satisfied: int = 0  # of those, rows whose answer is a whole match
    mask_ms: float = 0.0  # computing their token masks (overlaps the forward pass)
    draft: dict | None = None  # speculative decoding (measure_drafts); None: decode.draft is off


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_time_ms: float = 0.0
    decode_time_ms: float = 0.0
    prefill_tok_per_sec: float = 0.0
    decode_tok_per_sec: float = 0.0
    ttft_ms: float = 0.0  # from the start of prompt preparation to the first token on the host
    peak_memory_gb: float = 0.0
    visual_tokens: int = 0  # image-feature tokens among prompt_tokens (VLMs)
    image_preprocess_ms: float = 0.0  # loading + preprocessing images (part of ttft, not of prefill)
    vision_encode_ms: float = 0.0  # vision towers + projectors (part of prefill_time_ms)
    rows: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    occupancy: float = 0.0  # mean rows decoding per decode step (the scheduler's; 0 for the batch engine)
    max_rows: int = 0  # rows decoding at once the engine was given (runner.max_rows; auto resolved)
    max_rows_auto: bool = False  # runner.max_rows=auto chose it (8 on the CPU, what the KV budget holds on a GPU)
    row_ttft_ms: dict[str, float] = field(default_factory=dict)  # p50, p95 over the scheduler's rows
    row_latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p95: start to a row's last token
    kv_budget_gb: float = 0.0  # the scheduler's KV cache cap (runner.kv_budget_gb or the default share)
    kv_peak_gb: float = 0.0  # most KV cache the scheduler held at once
    row_state_gb: float = 0.0  # every row slot's recurrent states and sliding rings (in the KV budget; 0: none)
    # the scheduler's host work per iteration: below the device's step time, the device bounds the job
    host_ms_per_step: float = 0.0
    # the scheduler's forward calls and their distinct shapes (0 for the batch engine)
    forward_calls: int = 0
    call_shapes: int = 0
    # rows that adopted a prefix, prompt tokens adopted and computed, and the cache's entries; empty
    # with runner.prompt_cache=false. (Time saved is measured by python -m mlxcel.bench.prefix, cache off
    # vs on: in continuous batching no row's prefill time can be subtracted from the job's.)
    prompt_cache: dict = field(default_factory=dict)
    # structured output: constrained rows, how many ended with a whole match, their kinds and the
    # host time spent on masks; empty when no row has a constraint
    constraints: dict = field(default_factory=dict)
    # speculative decoding (decode.draft): drafted and accepted tokens, the acceptance rate and the
    # tokens a drafting row gained a verify step; {"off": why} where it could not run; empty when off
    draft: dict = field(default_factory=dict)
    batches: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_batch(state: BatchState | ScheduleState) -> BatchStats:
    timings, results = state.timings, state.results
    images = [r for r in state.request.rows if r.images is not None]
    first, end = timings.first_token or timings.start, timings.end or timings.start
    return BatchStats(
        rows=len(results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        generated_tokens=sum(len(r.token_ids) for r in results),
        tokens_after_first=sum(max(0, len(r.token_ids) - 1) for r in results),
        prefill_time_ms=(first - timings.start) * 1000,
        decode_time_ms=(end - first) * 1000,
        prefill_pieces=list(timings.prefill_pieces),
        first_token_at=first,
        visual_tokens=sum(sum(r.images.token_counts) for r in images),
        image_preprocess_ms=sum(r.images.preprocess_ms for r in images),
        vision_encode_ms=timings.vision_encode_ms,
        decode_steps=getattr(state, "decode_steps", 0),
        rows_decoding_sum=getattr(state, "rows_decoding_sum", 0),
        kv_budget_bytes=getattr(state, "kv_budget_bytes", 0),
        kv_peak_bytes=getattr(state, "kv_peak_bytes", 0),
        state_bytes=getattr(state, "state_bytes", 0),
        iterations=getattr(state, "iterations", 0),
        forward_calls=getattr(state, "forward_calls", 0),
        call_shapes=len(getattr(state, "call_shapes", ())),
        host_ms=1000 * getattr(state, "host_seconds", 0.0),
        row_ttft_ms=[r.timing["ttft_ms"] for r in results if r.timing],
        row_latency_ms=[r.timing["latency_ms"] for r in results if r.timing],
        cached_tokens=sum(r.cached_tokens for r in results),
        rows_adopted=sum(1 for r in results if r.cached_tokens),
        prompt_cache=getattr(state, "prompt_cache", None),
        constraint_kinds=dict(Counter(r.constraint.kind for r in state.request.rows if r.constraint is not None)),
        constraints_satisfied=sum(1 for r in results if r.constraint_satisfied),
        mask_ms=1000 * getattr(state, "mask_seconds", 0.0),
        draft=measure_drafts(state),
    )


def measure_drafts(state: BatchState | ScheduleState) -> dict | None:
    """A batch's speculative decoding: its drafting rows' sums, or why it was off."""
    if getattr(state.request, "draft", None) is None:
        return None
    if not isinstance(state, ScheduleState):
        return {"off": "the batch engine runs this request (drafts are verified in the scheduler only)"}
    if state.draft_off is not None:
        return {"off": state.draft_off}
    rows = [r.draft for r in state.results if r.draft is not None]
    sums = {key: sum(row[key] for row in rows) for key in ("drafted", "accepted", "steps")}
    return {"rows": len(rows), **sums, "verify_steps": state.verify_steps}


def summarize_drafts(batches: list[BatchStats]) -> dict:
    drafts = [b.draft for b in batches if b.draft is not None]
    if not drafts:
        return {}
    off = next((d["off"] for d in drafts if "off" in d), None)
    if off is not None:
        return {"off": off}
    sums = {key: sum(d[key] for d in drafts) for key in ("rows", "drafted", "accepted", "steps", "verify_steps")}
    drafted, accepted, steps = sums["drafted"], sums["accepted"], sums["steps"]
    return {
        **sums,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        # a drafting row's tokens a verify step: the accepted drafts and the target's own token
        "tokens_per_step": round((accepted + steps) / steps, 3) if steps else 0.0,
    }


def summarize_constraints(batches: list[BatchStats]) -> dict:
    kinds = sum((Counter(b.constraint_kinds) for b in batches), Counter())
    if not kinds:
        return {}
    return {
        "rows": kinds.total(),
        "satisfied": sum(b.constraints_satisfied for b in batches),
        "kinds": dict(kinds),
        "mask_ms": round(sum(b.mask_ms for b in batches), 3),
    }


def make_generation_stats(
    batches: list[BatchStats],
    prepare_start: float,
    finish_reasons: dict[str, int],
    side_by_side: bool = False,
    peak_memory_gb: float | None = None,
    max_rows: int = 0,
    max_rows_auto: bool = False,
) -> GenerationStats:
    """The job's figures from its batches: run one after another (a local job), or `side_by_side`
    (Ray workers), whose times overlap, so the job's are the longest batch's, not their sum.
    `peak_memory_gb`: where the memory was not this process's (the workers' largest peak).
    `max_rows`, `max_rows_auto`: as Pipeline.describe_max_rows says."""
    combine = max if side_by_side else sum
    prefill_ms = combine([b.prefill_time_ms for b in batches] or [0.0])
    decode_ms = combine([b.decode_time_ms for b in batches] or [0.0])
    prompt_tokens = sum(b.prompt_tokens for b in batches)
    after_first = sum(b.tokens_after_first for b in batches)
    return GenerationStats(
        prompt_tokens=prompt_tokens,
        generated_tokens=sum(b.generated_tokens for b in batches),
        prefill_time_ms=round(prefill_ms, 3),
        decode_time_ms=round(decode_ms, 3),
        prefill_tok_per_sec=round(prompt_tokens / prefill_ms * 1000, 3) if prefill_ms > 0 else 0.0,
        decode_tok_per_sec=round(after_first / decode_ms * 1000, 3) if decode_ms > 0 and after_first else 0.0,
        ttft_ms=round((min(b.first_token_at for b in batches) - prepare_start) * 1000, 3) if batches else 0.0,
        peak_memory_gb=round(mx.get_peak_memory() / 1e9 if peak_memory_gb is None else peak_memory_gb, 4),
        visual_tokens=sum(b.visual_tokens for b in batches),
        image_preprocess_ms=round(sum(b.image_preprocess_ms for b in batches), 3),
        vision_encode_ms=round(sum(b.vision_encode_ms for b in batches), 3),
        rows=sum(finish_reasons.values()),
        finish_reasons=dict(finish_reasons),
        occupancy=round(sum(b.rows_decoding_sum for b in batches) / max(1, sum(b.decode_steps for b in batches)), 3),
        max_rows=max_rows,
        max_rows_auto=max_rows_auto,
        row_ttft_ms=percentiles([t for b in batches for t in b.row_ttft_ms]),
        row_latency_ms=percentiles([t for b in batches for t in b.row_latency_ms]),
        kv_budget_gb=round(max((b.kv_budget_bytes for b in batches), default=0) / 1e9, 4),
        kv_peak_gb=round(max((b.kv_peak_bytes for b in batches), default=0) / 1e9, 4),
        row_state_gb=round(max((b.state_bytes for b in batches), default=0) / 1e9, 4),
        host_ms_per_step=round(sum(b.host_ms for b in batches) / max(1, sum(b.iterations for b in batches)), 3),
        forward_calls=sum(b.forward_calls for b in batches),
        call_shapes=sum(b.call_shapes for b in batches),
        prompt_cache=summarize_prompt_cache(batches),
        constraints=summarize_constraints(batches),
        draft=summarize_drafts(batches),
        batches=[
            {
                "rows": b.rows,
                "prompt_tokens": b.prompt_tokens,
                "generated_tokens": b.generated_tokens,
                "prefill_time_ms": round(b.prefill_time_ms, 3),
                "decode_time_ms": round(b.decode_time_ms, 3),
                "prefill_pieces": b.prefill_pieces,
            }
            for b in batches
        ],
    )


def summarize_prompt_cache(batches: list[BatchStats]) -> dict:
    caches = [b.prompt_cache for b in batches if b.prompt_cache is not None]
    if not caches:
        return {}
    adopted = sum(b.cached_tokens for b in batches)
    computed = sum(b.prompt_tokens for b in batches) - adopted
    last = caches[-1]
    if "off" in last:  # the scheduler turned it off for this model (why, in one line)
        return {"off": last["off"]}
    return {
        "rows_adopted": sum(b.rows_adopted for b in batches),
        "adopted_tokens": adopted,
        "computed_prompt_tokens": computed,
        "adopted_share": round(adopted / (adopted + computed), 4) if adopted + computed else 0.0,
        "entries": last["entries"],
        "cached_tokens": last["cached_tokens"],
        "cache_gb": round(last["bytes"] / 1e9, 4),
        "budget_gb": round(last["budget_bytes"] / 1e9, 4),
        "evicted_tokens": last["evicted_tokens"],
    }


SESSION_FIELDS = ("status", "rows", "prompt_tokens", "generated_tokens", "prefill_time_ms", "decode_time_ms")


def summarize_session(stats: dict) -> dict:
    """One run's (or resume's) own share of a job, as a resumed job's stats.json lists it."""
    return {key: stats[key] for key in SESSION_FIELDS if key in stats}


def describe_whole_job(report: dict, earlier_sessions: list[dict], rows: list[dict]) -> None:
    """A resumed job's stats describe the whole job: rows, finish reasons and tokens over every
    row in generations.jsonl, times summed over the sessions (each listed under `sessions`);
    the rest (TTFT, occupancy, memory...) stays this session's."""
    sessions = [*earlier_sessions, summarize_session(report)]
    reasons: dict[str, int] = {}
    for row in rows:
        reasons[row["finish_reason"]] = reasons.get(row["finish_reason"], 0) + 1
    prompt_tokens = sum(row.get("prompt_tokens") or 0 for row in rows)
    generated = sum(len(row.get("token_ids") or []) for row in rows)
    after_first = sum(max(0, len(row.get("token_ids") or []) - 1) for row in rows)
    prefill_ms = sum(s.get("prefill_time_ms") or 0 for s in sessions)
    decode_ms = sum(s.get("decode_time_ms") or 0 for s in sessions)
    report.update(
        rows=len(rows),
        finish_reasons=reasons,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        prefill_time_ms=round(prefill_ms, 3),
        decode_time_ms=round(decode_ms, 3),
        prefill_tok_per_sec=round(prompt_tokens / prefill_ms * 1000, 3) if prefill_ms > 0 else 0.0,
        decode_tok_per_sec=round(after_first / decode_ms * 1000, 3) if decode_ms > 0 and after_first else 0.0,
        sessions=sessions,
    )


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p95 (linear interpolation, numpy's default); empty without values."""
    if not values:
        return {}
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": round(float(p50), 3), "p95": round(float(p95), 3)}


def format_stats_table(stats: GenerationStats) -> str:
    """The short table a run ends with."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.finish_reasons.items()))
    lines = [
        f"{'':9}{'tokens':>8}{'time':>12}{'tok/s':>10}",
        f"{'prefill':9}{stats.prompt_tokens:>8}{stats.prefill_time_ms:>9.0f} ms{stats.prefill_tok_per_sec:>10.1f}",
        f"{'decode':9}{stats.generated_tokens:>8}{stats.decode_time_ms:>9.0f} ms{stats.decode_tok_per_sec:>10.1f}",
    ]
    if stats.visual_tokens:
        lines.append(
            f"images: {stats.visual_tokens} of the prompt tokens | preprocess {stats.image_preprocess_ms:.0f} ms"
            f" | encode {stats.vision_encode_ms:.0f} ms (in prefill)"
        )
    cache = stats.prompt_cache
    if cache.get("rows_adopted"):
        lines.append(
            f"prompt cache: {cache['rows_adopted']} row{'s' if cache['rows_adopted'] != 1 else ''} adopted "
            f"{cache['adopted_tokens']} of the prompt tokens"
            f" ({cache['adopted_share']:.0%}), not prefilled again"
        )
    draft = stats.draft
    if draft.get("off"):
        lines.append(f"draft: off ({draft['off']})")
    elif draft.get("steps"):
        lines.append(
            f"draft: {draft['accepted']} of {draft['drafted']} drafted tokens accepted"
            f" ({draft['acceptance_rate']:.0%}), {draft['tokens_per_step']:.2f} tokens a verify step"
        )
    occupancy = f" | occupancy {stats.occupancy:.1f}" if stats.occupancy else ""
    lines.append(
        f"ttft {stats.ttft_ms:.0f} ms | peak {stats.peak_memory_gb:.2f} GB | rows {stats.rows} ({reasons}){occupancy}"
    )
    return "\n".join(lines)


def read_environment() -> dict:
    device = mx.default_device()
    env = {
        "mlxcel": mlxcel.__version__,
        "mlx": mx.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": str(device),
        "blas": describe_blas(),
    }
    if device == mx.gpu:
        env["mlx_max_ops_per_buffer"] = os.environ.get("MLX_MAX_OPS_PER_BUFFER")
        try:
            env["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
        except Exception:  # device_info is backend-specific; its absence is not an error
            pass
    return env


def describe_reproducibility(runner) -> dict:
    """What a rerun of this job can be expected to repeat (docs/jobs.md, "Reproducible"), from its
    runner config: the mode, and where the model runs (a Ray job's workers, not this process)."""
    ray = runner.backend == "ray"
    on_gpu = runner.ray.gpus_per_worker > 0 if ray else mx.default_device() == mx.gpu
    batch_invariant = runner.batch_invariant
    if batch_invariant:
        holds = "each row's token ids equal the row run alone, whatever shares its batch or the chunk size"
    elif on_gpu and ray:
        holds = (
            "which rows share a worker's batch depends on timing, and on a GPU a row's tokens can change with "
            "what shares its batch: reruns can differ (runner.batch_invariant=true keeps them)"
        )
    elif on_gpu:
        holds = (
            "the same job and config on this machine gives the same token ids; a row's tokens can change "
            "with what shares its batch (runner.batch_invariant=true keeps them)"
        )
    else:
        holds = "each row's token ids equal the row run alone (MLX's CPU kernels keep one order whatever the rows)"
    return {"batch_invariant": batch_invariant, "gpu": on_gpu, "holds": holds}
