"""GenerationStats: what every run reports (SPEC.md section 6), plus timing detail.

Definitions: token counts are sums over rows (a stop id is not counted); prefill time runs
from the first prefill piece until the first token is on the host; decode throughput is
generated tokens after each row's first over the time after the first token (mlx-lm's
`generation_tps`).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass, field

import mlx.core as mx

import mlxcel
from mlxcel.engine import BatchState


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
    prefill_pieces: list[dict] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def make_generation_stats(state: BatchState, prepare_start: float) -> GenerationStats:
    timings, results = state.timings, state.results
    first, end = timings.first_token or timings.start, timings.end or timings.start
    prompt_tokens = sum(r.prompt_tokens for r in results)
    generated = sum(len(r.token_ids) for r in results)
    after_first = sum(max(0, len(r.token_ids) - 1) for r in results)
    prefill_s, decode_s = first - timings.start, end - first
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return GenerationStats(
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        prefill_time_ms=round(prefill_s * 1000, 3),
        decode_time_ms=round(decode_s * 1000, 3),
        prefill_tok_per_sec=round(prompt_tokens / prefill_s, 3) if prefill_s > 0 else 0.0,
        decode_tok_per_sec=round(after_first / decode_s, 3) if decode_s > 0 and after_first else 0.0,
        ttft_ms=round((first - prepare_start) * 1000, 3),
        peak_memory_gb=round(mx.get_peak_memory() / 1e9, 4),
        prefill_pieces=list(timings.prefill_pieces),
        finish_reasons=reasons,
    )


def read_environment() -> dict:
    device = mx.default_device()
    env = {
        "mlxcel": mlxcel.__version__,
        "mlx": mx.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": str(device),
    }
    if device == mx.gpu:
        try:
            env["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
        except Exception:  # device_info is backend-specific; its absence is not an error
            pass
    return env
