"""An MLA model (issue 42, item 4) through the paths tests/test_families_deepseek.py does not drive:
a JSONL job (a structured row beside plain and chat rows, two slots, pieces that end mid-prompt),
chat, and a Ray worker; each gives the tokens the Python API gives without a prompt cache. The tiny
DeepSeek V3 that transformers writes (its parity is checked there), greedy on the CPU in fp32."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from mlxcel.runner import run
from tests.helpers import by_key, drive_job_worker, read_rows, write_rows
from tests.test_hybrid_paths import CONVERSATION, GREEDY, MODEL, PROMPTS, SCHEMA, job_config, make_generator

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, on_the_cpu) -> Path:
    from tests.test_families_deepseek import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="module")
def answers(deepseek) -> dict:
    outs = make_generator(deepseek, "runner.prompt_cache=false").generate([*PROMPTS, CONVERSATION])
    return {"prompts": [o.token_ids for o in outs[:-1]], "conversation": outs[-1].token_ids}


def test_a_jsonl_job_with_a_structured_row_beside_plain_ones(deepseek, answers, tmp_path):
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.insert(1, {"id": "json", "prompt": "Answer in JSON.", "max_tokens": 40, "constraint": {"json_schema": SCHEMA}})
    rows.append({"id": "chat", "messages": CONVERSATION})
    cfg = job_config(deepseek, write_rows(tmp_path / "rows.jsonl", rows), "prefill.chunk_size=8")
    run(cfg, tmp_path / "run", None, None)
    written = by_key(read_rows(tmp_path / "run"))
    assert sorted(written) == sorted((r["id"], 0) for r in rows)
    assert [written[(f"p{i}", 0)]["token_ids"] for i in range(len(PROMPTS))] == answers["prompts"]
    assert written[("chat", 0)]["token_ids"] == answers["conversation"]
    structured = written[("json", 0)]
    assert structured["finish_reason"] == "stop" and structured["constraint_satisfied"] is True, structured
    jsonschema.validate(json.loads(structured["text"]), SCHEMA)
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["rows"] == len(rows)
    assert stats["row_state_gb"] == 0 and stats["kv_budget_gb"] > 0  # the latent is in the pool, no slot states


def test_chat_two_turns_answer_as_the_api_without_a_cache(deepseek, tmp_path, monkeypatch):
    from mlxcel.chat import chat

    uncached = make_generator(deepseek, "runner.prompt_cache=false")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello, world!\nI am fine, thank you.\n")))
    out, log = io.StringIO(), io.StringIO()
    args = [f"model.path={deepseek}", *MODEL, *GREEDY, "prompt.system=Be brief.", f"hydra.run.dir={tmp_path / 'chat'}"]
    assert chat(args, out, log) == 0
    turns = read_rows(tmp_path / "chat")
    first = uncached.generate(CONVERSATION[:2])
    assert len(turns) == 2 and turns[0]["token_ids"] == first.token_ids
    second = [*CONVERSATION[:2], {"role": "assistant", "content": first.text}, CONVERSATION[3]]
    assert turns[1]["token_ids"] == uncached.generate(second).token_ids
    assert turns[1]["cached_tokens"] > 0  # the second turn adopted the first from the pool's latents


def test_a_ray_worker_runs_the_rows_as_the_api(deepseek, answers, tmp_path):
    """The Ray job's worker body without Ray: rows sent in two parts join its open schedule."""
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)] + [{"id": "chat", "messages": CONVERSATION}]
    cfg = job_config(deepseek, write_rows(tmp_path / "rows.jsonl", rows), "runner.progress=off")
    got, figures, _ = drive_job_worker(cfg)
    tokens = {r["id"]: r["token_ids"] for r in got}
    assert len(got) == len(rows) == len(tokens) and figures["rows"] == len(rows)
    assert [tokens[f"p{i}"] for i in range(len(PROMPTS))] == answers["prompts"]
    assert tokens["chat"] == answers["conversation"]


def test_kv_bits_on_a_latent_wider_than_the_rope_key(tmp_path, on_the_cpu):
    """decode.kv_bits where the latent (64) and the RoPE key (32) differ in width, as in every
    released MLA model (V2-Lite: 512 and 64): the scheduler's quantized pool packs each at its own
    width (it once reshaped the RoPE key to the latent's width and failed), and rows among
    others draw what the batch engine's quantized cache draws for each alone."""
    from mlxcel.checkpoints.loader import load_model
    from tests.family_fixtures import PROMPT, mlxcel_generate, schedule
    from tests.test_families_deepseek import make_checkpoint

    folder = make_checkpoint(tmp_path / "v2", "deepseek_v2", kv_lora_rank=64)
    model = load_model(str(folder), dtype="float32").model
    assert model.model.layers[0].self_attn.cache_dims == (64, 32)
    prompts, request = [PROMPT * 2, PROMPT[5:28], PROMPT[:9]], {"kv_group_size": 32, "chunk_size": 16}
    state = schedule(model, prompts, 12, request={"kv_bits": 8, **request}, max_rows=3)
    alone = [mlxcel_generate(model, [p], 12, kv_bits=8, **request)[0] for p in prompts]
    assert [r.token_ids for r in state.results] == alone


def test_mla_layers_stay_off_the_in_place_kernels(deepseek, monkeypatch):
    """The CUDA kernels store keys and values of one width; an MLA layer's latent and RoPE key
    differ (cache_widths), so even where the kernels run the model takes the plain paged path."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine.scheduler import uses_kernels
    from mlxcel.models import paged_attention

    monkeypatch.setattr(paged_attention, "is_available", lambda head_dim, group=1: True)
    assert uses_kernels(load_model(str(deepseek), dtype="float32").model) == (False, False)
