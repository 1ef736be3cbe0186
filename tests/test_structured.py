"""Structured output: rows constrained to a JSON schema, a regex, a choice list or a grammar share
a batch with each other and with free rows. A tiny random Llama samples at temperature 1, so only
the masks make its answers match; the checks are other people's code (jsonschema, `re`,
llguidance's numpy mask)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxcel.config import DecodeConfig, validate_config
from mlxcel.errors import ConfigError
from mlxcel.runner import run
from mlxcel.sampling.chain import has_cpu_jit_compiler
from mlxcel.sampling.processors import apply_token_bitmask
from mlxcel.sampling.rows import compiled_apply_token_bitmask
from mlxcel.structured.spec import ConstraintError, check_spec, read_response_format
from tests.helpers import write_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CHOICES = ["yes", "no", "maybe so"]
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'  # a GBNF grammar, as llama.cpp writes them
GBNF_MATCH = r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)"
LARK = 'start: "say " WORD\nWORD: /[a-z]{1,5}/'
SAMPLER = {"processors": {"temperature": {"value": 1.0}}, "selector": {"kind": "categorical"}, "seed": 7}


def make_rows(count: int = 2) -> list[dict]:
    rows = []
    for i in range(count):
        rows += [
            {"id": f"json{i}", "prompt": f"person {i}", "response_format": json_format(SCHEMA)},
            {"id": f"date{i}", "prompt": f"date {i}", "constraint": {"regex": DATE}},
            {"id": f"choice{i}", "prompt": f"pick {i}", "constraint": {"choice": CHOICES}},
            {"id": f"sum{i}", "prompt": f"sum {i}", "constraint": {"grammar": GBNF}},
            {"id": f"lark{i}", "prompt": f"say {i}", "constraint": {"grammar": LARK}},
            {"id": f"free{i}", "prompt": f"anything {i}"},
        ]
    return rows


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def run_job(tmp_path, tiny_llama, rows, name: str, decode: dict | None = None, sampler: dict = SAMPLER, **runner):
    path = write_rows(tmp_path / f"{name}.jsonl", rows)
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 256},
            "template": {"kind": "none"},
            "prompt": {"file": str(path)},
            "decode": {"max_tokens": 60, **(decode or {})},
            "sampler": sampler,
            "runner": {"max_rows": 8, **runner},
        }
    )
    result = run(cfg, tmp_path / name, stream=None, log=None)
    stats = json.loads((tmp_path / name / "stats.json").read_text())
    return {str(r["id"]): r for r in result.generations}, stats


def check_answer(row: dict) -> None:
    kind, text = row["id"].rstrip("0123456789"), row["text"]
    assert row["finish_reason"] == "stop" and row["constraint_satisfied"] is True, row
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "date":
        assert re.fullmatch(DATE, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "sum":
        assert re.fullmatch(GBNF_MATCH, text), text
    elif kind == "lark":
        assert re.fullmatch(r"say [a-z]{1,5}", text), text


def test_mixed_constraints_share_a_batch_and_every_answer_matches(tmp_path, tiny_llama):
    rows = make_rows(2)
    got, stats = run_job(tmp_path, tiny_llama, rows, "mixed")
    for row in got.values():
        if not row["id"].startswith("free"):
            check_answer(row)
        else:
            assert "constraint_satisfied" not in row
    assert stats["constraints"]["rows"] == 10 and stats["constraints"]["satisfied"] == 10
    # each row as it runs alone (seeded rows: the batch does not change a row's tokens)
    for row in rows[:6]:
        alone, _ = run_job(tmp_path, tiny_llama, [row], f"alone-{row['id']}")
        assert alone[row["id"]]["token_ids"] == got[row["id"]]["token_ids"], row["id"]
    # and a rerun of the whole job gives the same tokens
    again, _ = run_job(tmp_path, tiny_llama, rows, "again")
    assert {k: r["token_ids"] for k, r in again.items()} == {k: r["token_ids"] for k, r in got.items()}


def set_order(monkeypatch, order: str) -> None:
    """One of bench.structured's ORDERS of a constrained step, for any number of rows."""
    import mlxcel.engine.scheduler as scheduler
    from mlxcel.bench.structured import ORDERS

    threaded_rows, few_rows_order = ORDERS[order]
    monkeypatch.setattr(scheduler, "THREADED_MASK_ROWS", threaded_rows)
    monkeypatch.setattr(scheduler, "FEW_ROWS_ORDER", few_rows_order)


@pytest.mark.cuda  # the orders differ where the device runs apart from the host
def test_every_order_of_a_constrained_step_draws_alike(tmp_path, tiny_llama, monkeypatch):
    """The orders of a constrained step draw the same tokens, and each runs the steps it claims:
    split queues a first half and advances the matchers on the mask thread, thread only the latter,
    after advances them on the scheduler's thread."""
    import threading

    import mlxcel.engine.scheduler as scheduler

    rows = make_rows(2)
    outcomes, threads, halves = {}, [], []
    advance, first_half = scheduler.advance_matchers, scheduler.first_half

    def counted_advance(*args):
        threads.append(threading.current_thread().name.startswith("mlxcel-masks"))
        return advance(*args)

    monkeypatch.setattr(scheduler, "advance_matchers", counted_advance)
    monkeypatch.setattr(scheduler, "first_half", lambda caches: halves.append(1) or first_half(caches))
    for order in ("split", "thread", "after"):
        set_order(monkeypatch, order)
        got, _ = run_job(tmp_path, tiny_llama, rows, order)
        assert len(threads) > 50 and set(threads) == {order != "after"}, order
        assert len(halves) == (len(threads) if order == "split" else 0), order
        threads.clear()
        halves.clear()
        outcomes[order] = {
            k: (r["token_ids"], r["finish_reason"], r.get("constraint_satisfied")) for k, r in got.items()
        }
    assert outcomes["split"] == outcomes["thread"] == outcomes["after"]
    assert sum(satisfied is True for _, _, satisfied in outcomes["split"].values()) == 10


@pytest.mark.cuda  # the orders differ where the device runs apart from the host
def test_every_order_draws_alike_with_a_quantized_kv_cache(tmp_path, monkeypatch):
    """decode.kv_bits: the split order's first half is then the quantized pool's parts (head_dim 32
    here: the tiny model's 16 is below the smallest group). Every order draws the same tokens, and
    the quantized cache does change them (the setting reaches the pool)."""
    import mlxcel.engine.scheduler as scheduler
    from tests.helpers import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "llama_head32", "llama", seed=3, head_dim=32)
    rows, outcomes, halves = make_rows(1), {}, []
    first_half = scheduler.first_half
    monkeypatch.setattr(scheduler, "first_half", lambda caches: halves.append(first_half(caches)) or halves[-1])
    for order in ("split", "thread", "after", "plain"):
        set_order(monkeypatch, "after" if order == "plain" else order)
        decode = {} if order == "plain" else {"kv_bits": 4, "kv_group_size": 32}
        got, _ = run_job(tmp_path, folder, rows, order, decode)
        outcomes[order] = {k: (r["token_ids"], r.get("constraint_satisfied")) for k, r in got.items()}
        if order == "split":  # a quantized pool's state: each of keys and values as (data, scales, biases)
            assert halves and all(len(half) == 6 for half in halves), [len(half) for half in halves[:3]]
    assert outcomes["split"] == outcomes["thread"] == outcomes["after"] != outcomes["plain"]
    assert sum(satisfied is True for _, satisfied in outcomes["split"].values()) == 5


def constrained_greedy_reference(
    reference, matcher, words: int, prompt: list[int], max_tokens: int, eos: int
) -> list[int]:
    """transformers' forward pass, llguidance's own mask (its numpy fill, unpacked here), argmax:
    a greedy constrained row that shares no code with the scheduler's loop, sampler or masks."""
    import torch
    from llguidance.numpy import fill_next_token_bitmask

    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = reference(torch.tensor([ids])).logits[0, -1]
            if matcher is not None:
                mask = np.zeros((1, words), dtype=np.int32)
                fill_next_token_bitmask(matcher, mask, 0)
                allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(logits)].astype(bool)
                logits[torch.from_numpy(~allowed)] = -float("inf")
            token = int(torch.argmax(logits))
            if token == eos:
                break
            if matcher is not None:
                assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize(
    "order, decode_step",
    [("split", "eager"), ("split", "segmented"), ("thread", "eager"), ("after", "eager")],
)
def test_greedy_constrained_rows_equal_transformers_with_llguidances_masks(tiny_llama, monkeypatch, order, decode_step):
    """Mixed constrained and free rows, greedy in one batch (logprobs asked), in every order of a
    constrained step and with the segmented decode step (the GPU's for few rows): each
    row's tokens are transformers' greedy tokens under llguidance's mask for that row alone."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import make_sampler_chain
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer
    from tests.helpers import load_reference, make_token_prompts

    set_order(monkeypatch, order)
    model = load_model(str(tiny_llama), dtype="float32").model
    tokenizer = load_tokenizer(tiny_llama)
    constraints = Constraints(tokenizer, model.args.vocab_size, [2])
    specs = [{"json_schema": SCHEMA}, {"regex": DATE}, None, {"grammar": GBNF}, {"choice": CHOICES}, {"grammar": LARK}]
    prompts = make_token_prompts(11, len(specs))
    rows = [
        RowRequest(prompt, row_id=i, max_tokens=40, constraint=constraints.compile(spec) if spec else None)
        for i, (prompt, spec) in enumerate(zip(prompts, specs))
    ]
    chain = make_sampler_chain({"selector": {"kind": "greedy"}}, model.args.vocab_size)
    request = GenerationRequest(
        rows, chain, max_tokens=40, stop_token_ids=frozenset([2]), constraints=constraints, logprobs=2
    )
    results = BatchScheduler(model, 512, max_rows=4, decode_step=decode_step).generate(request).results
    reference = load_reference(tiny_llama)
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        matcher = constraints.compile(spec).new_matcher() if spec else None
        words = (constraints.ll_tokenizer.vocab_size + 31) // 32
        expected = constrained_greedy_reference(reference, matcher, words, prompt, 40, eos=2)
        assert results[i].token_ids == expected, (i, spec)
        assert [entry["token"] for entry in results[i].logprobs] == expected
        if spec is not None:
            assert results[i].constraint_satisfied is (results[i].finish_reason == "stop"), i


def test_the_job_constraint_applies_to_rows_without_their_own(tmp_path, tiny_llama):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y", "constraint": {"choice": CHOICES}}]
    got, _ = run_job(tmp_path, tiny_llama, rows, "job", decode={"constraint": {"regex": DATE}})
    assert re.fullmatch(DATE, got["a"]["text"]) and got["b"]["text"] in CHOICES


def test_a_row_that_reaches_max_tokens_first_says_so(tmp_path, tiny_llama):
    rows = [{"id": "json0", "prompt": "p", "response_format": json_format(SCHEMA), "max_tokens": 3}]
    got, stats = run_job(tmp_path, tiny_llama, rows, "short")
    row = got["json0"]
    assert row["finish_reason"] == "length" and row["constraint_satisfied"] is False
    assert len(row["token_ids"]) == 3
    assert stats["constraints"]["satisfied"] == 0


def test_json_object_gives_a_json_object(tmp_path, tiny_llama):
    rows = [{"id": i, "prompt": f"obj {i}", "response_format": {"type": "json_object"}} for i in range(3)]
    got, _ = run_job(tmp_path, tiny_llama, rows, "object", decode={"max_tokens": 120})
    for row in got.values():
        if row["finish_reason"] == "stop":
            assert isinstance(json.loads(row["text"]), dict)
        else:  # free-form objects have no bound: a random model may run out of tokens
            assert row["finish_reason"] == "length" and row["constraint_satisfied"] is False
    assert all(row["text"].startswith("{") for row in got.values())
    assert any(row["finish_reason"] == "stop" for row in got.values())  # (rows 0-2 close at once: "{}")


def test_a_row_whose_constraint_does_not_compile_is_an_error_row(tmp_path, tiny_llama):
    rows = [
        {"id": "bad", "prompt": "x", "constraint": {"json_schema": {"type": "wat"}}},
        {"id": "badre", "prompt": "x", "constraint": {"regex": "[a-"}},
        {"id": "good", "prompt": "y", "constraint": {"choice": CHOICES}},
    ]
    got, _ = run_job(tmp_path, tiny_llama, rows, "bad")
    assert got["bad"]["finish_reason"] == "error" and "Invalid type: wat" in got["bad"]["error"]
    assert got["badre"]["finish_reason"] == "error" and "regex" in got["badre"]["error"]
    assert "\n" not in got["badre"]["error"]
    assert got["good"]["text"] in CHOICES


def test_a_job_constraint_that_does_not_compile_is_a_config_error(tmp_path, tiny_llama):
    with pytest.raises(ConfigError) as err:
        run_job(tmp_path, tiny_llama, [{"prompt": "x"}], "cfg", decode={"constraint": {"grammar": "start: foo"}})
    message = str(err.value)
    assert message.startswith("decode.constraint.grammar: does not compile:") and "foo" in message
    assert "\n" not in message


def test_constraint_config_checks():
    def issues(constraint, **decode):
        with pytest.raises(ConfigError) as err:
            validate_config({"model": {"path": "x"}, "decode": {"constraint": constraint, **decode}})
        return str(err.value)

    assert "exactly one of json_schema, regex, choice, grammar" in issues({"regex": "a", "choice": ["a"]})
    assert "exactly one" in issues({"grammar": "start: a", "json_schema": {}})
    unset = {"json_schema": None, "regex": None, "choice": None, "grammar": None}  # conf/decode/default.yaml's
    assert DecodeConfig.model_validate({"constraint": unset}).constraint is None
    assert "decode.constraint.choice" in issues({"choice": []})
    assert "decode.constraint.json_schema: is not valid JSON" in issues({"json_schema": "{nope"})
    assert "decode.ignore_eos" in issues({"regex": "a"}, ignore_eos=True)
    assert "decode.constraint.regexp" in issues({"regexp": "a"})  # extra keys are refused


def test_constraint_files_are_read_when_the_run_starts(tmp_path):
    def spec(kind: str, path):
        return DecodeConfig.model_validate({"constraint": {kind: str(path)}}).constraint.to_spec()

    with pytest.raises(ConfigError, match="decode.constraint.json_schema: cannot read the file"):
        spec("json_schema", tmp_path / "missing.json")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    assert spec("json_schema", tmp_path / "schema.json") == {"json_schema": SCHEMA}
    (tmp_path / "sum.gbnf").write_text(GBNF)
    assert spec("grammar", tmp_path / "sum.gbnf") == {"grammar": GBNF}
    assert spec("regex", "a.json") == {"regex": "a.json"}  # only json_schema and grammar name files


def test_response_format_shapes():
    assert read_response_format({"type": "text"}) is None
    assert read_response_format({"type": "json_object"}) == {"json_schema": {"type": "object"}}
    assert read_response_format(json_format(SCHEMA)) == {"json_schema": SCHEMA}
    for bad, fragment in [
        ({"type": "xml"}, "must be one of text, json_object, json_schema"),
        ({"type": "json_schema"}, "must be an object"),
        ({"type": "json_object", "schema": {}}, "unknown keys ['schema']"),
        ("json", "must be one of"),
    ]:
        with pytest.raises(ConstraintError, match=re.escape(fragment)):
            read_response_format(bad)
    with pytest.raises(ConstraintError, match="constraint.choice: must be a non-empty list"):
        check_spec({"choice": ["a", ""]})
    with pytest.raises(ConstraintError, match="exactly one of"):
        check_spec({"regex": "a", "grammar": "b"})
    with pytest.raises(ConstraintError, match="constraint.json_schema: must be a JSON object"):
        check_spec({"json_schema": "[1]"})


def test_the_mask_matches_llguidances_own():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    for vocab in (70, 96, 1000):
        logits = rng.normal(size=(3, vocab)).astype(np.float32)
        bitmask = rng.integers(-(2**31), 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        expected = logits.copy()
        apply_token_bitmask_inplace(expected, bitmask)
        got = np.array(apply_token_bitmask(mx.array(logits), mx.array(bitmask)))
        np.testing.assert_array_equal(got, expected)
        if has_cpu_jit_compiler() or mx.default_device() == mx.gpu:  # the fused form a GPU runs
            fused = np.array(compiled_apply_token_bitmask(mx.array(logits), mx.array(bitmask)))
            np.testing.assert_array_equal(fused, expected)
        half = np.array(apply_token_bitmask(mx.array(logits).astype(mx.bfloat16), mx.array(bitmask)).astype(mx.float32))
        assert np.array_equal(np.isinf(half), np.isinf(expected))


def test_a_dry_run_compiles_the_constraints_too(tmp_path, tiny_llama):
    with pytest.raises(ConfigError, match="decode.constraint.regex: does not compile"):
        run_job(tmp_path, tiny_llama, [{"prompt": "x"}], "dry", decode={"constraint": {"regex": "(a"}}, dry_run=True)


def test_batch_file_lines_carry_their_response_format(tmp_path):
    from mlxcel.batch_files import read_batch_rows
    from mlxcel.sampling.config import SamplerConfig

    def line(custom_id, response_format):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}

    path = write_rows(
        tmp_path / "batch.jsonl",
        [line("a", json_format(SCHEMA)), line("b", {"type": "json_object"}), line("c", {"type": "yaml"})],
    )
    rows = read_batch_rows(path, None, SamplerConfig())
    assert rows[0].constraint == {"json_schema": SCHEMA} and rows[1].constraint == {"json_schema": {"type": "object"}}
    assert "response_format.type: must be one of" in rows[2].batch["error"]


@pytest.mark.cuda  # the orders differ where the device runs apart from the host
@pytest.mark.parametrize("order", ["split", "thread", "after"])
def test_constrained_rows_arrive_and_leave_an_open_loop(tiny_llama, monkeypatch, order):
    """A server's shape: constrained and free rows arrive while others decode, one constrained
    row is cancelled mid-answer; every other row gets the tokens it gets alone."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import make_sampler_chain
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer
    from tests.helpers import ScriptedFeed, make_token_prompts

    set_order(monkeypatch, order)
    model = load_model(str(tiny_llama), dtype="float32").model
    tokenizer = load_tokenizer(tiny_llama)
    constraints = Constraints(tokenizer, model.args.vocab_size, [2])
    chain = make_sampler_chain(SAMPLER, model.args.vocab_size)
    specs = [{"regex": DATE}, None, {"choice": CHOICES}, {"json_schema": SCHEMA}, None, {"grammar": GBNF}]
    prompts = make_token_prompts(5, len(specs))

    def make_row(i: int) -> RowRequest:
        constraint = constraints.compile(specs[i]) if specs[i] else None
        return RowRequest(prompts[i], row_id=i, max_tokens=60, constraint=constraint)

    def run(feed_or_rows):
        engine = BatchScheduler(model, 512, 3, kv_budget_bytes=50_000_000)
        request = GenerationRequest([], chain, max_tokens=60, stop_token_ids=frozenset([2]), constraints=constraints)
        results = {}
        steps = engine.steps(request, lambda r, t: True, lambda r, res: results.__setitem__(r, res), feed=feed_or_rows)
        for _ in steps:
            pass
        return results

    feed = ScriptedFeed(
        {0: [(i, make_row(i)) for i in (0, 1, 3)], 3: [(2, make_row(2))], 6: [(4, make_row(4)), (5, make_row(5))]},
        {5: [3]},
    )
    together = run(feed)
    assert together[3].finish_reason == "cancelled" and together[3].constraint_satisfied is False
    for i in (0, 1, 2, 4, 5):
        alone = run(ScriptedFeed({0: [(i, make_row(i))]}))[i]
        assert together[i].token_ids == alone.token_ids, i
        if specs[i] is not None:
            kind = {0: "date", 2: "choice", 3: "json", 5: "sum"}[i]
            text = tokenizer.decode(together[i].token_ids)
            satisfied = together[i].constraint_satisfied
            check_answer(
                {
                    "id": kind,
                    "text": text,
                    "finish_reason": together[i].finish_reason,
                    "constraint_satisfied": satisfied,
                }
            )


def test_masks_fit_logits_narrower_than_the_tokenizer(tiny_llama):
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    narrow = tokenizer.vocab_size - 20  # a model whose head is narrower than its tokenizer
    constraints = Constraints(tokenizer, narrow, [2])
    matcher = constraints.compile({"choice": CHOICES}).new_matcher()
    masks = constraints.fill_masks([matcher, None])
    logits = apply_token_bitmask(mx.zeros((2, narrow)), mx.array(masks))
    allowed = np.isfinite(np.array(logits))
    assert allowed[1].all() and 0 < allowed[0].sum() < narrow
    first = [tokenizer.encode(c, add_special_tokens=False)[0] for c in CHOICES]
    assert all(allowed[0][t] for t in first if t < narrow)


def test_a_mask_buffer_is_written_in_place_and_read_for_the_batchs_rows(tiny_llama, monkeypatch):
    """MaskBuffer (the loop's masks, no new device array a step): fewer rows than it holds, then a
    step with other states, give the masks fill_masks makes fresh, under apply_token_bitmask; and
    where the view is not the array's memory it makes a new array each time."""
    from mlxcel.structured import matcher as matcher_module
    from mlxcel.structured.matcher import Constraints, MaskBuffer
    from mlxcel.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    vocab = tokenizer.vocab_size
    constraints = Constraints(tokenizer, vocab, [2])
    choice, date = (constraints.compile(spec).new_matcher() for spec in ({"choice": CHOICES}, {"regex": DATE}))
    buffer = MaskBuffer(constraints, 4)
    assert buffer.host is not None  # (the CPU: the view is the array's memory)

    def check(matchers, buffer):
        logits = mx.zeros((len(matchers), vocab))
        got = np.array(apply_token_bitmask(logits, buffer.fill(matchers)))
        want = np.array(apply_token_bitmask(logits, mx.array(constraints.fill_masks(matchers))))
        np.testing.assert_array_equal(got, want)
        return np.isfinite(got)

    first = check([choice, None, date], buffer)
    assert first[1].all() and not first[0].all() and not first[2].all()
    assert date.consume_token(tokenizer.encode("2", add_special_tokens=False)[0])
    second = check([date, choice], buffer)  # the same buffer, other rows in other states
    assert not np.array_equal(second[0], first[2]) and np.array_equal(second[1], first[0])
    # a loop on another thread (a server's engine thread) checks its buffer on a stream of its own
    built = []
    thread = threading.Thread(target=lambda: built.append(MaskBuffer(constraints, 2).host is not None))
    thread.start()
    thread.join()
    assert built == [True]
    monkeypatch.setattr(matcher_module, "device_sees_host_writes", lambda array, view: False)
    fresh = MaskBuffer(constraints, 4)
    assert fresh.host is None and fresh.fill([choice]) is not fresh.fill([choice])
    check([choice], fresh)


def nest(depth: int) -> str:
    """A JSON schema `depth` objects deep, as text."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def test_hostile_nesting_is_an_error_never_a_crash(tmp_path, tiny_llama):
    from mlxcel.batch_files import read_batch_rows
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer

    # llguidance's own limit: the row's error, and the other rows run
    path = tmp_path / "deep.jsonl"
    rows = ['{"id": "deep", "prompt": "x", "constraint": {"json_schema": ' + nest(400) + "}}"]
    path.write_text("\n".join([*rows, json.dumps({"id": "ok", "prompt": "y", "constraint": {"choice": CHOICES}})]))
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 256},
            "template": {"kind": "none"},
            "prompt": {"file": str(path)},
            "decode": {"max_tokens": 8},
        }
    )
    result = {r["id"]: r for r in run(cfg, tmp_path / "deep", stream=None, log=None).generations}
    assert result["deep"]["finish_reason"] == "error" and "recursion limit" in result["deep"]["error"]
    assert result["ok"]["text"] in CHOICES
    # deeper than Python's own JSON reader goes: the line is named, not a traceback
    path.write_text('{"id": "deep", "prompt": "x", "constraint": {"json_schema": ' + nest(3000) + "}}\n")
    with pytest.raises(ConfigError, match="prompt.file line 1: nested too deeply to read"):
        run(cfg, tmp_path / "deeper", stream=None, log=None)
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"custom_id": "x", "body": ' + nest(3000) + "}\n")
    (row,) = read_batch_rows(batch, None, None)
    assert "nested too deeply" in row.batch["error"]
    # a schema built in Python past the recursion limit of our own code
    constraints = Constraints(load_tokenizer(tiny_llama), 320, [2])
    schema = {"type": "string"}
    for _ in range(600):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ConstraintError, match="json_schema: nested too deeply to compile"):
        constraints.compile({"json_schema": schema})


def test_a_rows_bad_constraint_is_that_rows_error_naming_its_key():
    """A row's constraint that cannot be read (a bad shape, or both `constraint` and
    `response_format`) is that row's error, as one that does not compile is: the others run."""
    from mlxcel.config import PromptConfig
    from mlxcel.jobs import check_rows, hash_row

    prompt = PromptConfig.model_validate({"text": "x"})
    cases = [
        ({"constraint": {"choice": []}}, "constraint.choice: must be a non-empty list"),
        ({"constraint": {"regex": "a"}, "response_format": {"type": "json_object"}}, "constraint: give"),
        ({"response_format": {"type": "xml"}}, "response_format.type: must be one of"),
    ]
    for extra, fragment in cases:
        (row,) = check_rows([(3, {"prompt": "a", **extra})], prompt, "prompt.file=rows.jsonl")
        assert row.constraint is None and row.constraint_error.startswith(fragment), row
        assert hash_row(row) != hash_row(check_rows([(3, {"prompt": "a"})], prompt, "prompt.file=r.jsonl")[0])
    (row,) = check_rows([(1, {"prompt": "a", "response_format": json_format(SCHEMA)})], prompt, "prompt.file=r.jsonl")
    assert row.constraint == {"json_schema": SCHEMA} and row.constraint_error is None
    with pytest.raises(ConfigError, match="line 2: prompt: each row needs exactly one"):  # (the rest is the job's)
        check_rows([(2, {"constraint": {"regex": "a"}})], prompt, "prompt.file=rows.jsonl")


def test_a_row_with_both_constraint_and_response_format_is_an_error_row(tmp_path, tiny_llama):
    rows = [
        {"id": "both", "prompt": "x", "constraint": {"regex": "a"}, "response_format": {"type": "json_object"}},
        {"id": "ok", "prompt": "y", "constraint": {"choice": CHOICES}},
    ]
    got, stats = run_job(tmp_path, tiny_llama, rows, "both")
    assert got["both"]["finish_reason"] == "error"
    assert got["both"]["error"] == "constraint: give constraint or response_format, not both"
    assert got["ok"]["text"] in CHOICES and got["ok"]["constraint_satisfied"] is True
    assert stats["status"] == "completed"


# ---- constraint_satisfied: true means the returned answer is whole and valid (issue 39) ----
ONE_ANSWER = {  # (the layout is fixed: its one answer is {"a": 1})
    "type": "object",
    "properties": {"a": {"const": 1}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_stop_string_that_cuts_an_answer_leaves_it_unsatisfied(tmp_path, tiny_llama):
    """decode.stop_strings cut the text a row returns: satisfied means that text is a whole match,
    not that the tokens the matcher read were."""
    rows = [
        {"id": "json", "prompt": "a", "response_format": json_format(ONE_ANSWER)},  # {"a": 1} -> {"a": 1
        {"id": "abcdef", "prompt": "b", "constraint": {"choice": ["abcdef"]}},  # -> ab
        {"id": "ab", "prompt": "c", "constraint": {"choice": ["ab", "abcd"]}},  # -> ab, whole either way
        {"id": "uncut", "prompt": "d", "constraint": {"choice": ["xyz"]}},
    ]
    got, stats = run_job(tmp_path, tiny_llama, rows, "cut", decode={"stop_strings": ["}", "cd"]})
    expected = {"json": ('{"a": 1', False), "abcdef": ("ab", False), "ab": ("ab", True), "uncut": ("xyz", True)}
    assert {k: (r["text"], r["constraint_satisfied"]) for k, r in got.items()} == expected
    assert all(r["finish_reason"] == "stop" for r in got.values())
    assert stats["constraints"]["satisfied"] == 2


def test_a_cut_answer_is_judged_in_the_python_api_too(tiny_llama):
    from mlxcel.api import load_generator

    overrides = [f"model.path={tiny_llama}", "template=none", "decode.stop_strings=['}']", "decode.max_tokens=20"]
    gen = load_generator(overrides=overrides)
    cut = gen.generate("x", constraint={"json_schema": ONE_ANSWER})
    assert (cut.text, cut.finish_reason, cut.constraint_satisfied) == ('{"a": 1', "stop", False)
    assert gen.generate("x", constraint={"choice": ["xyz"]}).constraint_satisfied is True


def test_the_order_of_a_schemas_properties_is_its_own(tmp_path, tiny_llama):
    """Two schemas alike but for their properties' order are two grammars: the cache keys on the
    schema as given (a "reasoning before answer" schema must not answer first)."""
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer

    reasoning_first = {
        "type": "object",
        "properties": {"reasoning": {"type": "string", "maxLength": 5}, "answer": {"enum": [1, 2]}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    properties = reasoning_first["properties"]
    answer_first = {
        **reasoning_first,
        "properties": {"answer": properties["answer"], "reasoning": properties["reasoning"]},
    }
    tokenizer = load_tokenizer(tiny_llama)
    constraints = Constraints(tokenizer, tokenizer.vocab_size, [2])
    first, second = (constraints.compile({"json_schema": s}) for s in (reasoning_first, answer_first))
    assert first is not second and second.judge_text('{"answer": 1, "reasoning": "x"}')
    assert not second.judge_text('{"reasoning": "x", "answer": 1}')
    rows = [
        {"id": "reasoning", "prompt": "p", "response_format": json_format(reasoning_first)},
        {"id": "answer", "prompt": "p", "response_format": json_format(answer_first)},
    ]
    got, _ = run_job(tmp_path, tiny_llama, rows, "order")
    for key, row in got.items():
        assert row["constraint_satisfied"] is True, row
        assert next(iter(json.loads(row["text"]))) == key, row["text"]


def test_a_matcher_in_its_error_state_is_not_satisfied(tmp_path, tiny_llama, monkeypatch):
    """llguidance's is_stopped() is true in its error state too: a row whose token the matcher
    refused (here every token is let through the mask) ends in error, unsatisfied."""
    from mlxcel.structured.matcher import Constraints, is_satisfied
    from mlxcel.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    matcher = Constraints(tokenizer, tokenizer.vocab_size, [2]).compile({"regex": DATE}).new_matcher()
    assert not matcher.consume_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert matcher.is_error() and matcher.is_stopped() and not is_satisfied(matcher)

    def allow_everything(self, matchers, out=None):
        masks = np.full((len(matchers), self.mask_words), -1, dtype=np.int32)
        if out is not None:
            out[:] = masks
        return masks if out is None else out

    monkeypatch.setattr(Constraints, "fill_masks", allow_everything)
    rows = [{"id": i, "prompt": f"date {i}", "constraint": {"regex": DATE}} for i in range(4)]
    got, stats = run_job(tmp_path, tiny_llama, [*rows, {"id": "free", "prompt": "x"}], "refused")
    assert got.pop("free")["finish_reason"] == "length"
    for row in got.values():
        assert row["finish_reason"] == "error" and "refused token" in row["error"], row
        assert row["constraint_satisfied"] is False, row
    assert stats["constraints"]["satisfied"] == 0


INTEGER_A = {"type": "object", "properties": {"a": {"type": "integer"}}}
STRING_A = {"type": "object", "properties": {"a": {"type": "string"}}}
ESCAPED_KEY = '{"\\u0061": "x"}'  # the key "a", written with a \u escape


def test_json_answers_are_validated_past_the_matcher(tiny_llama):
    """llguidance's matcher accepts object keys written with \\u escapes unchecked: jsonschema
    decides a JSON schema's answer. Repeated keys and non-JSON constants are not whole either."""
    from mlxcel.structured.matcher import Constraints
    from mlxcel.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    constraints = Constraints(tokenizer, tokenizer.vocab_size, [2])
    constraint = constraints.compile({"json_schema": INTEGER_A})
    matcher, tokens = constraint.new_matcher(), constraints.ll_tokenizer.tokenize_str(ESCAPED_KEY)
    assert matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()  # (the gap)
    assert constraint.judge_text('{"a": 1}') and not constraint.judge_text(ESCAPED_KEY)
    free = constraints.compile({"json_schema": {"type": "object"}})
    assert free.judge_text('{"a": 1, "b": 2}') and not free.judge_text('{"a": 1, "\\u0061": 2}')
    assert not constraints.compile({"json_schema": True}).judge_text("NaN")


def forcing_checkpoint(folder, answer: str):
    """The tiny Llama with one more token, a text (not special) token spelling all of `answer`:
    greedy with a bias on it, the model writes `answer` whenever the mask allows it. Returns its id."""
    from tests.helpers import make_tiny_checkpoint

    make_tiny_checkpoint(folder, "llama", vocab_size=384)  # (rows past the tokenizer's: padding)
    data = json.loads((folder / "tokenizer.json").read_text())
    token = 1 + max([t["id"] for t in data["added_tokens"]] + list(data["model"]["vocab"].values()))
    added = {"id": token, "content": answer, "single_word": False, "lstrip": False, "rstrip": False}
    data["added_tokens"].append({**added, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return token


def test_an_escaped_key_the_matcher_lets_through_is_not_satisfied(tmp_path):
    folder = tmp_path / "forced"
    token = forcing_checkpoint(folder, ESCAPED_KEY)
    greedy = {"processors": {"logit_bias": {"bias": {token: 100.0}}}, "selector": {"kind": "greedy"}}
    rows = [
        {"id": "escaped", "prompt": "p", "response_format": json_format(INTEGER_A)},
        {"id": "string", "prompt": "p", "response_format": json_format(STRING_A)},
    ]
    got, stats = run_job(tmp_path, folder, rows, "escaped", sampler=greedy)
    assert got["escaped"]["token_ids"] == [token] and got["escaped"]["finish_reason"] == "stop"
    assert got["escaped"]["constraint_satisfied"] is False  # {"a": "x"}: a is not an integer
    assert got["string"]["text"] == ESCAPED_KEY and got["string"]["constraint_satisfied"] is True
    assert stats["constraints"]["satisfied"] == 1


def test_a_job_constraint_that_does_not_compile_is_refused_before_the_weights_load(tmp_path, tiny_llama, monkeypatch):
    import mlxcel.pipeline as pipeline

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights loaded before the constraint was checked")

    monkeypatch.setattr(pipeline, "load_weights_for", no_loading)
    for constraint, fragment in [
        ({"json_schema": {"type": "wat"}}, "decode.constraint.json_schema: does not compile: Invalid type: wat"),
        ({"json_schema": False}, "decode.constraint.json_schema: does not compile: Unsatisfiable schema"),
        ({"regex": "(a"}, "decode.constraint.regex: does not compile: at 1(8): invalid regex"),
        ({"grammar": "start: foo"}, "decode.constraint.grammar: does not compile: "),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            run_job(tmp_path, tiny_llama, [{"prompt": "x"}], "early", decode={"constraint": constraint})
        config = {"model": {"path": str(tiny_llama)}, "prompt": {"text": "x"}, "decode": {"constraint": constraint}}
        cfg = validate_config(config)
        with pytest.raises(ConfigError, match=re.escape(fragment)):  # (what mlxcel-run checks before Hydra runs)
            pipeline.check_model_config(cfg)


def test_the_boolean_schema_true_compiles(tmp_path, tiny_llama):
    """`true` (any JSON value) as a row's schema, as the job's, and as response_format's."""
    any_value = {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}
    rows = [
        {"id": "row", "prompt": "a", "constraint": {"json_schema": True}},
        {"id": "format", "prompt": "b", "response_format": any_value},
        {"id": "job", "prompt": "c"},
    ]
    got, _ = run_job(tmp_path, tiny_llama, rows, "true", decode={"constraint": {"json_schema": True}})
    assert all(r["finish_reason"] in ("stop", "length") for r in got.values())
    for row in got.values():
        if row["finish_reason"] == "stop":
            json.loads(row["text"])
        assert row["constraint_satisfied"] is (row["finish_reason"] == "stop"), row
    assert check_spec({"json_schema": "true"}) == {"json_schema": True}
