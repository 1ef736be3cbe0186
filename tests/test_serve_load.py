"""mlxcel-serve under load and faults (loopback, bounded): 64 concurrent clients, some streaming,
some hanging up mid-answer, some sending malformed JSON, oversize bodies, bad parameters or wrong
API keys, against a queue that is too short for all of them. Every accepted request gets a
complete answer or an OpenAI error object; a full queue answers 429 with Retry-After; the server
stays up, and afterwards MLX's active
memory equals its post-warm-up value and RSS is within 10% of it. A tiny random Llama (the faults,
not the model, are under test; test_serve checks a hung-up client's rows are freed on SmolLM2);
the prompt cache off, so the memory after equals the memory before by design (the cache keeps
entries by design, within its own budget: test_prompt_cache)."""

from __future__ import annotations

import asyncio
import json
import os
import random

import mlx.core as mx
import pytest

from tests.serve_fixtures import chat_body, raw_request, request_json, running_server, wait_for_idle

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_the_cpu")]  # 128 HTTP clients, ~30 s

KEY = "sk-test-key"
HANG_UP_TOKENS = 400  # (the tiny model's context is 512)


def read_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def run_clients(server, seed: int) -> dict:
    rng = random.Random(seed)
    port = int(server.url.split(":")[-1].split("/")[0])
    client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)
    outcomes: dict[str, int] = {}

    def count(name: str) -> None:
        outcomes[name] = outcomes.get(name, 0) + 1

    async def one(i: int) -> None:
        kind = rng.choice(["stream", "stream", "whole", "whole", "hang_up", "malformed", "oversize", "bad", "key"])
        prompt = f"Tell me about number {i}." + " Please." * rng.randint(0, 10)
        await asyncio.sleep(rng.random() * 0.05)  # (all at once: the queue overflows)
        if kind in ("stream", "whole"):
            try:
                if kind == "stream":
                    stream = await client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=32
                    )
                    finish = [
                        c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason
                    ]
                    assert finish and finish[0] in ("stop", "length"), finish
                else:
                    answer = await client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=32
                    )
                    assert answer.choices[0].finish_reason in ("stop", "length")
                count("answered")
            except openai.RateLimitError as err:
                assert err.response.headers.get("retry-after") == "1"
                assert err.body["type"] == "rate_limit_error"
                count("429")
        elif kind == "hang_up":
            status = 429
            while status == 429:  # (it must get in to hang up mid-answer)
                body = chat_body(prompt, stream=True, max_tokens=HANG_UP_TOKENS)
                status, _ = await raw_request(port, body, KEY, hang_up_after=2)
                await asyncio.sleep(0.05)
            count("hung_up" if status == 200 else str(status))
        elif kind == "malformed":
            status, text = await raw_request(port, b'{"model": "smollm2", "messages": [', KEY)
            assert status == 400 and "not valid JSON" in json.loads(text.split("\r\n\r\n", 1)[1])["error"]["message"]
            count("400")
        elif kind == "oversize":
            status, text = await raw_request(port, chat_body("x" * 20_000), KEY)
            assert status == 413 and "max_body_mb" in text
            count("413")
        elif kind == "bad":
            status, text = await raw_request(port, chat_body(prompt, n=0), KEY)
            assert status == 400 and '"param":"n"' in text.replace(" ", "")
            count("400")
        else:
            status, text = await raw_request(port, chat_body(prompt), key=rng.choice([None, "sk-wrong"]))
            assert status == 401 and "authentication_error" in text
            count("401")

    await asyncio.gather(*(one(i) for i in range(64)))
    await client.close()
    return outcomes


def test_64_clients_with_faults_get_answers_or_errors_and_nothing_leaks(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("MLXCEL_API_KEYS", KEY)
    overrides = (
        "model=hf",
        f"model.path={tiny_llama}",
        "serve.model_name=smollm2",
        "runner.max_rows=4",
        "serve.max_queue=4",
        "serve.max_body_mb=0.01",
        "runner.prompt_cache=false",
    )
    with running_server(tmp_path / "run", *overrides) as server:
        asyncio.run(run_clients(server, seed=0))  # warm-up: every request shape once
        wait_for_idle(server.engine, 60)
        mx.clear_cache()
        active, rss = mx.get_active_memory(), read_rss()
        outcomes = asyncio.run(run_clients(server, seed=1))
        assert {"answered", "429", "hung_up", "400", "401", "413"} <= set(outcomes), outcomes
        idle_after = wait_for_idle(server.engine, 30)
        status, health, _ = request_json(server.url.removesuffix("/v1") + "/health")
        assert status == 200 and health == {"status": "ok"}
        mx.clear_cache()
        # Under load a few small arrays can outlive the idle point by a round or more and then go:
        # .ci/run saw +512 and +1024 bytes here after models/cpu_attention.py came in (a guess, not
        # shown: a causal mask's key positions, 4 bytes each, held by some unevaluated graph), and a
        # probe of 16 rounds beside two busy loops saw +512 return to 0 three rounds later. State kept
        # per request (a row's ids, KV blocks, sampler state) over ~40 answered rows is far over 4 KB.
        assert abs(mx.get_active_memory() - active) <= 4096, (mx.get_active_memory(), active)
        # (growth only: the allocator handing pages back to the system is no leak; a run of .ci/run
        # saw the resident set shrink 13% here)
        assert read_rss() - rss <= 0.1 * rss, (read_rss(), rss)
        rows = [json.loads(line) for line in (server.run_dir / "generations.jsonl").read_text().splitlines()]
        assert sum(r["status"] == 429 for r in rows) >= outcomes["429"]
        print(f"outcomes {outcomes}; idle {idle_after:.2f} s after the last client")
    # the key was in use the whole time, and the run folder (closed now) never holds it
    files = [f for f in (tmp_path / "run").rglob("*") if f.is_file()]
    assert files and not any(KEY in f.read_text(errors="replace") for f in files)
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["api_keys"] == 1


def test_a_model_with_lazy_arrays_made_at_load_serves(tmp_path):
    """Llama 3's RoPE table is made lazily at load; MLX's streams belong to a thread, so the
    server loads the model on its engine thread (loaded on the main thread, the first request
    failed with "There is no Stream(cpu, 0) in current thread")."""
    from tests.helpers import make_tiny_checkpoint

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder = make_tiny_checkpoint(tmp_path / "llama3", "llama", rope_scaling=scaling)
    with running_server(tmp_path / "run", "model=hf", f"model.path={folder}", "serve.model_name=m") as server:
        status, reply, _ = request_json(f"{server.url}/completions", {"model": "m", "prompt": "hello", "max_tokens": 3})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply


def test_a_model_without_a_chat_template_serves_completions(tmp_path, tiny_llama):
    """template=auto and no chat template: completions answer, a chat request is a 400 that
    says so (mlxcel-run refuses such a config at start; a server has a use for it)."""
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(tiny_llama, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with running_server(tmp_path / "run", "model=hf", f"model.path={folder}", "serve.model_name=m") as server:
        status, reply, _ = request_json(f"{server.url}/completions", {"model": "m", "prompt": "hello", "max_tokens": 3})
        assert status == 200, reply
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        status, reply, _ = request_json(f"{server.url}/chat/completions", body)
        assert status == 400 and "no chat template" in reply["error"]["message"], reply
