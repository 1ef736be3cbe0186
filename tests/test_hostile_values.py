"""Values out of reason (issue 38, items 9, 11 and 12): sizes that would become a terabyte
allocation, a loop without end, or a read that never returns. Each is a config error naming the
key and its legal range (exit 2), a 400 for a server request, or a template error, never a hang."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from mlxcel.errors import ConfigError, MlxcelError
from tests.helpers import first_config_error as validate

REPO = Path(__file__).resolve().parent.parent
HUGE = 10**12


# ---- item 9: sampler sizes ----
@pytest.mark.parametrize(
    "sampler, line",
    [
        ({"min_keep": HUGE}, f"sampler.min_keep: must be in [0, 1048576] (got {HUGE})"),
        (
            {"processors": {"penalties": {"last_n": HUGE}}},
            f"sampler.processors.penalties.last_n: must be in [-1, 1048576]; -1 = the whole history, 0 = off "
            f"(got {HUGE})",
        ),
        (
            {"processors": {"dry": {"last_n": HUGE}}},
            f"sampler.processors.dry.last_n: must be in [-1, 1048576]; -1 = the whole history, 0 = off (got {HUGE})",
        ),
        (
            {"processors": {"dry": {"allowed_length": HUGE}}},
            f"sampler.processors.dry.allowed_length: must be in [0, 1048576] (got {HUGE})",
        ),
        (
            {"processors": {"dry": {"breakers": ["x"] * 65}}},
            "sampler.processors.dry.breakers: must be a list of at most 64 strings (got 65)",
        ),
        (
            {"processors": {"top_k": {"k": HUGE}}},
            f"sampler.processors.top_k.k: must be <= 1048576; <= 0 turns top-k off (got {HUGE})",
        ),
        (
            {"processors": {"logit_bias": {"bias": {HUGE: 1.0}}}},
            f"sampler.processors.logit_bias.bias: keys must be token ids (integers in [0, 1048576)) (got {HUGE})",
        ),
        (
            {"processors": {"logit_bias": {"suppress": [HUGE]}}},
            f"sampler.processors.logit_bias.suppress: token ids must be in [0, 1048576) (got {HUGE})",
        ),
    ],
)
def test_sampler_sizes_past_the_ceiling_are_config_errors(sampler, line):
    assert validate(sampler=sampler) == line


def test_a_whole_history_window_still_works_and_a_window_is_no_wider_than_the_context():
    from mlxcel.config import validate_config
    from mlxcel.sampling import make_sampler_chain

    processors = {"penalties": {"repeat": 1.1, "last_n": -1}, "dry": {"multiplier": 0.8, "last_n": -1}}
    cfg = validate_config(
        {"model": {"path": "embedded:smollm2"}, "prompt": {"text": "hi"}, "sampler": {"processors": processors}}
    )
    assert make_sampler_chain(cfg.sampler, 100).history_width is None  # -1: the whole history, as before
    wide = {"processors": {"penalties": {"repeat": 1.1, "last_n": 2**20}}}
    assert make_sampler_chain(wide, 100).history_width == 2**20
    assert make_sampler_chain(wide, 100, max_context=512).history_width == 512  # a history never holds more


def test_a_request_asking_for_a_huge_sampler_window_is_a_400():
    from mlxcel.openai_protocol import ApiError, ChatRequest, make_sampler_config, parse_request
    from mlxcel.sampling.config import SamplerConfig

    for sampler in ({"min_keep": HUGE}, {"processors": {"dry": {"last_n": HUGE}}}):
        request = parse_request(
            ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mlxcel": {"sampler": sampler}}
        )
        with pytest.raises(ApiError) as err:
            make_sampler_config(SamplerConfig(), request, 100)
        assert err.value.status == 400 and "1048576" in err.value.message, err.value.message


# ---- item 12: budgets, counts and sizes ----
@pytest.mark.parametrize(
    "groups, line",
    [
        (
            {"runner": {"kv_budget_gb": float("inf")}},
            "runner.kv_budget_gb: must be a number of GB in (0, 4096] (null: 40% of device memory) (got inf)",
        ),
        (
            {"runner": {"kv_budget_gb": 1e300}},
            "runner.kv_budget_gb: must be a number of GB in (0, 4096] (null: 40% of device memory) (got 1e+300)",
        ),
        (
            {"runner": {"prompt_cache_gb": float("inf")}},
            "runner.prompt_cache_gb: must be a number of GB in (0, 4096] (null: 10% of device memory) (got inf)",
        ),
        ({"serve": {"max_body_mb": 1e300}}, "serve.max_body_mb: must be a number of MB in (0, 1024] (got 1e+300)"),
        ({"serve": {"max_body_mb": float("inf")}}, "serve.max_body_mb: must be a number of MB in (0, 1024] (got inf)"),
        ({"runner": {"max_rows": HUGE}}, f"runner.max_rows: must be an integer in [1, 4096] or 'auto' (got {HUGE})"),
        ({"runner": {"ray": {"workers": HUGE}}}, f"runner.ray.workers: must be an integer in [1, 4096] (got {HUGE})"),
        (
            {"runner": {"ray": {"start_timeout_s": float("inf")}}},
            "runner.ray.start_timeout_s: must be a number of seconds in (0, 86400] (got inf)",
        ),
        (
            {"model": {"path": "embedded:smollm2", "max_context": HUGE}},
            f"model.max_context: must be an integer in [1, 16777216] tokens (null: the model's own) (got {HUGE})",
        ),
        ({"prefill": {"chunk_size": HUGE}}, f"prefill.chunk_size: must be an integer in [1, 16777216] (got {HUGE})"),
        (
            {"prefill": {"tile_size": 32, "chunk_size": 16}},
            "prefill.chunk_size: must be >= prefill.tile_size (32): prefill pieces are whole tiles, and a chunk "
            "below one tile holds none (raise it, or lower prefill.tile_size, or set prefill.tile_size=null) (got 16)",
        ),
        (
            {"prompt": {"file": "/dev/zero"}},
            "prompt.file: must be a regular file, not a character device (got '/dev/zero')",
        ),
    ],
)
def test_values_out_of_reason_are_config_errors(groups, line):
    assert validate(**groups) == line


def test_a_chunk_below_the_tile_from_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("MLXCEL_PREFILL_CHUNK", "16")
    assert validate(prefill={"tile_size": 32}).startswith("MLXCEL_PREFILL_CHUNK: must be >= prefill.tile_size (32)")


def test_an_automatic_tile_steps_aside_for_a_smaller_chunk(monkeypatch):
    import mlxcel.config as config

    monkeypatch.setattr(config, "choose_tile_size", lambda setting: 32 if setting == "auto" else setting)
    assert config.PrefillConfig(chunk_size=16).resolved_tile_size() is None
    assert config.PrefillConfig(chunk_size=64).resolved_tile_size() == 32


@contextmanager
def fifo_at(path: Path):
    """A FIFO at `path` whose reader, if any, gets EOF at once (a writer opens and closes it): code
    that still reads it finishes with some other error instead of hanging the test."""
    os.mkfifo(path)

    def release() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY))  # blocks until a reader opens it
        except OSError:
            pass

    writer = threading.Thread(target=release, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():  # nobody opened it: a reader lets the writer's open return
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            writer.join(5)
            os.close(reader)


def test_a_fifo_or_a_folder_as_prompt_file_is_a_config_error(tmp_path):
    from mlxcel.config import PromptConfig
    from mlxcel.jobs import load_job_rows

    with fifo_at(tmp_path / "rows.jsonl") as fifo:
        assert validate(prompt={"file": str(fifo)}) == (
            f"prompt.file: must be a regular file, not a FIFO (named pipe) (got '{fifo}')"
        )
        with pytest.raises(ConfigError, match="prompt.file: must be a regular file, not a FIFO"):
            load_job_rows(PromptConfig(file=str(fifo)))
    (tmp_path / "rows").mkdir()
    assert validate(prompt={"file": str(tmp_path / "rows")}) == (
        f"prompt.file: must be a regular file, not a folder (got '{tmp_path / 'rows'}')"
    )


# ---- item 11: a FIFO among the weights ----
@pytest.mark.parametrize("name", ["model.safetensors", "extra.safetensors", "config.json", "tokenizer.model"])
def test_a_fifo_in_the_model_folder_is_refused(tmp_path, tiny_llama, name):
    from mlxcel.checkpoints.fingerprint import read_model_header
    from mlxcel.checkpoints.loader import load_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / name).unlink(missing_ok=True)
    for load in (read_model_header, lambda path: load_model(str(path))):
        with fifo_at(folder / name), pytest.raises(ConfigError) as raised:
            load(folder)
        (folder / name).unlink()
        assert raised.value.format().splitlines()[0] == (
            f"model.path: {name} is a FIFO (named pipe): a model's files must be regular files (got '{folder}')"
        )


def test_a_safetensors_header_claiming_exabytes_is_refused(tmp_path):
    from mlxcel.checkpoints.fingerprint import read_safetensors_header

    path = tmp_path / "model.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(MlxcelError, match="its header claims 4611686018427387904 bytes, past safetensors' 100000000"):
        read_safetensors_header(path)


# ---- item 11: a template's work and sizes ----
def render(source: str) -> str:
    from mlxcel.template import render_prompt

    return render_prompt(source, [{"role": "user", "content": "hi"}], object())


@pytest.mark.parametrize(
    "source, message",
    [
        (  # 10**7 iterations printing nothing (the issue's: 10**10)
            "{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
            "runs more than 2000000 loop iterations and calls",
        ),
        (  # a recursive loop's own iterations count too
            "{% for x in range(2) recursive %}{% for y in range(100000) %}{% endfor %}"
            "{% if loop.depth < 6 %}{{ loop(range(2)) }}{% endif %}{% endfor %}",
            "runs more than 2000000 loop iterations and calls",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "concatenates a value of 4194304 characters",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "concatenates a text of 4194304 characters",
        ),
        ("{{ 'a'.center(10000000000) }}", "asks center() for a result of 10000000000 characters"),
        ("{{ 'a'|center(10000000000) }}", "asks center() for a result of 10000000000 characters"),
        ("{{ '%010000000000d' % 1 }}", "asks for a field width or precision of 10000000000 characters"),
        ("{{ '{:.2000000000f}'.format(1.0) }}", "asks for a field width or precision of 2000000000 characters"),
        ("{% set s = 'a' * 3000000 %}{{ s.replace('a', s) }}", "replaces to a text of 9000000000000 characters"),
        ("{% set s = 'a' * 3000000 %}{{ ([s] * 3000000)|join }}", "joins a text of 9000000000000 characters"),
        ("{{ [1]|batch(1000000000, 'x')|list }}", "asks batch() for a result of 1000000000 characters"),
        ("{{ messages|tojson(indent=100000000) }}", "tojson(indent=...) past 16"),
    ],
)
def test_a_template_cannot_loop_or_grow_without_bound(source, message):
    with pytest.raises(MlxcelError, match=re.escape(message)):
        render(source)


def test_a_macro_that_calls_itself_twice_runs_out_of_steps(monkeypatch):
    import mlxcel.template as template

    monkeypatch.setattr(template, "MAX_TEMPLATE_STEPS", 10_000)  # (2**40 calls otherwise; the bound is the same)
    with pytest.raises(MlxcelError, match="runs more than 10000 loop iterations and calls"):
        render("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}")


def test_bounded_templates_render_as_before():
    source = (
        "{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% if loop.last %}!{% endif %}{% endfor %}"
        "{% for x in [[1, [2]], [3]] recursive %}{{ x if x is number else loop(x) }}{% endfor %}"
        "{{ '%s-%03d' % ('x', 3) }} {{ '{:>4}'.format('a') }} {{ 'ab'|center(6) }} {{ 'a-b'.replace('-', '+') }}"
        "{{ ['a', 'b']|join(',') }} {{ [1, 2, 3]|batch(2)|list }}"
    )
    assert render(source) == "user: hi!123x-003    a   ab   a+ba,b [[1, 2], [3]]"


# ---- item 11 from the command line: no spin, exit 2 ----
@pytest.mark.slow  # a subprocess
def test_a_chunk_below_one_tile_exits_2_at_once(tmp_path, tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLXCEL_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "mlxcel", f"model.path={tiny_llama}", "prefill.tile_size=32", "prefill.chunk_size=16"]
        + [f"prompt.text='{'a longer prompt than one chunk of sixteen tokens ' * 4}'", "hydra.run.dir=run"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # the spin it replaces never ended: a regression fails here instead of hanging
    )
    assert result.returncode == 2, result.stderr
    assert "prefill.chunk_size: must be >= prefill.tile_size (32)" in result.stderr
    assert "loading model" not in result.stderr and not (tmp_path / "run").exists()
