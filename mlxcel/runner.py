"""run(cfg, out_dir): a job from a validated RunConfig to a run folder. No Hydra here.

Stages: 1 read the rows (prompt.text / messages / file / rows) → 2 resume check → 3 load the
pipeline (model, tokenizer, template) → 4 render + tokenize every sample (a bad one becomes an
error row) → 5 generate batch by batch, appending each row to generations.jsonl the moment it
finishes → 6 stats.json. `stats.json` is written whatever happens: `status: failed` or
`interrupted` with the error and the stats so far.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from mlxcel.batch_files import write_batch_output
from mlxcel.config import RunConfig
from mlxcel.devices import claim_gpu, select_device
from mlxcel.engine import RowResult
from mlxcel.errors import MlxcelError
from mlxcel.generation_rows import make_error_row, make_generation_row
from mlxcel.jobs import expand_samples, hash_samples, input_files, load_job_rows
from mlxcel.outputs import (
    HEADLINE_FIELDS,
    AnswerStream,
    RunOutputs,
    claim_run_folder,
    defer_interrupt,
    describe_disk_full,
    release_run_folder,
    write_failure_stats,
)
from mlxcel.pipeline import Pipeline, PreparedSample, say
from mlxcel.progress import Progress
from mlxcel.stats import (
    GenerationStats,
    describe_reproducibility,
    describe_whole_job,
    format_stats_table,
    make_generation_stats,
    measure_batch,
    read_environment,
)


@dataclass
class RunResult:
    out_dir: Path
    status: str
    generations: list[dict] = field(default_factory=list)
    stats: GenerationStats | None = None


def run(
    cfg: RunConfig,
    out_dir: Path,
    stream: TextIO | None = sys.stdout,
    log: TextIO | None = sys.stderr,
    overrides: list[str] | None = None,
    keep_weights: bool = False,
    sweep_job: tuple[Path, int] | None = None,
) -> RunResult:
    """`sweep_job`: (sweep folder, job number) where a launcher runs a sweep's jobs side by side:
    the job claims a GPU of its own (mlxcel.devices)."""
    # A refused start (another run's folder, a resume with another config, an input the run would
    # write over) leaves the folder as it was: no failure stats over another run's.
    samples = expand_samples(load_job_rows(cfg.prompt, cfg.sampler, list(cfg.model.adapters or {})))  # 1
    done = claim_run_folder(
        out_dir, cfg.resolved_dict(), cfg.runner.resume, input_files(cfg.prompt), hash_samples(samples)
    )  # 2
    outputs = RunOutputs(out_dir)
    report: dict = {"status": "running", "overrides": list(overrides or [])}
    claim = None
    try:
        if sweep_job is not None and cfg.runner.backend == "local" and cfg.runner.device != "cpu":
            claim = claim_gpu(*sweep_job)
            report["gpu_claim"] = claim.describe() if claim else None
        select_device(cfg.runner.device, claim)
        report["environment"] = read_environment()
        outputs.write_config(cfg.resolved_dict())
        # (on Ray the workers load the weights; this process needs the tokenizer and template)
        weights = not cfg.runner.dry_run and cfg.runner.backend == "local"
        pipeline = Pipeline.load(cfg, load_weights=weights, log=log, keep_weights=keep_weights)  # 3
        report["model"] = describe_model(pipeline)
        report["sampler_chain"] = cfg.sampler.effective_chain()
        if cfg.runner.dry_run:
            return run_dry(pipeline, samples, outputs, report, log)
        return run_job(pipeline, samples, done, outputs, report, stream, log)
    except BaseException as exc:
        write_failure_stats(outputs.dir, exc, order_report(report))
        disk_full = describe_disk_full(exc)
        if disk_full is not None:
            raise disk_full from exc
        raise
    finally:
        release_run_folder(out_dir)
        if claim is not None:
            claim.release()


def describe_model(pipeline: Pipeline) -> dict:
    header = pipeline.header
    info = {
        "arch": header.arch,
        "path": str(header.path),
        "files": header.files,
        "fingerprint_sha256": header.fingerprint,
    }
    if pipeline.loaded is not None:
        info.update(pipeline.loaded.info)
        info["generation_defaults"] = read_generation_defaults(pipeline.loaded.generation_config)
    return info


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty")


def read_generation_defaults(generation_config: dict) -> dict:
    """The checkpoint's suggested sampling values (generation_config.json), recorded for reference:
    the sampler group decides what runs, so a run never changes behaviour silently."""
    return {k: generation_config[k] for k in SAMPLING_KEYS if k in generation_config}


def run_dry(pipeline: Pipeline, samples, outputs: RunOutputs, report: dict, log: TextIO | None) -> RunResult:
    """Render and tokenize every prompt and plan its prefill; no weights are loaded."""
    rows = []
    for prepared in pipeline.prepare(samples):
        row = {"id": prepared.sample.row.id, "sample": prepared.sample.index}
        if prepared.error:
            row["error"] = prepared.error
        else:
            prompt = prepared.prompt
            pieces = pipeline.plan(prompt).pieces
            row.update(
                prompt_text=prompt.text,
                prompt_token_ids=prompt.token_ids,
                history_tokens=prompt.history_tokens,
                prefill_pieces=[{"start": p.start, "end": p.end, "pad": p.pad} for p in pieces],
            )
        rows.append(row)
    outputs.write_prompts(rows)
    errors = sum("error" in r for r in rows)
    report.update(status="dry_run", rows=len(rows), rows_with_errors=errors)
    outputs.write_stats(order_report(report))
    say(
        log,
        f"dry run: {len(rows)} prompt(s) rendered and tokenized ({errors} with errors), written to "
        f"{outputs.dir / 'prompts.jsonl'}",
    )
    if rows and errors == len(rows):  # nothing could run: the job itself would fail
        first = next(r["error"] for r in rows)
        raise MlxcelError(first if len(rows) == 1 else f"every prompt failed ({len(rows)}); the first: {first}")
    return RunResult(outputs.dir, "dry_run")


def run_job(
    pipeline: Pipeline, samples, done: set, outputs: RunOutputs, report: dict, stream: TextIO | None, log: TextIO | None
) -> RunResult:
    cfg = pipeline.cfg
    report["stop_token_ids"] = sorted(pipeline.stop_ids)
    report["reproducibility"] = describe_reproducibility(cfg.runner)
    prepare_start = time.perf_counter()
    pending = [s for s in samples if s.key not in done]
    earlier = outputs.read_sessions() if done else []  # kept in the stats whatever happens now
    if done:
        report["sessions"] = earlier
        say(log, f"resuming: {len(samples) - len(pending)} row(s) already written, {len(pending)} to go")
    local = cfg.runner.backend == "local"
    # (on Ray each worker renders and tokenizes the rows it gets)
    prepared = pipeline.prepare(pending) if local else []
    finish_reasons: dict[str, int] = {}
    generations: list[dict] = []
    batches = []

    def record(row: dict) -> None:
        with defer_interrupt():  # on disk and counted together, or neither
            outputs.append_generation(row)
            generations.append(row)
            finish_reasons[row["finish_reason"]] = finish_reasons.get(row["finish_reason"], 0) + 1
            report["finish_reasons"] = dict(finish_reasons)  # current even if the job is interrupted now

    for failed in (p for p in prepared if p.error):
        record(make_error_row(failed))
    runnable = [p for p in prepared if not p.error] if local else pending
    streaming = len(samples) == 1 and stream is not None and local
    progress = Progress(len(runnable), "off" if streaming else cfg.runner.progress, log)
    try:
        if not local and runnable:
            from mlxcel.ray_jobs import run_on_ray

            batches, report["ray"] = run_on_ray(cfg, runnable, record, progress, log)
            report["backend"] = "ray"
        for batch in pipeline.group_rows(runnable) if local else []:
            answer = AnswerStream(stream) if streaming else None
            state = run_batch(pipeline, batch, record, progress, answer, keep_partial=len(samples) == 1)
            batches.append(measure_batch(state))
            rows_at_once = pipeline.describe_max_rows()
            report.update(make_generation_stats(batches, prepare_start, finish_reasons, **rows_at_once).to_dict())
    finally:
        progress.close()
        if any(s.row.batch is not None for s in samples):  # an OpenAI batch file: its result lines too
            rows = list({id(s.row): s.row for s in samples}.values())
            answered = write_batch_output(outputs.dir, rows, outputs.read_rows(), pipeline.tokenizer)
            report["batch_output"] = {"requests": len(rows), "answered": answered}
    workers = report.get("ray", {}).get("workers", [])  # (side by side, each with its own memory)
    peak = max((w.get("peak_memory_gb", 0.0) for w in workers), default=0.0) if not local else None
    rows_at_once = pipeline.describe_max_rows()
    if workers:  # (each worker chose its own, on its own device: the largest)
        rows_at_once["max_rows"] = max(w.get("max_rows") or 0 for w in workers)
    stats = make_generation_stats(
        batches, prepare_start, finish_reasons, side_by_side=not local, peak_memory_gb=peak, **rows_at_once
    )
    report.update(stats.to_dict())
    errors = [row for row in generations if row["finish_reason"] == "error"]
    if errors and len(errors) == len(generations):  # nothing ran: the job itself failed
        raise MlxcelError(
            f"{errors[0]['error']}"
            if len(errors) == 1
            else f"all {len(errors)} rows failed; the first: {errors[0]['error']}"
        )
    report["status"] = "completed"
    if done:
        describe_whole_job(report, earlier, outputs.read_rows())
    outputs.write_stats(order_report(report))
    if errors:
        say(log, f'{len(errors)} of {len(generations)} rows failed (finish_reason "error" in generations.jsonl)')
    if log is not None:
        print(format_stats_table(stats) + f"\nrun folder: {outputs.dir}", file=log, flush=True)
    return RunResult(outputs.dir, "completed", generations, stats)


def run_batch(
    pipeline: Pipeline,
    batch: list[PreparedSample],
    record,
    progress: Progress,
    stream: AnswerStream | None,
    keep_partial: bool = False,
):
    """Generate `batch`, recording each row as it finishes. `keep_partial` (a single prompt): an
    interrupt records the row so far, finish_reason "interrupted" (a resume runs it again).
    `stream`: where a single prompt's answer streams; a reader that goes away ends the row there."""
    detokenizers = [pipeline.make_text_stream(stream is not None, p.sample.row.stop) for p in batch]
    keys = [p.sample.key for p in batch]
    finished: set[int] = set()

    def on_token(row: int, token: int) -> bool:
        # (a row's first token: its prompt is in, so progress moves while other rows prefill)
        progress.add_token(keys[row], len(batch[row].prompt.token_ids))
        text = detokenizers[row].add_token(token)
        if stream is not None and text and not stream.write(text):
            return False  # the reader went away (`| head`): no one reads the rest
        return not detokenizers[row].stopped  # a stop string ends the row

    def on_row_done(row: int, result: RowResult) -> None:
        tail = detokenizers[row].finalize()
        if detokenizers[row].stopped:
            result.finish_reason = "stop"
        if stream is not None:
            stream.write(tail + "\n")
        record(make_generation_row(batch[row], result, detokenizers[row].text))  # (its text includes the tail)
        finished.add(row)
        progress.finish_row(keys[row], len(result.token_ids), result.prompt_tokens)

    try:
        return pipeline.generate(batch, on_token, on_row_done)
    except KeyboardInterrupt:
        if keep_partial:
            for row in (r for r in range(len(batch)) if r not in finished):
                detokenizers[row].finalize()
                result = RowResult(
                    token_ids=list(detokenizers[row].tokens),
                    finish_reason="interrupted",
                    prompt_tokens=len(batch[row].prompt.token_ids),
                )
                record(make_generation_row(batch[row], result, detokenizers[row].text))
        raise


def order_report(report: dict) -> dict:
    """status and the headline figures first (outputs.HEADLINE_FIELDS), so stats.json reads top-down."""
    head = ["status", *HEADLINE_FIELDS]
    return {**{k: report[k] for k in head if k in report}, **{k: v for k, v in report.items() if k not in head}}
