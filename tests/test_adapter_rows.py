"""Several LoRA adapters in one job (issue 44 item 2, the engine side): rows that name different
adapters of `model.adapters`, and rows that name none, run in the same forward calls (the scheduler's
decode steps, pieces and packed calls) and each draws the tokens it draws on the model with its
adapter merged, alone; a JSONL row names its adapter, a bad name is one error before the weights load;
rows with an adapter neither share nor adopt cached prefixes (their KV is their adapter's)."""

from __future__ import annotations

import json
import random

import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.errors import ConfigError
from mlxcel.sampling import Sampler
from tests.helpers import make_tiny_checkpoint, read_rows, write_rows

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("on_the_cpu")

GREEDY = Sampler("greedy")
TOKENS = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory, on_the_cpu) -> dict:
    from tests.test_adapters import train_peft_adapter

    root = tmp_path_factory.mktemp("adapter_rows")
    base = make_tiny_checkpoint(root / "base", "llama", seed=3)
    common = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    return {
        "base": base,
        "a": train_peft_adapter(base, root / "a", seed=1, **common),
        "b": train_peft_adapter(
            base, root / "b", seed=2, **{**common, "r": 8, "target_modules": ["k_proj", "up_proj"]}
        ),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 90) for _ in range(rng.randint(3, 40))] for _ in range(9)]


@pytest.fixture(scope="module")
def alone(folders, prompts) -> dict:
    """Each prompt's greedy tokens on the base and on each adapter merged, one row at a time."""
    models = {
        -1: load_model(str(folders["base"]), dtype="float32").model,
        0: load_model(str(folders["base"]), dtype="float32", adapter=str(folders["a"])).model,
        1: load_model(str(folders["base"]), dtype="float32", adapter=str(folders["b"])).model,
    }
    return {
        (adapter, i): generate(model, [p], [-1])[0] for adapter, model in models.items() for i, p in enumerate(prompts)
    }


@pytest.fixture(scope="module", params=["columns", "gathered"])
def several(request, folders):
    """The base with both adapters beside its weights, each layer's mixed product in one form
    (the tiny model's layers would all gather: its adapters are wide against its layers)."""
    from mlxcel.models import adapters as layer_adapters

    adapters = {"a": str(folders["a"]), "b": str(folders["b"])}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_adapters, "prefers_columns", lambda *dims: request.param == "columns")
        model = load_model(str(folders["base"]), dtype="float32", adapters=adapters).model
    forms = {layer.adapters.masked for _, layer in model.named_modules() if hasattr(layer, "adapters")}
    assert forms == {request.param == "columns"}
    return model


def generate(model, prompts, adapters, engine=None, **options) -> list[list[int]]:
    rows = [RowRequest(p, row_id=i, adapter=a) for i, (p, a) in enumerate(zip(prompts, adapters))]
    engine = engine or BatchScheduler(model, 256, options.pop("max_rows", 4), chunk_size=options.pop("chunk", None))
    for name, value in options.items():
        setattr(engine, name, value)
    state = engine.generate(GenerationRequest(rows, GREEDY, max_tokens=TOKENS))
    return [r.token_ids for r in state.results]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a-call-a-part"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prompts", "pieces-of-8"])
def test_rows_with_different_adapters_share_calls_and_draw_their_own_tokens(several, prompts, alone, packed, chunk):
    adapters = [0, 1, -1, 1, 0, -1, 0, 1, 1]
    got = generate(several, prompts, adapters, max_rows=3, chunk=chunk, packed=packed)
    assert got == [alone[(a, i)] for i, a in enumerate(adapters)]


def test_a_compiled_step_follows_each_rows_adapter(several, prompts, alone, monkeypatch):
    """The segmented step takes the rows' picks as an input: traced once, it still gives each row
    its own adapter as rows come and go (3 rows at a time over 9, some with none)."""
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "segmented")
    several.__dict__.pop("_mlxcel_decoders", None)
    scheduler = BatchScheduler(several, 256, 3)
    assert scheduler.segmented
    adapters = [1, 0, -1, -1, 1, 0, 0, -1, 1]
    try:
        got = generate(several, prompts, adapters, engine=scheduler)
        assert got == [alone[(a, i)] for i, a in enumerate(adapters)]
        batch = [0, -1, 1]
        engine = DirectEngine(several, 256)
        assert engine.engine.decoder is not None
        assert generate(several, prompts[:3], batch, engine=engine) == [alone[(a, i)] for i, a in enumerate(batch)]
    finally:
        several.__dict__.pop("_mlxcel_decoders", None)


def test_the_batch_engine_runs_a_batch_of_mixed_adapters(several, prompts, alone):
    adapters = [1, -1, 0]
    got = generate(several, prompts[:3], adapters, engine=DirectEngine(several, 256))
    assert got == [alone[(a, i)] for i, a in enumerate(adapters)]


def test_rows_with_an_adapter_do_not_adopt_the_bases_prefix(several, prompts):
    shared = prompts[0] + prompts[1]  # (the same tokens: a base row and an adapter row must not share KV)
    rows = [shared + prompts[2][:3], shared + prompts[3][:5], shared + prompts[4][:4]]
    scheduler = BatchScheduler(several, 256, 4, prompt_cache=PromptCache(1 << 28))
    requests = [RowRequest(p, row_id=i, adapter=a) for i, (p, a) in enumerate(zip(rows, [-1, 0, -1]))]
    state = scheduler.generate(GenerationRequest(requests, GREEDY, max_tokens=TOKENS))
    assert state.results[1].cached_tokens == 0
    assert state.results[2].cached_tokens >= 32  # the base rows still share theirs


def test_a_jsonl_job_names_each_rows_adapter(folders, prompts, alone, tmp_path):
    from mlxcel.runner import run
    from tests.test_hybrid_paths import job_config

    rows = [{"id": "base", "prompt": "a b c"}, {"id": "a", "prompt": "a b c", "adapter": "a"}]
    rows.append({"id": "b", "prompt": "a b c", "adapter": "b"})
    adapters = f"model.adapters={{a: {folders['a']}, b: {folders['b']}}}"
    cfg = job_config(str(folders["base"]), write_rows(tmp_path / "rows.jsonl", rows), adapters, "decode.max_tokens=6")
    run(cfg, tmp_path / "run", None, None)
    written = {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "run")}
    singles = {}
    for name in ("a", "b"):
        merged = f"model.adapter={folders[name]}"
        one = job_config(
            str(folders["base"]), write_rows(tmp_path / f"{name}.jsonl", rows[:1]), merged, "decode.max_tokens=6"
        )
        run(one, tmp_path / f"run-{name}", None, None)
        singles[name] = read_rows(tmp_path / f"run-{name}")[0]["token_ids"]
    assert written["a"] == singles["a"] and written["b"] == singles["b"]
    assert len({json.dumps(v) for v in written.values()}) == 3  # the three rows differ


def test_a_row_naming_an_unknown_adapter_fails_before_the_weights_load(folders, tmp_path):
    from mlxcel.jobs import load_job_rows
    from tests.test_hybrid_paths import job_config

    rows = [{"id": 1, "prompt": "x"}, {"id": 2, "prompt": "y", "adapter": "c"}]
    cfg = job_config(
        str(folders["base"]), write_rows(tmp_path / "rows.jsonl", rows), f"model.adapters={{a: {folders['a']}}}"
    )
    with pytest.raises(ConfigError) as raised:
        load_job_rows(cfg.prompt, cfg.sampler, list(cfg.model.adapters))
    assert "line 2: adapter" in str(raised.value) and "'c'" in str(raised.value) and "a" in str(raised.value)
    with pytest.raises(ConfigError, match="model.adapters is not set"):
        load_job_rows(cfg.prompt, cfg.sampler, [])


def test_the_server_takes_the_adapter_from_the_requests_model(folders, prompts, alone, tmp_path):
    from tests.serve_fixtures import request_json, running_server

    adapters = f"model.adapters={{a: {folders['a']}, b: {folders['b']}}}"
    overrides = (f"model.path={folders['base']}", adapters, "sampler=greedy", "decode.ignore_eos=true")
    with running_server(tmp_path / "run", *overrides, "serve.model_name=m") as server:
        status, listed, _ = request_json(f"{server.url}/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == ["m", "m:a", "m:b"]
        decode = server.engine.pipeline.tokenizer.decode
        assert len({decode(alone[(adapter, 0)]) for adapter in (-1, 0, 1)}) == 3  # (three answers that differ)
        for model, adapter in [("m", -1), ("m:a", 0), ("b", 1)]:
            body = {"model": model, "prompt": prompts[0], "max_tokens": TOKENS, "temperature": 0}
            status, answer, _ = request_json(f"{server.url}/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == decode(alone[(adapter, 0)]), model
        status, answer, _ = request_json(f"{server.url}/completions", {"model": "m:c", "prompt": [5, 6]})
        assert status == 404 and "'m', 'm:a', 'm:b'" in answer["error"]["message"]


def test_a_ray_worker_runs_each_rows_adapter(folders, tmp_path):
    """The Ray job's worker body (ray_jobs.JobWorker, without Ray): rows keep their adapters."""
    from mlxcel.runner import run
    from tests.helpers import drive_job_worker
    from tests.test_hybrid_paths import job_config

    rows = [{"id": str(i), "prompt": "a b c d", "adapter": name} for i, name in enumerate(["a", None, "b", "a"])]
    rows = [{k: v for k, v in row.items() if v is not None} for row in rows]
    setting = (f"model.adapters={{a: {folders['a']}, b: {folders['b']}}}", "decode.max_tokens=6", "runner.progress=off")
    cfg = job_config(str(folders["base"]), write_rows(tmp_path / "rows.jsonl", rows), *setting)
    got, _, _ = drive_job_worker(cfg)
    run(cfg, tmp_path / "run", None, None)  # the same rows in the local job
    local = {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "run")}
    assert {r["id"]: r["token_ids"] for r in got} == local
    assert local["0"] == local["3"] and len({json.dumps(local[i]) for i in "012"}) == 3
