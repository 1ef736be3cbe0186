"""runner.backend=ray: one JSONL job's rows across Ray workers (docs/scaleout.md).

Each worker is a Ray actor holding the job's Pipeline (the model loaded once) and one open
BatchScheduler loop on its own thread, fed rows as a server's engine is. The driver hands rows
out as workers free up: it keeps each worker's queue at twice its max_rows (enough that its
scheduler never waits for rows, little enough that a ragged job ends balanced), takes the rows
that finish and writes them to generations.jsonl as a local job does. A worker that dies has its
unfinished rows run again on the others; a row is written once, when it comes back. Rows carry
their own seeds, so a row's tokens do not depend on the worker or what shares its batch.
runner.max_rows=auto resolves in each worker, on its device, through the pipeline a local job
uses (Pipeline.choose_rows); a worker's loop is fed as it goes, so it sizes as a server does.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TextIO

import mlx.core as mx

from mlxcel.blas import MARKER, describe_blas, plan_blas_preload
from mlxcel.config import RayConfig, RunConfig
from mlxcel.engine.auto_rows import choose_batch_engine_rows
from mlxcel.engine.scheduler import BatchScheduler, FeedUpdate
from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError
from mlxcel.jobs import Sample
from mlxcel.pipeline import Pipeline, say
from mlxcel.stats import BatchStats, measure_batch

QUEUED_ROWS_PER_SLOT = 2  # rows a worker holds per runner.max_rows slot (running + waiting)
TAKE_WAIT_S = 1.0  # how long a worker's take() waits for a finished row before answering empty


class JobWorker:
    """A worker's body: a Ray actor in run_on_ray, a plain object in tests. MLX's streams belong
    to the thread that made them, so the model is loaded on the loop's own thread."""

    def __init__(self, cfg: RunConfig, name: str, warm_up: list[Sample] = ()):
        self.cfg, self.name, self.warm_up = cfg, name, list(warm_up)
        self.inbox: queue.Queue = queue.Queue()  # lists of Samples; None: no more rows
        self.finished: queue.Queue = queue.Queue()  # generation rows as they end
        self.rows: dict[int, tuple] = {}  # scheduler index -> (PreparedSample, TextStream, RowRequest)
        self.ended: list[tuple] = []  # (RowRequest, RowResult) of each row run (an open loop's state keeps none)
        self.next_index = 0
        self.state = None
        self.failure: BaseException | None = None
        self.load_s = self.warm_up_s = 0.0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"mlxcel-{name}", daemon=True)
        self.thread.start()
        self.ready.wait()
        if self.failure is not None:
            raise self.failure

    # ---- the driver's side ----
    def describe(self) -> dict:
        return {
            "name": self.name,
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(mx.default_device()),
            "blas": describe_blas(),
            "load_s": round(self.load_s, 3),
            "max_rows": getattr(getattr(self, "pipeline", None), "max_rows", None),  # (auto resolved here)
            **({"warm_up_s": round(self.warm_up_s, 3)} if self.warm_up else {}),
        }

    def add(self, samples: list[Sample]) -> None:
        self.inbox.put(samples)

    def take(self, wait_s: float = TAKE_WAIT_S) -> list[dict]:
        """The rows that finished since the last take (waits up to `wait_s` for one)."""
        rows = []
        try:
            rows.append(self.finished.get(timeout=wait_s))
        except queue.Empty:
            pass
        while True:
            try:
                rows.append(self.finished.get_nowait())
            except queue.Empty:
                break
        if not rows and self.failure is not None:
            raise self.failure
        return rows

    def close(self) -> tuple[dict, BatchStats | None, float]:
        """End the loop (after the rows it holds); (its figures, its BatchStats, its clock now)."""
        self.inbox.put(None)
        self.thread.join()
        if self.failure is not None:
            raise self.failure
        stats = None
        if self.state is not None:
            requests, results = zip(*self.ended) if self.ended else ((), ())
            self.state.request = replace(self.state.request, rows=list(requests))
            self.state.results = list(results)
            stats = measure_batch(self.state)
        figures = self.describe()
        if stats is not None:
            # (the loop's time from its first rows to its last token, less its waits for rows)
            busy_s = stats.prefill_time_ms / 1000 + stats.decode_time_ms / 1000 - self.state.idle_seconds
            figures.update(
                rows=stats.rows,
                generated_tokens=stats.generated_tokens,
                busy_s=round(busy_s, 3),
                generated_tok_per_sec=round(stats.generated_tokens / busy_s, 3) if busy_s > 0 else 0.0,
                occupancy=round(stats.rows_decoding_sum / max(1, stats.decode_steps), 3),
                host_ms_per_step=round(stats.host_ms / max(1, stats.iterations), 3),
                peak_memory_gb=round(mx.get_peak_memory() / 1e9, 4),
            )
        return figures, stats, time.perf_counter()

    # ---- the loop's thread ----
    def run(self) -> None:
        from mlxcel.devices import select_device

        try:
            began = time.perf_counter()
            select_device(self.cfg.runner.device)
            self.pipeline = Pipeline.load(self.cfg, log=None)
            self.load_s = time.perf_counter() - began
            if self.warm_up:  # (a benchmark's: first-call costs, JIT, the allocator, before the timed job)
                began = time.perf_counter()
                self.pipeline.generate([p for p in self.pipeline.prepare(self.warm_up) if not p.error])
                self.warm_up_s = time.perf_counter() - began
                mx.reset_peak_memory()
            request = self.pipeline.make_request([])
            scheduler = self.pipeline.make_engine(request)
            if not isinstance(scheduler, BatchScheduler):
                raise MlxcelError("runner.backend=ray needs the scheduler; this model runs on the batch engine only")
            self.ready.set()
            for state in scheduler.steps(request, self.on_token, self.on_row_done, feed=self):
                self.state = state
        except BaseException as exc:  # the driver hears of it at its next take()
            self.failure = exc
            self.ready.set()

    def poll(self, idle: bool) -> FeedUpdate:
        """RowFeed: the rows the driver sent since the last poll (blocks while nothing runs)."""
        from mlxcel.generation_rows import make_error_row

        update = FeedUpdate()
        items = [self.inbox.get()] if idle else []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for samples in items:
            if samples is None:
                update.closed = True
                continue
            for sample in samples:
                prepared = self.pipeline.prepare_one(sample)
                if prepared.error:
                    self.finished.put(make_error_row(prepared))
                    continue
                index, self.next_index = self.next_index, self.next_index + 1
                request = self.pipeline.make_request([prepared]).rows[0]
                self.rows[index] = (prepared, self.pipeline.make_text_stream(False, sample.row.stop), request)
                update.rows.append((index, request))
        return update

    def on_token(self, index: int, token: int) -> bool:
        stream = self.rows[index][1]
        stream.add_token(token)
        return not stream.stopped  # a stop string ends the row

    def on_row_done(self, index: int, result) -> None:
        from mlxcel.generation_rows import make_generation_row

        prepared, stream, request = self.rows.pop(index)
        stream.finalize()
        if stream.stopped:
            result.finish_reason = "stop"
        self.ended.append((request, result))
        self.finished.put(make_generation_row(prepared, result, stream.text))


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            ConfigIssue("runner.backend", "needs Ray, which is not installed; fix: pip install 'mlxcel[ray]'", "ray")
        ) from None
    return ray


def describe_worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """What the workers' processes get from runtime_env: the OpenBLAS preload a local run uses
    (mlxcel/blas.py; LD_PRELOAD acts at process start, which Ray's env_vars reach) and the
    thread caps the driver was started with."""
    env = {k: v for k, v in environ.items() if k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MLXCEL_BLAS")}
    if "openblas" in environ.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = environ["LD_PRELOAD"]
        env[MARKER] = environ.get(MARKER, environ["LD_PRELOAD"])
    else:
        library, _ = plan_blas_preload(environ)
        if library:
            env.update(LD_PRELOAD=library, **{MARKER: library})
    return env


def connect(ray, settings: RayConfig, log: TextIO | None) -> bool:
    """Join (or start) the cluster; True when this call started Ray here (and must stop it)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (else Ray 2.60 writes a token under ~/.ray)
    runtime_env = {"env_vars": describe_worker_environment(dict(os.environ))}
    where = settings.address or "a local cluster"
    say(log, f"ray: connecting to {where}")
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        check_reachable(settings.address)  # (Ray itself retries an address that does not answer for minutes)
        ray.init(
            address=settings.address,
            runtime_env=runtime_env,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
        )
        # ray.init installs its own SIGTERM handler (exit 15 on the spot): keep the run's, which
        # ends the job as Ctrl-C does, its rows kept and stats.json saying so
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError: Ray's own words say which
        raise ConfigError(
            ConfigIssue(
                "runner.ray.address",
                f"no Ray cluster could be reached ({first_line(exc)}); fix: start one (ray start --head) "
                "and give its address, or null for a local cluster",
                settings.address,
            )
        ) from None
    return True


def check_reachable(address: str | None, timeout_s: float = 10.0) -> None:
    """Open and close a TCP connection to a HOST:PORT or ray://HOST:PORT address."""
    if not address or address == "auto" or ":" not in address:
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def check_resources(ray, settings: RayConfig) -> None:
    """A worker no node can hold would wait forever: say so now."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = [
        n for n in nodes if n.get("CPU", 0) >= settings.cpus_per_worker and n.get("GPU", 0) >= settings.gpus_per_worker
    ]
    if not fits:
        have = ", ".join(f"{n.get('CPU', 0):g} CPUs + {n.get('GPU', 0):g} GPUs" for n in nodes) or "no nodes"
        raise ConfigError(
            ConfigIssue(
                "runner.ray",
                f"no node of the cluster can hold a worker of {settings.cpus_per_worker:g} CPUs + "
                f"{settings.gpus_per_worker:g} GPUs (it has: {have}); fix: lower runner.ray.cpus_per_worker / "
                "gpus_per_worker or add nodes",
                {"cpus_per_worker": settings.cpus_per_worker, "gpus_per_worker": settings.gpus_per_worker},
            )
        )


def start_workers(ray, cfg: RunConfig, log: TextIO | None, warm_up: list[Sample] = ()) -> dict:
    """{actor: its description} for the workers that started (and ran `warm_up`) within
    runner.ray.start_timeout_s."""
    settings = cfg.runner.ray
    actor = ray.remote(JobWorker)
    handles = [
        actor.options(
            num_cpus=settings.cpus_per_worker,
            num_gpus=settings.gpus_per_worker,
            max_concurrency=4,  # take() waits while add() comes in
            max_restarts=0,
        ).remote(cfg, f"worker-{i}", warm_up)
        for i in range(settings.workers)
    ]
    say(log, f"ray: starting {settings.workers} worker(s), each loading the model")
    probes = {h.describe.remote(): h for h in handles}
    ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=settings.start_timeout_s)
    workers, failures = {}, []
    for ref in ready:
        try:
            workers[probes[ref]] = ray.get(ref)
        except Exception as exc:
            failures.append(exc)
    for handle in set(handles) - set(workers):
        ray.kill(handle)
    if not workers:
        if failures:
            raise MlxcelError(f"no Ray worker could start: {first_line(failures[0])}")
        raise MlxcelError(
            f"no Ray worker started within runner.ray.start_timeout_s={settings.start_timeout_s:g}s "
            f"(the cluster has {ray.available_resources().get('CPU', 0):g} CPUs and "
            f"{ray.available_resources().get('GPU', 0):g} GPUs free; each worker asks "
            f"{settings.cpus_per_worker:g} + {settings.gpus_per_worker:g})"
        )
    if len(workers) < len(handles):
        say(log, f"ray: {len(workers)} of {len(handles)} workers started; the job runs on those")
    return workers


def run_on_ray(
    cfg: RunConfig,
    samples: list[Sample],
    record: Callable[[dict], None],
    progress,
    log: TextIO | None,
    warm_up: list[Sample] = (),
) -> tuple[list[BatchStats], dict]:
    """Run `samples` on the workers, `record`ing each row as it comes back; (each worker's
    BatchStats, the report's `ray` section). Each worker first runs `warm_up` (untimed, unrecorded)."""
    ray = import_ray()
    started_here = connect(ray, cfg.runner.ray, log)
    workers: dict = {}
    try:
        check_resources(ray, cfg.runner.ray)
        workers = start_workers(ray, cfg, log, warm_up)
        began = time.perf_counter()
        # (each worker says its own max_rows: auto resolves there)
        deaths = hand_out(ray, workers, samples, choose_batch_engine_rows(cfg.runner.max_rows), record, progress, log)
        batches, figures = [], []
        for ref in [h.close.remote() for h in workers]:
            worker_figures, stats, worker_now = ray.get(ref)
            if stats is not None:  # its first token on this process's clock (for the job's ttft)
                stats.first_token_at = time.perf_counter() - (worker_now - stats.first_token_at)
                batches.append(stats)
            figures.append(worker_figures)
        wall = time.perf_counter() - began
        generated = sum(f.get("generated_tokens", 0) for f in figures)
        section = {
            "address": cfg.runner.ray.address,
            "workers_asked": cfg.runner.ray.workers,
            "wall_s": round(wall, 3),
            "generated_tok_per_sec": round(generated / wall, 3) if wall > 0 else 0.0,
            "workers": figures,
            "deaths": deaths,
        }
        return batches, section
    finally:
        for handle in workers:
            ray.kill(handle)
        if started_here:
            ray.shutdown()


def hand_out(ray, workers: dict, samples: list[Sample], max_rows: int, record, progress, log) -> list[dict]:
    """The driver's loop: keep each worker fed, record what comes back, and give the rows of a
    worker that died to the others. Returns the deaths.

    A worker holds its max_rows running rows plus as many again waiting (so its scheduler never
    waits on the driver), but never more than a fair share of what is left: a small job or a
    job's tail is spread over every worker, not queued behind the first. Each worker's max_rows is
    its own (its description's: auto resolves on the worker's device), else `max_rows`."""
    waiting = deque(samples)
    held: dict = {h: {} for h in workers}  # worker -> {sample key: Sample} sent, not yet back
    takes: dict = {}  # pending take() -> worker
    deaths: list[dict] = []

    def rows_of(handle) -> int:
        return workers[handle].get("max_rows") or max_rows

    def top_up(handle, limit: int) -> None:
        chunk = []
        while waiting and len(held[handle]) < min(limit, rows_of(handle) * QUEUED_ROWS_PER_SLOT):
            sample = waiting.popleft()
            held[handle][sample.key] = sample
            chunk.append(sample)
        if chunk:
            handle.add.remote(chunk)
        if held[handle] and handle not in takes.values():
            takes[handle.take.remote()] = handle

    def fair_share() -> int:
        return -(-len(waiting) // len(workers))  # (rounded up)

    first_share = fair_share()
    for handle in workers:
        top_up(handle, first_share)
    while takes:
        ready, _ = ray.wait(list(takes), num_returns=1)
        handle = takes.pop(ready[0])
        try:
            rows = ray.get(ready[0])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            lost = held.pop(handle)
            waiting.extendleft(reversed(list(lost.values())))  # first in line, in their order
            name = workers.pop(handle)["name"]
            deaths.append({"worker": name, "error": first_line(exc), "rows_rerun": len(lost)})
            say(log, f"ray: {name} died ({first_line(exc)}); its {len(lost)} unfinished row(s) go to the others")
            if not workers:
                raise MlxcelError(
                    f"every Ray worker died; the last: {first_line(exc)}. The rows written so far are kept: "
                    "rerun with runner.resume=true to finish the job"
                ) from None
            for other in workers:
                top_up(other, rows_of(other) + fair_share())
            continue
        for row in rows:
            if held[handle].pop((str(row["id"]), row["sample"]), None) is not None:  # (once, whatever happens)
                record(row)
                progress.update(rows=1, tokens=row.get("generated_tokens", 0))
        top_up(handle, rows_of(handle) + fair_share())
    return deaths
