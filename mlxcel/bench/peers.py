"""One generation by each engine, timed the same way on the same clock.

Both sides get token ids (no tokenizer, no detokenizer, no stop ids) and decode greedily for
exactly `gen` tokens per row. mlxcel runs as the runner runs it: the scheduler where it covers the
model, else the batch engine. The marks are the host clock when the first token of every row is
on the host (TTFT) and when the last one is; definitions follow mlxcel.stats:
prefill tok/s = prompt tokens / TTFT, decode tok/s = tokens after each row's first / (end - first).

mlx-lm is driven at its model level, as its own CLI drives it: `generate_step` (what
`stream_generate` wraps, minus the detokenizer) under its `wired_limit` at batch 1, and
`BatchGenerator` (what `batch_generate` wraps) above it. We time mlx-lm ourselves rather than
take its `generation_tps`, which divides all N tokens by the time after the first (N-1 steps).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, kv_bytes_per_position, supports_scheduling
from mlxcel.sampling import Sampler

ENGINES = ("mlxcel", "mlx-lm")


@dataclass
class Run:
    prompt_tokens: int  # summed over rows
    tokens_after_first: int  # summed over rows
    ttft_s: float
    decode_s: float
    peak_bytes: int  # the engine's weights + what the run allocated on top
    token_ids: list[list[int]]
    drafts: list[dict] | None = None  # mlxcel with decode.draft: each drafting row's {drafted, accepted, steps}
    loop: dict | None = None  # mlxcel: the scheduler's decode steps, host seconds and seconds waiting on the device

    def metrics(self) -> dict[str, float]:
        return {
            "prefill_tok_s": self.prompt_tokens / self.ttft_s,
            "decode_tok_s": self.tokens_after_first / self.decode_s if self.decode_s > 0 else float("nan"),
            "ttft_ms": self.ttft_s * 1000,
            "peak_gb": self.peak_bytes / 1e9,
        }


@dataclass
class Peer:
    name: str
    model: object
    weight_bytes: int

    def generate(self, prompts: list[list[int]], gen: int) -> Run:
        """One timed generation; peak memory counts only this engine's weights and run."""
        synchronize_streams()
        base = mx.get_active_memory()  # both engines' weights are resident; count only ours
        mx.reset_peak_memory()
        run = GENERATORS[self.name](self.model, prompts, gen)
        synchronize_streams()  # both engines queue one step ahead: that work must not overlap the next run
        run.peak_bytes = mx.get_peak_memory() - base + self.weight_bytes
        return run


def synchronize_streams() -> None:
    """Wait for the default stream and mlx-lm's own generation stream (mx.synchronize() alone
    waits only for the default one; on the CPU each stream has its own thread)."""
    mx.synchronize()
    mlx_lm_generate = sys.modules.get("mlx_lm.generate")
    if mlx_lm_generate is not None:
        mx.synchronize(mlx_lm_generate.generation_stream)


def count_weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load_peer(name: str, folder, dtype: mx.Dtype) -> Peer:
    if name == "mlxcel":
        model = load_model(str(folder), dtype=str(dtype).replace("mlx.core.", "")).model
    else:
        from mlx_lm.utils import load_model as load_mlx_lm_model

        model, _ = load_mlx_lm_model(folder)
        cast_mlx_lm_model(model, dtype)
        mx.eval(model.parameters())
    return Peer(name, model, count_weight_bytes(model))


def check_peer_dtype(config: dict, dtype: mx.Dtype) -> None:
    """mlx-lm's expert layers (SwitchGLU: gather_mm) run only in float32 on MLX's CPU backend: one
    line before the run instead of its RuntimeError in the middle of it."""
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    if experts and mx.default_device() == mx.cpu and dtype != mx.float32:
        raise ValueError(
            f"mlx-lm runs mixture-of-experts layers only in float32 on the CPU (MLX's gather_mm), not "
            f"{str(dtype).removeprefix('mlx.core.')}: pass --dtype float32"
        )


KV_PROBE_TOKENS = 4  # the prefill that makes mlx-lm allocate its cache


def uses_latent_attention(config: dict) -> bool:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2, Mistral 4: the config sets a latent rank),
    where what a position costs in the cache is the point of the model."""
    return bool(config.get("kv_lora_rank"))


def measure_mlx_lm_kv_bytes(model, tokens: int = KV_PROBE_TOKENS) -> float:
    """Bytes a position takes in mlx-lm's own cache: one prefill of a few tokens into the cache its
    make_prompt_cache builds for the model, then each cache array's bytes over its positions axis
    (mlx-lm lays them out [B, heads, positions, dim] and allocates 256 positions at a time, so the
    arrays, not the tokens fed, say what a position holds)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(1, tokens + 1)[None], cache=cache))
    arrays = [a for entry in cache for _, a in tree_flatten(entry.state) if isinstance(a, mx.array) and a.ndim == 4]
    if not arrays or min(a.shape[2] for a in arrays) < tokens:
        raise RuntimeError("mlx-lm's cache is no longer laid out [B, heads, positions, dim]: update this probe")
    return sum(a.nbytes / a.shape[2] for a in arrays)


def compare_kv_bytes(models: dict[str, object]) -> dict[str, float]:
    """KV bytes a position for each engine given (name -> loaded model): mlxcel's is what its paged pool
    keeps (the scheduler's kv_bytes_per_position: for MLA the latent and the RoPE key a layer), mlx-lm's
    is measured on its cache; with both, `ratio` mlxcel / mlx-lm."""
    figure: dict[str, float] = {}
    if "mlxcel" in models:
        figure["mlxcel"] = kv_bytes_per_position(models["mlxcel"])
    if "mlx-lm" in models:
        figure["mlx-lm"] = measure_mlx_lm_kv_bytes(models["mlx-lm"])
    if len(figure) == 2:
        figure["ratio"] = figure["mlxcel"] / figure["mlx-lm"]
    return figure


def format_kv_bytes(model: str, figure: dict[str, float]) -> str:
    engines = ", ".join(f"{name} {figure[name]:,.0f}" for name in ENGINES if name in figure)
    ratio = f": ratio {figure['ratio']:.3f} (1/{1 / figure['ratio']:.1f})" if "ratio" in figure else ""
    return f"{model} KV bytes per position (every layer, the bench dtype): {engines}{ratio}"


def cast_mlx_lm_model(model, dtype: mx.Dtype) -> None:
    """mlx-lm keeps the stored dtype, mlxcel casts to the bench dtype: cast as mlx_lm.convert does,
    leaving what the family's cast_predicate keeps (Qwen 3.5's A_log stays float32, as in mlxcel)."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda path, x: x.astype(dtype) if keep(path) and mx.issubdtype(x.dtype, mx.floating) else x,
            model.parameters(),
        )
    )


def generate_mlxcel(model, prompts: list[list[int]], gen: int) -> Run:
    """As the runner generates: through the scheduler where it runs the model (Pipeline.can_schedule),
    else the batch engine. The tightest context: neither allocates more than a run this long needs."""
    rows = [RowRequest(prompt, row_id=i) for i, prompt in enumerate(prompts)]
    request = GenerationRequest(rows=rows, sampler=Sampler("greedy"), max_tokens=gen)
    max_context = max(map(len, prompts)) + gen + 1
    if supports_scheduling(model, request):
        return schedule_mlxcel(model, request, max_context)
    state = DirectEngine(model, max_context=max_context, pipeline=True).generate(request)
    t = state.timings
    tokens = [list(r.token_ids) for r in state.results]
    return Run(
        sum(map(len, prompts)),
        sum(len(ids) - 1 for ids in tokens),
        t.first_token - t.start,
        t.end - t.first_token,
        0,
        tokens,
    )


def schedule_mlxcel(model, request: GenerationRequest, max_context: int, draft_model=None) -> Run:
    """The scheduler prefills rows a piece at a time and starts each decoding when its prompt is
    done, so rows' first tokens arrive apart. TTFT is when every row has its first token (as for
    mlx-lm's one prefill batch); decode tok/s counts the tokens after that over the time after it."""
    arrivals: list[list[float]] = [[] for _ in request.rows]

    def on_token(row: int, token: int) -> bool:
        arrivals[row].append(time.perf_counter())
        return True

    scheduler = BatchScheduler(model, max_context, len(request.rows), draft_model=draft_model)
    state = scheduler.generate(request, on_token)
    all_started = max(times[0] for times in arrivals)
    after = sum(1 for times in arrivals for t in times if t > all_started)
    end = max(times[-1] for times in arrivals)
    tokens = [list(r.token_ids) for r in state.results]
    return Run(
        sum(len(r.prompt_ids) for r in request.rows),
        after,
        all_started - state.timings.start,
        end - all_started,
        0,
        tokens,
        [r.draft for r in state.results if r.draft] if request.draft is not None else None,
        {"decode_steps": state.decode_steps, "host_s": state.host_seconds, "wait_s": state.wait_seconds},
    )


def generate_mlx_lm(model, prompts: list[list[int]], gen: int) -> Run:
    return (
        generate_mlx_lm_single(model, prompts[0], gen)
        if len(prompts) == 1
        else generate_mlx_lm_batch(model, prompts, gen)
    )


def generate_mlx_lm_single(model, prompt: list[int], gen: int) -> Run:
    from mlx_lm.generate import generate_step, generation_stream, wired_limit

    tokens: list[int] = []
    with wired_limit(model, [generation_stream]):
        start = time.perf_counter()
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=gen):
            now = time.perf_counter()
            if not tokens:
                first = now
            tokens.append(token)
    return Run(len(prompt), len(tokens) - 1, first - start, now - first, 0, [tokens])


def generate_mlx_lm_batch(model, prompts: list[list[int]], gen: int) -> Run:
    from mlx_lm.generate import BatchGenerator

    # All rows in one prefill batch, as mlxcel prefills them (mlx-lm's default would prefill 8
    # at a time and start decoding the first 8 while the rest still prefill).
    generator = BatchGenerator(
        model, max_tokens=gen, completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    try:
        start = time.perf_counter()
        uids = generator.insert(prompts, [gen] * len(prompts))
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        first = None
        while responses := generator.next_generated():
            now = time.perf_counter()
            first = first or now
            for response in responses:
                tokens[response.uid].append(response.token)
    finally:
        generator.close()
    ids = [tokens[uid] for uid in uids]
    return Run(sum(map(len, prompts)), sum(len(t) - 1 for t in ids), first - start, now - first, 0, ids)


GENERATORS = {"mlxcel": generate_mlxcel, "mlx-lm": generate_mlx_lm}
