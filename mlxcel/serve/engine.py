"""The server's engine thread: one BatchScheduler loop that runs for the server's life, fed with
the HTTP requests' rows as they come (a RowFeed), so requests share decode steps as a job's rows
do. Everything MLX (templates with images, the model, the sampler chains) runs on this thread;
the event loop only parses requests and writes answers. Tokens go back once per iteration (one
wake-up of the event loop per step, not one per token).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.engine.request import RowRequest
from mlxcel.engine.scheduler import BatchScheduler, FeedUpdate
from mlxcel.errors import MlxcelError, first_line
from mlxcel.jobs import JobRow, Sample
from mlxcel.openai_protocol import ApiError, describe_logprobs
from mlxcel.sampling.config import SamplerConfig
from mlxcel.structured.matcher import judge_returned_text
from mlxcel.template import PromptTokens
from mlxcel.tokenizer import TextStream


@dataclass
class Choice:
    """One row of a request: a choice of its answer."""

    index: int
    stream: TextStream
    logprobs: int = 0  # alternatives to report (0: none); > 0 also reports the token's own
    prompt_tokens: int = 0
    generated: int = 0  # tokens so far


@dataclass
class Job:
    """One HTTP request as the engine sees it. `prompts`: what to prefill: chat messages (one
    entry) or completion prompts (text or token ids); each gets `n` choices."""

    id: str
    endpoint: str  # "chat" | "completion"
    prompts: list[Any]
    n: int
    max_tokens: int | None
    seed: int | None
    sampler: SamplerConfig | None
    logprobs: int
    stop: list[str] | None
    streaming: bool
    loop: asyncio.AbstractEventLoop
    events: deque = field(default_factory=deque)  # what the engine posted, not yet taken
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set when events arrive
    cancelled: bool = False  # the client went away (set by the event loop, read here)
    disconnected: bool = False  # (the event loop's own flag: its reader stops)
    rows: list[int] = field(default_factory=list)  # scheduler row indices, while they run
    # structured output: the request's spec compiled (on a request thread: app.compile_constraint);
    # None: the server's decode.constraint
    constraint: Any = None
    adapter: int = -1  # the model's adapter the request's `model` names (model.adapters); -1: the base
    tools: list[dict] | None = None  # chat: the request's tools, rendered by the model's template
    # chat: how answers are read (tools/parsers.py): the tool syntax (None: calls stay text), and
    # how the template thinks (<think> blocks or harmony's channels); per prompt, whether its rendering opened <think>
    tool_parser: str | None = None
    reasoning: str | None = None  # the template's thinking format (tools/parsers.py: reasoning_format)
    opens_reasoning: dict[int, bool] = field(default_factory=dict)
    forced_call: bool = False  # tool_choice required or a named function: a call's arguments stream

    @property
    def row_count(self) -> int:
        return len(self.prompts) * self.n

    async def next_events(self) -> list[tuple]:
        """Every event that arrived since the last call (waits for one): a lagging reader takes
        them in one go, not one wake-up each."""
        if not self.events:
            await self.wake.wait()
        return self.take_events()

    def take_events(self) -> list[tuple]:
        events = list(self.events)
        self.events.clear()
        self.wake.clear()
        return events


class ServeEngine:
    """`load` builds the Pipeline on the engine thread: MLX's streams belong to the thread that
    made them, so arrays made at load time (a lazy RoPE table, prompt cache entries read from
    disk) must be made where they are evaluated."""

    def __init__(self, load: Callable[[], Any], max_queue: int):
        self.load = load
        self.pipeline = self.tokenizer = None
        self.ready = threading.Event()
        self.max_rows = 0  # runner.max_rows, auto resolved once the model is loaded (Pipeline.choose_rows)
        self.max_queue = max_queue
        self.inbox: queue.Queue = queue.Queue()
        self.rows: dict[int, tuple[Job, Choice]] = {}
        self.next_row = 0
        self.outbox: list[tuple[Job, tuple]] = []
        self.starting: list[Job] = []  # requests whose rows the scheduler takes this iteration
        self.lock = threading.Lock()
        self.accepted_rows = 0  # rows of accepted requests that have not ended (the queue's fill)
        self.scheduler: BatchScheduler | None = None
        self.totals = {"decode_steps": 0, "rows_decoding_sum": 0, "iterations": 0}
        self.closed = False
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name="mlxcel-engine", daemon=True)

    # ---- the event loop's side ----
    def start(self) -> None:
        """Start the engine thread and wait until it has loaded the model (its failure raised here)."""
        self.thread.start()
        self.ready.wait()
        if self.failure is not None:
            raise self.failure

    def submit(self, job: Job) -> None:
        """Queue a request, or refuse it (429) when its rows would pass runner.max_rows running
        plus serve.max_queue waiting."""
        if self.failure is not None or self.closed:
            raise ApiError(503, "the engine has stopped; see the server's log", kind="server_error")
        if job.row_count > self.max_rows + self.max_queue:
            raise ApiError(
                400,
                f"{job.row_count} rows (prompts x n) is more than this server ever holds at once "
                f"(runner.max_rows={self.max_rows} + serve.max_queue={self.max_queue})",
                "n",
            )
        with self.lock:
            if self.accepted_rows + job.row_count > self.max_rows + self.max_queue:
                raise ApiError(
                    429,
                    f"the server's queue is full ({self.max_rows} rows running, serve.max_queue={self.max_queue} "
                    "waiting); retry shortly",
                    code="rate_limit_exceeded",
                    kind="rate_limit_error",
                    headers={"Retry-After": "1"},
                )
            self.accepted_rows += job.row_count
        self.inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self.inbox.put(("cancel", job))

    def stop(self) -> None:
        """End every row now (finish_reason "cancelled": their answers complete) and take no
        more requests (503); the engine thread ends once the rows have. Does not wait."""
        self.closed = True
        self.inbox.put(("close", None))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (rows still running are cancelled) and let the model go now:
        arrays left to the interpreter's exit are freed after MLX's own threads (a C++ abort)."""
        import gc

        self.stop()
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.scheduler = self.pipeline = None
            gc.collect()

    # ---- the engine thread ----
    def run(self) -> None:
        try:
            self.pipeline = self.load()
            self.tokenizer = self.pipeline.tokenizer
            request = self.pipeline.make_request([])
            scheduler = self.pipeline.make_engine(request)
            if not isinstance(scheduler, BatchScheduler):
                raise MlxcelError("mlxcel-serve needs the scheduler, and this model runs on the batch engine only")
            self.scheduler, self.max_rows = scheduler, self.pipeline.max_rows
            self.ready.set()  # (after max_rows: submit() reads it)
            for state in scheduler.steps(request, self.on_token, self.on_row_done, feed=self):
                state.timings.prefill_pieces.clear()  # (a server's loop would keep one per piece, forever)
                self.totals = {
                    "decode_steps": state.decode_steps,
                    "rows_decoding_sum": state.rows_decoding_sum,
                    "iterations": state.iterations,
                }
                self.announce_started()
                self.flush()
        except BaseException as exc:  # every waiting request gets an answer, then the server reports it
            self.failure = exc
            self.ready.set()
            for job, _ in list(self.rows.values()):
                self.post(job, ("error", ApiError(500, f"the engine failed: {exc}", kind="server_error")))
            self.rows.clear()
            self.drain_inbox_after_failure(exc)
        finally:
            self.flush()

    def drain_inbox_after_failure(self, exc: BaseException) -> None:
        while True:
            try:
                kind, job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.post(job, ("error", ApiError(500, f"the engine failed: {exc}", kind="server_error")))

    def poll(self, idle: bool) -> FeedUpdate:
        """RowFeed: the requests and cancellations that came in; blocks while nothing runs."""
        self.flush()
        update = FeedUpdate()
        items = []
        if idle:
            items.append(self.inbox.get())
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, job in items:
            if kind == "close":
                update.closed = True
                for running in {id(j): j for j, _ in self.rows.values()}.values():
                    update.cancelled += running.rows
            elif kind == "cancel":
                update.cancelled += job.rows
            elif job.cancelled or update.closed:  # (a request that came in as the server stopped)
                self.release(job.row_count)
                if not job.cancelled:
                    self.post(job, ("error", ApiError(503, "the server is stopping", kind="server_error")))
            else:
                update.rows += self.start_job(job)
        self.flush()
        return update

    def start_job(self, job: Job) -> list[tuple[int, RowRequest]]:
        """The request's rows, or an error answer when they cannot be built: 400 for what the
        request asked (its prompt, its sampler), 500 for anything else. Either way only this
        request fails: an exception out of here would stop the engine for every client."""
        try:
            built = self.make_rows(job)
        except Exception as exc:
            self.release(job.row_count)
            self.post(job, ("error", describe_start_failure(exc)))
            return []
        rows = []
        for index, request, choice in built:  # (kept only once every row was built)
            self.rows[index] = (job, choice)
            job.rows.append(index)
            rows.append((index, request))
        self.starting.append(job)
        return rows

    def announce_started(self) -> None:
        """("started",) for the requests whose rows the scheduler took in this iteration, after
        any of those rows it refused (a "done" with finish_reason "error"): a stream's status
        line waits for this, so a request that cannot run is a 400, not a 200 with an error event.
        Said at the iteration's first token or its end, whichever comes first (the scheduler
        checks new rows before it draws)."""
        for job in self.starting:
            self.post(job, ("started",))
        self.starting.clear()

    def make_rows(self, job: Job) -> list[tuple[int, RowRequest, Choice]]:
        prompts = [self.prepare(job, prompt) for prompt in job.prompts]
        for p, (prompt, _) in enumerate(prompts):
            check_room(job.max_tokens, len(prompt.token_ids), self.pipeline.max_context)
            for i in range(job.n):  # (the answer starts inside <think> where the rendering opened it)
                job.opens_reasoning[p * job.n + i] = prompt.text.rstrip().endswith("<think>")
        try:
            chain = self.pipeline.chain_for(job.sampler)
        except (MlxcelError, ValueError, OverflowError, MemoryError) as exc:  # (the request's own values)
            message = f"the request's sampler settings: {describe_exception(exc)}"
            raise ApiError(400, message, "mlxcel.sampler") from None
        constraint = job.constraint or self.pipeline.constraint
        rows = []
        for p, (prompt, images) in enumerate(prompts):
            for i in range(job.n):
                index = self.next_row
                self.next_row += 1
                # seeded: the same seed and prompt give the same answer; else each request its own stream
                row_id = 0 if job.seed is not None else job.id
                request = RowRequest(
                    prompt.token_ids,
                    row_id=row_id,
                    sample_index=i,
                    history_tokens=prompt.history_tokens,
                    max_tokens=job.max_tokens,
                    seed=job.seed,
                    images=images,
                    sampler=chain,
                    logprobs=job.logprobs,
                    constraint=constraint,
                    adapter=job.adapter,
                )
                stream = self.pipeline.make_text_stream(job.streaming, job.stop)
                choice = Choice(p * job.n + i, stream, job.logprobs, len(prompt.token_ids))
                rows.append((index, request, choice))
        return rows

    def prepare(self, job: Job, prompt: Any) -> tuple[PromptTokens, Any]:
        """A chat's messages (templated), a completion's text (as it is) or its token ids."""
        pipeline = self.pipeline
        if job.endpoint == "chat" or isinstance(prompt, str):
            raw = job.endpoint != "chat"
            messages = [{"role": "user", "content": prompt}] if raw else prompt
            prepared = pipeline.prepare_one(Sample(JobRow(id=job.id, messages=messages, raw=raw, tools=job.tools)))
            return prepared.prompt, prepared.images
        vocab = pipeline.loaded.model.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got {bad[0]}", "prompt")
        tokens = PromptTokens(self.tokenizer.decode(prompt), list(prompt), 0)
        pipeline.check_length(tokens)
        return tokens, None

    def on_token(self, row: int, token: int) -> bool:
        if self.starting:  # (the scheduler has checked this iteration's new rows: their streams may start)
            self.announce_started()
            self.flush()
        job, choice = self.rows[row]
        piece = choice.stream.add_token(token)
        choice.generated += 1
        if choice.generated == 1:
            self.post(job, ("first", choice.index))
        if choice.logprobs:
            entry = self.scheduler.live[row].result.logprobs[-1]
            self.post(job, ("logprobs", choice.index, describe_logprobs(self.tokenizer, entry, choice.logprobs)))
        if piece and job.streaming:
            self.post(job, ("text", choice.index, piece))
        return not (job.cancelled or choice.stream.stopped)

    def on_row_done(self, row: int, result) -> None:
        if row not in self.rows:
            return
        job, choice = self.rows.pop(row)
        job.rows.remove(row)
        tail = choice.stream.finalize()
        reason = result.finish_reason
        if choice.stream.stopped:
            reason = "stop"
        if tail and job.streaming:
            self.post(job, ("text", choice.index, tail))
        self.post(
            job,
            (
                "done",
                choice.index,
                {
                    "finish_reason": reason,
                    "text": choice.stream.text,
                    "completion_tokens": len(result.token_ids),
                    "prompt_tokens": choice.prompt_tokens,
                    "cached_tokens": result.cached_tokens,
                    "error": result.error,
                    # (a text a stop string cut is judged itself)
                    "constraint_satisfied": judge_returned_text(
                        job.constraint or self.pipeline.constraint, result, choice.stream.text
                    ),
                },
            ),
        )
        self.release(1)

    def release(self, rows: int) -> None:
        with self.lock:
            self.accepted_rows -= rows

    def post(self, job: Job, event: tuple) -> None:
        self.outbox.append((job, event))

    def flush(self) -> None:
        """Hand this iteration's events to the event loop in one wake-up."""
        if not self.outbox:
            return
        batch, self.outbox = self.outbox, []
        loop = batch[0][0].loop
        try:
            loop.call_soon_threadsafe(deliver, batch)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
            pass


def check_room(max_tokens: int | None, prompt_tokens: int, context: int) -> None:
    """A request's own max_tokens must fit after its prompt, as OpenAI answers (400), not be cut
    to the context silently: a client asking for 10**6 tokens would wait minutes for a context's
    worth. The server's default (decode.max_tokens) is cut to the context, as a job's is."""
    if max_tokens is not None and prompt_tokens + max_tokens > context:
        raise ApiError(
            400,
            f"max_tokens (or max_completion_tokens) is {max_tokens}, but this model's context is {context} tokens "
            f"and the prompt takes {prompt_tokens}: ask for at most {max(context - prompt_tokens, 0)}",
            "max_tokens",
            code="context_length_exceeded",
        )


def describe_start_failure(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MlxcelError):  # (a prompt longer than the context, an image for a text model, ...)
        return ApiError(400, describe_exception(exc), code="invalid_prompt")
    detail = f"{type(exc).__name__}: {describe_exception(exc)}" if str(exc).strip() else type(exc).__name__
    return ApiError(500, f"the request could not be prepared: {detail}", kind="server_error")


def describe_exception(exc: BaseException) -> str:
    """One line: the message's first, or the exception's name when it has none (a bare MemoryError)."""
    return first_line(str(exc)) or type(exc).__name__


def deliver(batch: list[tuple[Job, tuple]]) -> None:
    woken = {}
    for job, event in batch:
        job.events.append(event)
        woken[id(job)] = job
    for job in woken.values():
        job.wake.set()
