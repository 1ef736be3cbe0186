"""run(cfg, out_dir): the staged text pipeline, from a validated RunConfig to a run folder.

Stages: 1 load model → 2 tokenizer → 3 template + tokenize → 4 bind config to model →
5 sampler → 6 prefill + decode (streaming detokenize) → 7 write outputs. No Hydra here.
`stats.json` is written whatever happens: `status: failed` and the error when a stage raises.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import mlx.core as mx

from mlxcel.config import RunConfig
from mlxcel.engine import BatchState, DirectEngine, GenerationRequest, RowRequest
from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.models.loader import LoadedModel, load_model
from mlxcel.outputs import RunOutputs, write_failure_stats
from mlxcel.sampling import make_sampler
from mlxcel.stats import GenerationStats, make_generation_stats, read_environment
from mlxcel.template import PromptTokens, build_prompt, load_template_source
from mlxcel.tokenizer import StreamingDetokenizer, load_tokenizer
from mlxcel.tokenizer.base import MlxcelTokenizer


@dataclass
class RunResult:
    out_dir: Path
    status: str
    generations: list[dict] = field(default_factory=list)
    stats: GenerationStats | None = None


def run(cfg: RunConfig, out_dir: Path, stream: TextIO | None = sys.stdout, log: TextIO | None = sys.stderr) -> RunResult:
    outputs = RunOutputs(out_dir)
    outputs.write_config(cfg.resolved_dict())
    report = {"status": "running", "environment": read_environment()}
    try:
        select_device(cfg.runner.device)
        report["environment"] = read_environment()
        result = run_stages(cfg, outputs, report, stream, log)
    except BaseException as exc:
        write_failure_stats(outputs.dir, exc, report)
        raise
    return result


def select_device(device: str) -> None:
    if device == "cpu":
        mx.set_default_device(mx.cpu)
    elif device == "gpu":
        if not mx.is_available(mx.gpu):
            raise ConfigError(ConfigIssue("runner.device", "no GPU backend is available in this MLX build; use auto or cpu", device))
        mx.set_default_device(mx.gpu)


def run_stages(cfg: RunConfig, outputs: RunOutputs, report: dict, stream: TextIO | None, log: TextIO | None) -> RunResult:
    say(log, f"loading model {cfg.model.path} ...")
    loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.gguf_weights)  # 1
    report["model"] = {**loaded.info, "generation_defaults": read_generation_defaults(loaded.generation_config)}
    say(log, f"loaded {loaded.info['arch']} ({loaded.info['params'] / 1e6:.0f}M params, {loaded.info['dtype']}) in {loaded.info['load_ms'] / 1000:.1f} s")

    prepare_start = time.perf_counter()
    tokenizer_path = cfg.tokenizer.path or loaded.path  # 2
    tokenizer = load_tokenizer(tokenizer_path, cfg.tokenizer.kind, gguf_metadata=loaded.gguf_metadata)
    source = load_template_source(tokenizer, cfg.template.text, cfg.template.file)  # 3
    prompt = build_prompt(tokenizer, cfg.prompt.to_messages(), source, enabled=cfg.template.kind != "none")

    stop_ids = merge_stop_ids(cfg, loaded, tokenizer)  # 4
    max_context = cfg.model.max_context or loaded.model.args.max_position_embeddings
    check_prompt(prompt, max_context)
    report["stop_token_ids"] = sorted(stop_ids)
    report["sampler_chain"] = cfg.sampler.effective_chain()

    request = GenerationRequest(  # 5
        rows=[RowRequest(prompt.token_ids, row_id=0, history_tokens=prompt.history_tokens)],
        sampler=make_sampler(cfg.sampler.effective_chain(), cfg.sampler.seed),
        max_tokens=cfg.decode.max_tokens,
        stop_token_ids=frozenset(stop_ids),
        chunk_size=cfg.prefill.resolved_chunk_size(),
        tile_size=cfg.prefill.tile_size,
        pad_token_id=tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0,
    )
    engine = DirectEngine(loaded.model, max_context, pipeline=cfg.decode.use_pipeline())
    detokenizers = [StreamingDetokenizer(tokenizer) for _ in request.rows]

    def on_token(row: int, token: int) -> bool:
        text = detokenizers[row].add_token(token)
        if stream is not None and text:
            stream.write(text)
            stream.flush()
        return True

    state = engine.generate(request, on_token)  # 6
    for row, detok in enumerate(detokenizers):
        tail = detok.finalize()
        if stream is not None and tail:
            stream.write(tail)
    if stream is not None:
        stream.write("\n")
        stream.flush()

    stats = make_generation_stats(state, prepare_start)  # 7
    generations = make_generation_rows(state, [prompt], [cfg.prompt.to_messages()], tokenizer)
    for row in generations:
        outputs.append_generation(row)
    report.update(stats.to_dict())
    report["status"] = "completed"
    report["per_prompt"] = [{k: row[k] for k in ("id", "prompt_tokens", "generated_tokens", "finish_reason")} for row in generations]
    outputs.write_stats(order_report(report))
    say(log, format_summary(stats, outputs.dir))
    return RunResult(outputs.dir, "completed", generations, stats)


def merge_stop_ids(cfg: RunConfig, loaded: LoadedModel, tokenizer: MlxcelTokenizer) -> set[int]:
    """EOS from the model, generation_config.json and the tokenizer, plus decode.stop_token_ids.
    decode.ignore_eos keeps only the explicit stop ids."""
    vocab = loaded.model.args.vocab_size
    bad = [i for i in cfg.decode.stop_token_ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(ConfigIssue("decode.stop_token_ids", f"ids must be in [0, {vocab}) for this model", bad))
    stop = set(cfg.decode.stop_token_ids)
    if not cfg.decode.ignore_eos:
        eos = loaded.generation_config.get("eos_token_id")
        stop.update([eos] if isinstance(eos, int) else eos or [])
        stop.update(loaded.model.eos_token_ids())
        stop.update(tokenizer.eos_token_ids)
    return stop


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty")


def read_generation_defaults(generation_config: dict) -> dict:
    """The checkpoint's suggested sampling values (generation_config.json), recorded for reference:
    the sampler group decides what runs, so a run never changes behaviour silently."""
    return {k: generation_config[k] for k in SAMPLING_KEYS if k in generation_config}


def check_prompt(prompt: PromptTokens, max_context: int) -> None:
    if not prompt.token_ids:
        raise ConfigError(ConfigIssue("prompt", "the prompt encodes to no tokens", prompt.text))
    if len(prompt.token_ids) >= max_context:
        raise ConfigError(
            ConfigIssue("prompt", f"{len(prompt.token_ids)} tokens do not fit the model's context of {max_context}", f"{prompt.text[:60]}...")
        )


def make_generation_rows(
    state: BatchState, prompts: list[PromptTokens], messages: list[list[dict]], tokenizer: MlxcelTokenizer
) -> list[dict]:
    rows = []
    for index, (result, prompt, conversation) in enumerate(zip(state.results, prompts, messages)):
        rows.append(
            {
                "id": index,
                "messages": conversation,
                "prompt": prompt.text,
                "text": tokenizer.decode(result.token_ids),
                "token_ids": result.token_ids,
                "prompt_token_ids": prompt.token_ids,
                "history_tokens": prompt.history_tokens,
                "finish_reason": result.finish_reason,
                "prompt_tokens": result.prompt_tokens,
                "generated_tokens": len(result.token_ids),
            }
        )
    return rows


SPEC_FIELDS = ("prompt_tokens", "generated_tokens", "prefill_time_ms", "decode_time_ms", "prefill_tok_per_sec", "decode_tok_per_sec")


def order_report(report: dict) -> dict:
    """status and the six SPEC fields first, so stats.json reads top-down."""
    head = ["status", *SPEC_FIELDS, "ttft_ms", "peak_memory_gb"]
    return {**{k: report[k] for k in head if k in report}, **{k: v for k, v in report.items() if k not in head}}


def format_summary(stats: GenerationStats, out_dir: Path) -> str:
    return (
        f"prompt {stats.prompt_tokens} tok, prefill {stats.prefill_time_ms:.0f} ms ({stats.prefill_tok_per_sec:.1f} tok/s) | "
        f"generated {stats.generated_tokens} tok, decode {stats.decode_tok_per_sec:.1f} tok/s | ttft {stats.ttft_ms:.0f} ms | "
        f"peak {stats.peak_memory_gb:.2f} GB\nrun folder: {out_dir}"
    )


def say(log: TextIO | None, message: str) -> None:
    if log is not None:
        print(f"mlxcel: {message}", file=log, flush=True)
