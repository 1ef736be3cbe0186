"""Batch jobs through the CLI on a tiny model: JSONL rows, error rows, resume, dry run."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_one_line_error, by_key, job_args, read_rows, run_cli, write_rows

ROWS = [
    {"id": "capital", "prompt": "What is the capital of France?"},
    {
        "id": "chat",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    },
    {"prompt": "Numbers 0123456789 and symbols", "max_tokens": 3},
    {"id": "many", "prompt": "def add(a, b):", "n": 2},
    {"id": "too_long", "prompt": "hello world " * 300},
    {"id": "seeded", "prompt": "The capital of Italy", "seed": 5},
]


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_jsonl_job_writes_every_row_and_isolates_the_bad_one(tmp_path, tiny_llama):
    rows_file = write_rows(tmp_path / "rows.jsonl", ROWS)
    result = run_cli(tmp_path, *job_args(tiny_llama, rows_file, "runner.max_rows=2"))
    assert result.returncode == 0, result.stderr
    rows = by_key(read_rows(tmp_path / "run"))
    assert set(rows) == {
        ("capital", 0),
        ("chat", 0),
        ("3", 0),
        ("many", 0),
        ("many", 1),
        ("too_long", 0),
        ("seeded", 0),
    }
    assert rows[("too_long", 0)]["finish_reason"] == "error" and "context of 256" in rows[("too_long", 0)]["error"]
    assert len(rows[("3", 0)]["token_ids"]) == 3 and rows[("3", 0)]["finish_reason"] == "length"
    assert rows[("chat", 0)]["messages"][0] == {"role": "system", "content": "Be brief."}
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["status"] == "completed"
    assert stats["finish_reasons"] == {"error": 1, "length": 6} and stats["rows"] == 7
    assert [b["rows"] for b in stats["batches"]] == [6]  # one schedule: rows join as others finish
    assert 1 < stats["occupancy"] <= 2 and 0 < stats["kv_peak_gb"] <= stats["kv_budget_gb"]
    assert stats["host_ms_per_step"] > 0
    ran = [r for r in rows.values() if r["finish_reason"] != "error"]
    assert all(0 <= r["queue_ms"] <= r["ttft_ms"] <= r["latency_ms"] and r["decode_tok_per_sec"] > 0 for r in ran)
    ttfts = sorted(r["ttft_ms"] for r in ran)
    assert ttfts[0] <= stats["row_ttft_ms"]["p50"] <= stats["row_ttft_ms"]["p95"] <= ttfts[-1]
    assert stats["row_latency_ms"]["p95"] <= max(r["latency_ms"] for r in ran)
    assert "occupancy" in result.stderr
    assert stats["generated_tokens"] == sum(len(r["token_ids"]) for r in rows.values())
    assert "1 of 7 rows failed" in result.stderr
    # what makes the run reproducible is recorded with it
    assert stats["model"]["files"]["model.safetensors"] > 0 and len(stats["model"]["fingerprint_sha256"]) == 64
    assert "runner.max_rows=2" in stats["overrides"] and {"mlx", "mlxcel", "device"} <= set(stats["environment"])
    assert "6/6 rows" in result.stderr  # plain progress lines when stderr is not a terminal


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_rows_are_the_same_alone_in_batches_and_across_reruns(tmp_path, tiny_llama):
    rows_file = write_rows(tmp_path / "rows.jsonl", [r for r in ROWS if r.get("id") != "too_long"])
    for run, batch in (("b1", 1), ("b4", 4), ("b4again", 4)):
        result = run_cli(
            tmp_path, *job_args(tiny_llama, rows_file, f"runner.max_rows={batch}", "sampler=temperature"), run=run
        )
        assert result.returncode == 0, result.stderr
    alone, batched, again = (by_key(read_rows(tmp_path / run)) for run in ("b1", "b4", "b4again"))
    assert {k: r["token_ids"] for k, r in alone.items()} == {k: r["token_ids"] for k, r in batched.items()}
    assert [r["token_ids"] for r in read_rows(tmp_path / "b4")] == [
        r["token_ids"] for r in read_rows(tmp_path / "b4again")
    ]
    assert batched[("many", 0)]["token_ids"] != batched[("many", 1)]["token_ids"]  # samples draw differently


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_row_seed_replaces_the_sampler_seed(tmp_path, tiny_llama):
    seeded = write_rows(tmp_path / "a.jsonl", [{"id": "s", "prompt": "The capital of Italy", "seed": 5}])
    plain = write_rows(tmp_path / "b.jsonl", [{"id": "s", "prompt": "The capital of Italy"}])
    assert run_cli(tmp_path, *job_args(tiny_llama, seeded, "sampler=temperature"), run="a").returncode == 0
    assert (
        run_cli(tmp_path, *job_args(tiny_llama, plain, "sampler=temperature", "sampler.seed=5"), run="b").returncode
        == 0
    )
    assert read_rows(tmp_path / "a")[0]["token_ids"] == read_rows(tmp_path / "b")[0]["token_ids"]


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_resume_skips_written_rows_and_appends_the_rest(tmp_path, tiny_llama):
    rows_file = write_rows(tmp_path / "rows.jsonl", [r for r in ROWS if r.get("id") != "too_long"])
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="full").returncode == 0
    full = read_rows(tmp_path / "full")
    # a crash after two rows, mid-way through writing the third
    crashed = tmp_path / "crashed"
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="crashed").returncode == 0
    lines = (crashed / "generations.jsonl").read_text().splitlines()
    (crashed / "generations.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])
    fresh = run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="crashed")
    assert_one_line_error(fresh, 2, "runner.resume=true")
    resumed = run_cli(
        tmp_path, *job_args(tiny_llama, rows_file, "runner.resume=true", "runner.max_rows=3"), run="crashed"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "2 row(s) already written, 4 to go" in resumed.stderr
    rows = [json.loads(line) for line in (crashed / "generations.jsonl").read_text().splitlines()]
    assert sorted(by_key(rows)) == sorted(by_key(full)) and len(rows) == len(full)  # none lost, none twice
    assert {k: r["token_ids"] for k, r in by_key(rows).items()} == {k: r["token_ids"] for k, r in by_key(full).items()}


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_resume_a_folder_written_before_max_rows_tile_size_auto_and_prompt_format(tmp_path, tiny_llama):
    """A run folder from before runner.batch_size became runner.max_rows and prefill.tile_size's
    default became auto resumes, and gives the rows the uninterrupted run gives."""
    rows_file = write_rows(tmp_path / "rows.jsonl", ROWS[:4])
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="full").returncode == 0
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="old").returncode == 0
    old = tmp_path / "old"
    config = json.loads((old / "config.resolved.json").read_text())
    config["runner"]["batch_size"] = config["runner"].pop("max_rows")
    config["prefill"]["tile_size"] = None
    config["prompt"].pop("format")  # (before prompt.format was a key)
    (old / "config.resolved.json").write_text(json.dumps(config))
    lines = (old / "generations.jsonl").read_text().splitlines()
    (old / "generations.jsonl").write_text("\n".join(lines[:2]) + "\n")
    resumed = run_cli(tmp_path, *job_args(tiny_llama, rows_file, "runner.resume=true"), run="old")
    assert resumed.returncode == 0, resumed.stderr
    full, rows = by_key(read_rows(tmp_path / "full")), by_key(read_rows(old))
    assert {k: r["token_ids"] for k, r in rows.items()} == {k: r["token_ids"] for k, r in full.items()}


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_resume_with_a_different_config_says_what_differs(tmp_path, tiny_llama):
    rows_file = write_rows(tmp_path / "rows.jsonl", ROWS[:2])
    assert run_cli(tmp_path, *job_args(tiny_llama, rows_file)).returncode == 0
    result = run_cli(tmp_path, *job_args(tiny_llama, rows_file, "runner.resume=true", "decode.max_tokens=9"))
    assert_one_line_error(result, 2, "decode.max_tokens: differs from the run being resumed (was 6) (got 9)")
    missing = run_cli(tmp_path, *job_args(tiny_llama, rows_file, "runner.resume=true"), run="nowhere")
    assert_one_line_error(missing, 2, "not a run folder to resume")


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_bad_jsonl_lines_are_reported_with_line_numbers(tmp_path, tiny_llama):
    rows_file = write_rows(
        tmp_path / "rows.jsonl",
        [{"id": "a", "prompt": "x"}],
        ("not json", '{"id": "a", "prompt": "y"}', '{"text": "z"}'),
    )
    result = run_cli(tmp_path, *job_args(tiny_llama, rows_file))
    assert_one_line_error(result, 2, "prompt.file line 2: not valid JSON")
    rows_file = write_rows(
        tmp_path / "rows.jsonl", [{"id": "a", "prompt": "x"}], ('{"id": "a", "prompt": "y"}', '{"text": "z"}')
    )
    result = run_cli(tmp_path, *job_args(tiny_llama, rows_file), run="second")
    assert_one_line_error(
        result,
        2,
        "prompt.file line 2: duplicate id (first used at line 1) (got 'a')",
        "prompt.file line 3: text: unknown key",
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_inline_rows_and_dry_run(tmp_path, tiny_llama):
    rows = "prompt.rows=[{id: a, prompt: 'Hello, world'}, {messages: [{role: user, content: hi}], n: 2}]"
    result = run_cli(
        tmp_path, f"model.path={tiny_llama}", "prompt.text=null", rows, "runner.dry_run=true", "prefill.chunk_size=4"
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "run"
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    assert [(p["id"], p["sample"]) for p in prompts] == [("a", 0), (2, 0), (2, 1)]
    first = prompts[0]
    assert first["prompt_text"].startswith("<|im_start|>user\nHello, world<|im_end|>")
    pieces = first["prefill_pieces"]
    assert first["history_tokens"] in [p["end"] for p in pieces]  # the history boundary is a cut
    assert all(p["end"] - p["start"] <= 4 and p["pad"] == 0 for p in pieces)
    assert first["prefill_pieces"][-1]["end"] == len(first["prompt_token_ids"])
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["status"] == "dry_run" and "params" not in stats["model"]  # no weights were loaded
    assert not (run_dir / "generations.jsonl").exists()


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_ctrl_c_keeps_every_finished_row(tmp_path, tiny_llama):
    import signal

    from tests.helpers import stop_cli_after_rows

    rows_file = write_rows(tmp_path / "rows.jsonl", [{"id": i, "prompt": f"row {i}"} for i in range(6)])
    run_dir = tmp_path / "run"
    args = [
        f"model.path={tiny_llama}",
        "prompt=jsonl",
        f"prompt.file={rows_file}",
        "decode.max_tokens=480",
        "decode.ignore_eos=true",
        "runner.max_rows=1",
        f"hydra.run.dir={run_dir}",
    ]
    code, stderr = stop_cli_after_rows(tmp_path, args, run_dir, 1, signal.SIGINT)
    generations = run_dir / "generations.jsonl"
    assert code == 130, stderr
    rows = [json.loads(line) for line in generations.read_text().splitlines()]
    assert 1 <= len(rows) < 6 and all(len(r["token_ids"]) == 480 for r in rows)
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["finish_reasons"]["length"] == len(rows)


def test_ctrl_c_inside_a_row_write_waits_for_the_write(tmp_path):
    import signal

    import pytest

    from mlxcel.outputs import RunOutputs, defer_interrupt

    outputs = RunOutputs(tmp_path)
    counted = []
    with pytest.raises(KeyboardInterrupt), defer_interrupt():
        signal.raise_signal(signal.SIGINT)  # arrives mid-block: held, not raised here
        outputs.append_generation({"id": 1})
        counted.append(1)
    assert counted == [1] and (tmp_path / "generations.jsonl").read_text() == '{"id": 1}\n'
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_jsonl_tool_call_conversations_with_row_tools_render_as_transformers(tmp_path):
    """Assistant tool calls, tool results (tool_call_id, name) and per-row `tools` reach the
    template as transformers passes them; a row without tools renders without them."""
    from transformers import AutoTokenizer

    from tests.helpers import TEMPLATES, TOOLS, WEATHER_TOOL, make_tiny_checkpoint

    tiny_llama = make_tiny_checkpoint(
        tmp_path / "long_context", "llama", max_position_embeddings=2048
    )  # tool schemas are long

    template = TEMPLATES / "qwen2.5.jinja"
    rows_file = write_rows(
        tmp_path / "rows.jsonl",
        [{"id": "t", "messages": TOOLS, "tools": [WEATHER_TOOL]}, {"id": "plain", "messages": TOOLS[:2]}],
    )
    result = run_cli(
        tmp_path,
        *job_args(tiny_llama, rows_file),
        f"template.file={template}",
        "runner.dry_run=true",
        "model.max_context=2048",
    )
    assert result.returncode == 0, result.stderr
    prompts = {p["id"]: p for p in map(json.loads, (tmp_path / "run" / "prompts.jsonl").read_text().splitlines())}
    reference = AutoTokenizer.from_pretrained(str(tiny_llama))
    source = template.read_text(encoding="utf-8")
    expected = reference.apply_chat_template(
        TOOLS, chat_template=source, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert prompts["t"]["prompt_text"] == expected and "get_weather" in expected
    plain = reference.apply_chat_template(TOOLS[:2], chat_template=source, tokenize=False, add_generation_prompt=True)
    assert prompts["plain"]["prompt_text"] == plain and "get_weather" not in plain


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_message_checks_name_the_field(tmp_path, tiny_llama):
    rows_file = write_rows(
        tmp_path / "rows.jsonl",
        [{"messages": [{"role": "user"}]}, {"messages": [{"role": "assistant", "content": " "}]}],
    )
    result = run_cli(tmp_path, *job_args(tiny_llama, rows_file))
    assert result.returncode == 2
    assert "messages.0.content: required (only an assistant message with tool_calls may omit it)" in result.stderr
    assert "messages.0.content: must not be empty or only whitespace" in result.stderr
