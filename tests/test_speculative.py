"""Speculative decoding (issue 45): prompt lookup's drafts against a brute-force lookup, and the
scheduler's verify calls exact: whatever a row drafts (the true continuation, a corrupted one,
nothing), every family's greedy rows draw plain decoding's tokens, with rows that cannot draft in
the same calls, rows joining and leaving, prefill pieces and the prompt cache; where drafts cannot
run (a hybrid), the run says why and decodes as before. fp32 on the CPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.config import DraftConfig
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.drafts import PAUSE_AFTER_MISSES, NgramIndex, RowDrafts, count_accepted
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.sampling import Sampler, SamplerChain
from mlxcel.sampling.config import SamplerConfig
from tests.helpers import make_tiny_checkpoint, read_rows, write_rows

pytestmark = pytest.mark.usefixtures("on_the_cpu")

NGRAM = DraftConfig(method="ngram")
TOKENS = 24


# ---- prompt lookup ----


def lookup(tokens: list[int], low: int, high: int, count: int) -> list[int]:
    """The reference: the longest suffix (high..low tokens) found ending earlier, its latest occurrence."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + count]
    return []


@pytest.mark.parametrize("low, high", [(1, 1), (2, 4), (1, 3)])
def test_the_ngram_index_proposes_what_a_brute_force_lookup_finds(low, high):
    rng = random.Random(low * 10 + high)
    for _ in range(20):
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
        generated: list[int] = []
        index = NgramIndex(low, high)
        for _ in range(30):
            index.sync(prompt, generated)
            assert index.propose(4) == lookup(prompt + generated, low, high, 4)
            generated += [rng.randrange(6) for _ in range(rng.randint(1, 3))]  # (a step may accept several)


def test_a_draft_models_backlog_is_the_sequences_tail():
    from mlxcel.engine.draft_model import read_tail

    rng = random.Random(1)
    for _ in range(500):
        prompt, generated = ([rng.randrange(9) for _ in range(rng.randint(0, 6))] for _ in range(2))
        n = len(prompt) + len(generated)
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        assert read_tail(prompt, generated, start, end) == (prompt + generated)[start:end]
        assert read_tail(prompt, generated, start) == (prompt + generated)[start:]


def test_count_accepted_stops_at_the_first_disagreement():
    assert count_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert count_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert count_accepted([5], [4, 5]) == 0


def test_adaptive_lookup_drafts_keep_their_size_through_partial_misses():
    drafts = RowDrafts(NgramIndex(1, 2), tokens=16, adaptive=True)  # lookup: cheap to make
    drafts.record(16, 2)  # a copied span ended after 2: the next span may be long
    assert drafts.size == 16
    drafts.record(16, 0)
    drafts.record(8, 0)  # nothing accepted: halved each time
    assert drafts.size == 4 and drafts.paused == 0
    drafts.record(4, 0)  # the third step in a row with nothing: a pause
    assert drafts.size == 2 and drafts.paused > 0
    drafts.paused = 0
    drafts.record(2, 2)
    drafts.record(4, 4)  # hits double it, to `tokens` at most
    assert drafts.size == 8
    drafts.record(8, 8)
    drafts.record(16, 16)
    assert drafts.size == 16


def test_adaptive_model_drafts_shrink_to_what_was_accepted():
    drafts = RowDrafts(NgramIndex(1, 2), tokens=6, adaptive=True, cheap=False)  # a draft model: a step a token
    drafts.record(6, 2)  # a miss after 2: next time 3
    assert drafts.size == 3
    for _ in range(PAUSE_AFTER_MISSES):
        drafts.record(drafts.size, 0)
    assert drafts.size == 1 and drafts.paused > 0  # nothing accepted, three times: a pause
    drafts.paused = 0
    for _ in range(8):
        drafts.record(drafts.size, drafts.size)
    assert drafts.size == 6  # hits grow it back by one, to `tokens` at most
    fixed = RowDrafts(NgramIndex(1, 2), tokens=6, adaptive=False)
    for _ in range(5):
        fixed.record(6, 0)
    assert fixed.size == 0 and fixed.paused == 0 and fixed.describe() == {"drafted": 30, "accepted": 0, "steps": 5}


def test_draft_tokens_auto_depends_on_the_source():
    assert DraftConfig(method="ngram").tokens == 16
    assert DraftConfig(method="model", model_path="x").tokens == 4
    assert DraftConfig(method="ngram", tokens=3).tokens == 3
    from tests.helpers import first_config_error

    for bad in (0, 17, True, "many"):
        message = first_config_error(decode={"draft": {"method": "ngram", "tokens": bad}})
        assert "decode.draft.tokens: must be an integer in [1, 16] or 'auto'" in message


# ---- verify calls: exact whatever is drafted ----


def prompts_for(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(5, 90) for _ in range(rng.randint(3, 9))]
        prompts.append(phrase * rng.randint(1, 4) + [rng.randrange(5, 90) for _ in range(rng.randint(1, 12))])
    return prompts


def run(model, prompts, draft=None, samplers=None, request_options=None, **options) -> tuple[list[list[int]], object]:
    packed = options.pop("packed", None)
    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 3), chunk_size=options.pop("chunk", None), **options)
    if packed is not None:
        scheduler.packed = packed and scheduler.packed
    rows = [RowRequest(p, row_id=i, sampler=(samplers or {}).get(i)) for i, p in enumerate(prompts)]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=TOKENS, draft=draft, **(request_options or {}))
    state = scheduler.generate(request)
    return [r.token_ids for r in state.results], state


def draft_from(expected: list[list[int]] | dict, seed: int):
    """BatchScheduler.propose_drafts drafting each row's true continuation (`expected`, by row id),
    cut short and corrupted at random: exactness must not depend on what is drafted."""
    rng = random.Random(seed)

    def propose(self, batch, table):
        drafts = []
        for i, row in enumerate(batch.rows):
            room = self.draft_room(batch, i, table)
            if row.drafts is None or room <= 0 or rng.random() < 0.2:
                drafts.append([])
                continue
            drawn = len(row.result.token_ids)
            draft = list(expected[row.request.row_id][drawn : drawn + rng.randint(1, min(room, 6))])
            if draft and rng.random() < 0.5:
                at = rng.randrange(len(draft))
                draft[at] = (draft[at] + 1) % 90 + 5  # a wrong token: the rest of the draft goes too
            drafts.append(draft)
        return drafts if any(drafts) else None

    return propose


def build_family(folder: Path, family: str) -> Path:
    from tests.family_fixtures import FAMILIES, make_family_checkpoint
    from tests.test_new_families_paths import build

    if family in ("llama", "qwen2"):
        return make_tiny_checkpoint(folder, family, seed=1)
    if family in FAMILIES:
        return make_family_checkpoint(folder, family, seed=1)
    if family == "deepseek_v3":
        from tests.test_families_deepseek import make_checkpoint

        return make_checkpoint(folder, family)
    if family == "llama4":
        from tests.test_families_llama4 import write_llama4

        return write_llama4(folder)
    return build(family, folder)


FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_oss",
    "gemma4",
    "llama4",
    "glm4",
    "glm4_moe",
    "olmo2",
    "olmo3",
    "smollm3",
    "deepseek_v3",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_any_draft_gives_plain_decodings_tokens(family, tmp_path, monkeypatch):
    model = load_model(str(build_family(tmp_path / family, family)), dtype="float32").model
    prompts = prompts_for(3)
    plain, plain_state = run(model, prompts, chunk=16)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=7))
    drafted, state = run(model, prompts, NGRAM, chunk=16)
    assert drafted == plain
    figures = [r.draft for r in state.results]
    accepted, offered = sum(f["accepted"] for f in figures), sum(f["drafted"] for f in figures)
    assert state.draft_off is None and state.verify_steps > 0
    assert 0 < accepted < offered  # drafts were taken, and some were turned down
    assert state.decode_steps < plain_state.decode_steps  # fewer steps for the same tokens


@pytest.mark.cuda  # (the CPU runs it too; on a GPU it checks the decode kernel over the positions stored first)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma2", "gpt_oss", "gemma4"])
def test_a_verify_call_as_decode_rows_gives_plain_decodings_tokens(family, tmp_path, monkeypatch):
    """scheduler.VERIFY_AS_ROWS: each drafted position a decode row of its own on the row's slot
    (the decode path; on a GPU its kernel reads the positions stored before it); greedy and
    sampled rows beside a row with penalties draw plain decoding's tokens."""
    from mlxcel.engine import scheduler

    model = load_model(str(build_family(tmp_path / family, family)), dtype="float32").model
    prompts = prompts_for(3)
    plain, _ = run(model, prompts, samplers=mixed_samplers(), chunk=16)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=7))
    monkeypatch.setattr(scheduler, "VERIFY_AS_ROWS", True)
    drafted, state = run(model, prompts, NGRAM, samplers=mixed_samplers(), chunk=16)
    assert drafted == plain
    kinds = {shape[0] for shape in state.call_shapes}
    assert "verify rows" in kinds and "verify" not in kinds
    assert sum(r.draft["accepted"] for r in state.results if r.draft) > 0


def penalized(seed: int) -> SamplerChain:
    """A chain with repetition penalties: its state follows every drawn token, so its rows do not draft."""
    config = {"seed": seed, "processors": {"penalties": {"repeat": 1.3}, "temperature": {"value": 0.8}}}
    return SamplerChain(SamplerConfig.model_validate({**config, "selector": {"kind": "categorical"}}), 0)


def mixed_samplers() -> dict:
    """Rows 1 and 4 sample (temperature 0.8, seeded), row 2 has penalties; the rest are greedy."""
    sampled = Sampler("categorical", temperature=0.8, seed=5)
    return {1: sampled, 4: sampled, 2: penalized(9)}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a-call-a-part"])
def test_prompt_lookup_is_exact_beside_rows_that_cannot_draft(tmp_path, packed):
    """Prompt lookup itself (no oracle): greedy and sampled rows draft from their repeated phrases;
    a row with penalties (and its state) shares every call and draws what it draws without drafts."""
    model = load_model(str(make_tiny_checkpoint(tmp_path / "llama", "llama", seed=1)), dtype="float32").model
    prompts = prompts_for(11, count=8)
    plain, _ = run(model, prompts, samplers=mixed_samplers(), chunk=8, max_rows=4)
    drafted, state = run(model, prompts, NGRAM, samplers=mixed_samplers(), chunk=8, max_rows=4, packed=packed)
    assert drafted == plain
    assert state.results[2].draft is None and state.results[1].draft is not None
    assert sum(r.draft["accepted"] for r in state.results if r.draft) > 0


def test_sampled_rows_draw_plain_decodings_tokens_whatever_is_drafted(tmp_path, monkeypatch):
    """A sampled row's verify step draws each position with the random key its plain step would
    have used, so a seeded row's tokens are plain decoding's, token for token, drafts or not (and
    so distributed as the target's: a drafted token stands where the target drew it)."""
    model = load_model(str(make_tiny_checkpoint(tmp_path / "llama", "llama", seed=4)), dtype="float32").model
    prompts = prompts_for(12, count=7)
    plain, _ = run(model, prompts, samplers=mixed_samplers(), chunk=8)
    assert plain[1] != run(model, prompts, chunk=8)[0][1]  # (the sampled rows do sample)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=2))
    drafted, state = run(model, prompts, NGRAM, samplers=mixed_samplers(), chunk=8)
    assert drafted == plain
    assert state.results[1].draft["accepted"] > 0 and state.results[4].draft["accepted"] > 0


def test_drafts_with_the_prompt_cache_adopting_prefixes(tmp_path, monkeypatch):
    model = load_model(str(make_tiny_checkpoint(tmp_path / "llama", "llama", seed=2)), dtype="float32").model
    shared = prompts_for(5, count=1)[0] * 3
    prompts = [shared + p for p in prompts_for(6, count=5)]
    plain, _ = run(model, prompts)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=3))
    drafted, state = run(model, prompts, NGRAM, prompt_cache=PromptCache(1 << 28))
    assert drafted == plain
    assert sum(r.cached_tokens for r in state.results) > 0 and state.verify_steps > 0


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"])
def test_a_hybrids_rows_go_back_to_the_state_of_the_tokens_they_keep(family, tmp_path, monkeypatch):
    """Recurrent layers run through every drafted token of a verify call: a row whose draft was cut
    short has its states put back and its kept tokens run again, so its tokens are plain decoding's.
    (With MLXCEL_VERIFY_AS_ROWS on: a hybrid keeps the ragged call, whose positions run in order.)"""
    from mlxcel.engine import scheduler
    from tests.test_families_qwen3_5 import make_checkpoint
    from tests.test_new_families_paths import build

    where = tmp_path / family
    folder = make_checkpoint(where, family) if family == "qwen3_5_text" else build(family, where)
    model = load_model(str(folder), dtype="float32").model
    prompts = prompts_for(4, count=5)
    plain, _ = run(model, prompts, samplers=mixed_samplers(), chunk=16)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=5))
    monkeypatch.setattr(scheduler, "VERIFY_AS_ROWS", True)
    drafted, state = run(model, prompts, NGRAM, samplers=mixed_samplers(), chunk=16)
    assert drafted == plain and state.draft_off is None
    assert {"verify", "verify rows"} & {shape[0] for shape in state.call_shapes} == {"verify"}
    figures = [r.draft for r in state.results if r.draft]
    assert 0 < sum(f["accepted"] for f in figures) < sum(f["drafted"] for f in figures)
    assert any(shape[0] == "replay" for shape in state.call_shapes)  # (cut drafts were run again)


def test_drafts_are_off_with_a_quantized_kv_cache_and_say_why(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=1, head_dim=32)  # (KV groups of 32)
    model = load_model(str(folder), dtype="float32").model
    prompts = prompts_for(4, count=3)
    plain, _ = run(model, prompts, request_options={"kv_bits": 8, "kv_group_size": 32})
    drafted, state = run(model, prompts, NGRAM, request_options={"kv_bits": 8, "kv_group_size": 32})
    assert drafted == plain
    assert "decode.kv_bits" in state.draft_off and state.verify_steps == 0
    assert all(r.draft is None for r in state.results)


# ---- through the job path: stats.json and generations.jsonl ----


def test_a_job_reports_its_drafts(tmp_path, monkeypatch):
    from mlxcel.runner import run as run_job
    from tests.test_hybrid_paths import job_config

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=1)
    rows = [{"id": i, "prompt": "a b c d e f a b c d e f a b c"} for i in range(3)]
    rows_file = write_rows(tmp_path / "rows.jsonl", rows)
    settings = ("decode.max_tokens=20", "decode.ignore_eos=true", "runner.progress=off")
    run_job(job_config(str(folder), rows_file, *settings), tmp_path / "plain", None, None)
    plain = {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "plain")}
    # (a random model seldom repeats itself: the drafts are the true continuations, corrupted)
    monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=1))
    run_job(job_config(str(folder), rows_file, *settings, "decode.draft.method=ngram"), tmp_path / "spec", None, None)
    spec = read_rows(tmp_path / "spec")
    assert {r["id"]: r["token_ids"] for r in spec} == plain
    assert all(set(r["draft"]) == {"drafted", "accepted", "steps"} for r in spec)
    stats = json.loads((tmp_path / "spec" / "stats.json").read_text())["draft"]
    assert stats["rows"] == 3 and stats["drafted"] == sum(r["draft"]["drafted"] for r in spec)
    assert stats["accepted"] == sum(r["draft"]["accepted"] for r in spec) > 0
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"], abs=1e-4)
    steps = stats["steps"]
    assert stats["tokens_per_step"] == pytest.approx((stats["accepted"] + steps) / steps, abs=1e-3)
    assert json.loads((tmp_path / "plain" / "stats.json").read_text())["draft"] == {}


def test_the_server_answers_alike_with_drafts(tmp_path):
    from tests.serve_fixtures import request_json, running_server

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=1)
    prompt = prompts_for(9, count=1)[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    answers = []
    for extra in ((), ("decode.draft.method=ngram",)):
        overrides = (f"model.path={folder}", "decode.ignore_eos=true", "serve.model_name=m", *extra)
        with running_server(tmp_path / f"run{len(extra)}", *overrides) as server:
            status, answer, _ = request_json(f"{server.url}/completions", body)
            assert status == 200, answer
            answers.append(answer["choices"][0]["text"])
    assert answers[0] == answers[1] and answers[0]


def test_bad_draft_settings_are_config_errors():
    from tests.helpers import first_config_error

    assert "decode.draft.tokens: " in first_config_error(decode={"draft": {"method": "ngram", "tokens": 0}})
    assert "decode.draft.method: must be one of: none, ngram" in first_config_error(decode={"draft": {"method": "x"}})
    message = first_config_error(decode={"draft": {"ngram_min": 5, "ngram_max": 3}})
    assert "decode.draft.ngram_min: must be <= decode.draft.ngram_max (3)" in message
    message = first_config_error(decode={"draft": {"method": "model"}})
    assert "decode.draft.model_path: decode.draft.method=model needs the draft model" in message
    message = first_config_error(decode={"draft": {"model_path": "/m"}})
    assert "decode.draft.model_path: is set but decode.draft.method is none: set decode.draft.method=model" in message


# ---- a draft model ----


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """A tiny target, and drafts of the same tokenizer: the target itself (it drafts what the target
    draws: every draft is taken) and another random model (it drafts little the target draws)."""
    root = tmp_path_factory.mktemp("draft_pair")
    folders = {name: make_tiny_checkpoint(root / name, "llama", seed=seed) for name, seed in (("t", 1), ("o", 2))}
    return {"folders": folders, "models": {k: load_model(str(f), dtype="float32").model for k, f in folders.items()}}


DRAFT_MODEL = DraftConfig(method="model", model_path="(given as an object)")


@pytest.mark.parametrize("which", ["itself", "another"])
def test_a_draft_model_gives_plain_decodings_tokens(pair, which):
    from mlxcel.engine.draft_model import DraftModel

    target = pair["models"]["t"]
    draft = DraftModel(target if which == "itself" else pair["models"]["o"], target.args.vocab_size)
    prompts = prompts_for(3) + [list(range(5, 80))]  # (a prompt past the draft's batched backlog: caught up first)
    plain, plain_state = run(target, prompts, samplers=mixed_samplers(), chunk=16)
    drafted, state = run(target, prompts, DRAFT_MODEL, samplers=mixed_samplers(), chunk=16, draft_model=draft)
    assert drafted == plain and state.draft_off is None
    figures = [r.draft for r in state.results if r.draft is not None]
    accepted, offered = sum(f["accepted"] for f in figures), sum(f["drafted"] for f in figures)
    if which == "itself":  # the greedy rows take every draft; the sampled ones what their draws agree with
        assert all(f["accepted"] == f["drafted"] > 0 for f in (state.results[i].draft for i in (0, 3, 5)))
        assert state.decode_steps < 0.6 * plain_state.decode_steps
    else:
        assert offered > 0 and accepted < offered
    assert not draft.table.owned.any()  # every row's blocks in the draft's pool went back


def test_a_job_with_a_draft_model(pair, tmp_path):
    from mlxcel.runner import run as run_job
    from tests.test_hybrid_paths import job_config

    target = pair["folders"]["t"]
    rows_file = write_rows(tmp_path / "rows.jsonl", [{"id": i, "prompt": f"a b c {i}"} for i in range(4)])
    settings = ("decode.max_tokens=16", "decode.ignore_eos=true", "runner.progress=off")
    run_job(job_config(str(target), rows_file, *settings), tmp_path / "plain", None, None)
    drafted = ("decode.draft.method=model", f"decode.draft.model_path={target}")
    run_job(job_config(str(target), rows_file, *settings, *drafted), tmp_path / "spec", None, None)
    plain = {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "plain")}
    assert {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "spec")} == plain
    stats = json.loads((tmp_path / "spec" / "stats.json").read_text())["draft"]
    assert stats["rows"] == 4 and stats["acceptance_rate"] == 1.0 and stats["tokens_per_step"] > 2


def test_a_draft_model_of_another_tokenizer_or_with_recurrent_layers_is_refused(pair, tmp_path):
    from mlxcel.errors import MlxcelError
    from mlxcel.runner import run as run_job
    from tests.test_families_qwen3_5 import make_checkpoint
    from tests.test_hybrid_paths import job_config

    rows_file = write_rows(tmp_path / "rows.jsonl", [{"prompt": "a b c"}])
    target = str(pair["folders"]["t"])
    hybrid = make_checkpoint(tmp_path / "hybrid", "qwen3_5_text")
    cases = [
        ("embedded:smollm2", "in the draft's vocabulary and"),
        (str(hybrid), "keeps recurrent state, which a rejected draft cannot take back yet"),
    ]
    for path, message in cases:
        settings = ("decode.draft.method=model", f"decode.draft.model_path={path}", "runner.progress=off")
        with pytest.raises(MlxcelError, match=message):
            run_job(job_config(target, rows_file, *settings), tmp_path / "run", None, None)


def test_chat_turns_and_a_ray_worker_draft_as_the_api_answers(pair, tmp_path, monkeypatch):
    """The chat loop (its answers kept in the prompt cache for the next turn) and the Ray job's worker
    body with the target drafting for itself: every draft taken, the tokens of plain decoding."""
    import io
    import sys

    from mlxcel import load_generator
    from mlxcel.chat import chat
    from tests.helpers import drive_job_worker
    from tests.test_hybrid_paths import job_config

    target = str(pair["folders"]["t"])
    plain = ("model=hf", "runner.device=cpu", "model.dtype=float32", "decode.max_tokens=12", "decode.ignore_eos=true")
    drafted = ("decode.draft.method=model", f"decode.draft.model_path={target}")
    api = load_generator({"model": {"path": target}}, overrides=["runner.prompt_cache=false", *plain])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello, world!\nI am fine, thank you.\n")))
    args = [f"model.path={target}", *plain, *drafted, "prompt.system=Be brief.", f"hydra.run.dir={tmp_path / 'chat'}"]
    assert chat(args, io.StringIO(), io.StringIO()) == 0
    turns = read_rows(tmp_path / "chat")
    first = api.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}])
    assert turns[0]["token_ids"] == first.token_ids
    assert turns[1]["token_ids"] == api.generate(turns[1]["messages"]).token_ids
    assert all(t["draft"]["accepted"] == t["draft"]["drafted"] > 0 for t in turns)

    rows = [{"id": f"p{i}", "prompt": text} for i, text in enumerate(["a b c", "Hello, world!", "def add(a, b):"])]
    cfg = job_config(target, write_rows(tmp_path / "rows.jsonl", rows), *plain[3:], *drafted, "runner.progress=off")
    got, _, _ = drive_job_worker(cfg)
    expected = api.generate([row["prompt"] for row in rows])
    assert {r["id"]: r["token_ids"] for r in got} == {row["id"]: e.token_ids for row, e in zip(rows, expected)}
    assert all(r["draft"]["accepted"] == r["draft"]["drafted"] > 0 for r in got)


# ---- structured output ----


@pytest.mark.parametrize("source", ["oracle", "ngram"])
def test_constrained_rows_draft_what_their_matcher_accepts(tiny_llama, monkeypatch, source):
    """Rows with a JSON schema, a regex, grammars and a choice beside free rows: a constrained row's
    draft is cut to what its matcher accepts (or is the tokens its grammar forces), each verified
    position is masked by the matcher after the drafted tokens before it, and every row draws the
    tokens of plain constrained decoding."""
    from mlxcel.sampling import make_sampler_chain
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer
    from tests.helpers import make_token_prompts
    from tests.test_structured import CHOICES, DATE, GBNF, LARK, SCHEMA

    model = load_model(str(tiny_llama), dtype="float32").model
    constraints = Constraints(load_tokenizer(tiny_llama), model.args.vocab_size, [2])
    specs = [{"json_schema": SCHEMA}, {"regex": DATE}, None, {"grammar": GBNF}, {"choice": CHOICES}, {"grammar": LARK}]
    prompts = make_token_prompts(11, len(specs))
    chain = make_sampler_chain({"selector": {"kind": "greedy"}}, model.args.vocab_size)

    def generate(draft):
        rows = [
            RowRequest(p, row_id=i, max_tokens=40, constraint=constraints.compile(spec) if spec else None)
            for i, (p, spec) in enumerate(zip(prompts, specs))
        ]
        request = GenerationRequest(
            rows, chain, max_tokens=40, stop_token_ids=frozenset([2]), constraints=constraints, draft=draft
        )
        state = BatchScheduler(model, 512, max_rows=4).generate(request)
        return [r.token_ids for r in state.results], state

    plain, _ = generate(None)
    if source == "oracle":
        monkeypatch.setattr(BatchScheduler, "propose_drafts", draft_from(plain, seed=8))
    drafted, state = generate(NGRAM)
    assert drafted == plain
    for i, spec in enumerate(specs):
        if spec is not None:
            assert state.results[i].constraint_satisfied is (state.results[i].finish_reason == "stop"), i
    constrained = [state.results[i].draft for i, spec in enumerate(specs) if spec]
    assert sum(f["accepted"] for f in constrained) > 0  # (forced tokens, at least, are drafted and taken)


def test_a_verify_call_holds_at_most_its_budget_and_the_best_drafters_keep_theirs(monkeypatch):
    from types import SimpleNamespace

    from mlxcel.engine import scheduler

    monkeypatch.setitem(scheduler.VERIFY_TOKENS, "cpu", 10)
    monkeypatch.setitem(scheduler.VERIFY_TOKENS, "gpu", 10)

    def row(accepted, drafted):
        return SimpleNamespace(drafts=SimpleNamespace(accepted=accepted, drafted=drafted))

    class Batch:
        rows = [row(1, 10), row(9, 10), SimpleNamespace(drafts=None), row(0, 0)]

        def __len__(self):
            return len(self.rows)

    batch = Batch()
    drafts = [[1, 2, 3], [4, 5, 6], [], [7, 8, 9]]
    rows_form, ragged = SimpleNamespace(verifies_as_rows=True), SimpleNamespace(verifies_as_rows=False)
    kept = scheduler.BatchScheduler.budget_drafts(rows_form, batch, drafts)
    # unpadded lines: 10 positions less the 4 rows' inputs; the row without figures yet (rate 1.0)
    # and the 90% row first
    assert kept == [[], [4, 5, 6], [], [7, 8, 9]]
    assert scheduler.BatchScheduler.budget_drafts(rows_form, batch, [[1], [], [], [2]]) == [[1], [], [], [2]]
    # the ragged call pads every line to the longest: 4 lines of at most 10 // 4 = 2 positions
    assert scheduler.BatchScheduler.budget_drafts(ragged, batch, drafts) == [[1], [4], [], [7]]
    assert scheduler.BatchScheduler.budget_drafts(ragged, [row(0, 0)], [list(range(20))]) == [list(range(9))]
    assert scheduler.BatchScheduler.budget_drafts(ragged, [row(0, 0)] * 5, [[1, 2]] * 5) == [[1]] * 5
    # 6 lines in 10 positions: no room past the rows' inputs
    assert scheduler.BatchScheduler.budget_drafts(ragged, [row(0, 0)] * 6, [[1, 2]] * 6) is None


def test_the_draft_pool_holds_no_more_positions_than_the_models_own(pair):
    """A server's open feed: the draft model's pool is sized by the model's pool (which the KV budget
    caps) and the drafts' overhang, not by max_rows rows of the whole context."""
    from mlxcel.engine.draft_model import DraftModel

    target = pair["models"]["t"]
    scheduler = BatchScheduler(target, 32768, 64, draft_model=DraftModel(target, target.args.vocab_size))
    scheduler.slots = 64
    request = GenerationRequest([], Sampler("greedy"), draft=NGRAM)
    scheduler.make_draft_pool([], request, open_feed=True, target_blocks=100)
    assert scheduler.draft_model.table.max_blocks == 100 + 64 * 2  # (4 drafted tokens: one block, and one more)


def test_the_draft_models_pool_comes_out_of_the_kv_budget(pair, monkeypatch):
    """runner.kv_budget_gb holds both pools: the model's blocks and the draft model's beside them
    (each with its own bytes a block, the drafts' overhang included), and the tokens stay plain
    decoding's."""
    from mlxcel.engine import scheduler as scheduler_module
    from mlxcel.engine.draft_model import DraftModel
    from mlxcel.engine.scheduler import kv_bytes_per_position
    from mlxcel.models.paged_cache import BLOCK_SIZE

    target, other = pair["models"]["t"], pair["models"]["o"]
    tables = []

    class Recorded(scheduler_module.PageTable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tables.append(self)

    monkeypatch.setattr(scheduler_module, "PageTable", Recorded)
    block = {name: kv_bytes_per_position(m) * BLOCK_SIZE for name, m in (("t", target), ("o", other))}
    budget = 12 * block["t"]  # (a pool of the model's alone would hold 12 blocks)
    prompts = prompts_for(3)
    plain, _ = run(target, prompts, kv_budget_bytes=budget)
    drafted, state = run(
        target, prompts, DRAFT_MODEL, kv_budget_bytes=budget, draft_model=DraftModel(other, target.args.vocab_size)
    )
    assert drafted == plain and state.draft_off is None
    model_pool, draft_pool = tables[-2].max_blocks, tables[-1].max_blocks
    assert model_pool * block["t"] + draft_pool * block["o"] <= budget
    assert model_pool < 12 and draft_pool >= model_pool
