"""Concurrent streaming clients against mlxcel-serve and mlx_lm.server: python -m mlxcel.bench.serve

    python -m mlxcel.bench.serve [--model smollm2] [--clients 8] [--requests 16] [--prompt-tokens 128]
                                 [--max-tokens 128] [--servers mlxcel,mlx-lm] [--max-rows 8] [--seed 0]
                                 [--endpoint auto] [--json OUT.json] [--logs DIR]

Each server in turn is started as a subprocess on a free loopback port, on the same HF folder,
given a warm-up round, timed on one round, and stopped with SIGTERM. The folder is
bench/checkpoints.py's checkpoint (--model: smollm2, a random-weight shape such as llama-3.2-1b, or
an HF folder, which keeps its own tokenizer) plus a tokenizer both servers read: SmolLM2's GGUF
tokenizer as mlxcel rebuilds it, with its chat template, or for the random shapes bench.jobs'
word-level one. Before any server starts, mlx-lm's tokenizer (transformers' pick for the folder)
must turn the first prompt into the same ids as mlxcel's, so both prefill the same tokens (it does
not for the qwen2.5-0.5b shape: transformers builds its Qwen2 tokenizer whatever the folder says).

- mlxcel-serve: `model=hf model.path=FOLDER model.dtype=D runner.max_rows=M decode.max_tokens=T`
  (+ `template=none` where the tokenizer has no chat template), the server's defaults otherwise.
- mlx_lm.server: `--model FOLDER --max-tokens T --decode-concurrency M --prompt-concurrency min(8, M)`:
  its batching on with its defaults otherwise (8 is its default prompt concurrency, which must not
  exceed the decode one; its default decode concurrency, 32, would cap wider runs).

M is --max-rows (default --clients). Both servers get the same LD_PRELOAD: on a Linux CPU the
OpenBLAS that mlxcel-serve would preload itself (mlxcel/blas.py), so both run on the same BLAS.

The round: --requests requests (default 2 x --clients) go out through --clients concurrent clients
(asyncio over bare HTTP/1.1 connections: post_events), each client sending its next request as soon as its
last one ends, so the server stays loaded. Every request streams (stream_options.include_usage) with
max_tokens = --max-tokens at temperature 0: a chat completion where the tokenizer has a chat
template, else a completion (--endpoint). Its prompt is drawn from --seed, a different one per
request: an essay request on a drawn topic padded with drawn words to --prompt-tokens tokens (before
the chat template), or for the random shapes --prompt-tokens random token ids written as the
word-level tokenizer's words. The prompt cache stays on as each server runs it by default (mlxcel's
runner.prompt_cache, mlx-lm's LRU cache of 10 entries); the prompts share only the template's and
the instruction's first tokens. The OpenAI API cannot ask to ignore EOS, so a request may stop
before max_tokens: its tokens are its usage chunk's completion_tokens (or, where a server sends
none, its non-empty content chunks; the output says which).

Measured per server, over the timed round: throughput = generated tokens / wall time (first request
sent to last answer); TTFT = request sent to its first non-empty content chunk; ITL = the gaps
between a request's successive content chunks, pooled over all requests; p50 and p95 of both. The
warm-up round before it: --clients requests of 8 tokens on other prompts (seed + 1), unmeasured.
The table and ratios (mlxcel / mlx-lm) go to stdout, progress to stderr, everything (per request
too) to --json. Server logs go to a temporary folder, kept only when something failed (or --logs).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel import blas
from mlxcel.bench.__main__ import add_checkpoint_arguments, describe_environment
from mlxcel.bench.checkpoints import (
    CHECKPOINT_NAMES,
    RANDOM_SHAPES,
    dtype_name,
    prepare_checkpoint,
    read_model_config,
)
from mlxcel.bench.harness import align_columns, explain_ratios, log
from mlxcel.bench.jobs import MLX_LM_PREFILL_BATCH, draw_job, prepare_tokenizer, read_special_ids
from mlxcel.checkpoints.loader import pick_dtype
from mlxcel.errors import MlxcelError
from mlxcel.tokenizer.loader import load_tokenizer

SERVERS = ("mlxcel", "mlx-lm")
MODEL_NAMES = {"mlxcel": "bench", "mlx-lm": "default_model"}  # what each server answers to
WARM_UP_TOKENS = 8
STARTUP_TIMEOUT_S = 900  # a large model's load and the server's own warm-up
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 1800
CONNECT_ATTEMPTS = 50
READY_LINE = re.compile(r"mlxcel-serve: .* at (http://\S+/v1)")

TOPICS = (
    "the history of the bicycle",
    "how volcanoes form and erupt",
    "the life cycle of stars",
    "why the Roman Empire fell",
    "how bread is made",
    "the invention of the printing press",
    "how bees make honey",
    "the water cycle",
    "the causes of the First World War",
    "how computers store numbers",
    "the migration of birds",
    "the history of chess",
    "how rivers shape valleys",
    "the discovery of penicillin",
    "how a steam engine works",
    "the building of the pyramids",
    "the deep ocean and its animals",
    "how languages change over time",
    "the history of the telescope",
    "how forests recover after a fire",
)
INSTRUCTION = (
    "Write a long, detailed essay about {topic}. Explain its history, how it works and why it matters, "
    "in many paragraphs. Some words to use along the way:"
)
WORDS = (
    "river mountain light stone garden window machine letter winter market village engine silver "
    "harbor forest music paper bridge island candle storm meadow lantern copper tower valley orchard "
    "library compass thunder glacier desert canyon feather marble harvest journey mirror needle ocean "
    "planet quarry ribbon saddle timber velvet whistle anchor blanket castle dragon ember falcon "
    "granite hammer ivory jungle kettle ladder meteor nectar pebble quiver"
).split()

METRICS = {  # key -> (table label, higher is better)
    "throughput_tok_s": ("tok/s", True),
    "ttft_p50_ms": ("TTFT p50 ms", False),
    "ttft_p95_ms": ("TTFT p95 ms", False),
    "itl_p50_ms": ("ITL p50 ms", False),
    "itl_p95_ms": ("ITL p95 ms", False),
}


@dataclass
class RequestResult:
    sent_s: float  # from the round's start
    end_s: float = math.nan
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # non-empty content chunks
    tokens: int = 0
    token_source: str = "usage"  # or "chunks": the server sent no usage
    finish_reason: str | None = None
    error: str | None = None
    reconnects: int = 0  # connections the server refused before this request got in


@dataclass
class Round:
    wall_s: float
    requests: list[RequestResult]

    def summarize(self) -> dict:
        ok = [r for r in self.requests if r.error is None]
        tokens = sum(r.tokens for r in ok)
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        itl = [gap for r in ok for gap in r.itl_s]
        sources = {r.token_source for r in ok}
        return {
            "throughput_tok_s": tokens / self.wall_s,
            "ttft_p50_ms": percentile_ms(ttft, 50),
            "ttft_p95_ms": percentile_ms(ttft, 95),
            "itl_p50_ms": percentile_ms(itl, 50),
            "itl_p95_ms": percentile_ms(itl, 95),
            "requests": len(ok),
            "errors": len(self.requests) - len(ok),
            "tokens": tokens,
            "chunks": sum(r.chunks for r in ok),
            "wall_s": self.wall_s,
            "tokens_from": " and ".join(sorted(sources)) or "-",
            "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
            "reconnects": sum(r.reconnects for r in self.requests),
        }


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str  # .../v1
    log_path: Path
    run_dir: Path | None = None  # mlxcel-serve's run folder (stats.json)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else math.nan


def parse_servers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not set(names) <= set(SERVERS) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SERVERS)}, comma-separated (got {text!r})")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help=f"{', '.join(CHECKPOINT_NAMES)}, or an HF model folder (default smollm2)"
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    parser.add_argument("--requests", type=int, help="requests in the timed round (default 2 x --clients)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, help="tokens of each prompt's text, before any chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument(
        "--servers", type=parse_servers, default=list(SERVERS), help="comma-separated, run in this order"
    )
    parser.add_argument(
        "--max-rows",
        type=int,
        help="rows decoding at once: mlxcel's runner.max_rows, mlx-lm's --decode-concurrency (default --clients)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the prompts")
    parser.add_argument(
        "--endpoint",
        choices=["auto", "chat", "completions"],
        default="auto",
        help="auto: chat completions where the tokenizer has a chat template, else completions",
    )
    parser.add_argument("--json", type=Path, help="also write the settings, every figure and every request here")
    parser.add_argument(
        "--logs",
        type=Path,
        help="keep the servers' logs and mlxcel-serve's run folder in a new folder under this one (default: a "
        "temporary folder, removed after a run with no failure)",
    )
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    args.requests = args.requests or 2 * args.clients
    args.max_rows = args.max_rows or args.clients
    if min(args.clients, args.requests, args.max_rows, args.prompt_tokens, args.max_tokens) < 1:
        parser.error("--clients, --requests, --max-rows, --prompt-tokens and --max-tokens must be >= 1")
    return args


# ---- the model folder ----
def prepare_serving_folder(name: str, work_dir: Path, dtype: mx.Dtype) -> Path:
    """The bench checkpoint with a tokenizer both servers read (an HF folder keeps its own)."""
    checkpoint = prepare_checkpoint(name, work_dir, dtype)
    if name not in CHECKPOINT_NAMES:
        return checkpoint  # linked with all its files, the tokenizer's among them
    folder = work_dir / f"serve-{checkpoint.name}"
    partial = folder.with_name(folder.name + ".partial")  # renamed when whole, as checkpoints.write_folder
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in checkpoint.iterdir():
        (partial / item.name).symlink_to(item.resolve())
    write_tokenizer(name, checkpoint, partial, work_dir)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def write_tokenizer(name: str, checkpoint: Path, folder: Path, work_dir: Path) -> None:
    """SmolLM2: the GGUF's tokenizer as mlxcel rebuilds it (same ids in transformers), with its chat
    template. The random-weight shapes: bench.jobs' word-level tokenizer over their vocabulary.
    PreTrainedTokenizerFast makes transformers take tokenizer.json as it is."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if name == "smollm2":
        from mlxcel.checkpoints.loader import resolve_model_path
        from mlxcel.tokenizer.gguf import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(resolve_model_path("embedded:smollm2"))
        tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")
        config.update({key: getattr(tokenizer, key) for key in names if getattr(tokenizer, key) is not None})
    else:
        vocab_size = read_model_config(checkpoint)["vocab_size"]
        source = prepare_tokenizer(vocab_size, work_dir)
        (folder / "tokenizer.json").symlink_to((source / "tokenizer.json").resolve())
        config["unk_token"] = "t0"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# ---- the prompts ----
def draw_prompts(name: str, folder: Path, tokenizer, count: int, prompt_tokens: int, seed: int) -> list[str]:
    if name in RANDOM_SHAPES:
        return draw_id_prompts(folder, count, prompt_tokens, seed)
    return draw_text_prompts(tokenizer, count, prompt_tokens, seed)


def draw_id_prompts(folder: Path, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """Random ids as bench.jobs draws them, written as the word-level tokenizer's words."""
    config = read_model_config(folder)
    job = draw_job(count, (prompt_tokens,) * 2, (1, 1), config["vocab_size"], read_special_ids(config), seed)
    return [" ".join(f"t{i}" for i in prompt) for prompt in job.prompts]


def draw_text_prompts(tokenizer, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """An essay request on a drawn topic, then drawn words up to `prompt_tokens` tokens."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        head = INSTRUCTION.format(topic=TOPICS[rng.integers(len(TOPICS))])
        words = [WORDS[i] for i in rng.integers(len(WORDS), size=prompt_tokens)]  # a word is >= 1 token
        prompts.append(fit_prompt(head, words, prompt_tokens, tokenizer))
    return prompts


def fit_prompt(head: str, words: list[str], prompt_tokens: int, tokenizer) -> str:
    """`head` and as many of `words` as fit in `prompt_tokens` tokens (a binary search)."""

    def text(n: int) -> str:
        return " ".join([head, *words[:n]])

    low, high = 0, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(text(middle), add_special_tokens=False)) <= prompt_tokens:
            low = middle
        else:
            high = middle - 1
    return text(low)


def check_same_prompt_tokens(folder: Path, tokenizer, endpoint: str, prompt: str) -> None:
    """Both servers must prefill the same ids: mlx-lm's tokenizer is transformers' pick for the
    folder, which for some model types (qwen2) is not the tokenizer.json as written."""
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    from mlxcel.template import build_prompt

    theirs = load_mlx_lm_tokenizer(folder)
    messages = [{"role": "user", "content": prompt}]
    if endpoint == "chat":  # as each server renders a chat request
        ours = build_prompt(tokenizer, messages, tokenizer.chat_template).token_ids
        their_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        ours, their_ids = tokenizer.encode(prompt), theirs.encode(prompt)
    if list(ours) != list(their_ids):
        raise MlxcelError(
            f"mlx-lm's tokenizer ({type(theirs._tokenizer).__name__}, transformers' pick for {folder}) reads the "
            f"first prompt as {len(their_ids)} tokens, mlxcel's as {len(ours)}; the servers would not run the same "
            "prompts"
        )


# ---- the servers ----
def make_server_environment() -> tuple[dict[str, str], str]:
    """Both servers' environment, with the BLAS mlxcel-serve would preload itself, and its name."""
    env = dict(os.environ)
    library, _ = blas.plan_blas_preload(env)
    if library:
        env["LD_PRELOAD"] = f"{library}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else library
        env[blas.MARKER] = library  # mlxcel-serve then neither re-executes nor doubts it
        return env, f"openblas (LD_PRELOAD {library})"
    if "openblas" in env.get("LD_PRELOAD", ""):
        return env, f"openblas (LD_PRELOAD {env['LD_PRELOAD']})"
    return env, blas.describe_blas()


def find_free_port() -> int:
    """mlx_lm.server has no port 0: a port the kernel just handed out and that is free again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_mlxcel_command(folder: Path, args: argparse.Namespace, dtype: mx.Dtype, run_dir: Path) -> list[str]:
    overrides = [
        "model=hf",
        f"model.path={folder}",
        f"model.dtype={dtype_name(dtype)}",
        f"runner.max_rows={args.max_rows}",
        f"decode.max_tokens={args.max_tokens}",
        "serve.host=127.0.0.1",
        "serve.port=0",
        f"serve.model_name={MODEL_NAMES['mlxcel']}",
        f"hydra.run.dir={run_dir}",
    ]
    if not args.has_chat_template:  # else template=auto refuses to start (completions need none)
        overrides.append("template=none")
    return blas.rerun_command("mlxcel.serve.cli", overrides)  # this mlxcel's server, as mlxcel-serve runs it


def make_mlx_lm_flags(args: argparse.Namespace) -> list[str]:
    """Our max_tokens and row count; its batching otherwise as it comes (prompt concurrency: its
    default, but never above the decode one, which BatchGenerator refuses)."""
    return [
        *("--max-tokens", str(args.max_tokens)),
        *("--decode-concurrency", str(args.max_rows)),
        *("--prompt-concurrency", str(min(MLX_LM_PREFILL_BATCH, args.max_rows))),
    ]


def make_mlx_lm_command(folder: Path, args: argparse.Namespace, port: int) -> list[str]:
    server = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--host", "127.0.0.1"]
    return [*server, "--port", str(port), *make_mlx_lm_flags(args)]


def start_server(name: str, folder: Path, args, dtype: mx.Dtype, env: dict[str, str], log_dir: Path) -> Server:
    log_path = log_dir / f"{name}.log"
    run_dir = log_dir / "mlxcel-run" if name == "mlxcel" else None
    port = find_free_port()
    if name == "mlxcel":
        command = make_mlxcel_command(folder, args, dtype, run_dir)
    else:
        command = make_mlx_lm_command(folder, args, port)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = Server(name, process, f"http://127.0.0.1:{port}/v1", log_path, run_dir)
    try:
        if name == "mlxcel":
            server.url = wait_for_line(server)
        wait_for_health(server)
    except BaseException:
        stop_server(server)
        raise
    return server


def wait_for_line(server: Server) -> str:
    """mlxcel-serve's 'at http://...' line: printed once it listens, after its own warm-up."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = READY_LINE.search(server.log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        check_alive(server)
        time.sleep(0.2)
    raise MlxcelError(f"{server.name}: not ready after {STARTUP_TIMEOUT_S} s; its log: {server.log_path}")


def wait_for_health(server: Server) -> None:
    """GET /health answers 200 (mlx_lm.server loads its model after that: the warm-up waits for it)."""
    url = server.url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        check_alive(server)
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise MlxcelError(f"{server.name}: {url} did not answer in {STARTUP_TIMEOUT_S} s; its log: {server.log_path}")


def check_alive(server: Server) -> None:
    code = server.process.poll()
    if code is not None:
        tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-20:])
        raise MlxcelError(f"{server.name} exited with status {code} while starting; its log ends:\n{tail}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log(f"{server.name}: still running {STOP_TIMEOUT_S} s after SIGTERM; killing it")
            server.process.kill()
            server.process.wait()


def read_mlxcel_stats(server: Server) -> dict | None:
    """The scheduler's own figures from mlxcel-serve's stats.json (over its whole life, warm-up included)."""
    path = server.run_dir / "stats.json" if server.run_dir else None
    if path is None or not path.exists():
        return None
    stats = json.loads(path.read_text())
    keys = ("requests", "finish_reasons", "generated_tokens", "cached_tokens", "decode_steps", "occupancy", "ttft_ms")
    return {key: stats.get(key) for key in keys}


# ---- the clients ----
class ServerRefused(ConnectionError):
    pass


async def post_events(url: str, body: dict):
    """POST `body` and yield each Server-Sent Event's data (text) as it arrives, over a bare
    HTTP/1.1 connection (chunked or close-delimited): the clients must cost far less than the
    servers, and parsing every chunk into the openai package's models made one Python process
    of 64 clients the bottleneck (its timestamps lagged: ITL p50 0.2 ms against 12 ms steps)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    hostname, _, port = host.partition(":")
    payload = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.open_connection(hostname, int(port))
    except OSError as exc:
        raise ServerRefused(str(exc)) from None
    try:
        head = (
            f"POST /{rest} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer bench\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ServerRefused("the connection closed before an answer")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read()).decode(errors='replace')[:300]}")
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                buffer += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip().decode()
    finally:
        writer.close()


async def stream_request(server: Server, endpoint: str, prompt: str, max_tokens: int, start: float) -> RequestResult:
    """One streamed request; content chunks time-stamped as they arrive."""
    sent = time.perf_counter()
    result = RequestResult(sent_s=sent - start)
    arrivals: list[float] = []
    usage = None
    body = {
        "model": MODEL_NAMES[server.name],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        url = f"{server.url}/chat/completions"
    else:
        body["prompt"] = prompt
        url = f"{server.url}/completions"
    try:
        for attempt in range(CONNECT_ATTEMPTS):
            # mlx_lm.server's listen backlog (socketserver's 5) refuses part of a burst of
            # connections: a client connects again at once, as clients do; the wait counts in TTFT
            try:
                async for data in post_events(url, body):
                    now = time.perf_counter()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise RuntimeError(str(chunk["error"]))
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                        if text:
                            arrivals.append(now)
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
                break
            except ServerRefused:
                if attempt == CONNECT_ATTEMPTS - 1 or arrivals:
                    raise
                result.reconnects += 1
                await asyncio.sleep(0.02)
    except Exception as exc:  # a failed request is counted and shown, the round goes on
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = time.perf_counter() - start
    if arrivals:
        result.ttft_s = arrivals[0] - sent
        result.itl_s = np.diff(arrivals).tolist()
    result.chunks = len(arrivals)
    result.tokens = usage if usage is not None else len(arrivals)
    result.token_source = "usage" if usage is not None else "chunks"
    return result


async def run_round(server: Server, endpoint: str, prompts: list[str], clients: int, max_tokens: int) -> Round:
    """`clients` clients share the prompts: each sends the next as soon as its last request ends."""
    results: list[RequestResult | None] = [None] * len(prompts)
    pending = iter(enumerate(prompts))  # one iterator for all clients: no request is sent twice

    async def run_client() -> None:
        for index, prompt in pending:
            results[index] = await stream_request(server, endpoint, prompt, max_tokens, start)

    start = time.perf_counter()
    await asyncio.gather(*(run_client() for _ in range(clients)))
    return Round(time.perf_counter() - start, results)


def bench_server(name: str, folder: Path, args, dtype, env, log_dir: Path, warm_up: list[str], prompts: list[str]):
    """Start, warm up, time one round, stop: (the round, mlxcel-serve's own stats or None)."""
    started = time.perf_counter()
    log(f"{name}: starting the server")
    server = start_server(name, folder, args, dtype, env, log_dir)
    try:
        log(f"{name}: listening at {server.url} after {time.perf_counter() - started:.1f} s; warm-up round")
        warm = asyncio.run(run_round(server, args.endpoint, warm_up, args.clients, WARM_UP_TOKENS))
        failed = [r.error for r in warm.requests if r.error]
        if failed:
            raise MlxcelError(f"{name}: {len(failed)} warm-up requests failed, the first: {failed[0]}")
        log(f"{name}: timed round, {len(prompts)} requests through {args.clients} clients")
        timed = asyncio.run(run_round(server, args.endpoint, prompts, args.clients, args.max_tokens))
        log(f"{name}: {format_summary(timed.summarize())}")
    finally:
        stop_server(server)
        log(f"{name}: stopped")
    return timed, read_mlxcel_stats(server)


# ---- the output ----
def format_summary(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items()))
    return (
        f"{s['tokens']} tokens in {s['wall_s']:.1f} s ({s['throughput_tok_s']:.1f} tok/s), TTFT p50/p95 "
        f"{s['ttft_p50_ms']:.0f}/{s['ttft_p95_ms']:.0f} ms, "
        f"ITL p50/p95 {s['itl_p50_ms']:.1f}/{s['itl_p95_ms']:.1f} ms; "
        f"{s['requests']} requests ({reasons}), {s['errors']} failed, {s['reconnects']} refused connections "
        f"retried; tokens from {s['tokens_from']}, "
        f"{s['chunks']} content chunks"
    )


def compute_ratios(summaries: dict[str, dict]) -> dict[str, float] | None:
    if set(summaries) != set(SERVERS):
        return None
    ours, theirs = summaries["mlxcel"], summaries["mlx-lm"]
    return {key: ours[key] / theirs[key] if theirs[key] else math.nan for key in METRICS}


def format_table(summaries: dict[str, dict], ratios: dict[str, float] | None) -> str:
    header = ("server", *(label for label, _ in METRICS.values()), "requests", "failed", "tokens", "wall s")
    lines = [header]
    for name, s in summaries.items():
        figures = [f"{s[key]:.1f}" for key in METRICS]
        lines.append((name, *figures, str(s["requests"]), str(s["errors"]), str(s["tokens"]), f"{s['wall_s']:.1f}"))
    if ratios:
        lines.append(("ratio", *(f"{ratios[key]:.2f}" for key in METRICS), "", "", "", ""))
    return "\n".join(align_columns(lines, 1) + ([explain_ratios(METRICS)] if ratios else []))


def describe_run(args: argparse.Namespace, server_blas: str) -> dict:
    return {
        "model": args.model,
        "clients": args.clients,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "max_rows": args.max_rows,
        "seed": args.seed,
        "endpoint": args.endpoint,
        "servers": args.servers,
        "server_blas": server_blas,
        "mlx_lm_flags": make_mlx_lm_flags(args) if "mlx-lm" in args.servers else None,
    }


def format_settings(run: dict) -> str:
    return (
        f"{run['model']}: {run['requests']} requests through {run['clients']} concurrent streaming clients, "
        f"{run['endpoint']} endpoint, prompts of {run['prompt_tokens']} tokens before any template "
        f"(seed {run['seed']}), max_tokens {run['max_tokens']}, greedy; at most {run['max_rows']} rows decoding "
        f"at once; servers' BLAS {run['server_blas']}"
    )


def pick_endpoint(requested: str, has_chat_template: bool) -> str:
    if requested != "auto":
        return requested
    return "chat" if has_chat_template else "completions"


def check_packages(servers: list[str]) -> str | None:
    """What is missing, as a line to print, or None."""
    if "mlx-lm" in servers and importlib.util.find_spec("mlx_lm") is None:
        return "mlx-lm (the benchmark peer) is not installed: pip install -e '.[bench]', or --servers mlxcel"
    if "mlxcel" in servers and not all(importlib.util.find_spec(n) for n in ("starlette", "uvicorn")):
        return "mlxcel-serve needs the serve extra: pip install -e '.[serve]', or --servers mlx-lm"
    return None


def prepare_model(args: argparse.Namespace, dtype: mx.Dtype) -> tuple[Path, list[str], list[str]]:
    """The serving folder and the rounds' prompts (warm-up, timed); settles --endpoint."""
    folder = prepare_serving_folder(args.model, args.work_dir.expanduser(), dtype)
    tokenizer = load_tokenizer(folder)
    log(f"{args.model}: serving folder {folder}")
    args.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
    args.endpoint = pick_endpoint(args.endpoint, args.has_chat_template)
    warm_up = draw_prompts(args.model, folder, tokenizer, args.clients, args.prompt_tokens, args.seed + 1)
    prompts = draw_prompts(args.model, folder, tokenizer, args.requests, args.prompt_tokens, args.seed)
    if "mlx-lm" in args.servers:
        check_same_prompt_tokens(folder, tokenizer, args.endpoint, prompts[0])
    return folder, warm_up, prompts


def make_log_dir(logs: Path | None) -> Path:
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="mlxcel-bench-serve-", dir=logs))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = check_packages(args.servers)
    if missing:
        print(f"mlxcel.bench.serve: {missing}", file=sys.stderr)
        return 2
    dtype = pick_dtype(args.dtype)
    env, server_blas = make_server_environment()
    environment = describe_environment(dtype, peer="mlx-lm" in args.servers)
    if mx.default_device() == mx.cpu:  # the servers' BLAS, not this process's (which runs no model)
        environment["device"] = f"{mx.default_device()}, BLAS {server_blas}"
    log(" | ".join(f"{k} {v}" for k, v in environment.items()))
    try:
        folder, warm_up, prompts = prepare_model(args, dtype)
    except (MlxcelError, ValueError) as exc:  # a missing package, a wrong path, tokenizers that differ: one line
        print(f"mlxcel.bench.serve: {args.model}: {exc}", file=sys.stderr)
        return 1
    log_dir = make_log_dir(args.logs)
    rounds, stats = {}, None
    try:
        for name in args.servers:
            rounds[name], server_stats = bench_server(name, folder, args, dtype, env, log_dir, warm_up, prompts)
            stats = server_stats or stats
    except MlxcelError as exc:
        print(f"mlxcel.bench.serve: {exc}\n(server logs kept in {log_dir})", file=sys.stderr)
        return 1
    summaries = {name: r.summarize() for name, r in rounds.items()}
    ratios = compute_ratios(summaries)
    run = describe_run(args, server_blas)
    print(" | ".join(f"{k} {v}" for k, v in environment.items()))
    print(format_settings(run))
    print(format_table(summaries, ratios))
    for name, s in summaries.items():
        print(f"{name}: {format_summary(s)}")
    failed = sum(s["errors"] for s in summaries.values())
    if failed:
        first = next(r.error for rnd in rounds.values() for r in rnd.requests if r.error)
        print(f"{failed} requests failed, the first: {first} (server logs kept in {log_dir})")
    elif args.logs is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.logs:
        log(f"server logs in {log_dir}")
    if args.json:
        report = {
            "environment": environment,
            "run": run,
            "servers": summaries,
            "ratio": ratios,
            "mlxcel_stats": stats,
            "requests": {name: [asdict(r) for r in rnd.requests] for name, rnd in rounds.items()},
        }
        args.json.write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
