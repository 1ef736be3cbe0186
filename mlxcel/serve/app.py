"""The HTTP side of `mlxcel-serve` (Starlette): routes, API keys, body limits, streaming.

Every answer is either the endpoint's response or an OpenAI-style error object; a streaming
answer that fails after it started ends with an error event. A client that goes away cancels its
rows (the engine ends them at the next step)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxcel.openai_messages import convert_messages, has_data_urls
from mlxcel.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    count_usage,
    make_answer,
    make_chat_logprobs,
    make_choice,
    make_completion_logprobs,
    make_id,
    make_sampler_config,
    now,
    parse_request,
    read_constraint,
)
from mlxcel.serve.engine import Job, ServeEngine, describe_exception
from mlxcel.serve.records import ServeRecords
from mlxcel.tools.grammar import make_call_grammar
from mlxcel.tools.parsers import make_output_parser, parse_output


class ServeApp:
    """What the routes share: the engine, the settings, the run folder's records."""

    def __init__(
        self,
        engine: ServeEngine,
        settings,
        model_id: str,
        model_aliases: set[str],
        records: ServeRecords,
        keys: set[str],
        log: TextIO | None = None,
        adapters: list[str] | None = None,
    ):
        self.engine, self.settings, self.records = engine, settings, records
        self.adapters = adapters or []  # model.adapters' names: a request's model "base:name" or "name" picks one
        self.log = log  # one line a client that went away (None: stderr)
        self.model_id, self.model_aliases = model_id, model_aliases | {model_id}
        self.keys = keys
        self.max_body = int(settings.max_body_mb * 1024 * 1024)
        self.image_dirs = [Path(d).expanduser().resolve() for d in settings.image_dirs]
        self.created = now()
        # how chat answers are read (tools/parsers.py): the model's tool-call syntax, and <think>
        pipeline = engine.pipeline
        source = pipeline.tool_template_source if pipeline is not None else None  # (prompts with tools)
        self.tool_parser = pipeline.tool_parser if pipeline is not None else None
        self.reasoning = pipeline.reasoning if pipeline is not None else None
        self.renders_tools = source is not None and "tools" in source

    # ---- plumbing ----
    def check_key(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in self.keys):
            missing = not header
            raise ApiError(
                401,
                "no API key given (Authorization: Bearer KEY)" if missing else "the API key is not valid",
                code="invalid_api_key",
                kind="authentication_error",
            )

    async def read_json(self, request: Request) -> Any:
        check_content_type(request.headers.get("content-type"))
        length = request.headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length[:20]) > self.max_body:
            raise ApiError(413, f"the request body is over serve.max_body_mb ({self.settings.max_body_mb} MB)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                raise ApiError(413, f"the request body is over serve.max_body_mb ({self.settings.max_body_mb} MB)")
        try:
            return json.loads(body)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as exc:  # (bad JSON, bad UTF-8, an integer past Python's 4300 digits)
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def check_model(self, name: str) -> int:
        """The adapter a request's `model` names: -1 for the base model (any of its names), else
        the index of one of model.adapters, named `base:adapter` or `adapter` (/v1/models lists them)."""
        if name in self.model_aliases:
            return -1
        base, _, adapter = name.rpartition(":")
        if adapter in self.adapters and (not base or base in self.model_aliases):
            return self.adapters.index(adapter)
        served = ", ".join(repr(n) for n in self.model_names())
        raise ApiError(
            404, f"model {name[:200]!r} is not served here; this server serves {served}", "model", "model_not_found"
        )

    def model_names(self) -> list[str]:
        return [self.model_id] + [f"{self.model_id}:{name}" for name in self.adapters]

    # ---- routes ----
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok" if self.engine.failure is None else "failed"})

    async def models(self, request: Request) -> Response:
        try:
            self.check_key(request)
        except ApiError as error:
            return self.error_response(error, request, "models")
        return JSONResponse({"object": "list", "data": [self.describe_model(name) for name in self.model_names()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the model (any of its names), or OpenAI's 404 model_not_found."""
        try:
            self.check_key(request)
            adapter = self.check_model(request.path_params["model"])
        except ApiError as error:
            return self.error_response(error, request, "models")
        return JSONResponse(self.describe_model(self.model_names()[adapter + 1]))

    def describe_model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlxcel"}

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "completion")

    async def complete(self, request: Request, endpoint: str) -> Response:
        started = time.perf_counter()
        images = None
        try:
            self.check_key(request)
            body = await self.read_json(request)
            parsed = parse_request(ChatRequest if endpoint == "chat" else CompletionRequest, body)
            adapter = self.check_model(parsed.model)
            tools, choice, spec = None, "none", read_constraint(parsed)
            if endpoint == "chat":
                tools, choice = parsed.tool_settings()
                spec = self.tool_constraint(tools, choice, parsed, spec)
                images = tempfile.mkdtemp(prefix="mlxcel-serve-") if has_data_urls(parsed.messages) else None
                prompts = [convert_messages(parsed.messages, Path(images) if images else None, self.image_dirs)]
            else:
                prompts = parsed.prompts()
            vocab = self.engine.pipeline.loaded.model.args.vocab_size
            job = Job(
                id=make_id("chatcmpl" if endpoint == "chat" else "cmpl"),
                endpoint=endpoint,
                prompts=prompts,
                n=parsed.n,
                max_tokens=parsed.token_limit(),
                seed=parsed.seed,
                sampler=make_sampler_config(self.engine.pipeline.cfg.sampler, parsed, vocab),
                logprobs=parsed.logprobs_wanted(),
                stop=parsed.stop_strings(),
                streaming=parsed.stream,
                loop=asyncio.get_running_loop(),
                constraint=await self.compile_constraint(spec, endpoint),
                adapter=adapter,
                tools=tools,  # (rendered with tool_choice none too, as vLLM does: the model just calls none)
                tool_parser=self.tool_parser if choice != "none" else None,
                forced_call=choice not in ("none", "auto"),
                reasoning=self.reasoning if endpoint == "chat" else None,
            )
            self.engine.submit(job)
        except ApiError as error:
            if images:
                shutil.rmtree(images, ignore_errors=True)
            return self.error_response(error, request, endpoint, started)
        except ClientDisconnect:
            if images:
                shutil.rmtree(images, ignore_errors=True)
            return Response(status_code=499)
        if parsed.stream:
            try:
                await self.wait_started(job)
            except ApiError as error:
                if images:
                    shutil.rmtree(images, ignore_errors=True)
                return self.error_response(error, request, endpoint, started)
            return EventStream(
                self.stream_answer(job, parsed, request, started, images),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return await self.whole_answer(job, parsed, request, started)
        finally:
            if images:
                shutil.rmtree(images, ignore_errors=True)

    def tool_constraint(self, tools: list | None, choice, parsed, spec: dict | None) -> dict | None:
        """The structured-output spec of a chat request: tool_choice required or a named function
        constrains the answer to a call (tools/grammar.py); else response_format's, if any."""
        if tools is None:
            return spec
        if not self.renders_tools:
            raise ApiError(
                400,
                "tools: the model's chat template does not render tools (set template.text or template.file to one "
                "that does, or leave tools out)",
                "tools",
            )
        if choice in ("auto", "none"):
            return spec
        if spec is not None:
            message = "response_format cannot be used with tool_choice required or a named function"
            raise ApiError(400, message, "tool_choice")
        specials = self.engine.pipeline.tokenizer.special_tokens
        return make_call_grammar(self.tool_parser, tools, choice, parsed.parallel_tool_calls, specials)

    async def compile_constraint(self, spec: dict | None, endpoint: str):
        """The request's spec compiled, on a worker thread: a large schema or grammar takes ~0.1 s,
        which on the engine thread would stall every answer in flight (and on the event loop every
        request); one that does not compile is a 400 before the request takes a slot."""
        from starlette.concurrency import run_in_threadpool

        from mlxcel.structured.spec import ConstraintError

        if spec is None:
            return None
        try:
            return await run_in_threadpool(self.engine.pipeline.constraints.compile, spec)
        except ConstraintError as exc:
            param = "response_format" if endpoint == "chat" else "mlxcel.constraint"
            raise ApiError(400, f"{param}: {exc}", param, code="invalid_constraint") from None

    def error_response(
        self, error: ApiError, request: Request, endpoint: str, started: float | None = None
    ) -> Response:
        self.records.add_refusal(endpoint, error, started)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    # ---- answers ----
    async def wait_started(self, job: Job) -> None:
        """Until the engine has taken a streamed request's rows: what it refuses (a prompt over the
        context, a bad token id, max_tokens past the context) is raised here, before the status
        line, as the request's own 4xx. The events that came along stay queued for the stream."""
        taken: list[tuple] = []
        while True:
            try:
                events = await job.next_events()
            except asyncio.CancelledError:  # (uvicorn's last resort at shutdown)
                self.engine.cancel(job)
                raise
            for position, event in enumerate(events):
                failure = read_failure(event)
                if failure is not None:
                    self.engine.cancel(job)  # (its other choices)
                    raise failure
                if event[0] == "started":
                    job.events.extendleft(reversed(taken + events[position + 1 :]))
                    if job.events:
                        job.wake.set()
                    return
                taken.append(event)

    def log_disconnect(self, job: Job, started: float) -> None:
        """One line a client that went away (uvicorn would print an ASGI traceback)."""
        kind = "stream" if job.streaming else "answer"
        seconds = time.perf_counter() - started
        print(
            f"mlxcel-serve: {job.id}: the client disconnected {seconds:.1f} s into its {kind}; its rows are cancelled",
            file=self.log if self.log is not None else sys.stderr,
            flush=True,
        )

    async def wait_events(self, job: Job, request: Request):
        """The job's events in batches (all that arrived since the last: a reader that lags
        behind the engine catches up in one go); raises ClientDisconnect when the client goes away."""
        gone = asyncio.ensure_future(watch_disconnect(request, job))  # (one task a request, not one a wait)
        try:
            while True:
                events = await job.next_events()
                if job.disconnected:
                    raise ClientDisconnect()
                yield events
        finally:
            gone.cancel()

    async def whole_answer(self, job: Job, parsed, request: Request, started: float) -> Response:
        done: dict[int, dict] = {}
        logprobs: dict[int, list] = {}
        first = None
        try:
            async for events in self.wait_events(job, request):
                for event in events:
                    kind = event[0]
                    if kind == "error":
                        return self.error_response(event[1], request, job.endpoint, started)
                    if kind == "first" and first is None:
                        first = time.perf_counter()
                    elif kind == "logprobs":
                        logprobs.setdefault(event[1], []).append(event[2])
                    elif kind == "done":
                        done[event[1]] = event[2]
                if len(done) == job.row_count:
                    break
        except ClientDisconnect:
            self.engine.cancel(job)
            self.records.add_answer(job, done, started, first, "disconnected")
            self.log_disconnect(job, started)
            return Response(status_code=499)
        except asyncio.CancelledError:  # (uvicorn's last resort at shutdown: the request keeps its row)
            self.engine.cancel(job)
            self.records.add_answer(job, done, started, first, "disconnected")
            raise
        failed = next((d for d in done.values() if d["finish_reason"] == "error"), None)
        if failed is not None:
            self.engine.cancel(job)  # (its other choices)
            return self.error_response(describe_row_failure(failed), request, job.endpoint, started)
        self.records.add_answer(job, done, started, first, "ok")
        top = (parsed.top_logprobs or 0) if job.endpoint == "chat" else parsed.logprobs
        choices = []
        echoed = job.endpoint == "completion" and parsed.echo and isinstance(job.prompts[0], str)
        for index in sorted(done):
            text = (job.prompts[index // job.n] if echoed else "") + done[index]["text"]
            entries = logprobs.get(index, []) if job.logprobs else None
            choice = make_choice(job.endpoint, index, text, done[index]["finish_reason"], entries, top)
            if job.tool_parser is not None or job.reasoning:
                read_message(choice, job, index)
            choices.append(choice)
        usage = count_usage(done, job.n)
        body = make_answer(job.endpoint, job.id, self.model_id, choices, usage, self.records.fingerprint)
        return JSONResponse(body)

    async def stream_answer(self, job: Job, parsed, request: Request, started: float, images: str | None):
        """Server-Sent Events as OpenAI's clients parse them: one chunk per piece of text, the
        finish reason in a last chunk per choice, usage (stream_options.include_usage) in a
        chunk of its own, then [DONE]."""
        chat = job.endpoint == "chat"
        base = {
            "id": job.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": self.model_id,
            "system_fingerprint": self.records.fingerprint,
        }
        include_usage = parsed.include_usage()
        offsets: dict[int, int] = {}
        done: dict[int, dict] = {}
        first = None
        finished = False

        # a text chunk without logprobs is this template around the text: a chunk a token a
        # stream is most of the event loop's work at 64 streams (json.dumps of the whole dict
        # cost more than the rest of the write)
        plain = {**base, "choices": [{"index": 0}], **({"usage": None} if include_usage else {})}
        head, _, tail = json.dumps(plain, ensure_ascii=False, separators=(",", ":")).partition('"index":0')
        field = '"delta":{"content":' if chat else '"text":'
        close = '},"logprobs":null,"finish_reason":null' if chat else ',"logprobs":null,"finish_reason":null'

        def text_chunk(index: int, text: str) -> str:
            return f'data: {head}"index":{index},{field}{json.dumps(text, ensure_ascii=False)}{close}{tail}\n\n'

        def chunk(index: int, text: str | None = None, finish: str | None = None, entries=None, role=False) -> str:
            if text and finish is None and not entries and not role:
                return text_chunk(index, text)
            if chat:
                delta = (
                    {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                )
                lp = make_chat_logprobs(entries, parsed.top_logprobs or 0) if entries else None
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                lp = make_completion_logprobs(entries, parsed.logprobs, offsets.get(index, 0)) if entries else None
                choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            data = {**base, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

        try:
            if chat:
                for index in range(job.row_count):
                    yield chunk(index, role=True)
            elif parsed.echo:
                for index in range(job.row_count):
                    prompt = job.prompts[index // job.n]
                    if isinstance(prompt, str):
                        offsets[index] = len(prompt)
                        yield chunk(index, prompt)
            pending: dict[int, list] = {}  # index -> [text, logprob entries] not yet sent

            # chat answers read for tool calls and reasoning: each choice's text through its parser
            readers = (
                {
                    i: make_output_parser(
                        job.tool_parser, job.reasoning, job.opens_reasoning.get(i, False), job.forced_call
                    )
                    for i in range(job.row_count)
                }
                if chat and (job.tool_parser is not None or job.reasoning)
                else None
            )
            calls: dict[int, int] = {}  # index -> tool calls streamed

            def delta_chunk(index: int, delta: dict, entries=None) -> str:
                lp = make_chat_logprobs(entries, parsed.top_logprobs or 0) if entries else None
                data = {**base, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}]}
                if include_usage:
                    data["usage"] = None
                return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

            def read_deltas(index: int, deltas: list, entries: list, out: list[str]) -> None:
                for delta in deltas:
                    if delta.kind == "call_end":  # (a forced call, sent as it was written)
                        continue
                    if delta.kind in ("tool_call", "call_start"):
                        k = calls.get(index, 0)
                        calls[index] = k + 1
                        body = {"tool_calls": [delta.call.to_openai(k)]}
                    elif delta.kind == "call_arguments":
                        body = {"tool_calls": [{"index": calls[index] - 1, "function": {"arguments": delta.text}}]}
                    else:
                        body = {"content" if delta.kind == "content" else "reasoning_content": delta.text}
                    out.append(delta_chunk(index, body, entries))
                    entries = []
                if entries:  # (logprobs of tokens whose text is held back: on an empty delta)
                    out.append(delta_chunk(index, {}, entries))

            def flush(index: int, out: list[str]) -> None:
                text, entries = pending.pop(index, ["", []])
                if readers is not None:
                    if text or entries:
                        read_deltas(index, readers[index].feed(text), entries, out)
                    return
                if text or entries:
                    out.append(chunk(index, text, entries=entries or None))
                    offsets[index] = offsets.get(index, 0) + len(text)

            async for events in self.wait_events(job, request):
                out: list[str] = []  # one write for the whole batch; a choice's pieces in one chunk
                for event in events:
                    kind = event[0]
                    if kind == "error":
                        out.append(f"data: {json.dumps(event[1].body())}\n\n")
                        yield "".join(out)
                        self.records.add_refusal(job.endpoint, event[1], started)
                        finished = True
                        return
                    if kind == "first" and first is None:
                        first = time.perf_counter()
                    elif kind == "logprobs":
                        pending.setdefault(event[1], ["", []])[1].append(event[2])
                    elif kind == "text":
                        pending.setdefault(event[1], ["", []])[0] += event[2]
                    elif kind == "done":
                        index, d = event[1], event[2]
                        flush(index, out)
                        done[index] = d
                        if d["finish_reason"] == "error":
                            error = describe_row_failure(d)
                            out.append(f"data: {json.dumps(error.body())}\n\n")
                            yield "".join(out)
                            self.engine.cancel(job)
                            self.records.add_refusal(job.endpoint, error, started)
                            finished = True
                            return
                        finish = d["finish_reason"]
                        if readers is not None:
                            read_deltas(index, readers[index].finish(), [], out)
                            if calls.get(index) and finish == "stop":
                                finish = "tool_calls"
                        out.append(chunk(index, None if chat else "", finish=finish))
                for index in list(pending):
                    flush(index, out)
                if out:
                    yield "".join(out)
                if len(done) == job.row_count:
                    break
            if include_usage:
                usage = count_usage(done, job.n)
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
            self.records.add_answer(job, done, started, first, "ok")
        except ClientDisconnect:  # (our watcher saw it first: the stream ends here, quietly)
            pass
        finally:
            if not finished:  # the client went away (the response task was cancelled) or a write failed
                self.engine.cancel(job)
                self.records.add_answer(job, done, started, first, "disconnected")
                self.log_disconnect(job, started)
            if images:
                shutil.rmtree(images, ignore_errors=True)


def read_message(choice: dict, job: Job, index: int) -> None:
    """A chat choice's text read for tool calls and reasoning (tools/parsers.py)."""
    message = choice["message"]
    parsed = parse_output(message["content"], job.tool_parser, job.reasoning, job.opens_reasoning.get(index, False))
    message["content"] = parsed.content if parsed.content or not parsed.tool_calls else None
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"


def read_failure(event: tuple) -> ApiError | None:
    """An engine event's error: the request's own ("error", ApiError), or a row that ended with
    finish_reason "error" (the scheduler refused it, or its constraint failed)."""
    if event[0] == "error":
        return event[1]
    if event[0] == "done" and event[2]["finish_reason"] == "error":
        return describe_row_failure(event[2])
    return None


def describe_row_failure(done: dict) -> ApiError:
    return ApiError(400, done["error"] or "the row could not run")


class EventStream(StreamingResponse):
    """A stream whose client went away ends quietly: Starlette raises ClientDisconnect out of the
    response when a write fails (ASGI 2.4 servers), which uvicorn prints as an ASGI traceback. The
    generator is closed here, so its `finally` records the request now, not at garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            await self.body_iterator.aclose()


def check_content_type(header: str | None) -> None:
    """A body must say it is JSON (`application/json`, or a `+json` type); none said is taken as
    JSON, as FastAPI does. `curl -d` sends form encoding: it gets 415 naming the header to add."""
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(
            415,
            f"the request body must be JSON sent as Content-Type: application/json (got {header[:100]!r})",
            code="unsupported_media_type",
        )


async def watch_disconnect(request: Request, job: Job) -> None:
    """Mark the job and wake its reader when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.disconnected = True
            job.wake.set()
            return


def make_app(serve: ServeApp) -> Starlette:
    async def not_found(request: Request, exc) -> Response:
        error = ApiError(
            404,
            f"no route {request.method} {request.url.path} "
            "(/v1/chat/completions, /v1/completions, /v1/models, /v1/models/{model}, /health)",
        )
        return JSONResponse(error.body(), status_code=404)

    async def method_not_allowed(request: Request, exc) -> Response:
        error = ApiError(405, f"{request.method} is not allowed on {request.url.path}")
        return JSONResponse(error.body(), status_code=405)

    async def server_error(request: Request, exc) -> Response:
        error = ApiError(500, f"internal error: {type(exc).__name__}: {describe_exception(exc)}", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    routes = [
        Route("/health", serve.health, methods=["GET"]),
        Route("/v1/models", serve.models, methods=["GET"]),
        Route("/v1/models/{model:path}", serve.model, methods=["GET"]),  # (ids hold slashes: org/name)
        Route("/v1/chat/completions", serve.chat, methods=["POST"]),
        Route("/v1/completions", serve.completions, methods=["POST"]),
    ]
    handlers = {404: not_found, 405: method_not_allowed, 500: server_error, Exception: server_error}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        refresh = asyncio.ensure_future(serve.records.keep_fresh())  # stats.json every few seconds
        try:
            yield
        finally:
            refresh.cancel()

    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
