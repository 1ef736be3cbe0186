"""`mlxcel-serve`: an OpenAI-compatible server on the same Hydra config as `mlxcel-run`.

    mlxcel-serve model=hf model.path=Qwen/Qwen2.5-0.5B-Instruct serve.port=8000 runner.max_rows=64

It loads the model, warms the engine up with one short request, then listens; Ctrl-C or SIGTERM
stops it (requests in flight get a few seconds to finish). The run folder
(outputs/<runner.name>/serve/<time>_<pid>, or hydra.run.dir=) gets config.resolved.json, a row
per request and stats.json. docs/serve.md has the endpoints and fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from pathlib import Path

GRACEFUL_SHUTDOWN_SECONDS = 10  # a stop gives requests in flight this long to finish
ANSWER_SECONDS = 5  # then their rows end ("cancelled") and their answers this long to be written
WARM_UP_PROMPT = "Hello"


def add_serve_group(overrides: list[str]) -> list[str]:
    """conf/serve/ is not in mlxcel-run's defaults: put it in (serve=NAME picks another file)."""
    picked = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "serve"]
    rest = [o for o in overrides if o not in picked]
    name = picked[-1].split("=", 1)[1] if picked else "default"
    return [f"+serve={name}", *rest]


def check_serve_extra() -> None:
    from importlib.util import find_spec

    from mlxcel.errors import MlxcelError

    missing = [name for name in ("starlette", "uvicorn") if find_spec(name) is None]
    if missing:
        raise MlxcelError(f"mlxcel-serve needs {' and '.join(missing)}: pip install 'mlxcel[serve]'")


def load_api_keys(path: str | None) -> set[str]:
    """serve.api_keys_file (one key a line, '#' comments) and $MLXCEL_API_KEYS (comma-separated).
    A file that holds no key is a config error: served as it is, it would ask for none."""
    from mlxcel.errors import ConfigError, ConfigIssue

    keys = {k.strip() for k in os.environ.get("MLXCEL_API_KEYS", "").split(",") if k.strip()}
    if path:
        try:
            lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(ConfigIssue("serve.api_keys_file", f"cannot read it: {reason}", path)) from None
        found = {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
        if not found:
            message = "holds no API key (one key a line; '#' starts a comment): the server would ask for none"
            raise ConfigError(ConfigIssue("serve.api_keys_file", message, path))
        keys |= found
    return keys


def warm_up(engine) -> None:
    """One short request through the engine, so the first client does not pay for kernel builds."""
    from mlxcel.openai_protocol import ApiError
    from mlxcel.serve.engine import Job

    async def run() -> None:
        job = Job(
            "warm-up", "completion", [WARM_UP_PROMPT], 1, 4, None, None, 0, None, False, asyncio.get_running_loop()
        )
        engine.submit(job)
        while True:
            for event in await job.next_events():
                if event[0] == "error":
                    raise event[1]
                if event[0] == "done":
                    return

    try:
        asyncio.run(run())
    except ApiError as error:
        from mlxcel.errors import MlxcelError

        raise MlxcelError(f"the warm-up request failed: {error.message}") from None


def bind_socket(host: str, port: int) -> socket.socket:
    from mlxcel.errors import ConfigError, ConfigIssue

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(ConfigIssue("serve.port", f"cannot listen on {host}:{port}: {exc.strerror}", port)) from None
    sock.listen(2048)  # from now on connections wait in the backlog: the start line can say "ready"
    sock.set_inheritable(True)
    return sock


class Server:
    """A loaded server: the run folder, the model and its engine, the app, the socket.
    `open()` does everything that may fail before a client could connect; `run()` serves until
    SIGINT/SIGTERM (or `stop()`); `close()` ends the engine and writes the last stats."""

    def __init__(self, args: list[str], log=sys.stderr):
        from mlxcel.cli import compose_config
        from mlxcel.config import validate_config

        check_serve_extra()
        from mlxcel.outputs import default_run_dir, split_run_dir

        run_dir, self.overrides = split_run_dir(args)
        self.cfg = validate_config(compose_config(add_serve_group(self.overrides)))
        self.keys = load_api_keys(self.cfg.serve.api_keys_file)
        self.run_dir = run_dir or default_run_dir(self.cfg.runner.name, "serve")
        self.log = log
        self.engine = self.records = self.app = self.uvicorn = None
        self.sock: socket.socket | None = None
        self.report: dict = {"status": "starting", "mode": "serve", "overrides": self.overrides}
        self.stopped_by: str | None = None

    def open(self) -> None:
        from mlxcel.devices import select_device
        from mlxcel.outputs import RunOutputs, claim_run_folder
        from mlxcel.pipeline import Pipeline
        from mlxcel.runner import describe_model
        from mlxcel.serve.app import ServeApp, make_app
        from mlxcel.serve.engine import ServeEngine
        from mlxcel.serve.records import ServeRecords
        from mlxcel.stats import read_environment

        cfg, settings, report = self.cfg, self.cfg.serve, self.report
        self.sock = bind_socket(settings.host, settings.port)
        claim_run_folder(self.run_dir, cfg.resolved_dict(), False, [], {})
        self.outputs = RunOutputs(self.run_dir)
        select_device(cfg.runner.device)
        report["environment"] = read_environment()
        self.outputs.write_config(cfg.resolved_dict())

        def load() -> Pipeline:  # (on the engine thread)
            select_device(cfg.runner.device)
            pipeline = Pipeline.load(cfg, log=self.log, require_template=False)  # (completions need none)
            pipeline.keep_answers = True  # a conversation's next request starts with this answer
            return pipeline

        self.engine = ServeEngine(load, settings.max_queue)
        self.engine.start()
        pipeline = self.engine.pipeline
        report.update(pipeline.describe_max_rows())  # (auto resolved for the server's open loop)
        report["model"] = describe_model(pipeline)
        report["sampler_chain"] = cfg.sampler.effective_chain()
        report["api_keys"] = len(self.keys)  # how many, never which
        warm_up(self.engine)
        self.model_id = settings.model_name or str(cfg.model.path).removeprefix("embedded:")
        self.records = ServeRecords(self.outputs, report, settings.log_text, pipeline.header.fingerprint[:16])
        self.records.engine = self.engine
        self.app = make_app(
            ServeApp(
                self.engine,
                settings,
                self.model_id,
                {str(cfg.model.path)},
                self.records,
                self.keys,
                self.log,
                pipeline.adapter_names(),
            )
        )
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}/v1"
        report["listening"] = self.url
        self.records.write_stats()

    def run(self) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS + ANSWER_SECONDS,
            lifespan="on",  # (the app's lifespan keeps stats.json fresh)
        )
        self.uvicorn = make_uvicorn_server(config, self)
        self.uvicorn.run(sockets=[self.sock])

    def stop(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def close(self, failure: BaseException | None = None) -> None:
        from mlxcel.outputs import release_run_folder, write_failure_stats

        try:
            if self.engine is not None:
                self.engine.close()
            failure = failure or (self.engine.failure if self.engine is not None else None)
            if self.records is not None and failure is None:
                if self.stopped_by:
                    self.report["stopped_by"] = self.stopped_by
                self.records.write_stats("completed")
            elif failure is not None and hasattr(self, "outputs"):
                write_failure_stats(self.outputs.dir, failure, self.report)
        finally:
            if self.sock is not None:
                self.sock.close()
            release_run_folder(self.run_dir)


def make_uvicorn_server(config, owner: Server):
    """uvicorn's server whose SIGINT/SIGTERM start a graceful stop and are not raised again
    afterwards (uvicorn re-raises them, which would end the process before the last stats)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            """Requests in flight get GRACEFUL_SHUTDOWN_SECONDS to finish; then the engine ends
            their rows (finish_reason "cancelled"), so their answers complete and are recorded
            as any other. uvicorn cancels only a handler still running ANSWER_SECONDS later
            (a CancelledError traceback, and a whole answer without a row, were the rule)."""
            ending = asyncio.ensure_future(stop_engine_after(owner.engine, GRACEFUL_SHUTDOWN_SECONDS))
            try:
                await super().shutdown(sockets)
            finally:
                ending.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield  # (a server in a thread, as the tests run it: stop() ends it)
                return

            def handle(signum, frame):
                owner.stopped_by = signal.Signals(signum).name
                self.should_exit = True

            previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer(config)


async def stop_engine_after(engine, seconds: float) -> None:
    await asyncio.sleep(seconds)
    engine.stop()


def serve(args: list[str], log=sys.stderr) -> int:
    server = Server(args, log)
    try:
        server.open()
        print(
            f"mlxcel-serve: {server.model_id} at {server.url} ({server.engine.max_rows} rows at once"
            f"{', API keys required' if server.keys else ''}); run folder: {server.run_dir}",
            file=log,
            flush=True,
        )
        server.run()
    except BaseException as exc:
        server.close(exc)
        raise
    server.close()
    if server.engine.failure is not None:
        raise server.engine.failure
    print(f"mlxcel-serve: stopped ({server.stopped_by or 'done'}); run folder: {server.run_dir}", file=log, flush=True)
    return 0


def entry() -> None:
    """`mlxcel-serve`: OpenBLAS preloaded on a Linux CPU (as mlxcel-run), then `main`."""
    from mlxcel.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv[1:], module="mlxcel.serve.cli")
    main()


def main() -> None:
    from mlxcel.cli import run_command

    run_command(serve)


if __name__ == "__main__":
    main()
