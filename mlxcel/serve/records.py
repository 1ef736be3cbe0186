"""The server's run folder: config.resolved.json (never the API keys), a row per request in
generations.jsonl (its text and prompt only with serve.log_text=true), and stats.json, rewritten
every 5 s (requests in flight or not) and at shutdown: requests by status, rows in flight, tokens,
throughput, TTFT percentiles."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

from mlxcel.openai_protocol import count_usage
from mlxcel.outputs import RunOutputs
from mlxcel.stats import percentiles

STATS_EVERY_SECONDS = 5.0
TTFT_WINDOW = 10_000  # the latest requests' TTFTs kept for the percentiles


class ServeRecords:
    def __init__(self, outputs: RunOutputs, report: dict, log_text: bool, fingerprint: str):
        self.outputs, self.report, self.log_text = outputs, report, log_text
        self.fingerprint = fingerprint
        self.started = time.perf_counter()
        self.statuses: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.tokens = Counter()
        self.ttfts: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.written_at = 0.0
        self.engine = None  # ServeEngine: its step counters go into stats.json

    def add_refusal(self, endpoint: str, error, started: float | None) -> None:
        self.statuses[str(error.status)] += 1
        row = {"endpoint": endpoint, "status": error.status, "error": error.message}
        if started is not None:
            row["latency_ms"] = round((time.perf_counter() - started) * 1000, 3)
        self.outputs.append_generation(row)
        self.maybe_write_stats()

    def add_answer(self, job, done: dict[int, dict], started: float, first: float | None, outcome: str) -> None:
        end = time.perf_counter()
        status = "200" if outcome == "ok" else "disconnected"
        self.statuses[status] += 1
        usage = count_usage(done, job.n)
        prompt_tokens, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.tokens.update(prompt=prompt_tokens, completion=completion, cached=cached)
        reasons = [done[i]["finish_reason"] for i in sorted(done)]
        self.finish_reasons.update(reasons)
        row = {
            "id": job.id,
            "endpoint": job.endpoint,
            "status": 200 if outcome == "ok" else "disconnected",
            "stream": job.streaming,
            "n": job.n,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "finish_reasons": reasons,
            "ttft_ms": round((first - started) * 1000, 3) if first is not None else None,
            "latency_ms": round((end - started) * 1000, 3),
        }
        satisfied = [done[i].get("constraint_satisfied") for i in sorted(done)]
        if any(s is not None for s in satisfied):  # structured output: whether each answer is whole
            row["constraint_satisfied"] = satisfied
        if first is not None:
            self.ttfts.append(row["ttft_ms"])
        if self.log_text:
            row["prompts"] = job.prompts
            row["texts"] = [done[i]["text"] for i in sorted(done)]
        self.outputs.append_generation(row)
        self.maybe_write_stats()

    async def keep_fresh(self) -> None:
        """stats.json rewritten every STATS_EVERY_SECONDS while the server runs, not only when a
        request ends: a request of minutes shows its rows in flight and decode steps as it goes."""
        while True:
            await asyncio.sleep(max(0.0, self.written_at + STATS_EVERY_SECONDS - time.perf_counter()))
            self.maybe_write_stats()

    def maybe_write_stats(self) -> None:
        if time.perf_counter() - self.written_at >= STATS_EVERY_SECONDS:
            self.write_stats()

    def write_stats(self, status: str = "running") -> None:
        from mlxcel.runner import order_report

        self.written_at = time.perf_counter()
        uptime = self.written_at - self.started
        ttfts = list(self.ttfts)
        totals = self.engine.totals if self.engine is not None else {}
        steps = totals.get("decode_steps", 0)
        self.report.update(
            {
                "status": status,
                "uptime_s": round(uptime, 3),
                "requests": dict(self.statuses),
                "finish_reasons": dict(self.finish_reasons),
                "prompt_tokens": self.tokens["prompt"],
                "cached_tokens": self.tokens["cached"],
                "generated_tokens": self.tokens["completion"],
                "generated_tok_per_sec_over_uptime": round(self.tokens["completion"] / uptime, 3) if uptime else None,
                "ttft_ms": {**percentiles(ttfts), "count": len(ttfts)},  # (as mlxcel-run's row_ttft_ms)
                "rows_in_flight": self.engine.accepted_rows if self.engine is not None else 0,
                "decode_steps": steps,
                "occupancy": round(totals.get("rows_decoding_sum", 0) / steps, 3) if steps else None,
            }
        )
        self.outputs.write_stats(order_report(self.report))
