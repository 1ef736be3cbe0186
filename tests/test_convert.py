"""mlxcel-convert (issue 44 item 4): the folder it writes has mlx-community's layout and the
checkpoint's own tensor names, loads in mlxcel, mlx-lm and transformers, and gives the logits of
quantizing at load; per-layer overrides are in config.json and honoured; refusals are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.cli import compose_config
from mlxcel.config import validate_config
from mlxcel.convert import RECORD_FILE, convert, convert_command, validate_convert_config
from mlxcel.errors import ConfigError, MlxcelError
from tests.helpers import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("on_the_cpu")
PROMPT = [[5, 17, 33, 99, 120, 7, 250, 64]]
QUANTIZE_4 = {"bits": 4, "group_size": 64}


def run_convert(source: Path, output: Path | None, **settings) -> dict:
    cfg = validate_config(compose_config([f"model.path={source}", "runner.device=cpu"]))
    given = {"output": output and str(output), "progress": "off", **settings}
    return convert(cfg, validate_convert_config(given))


def logits(path: Path, **load) -> np.ndarray:
    loaded = load_model(str(path), dtype="float32", **load)
    return np.array(loaded.model(mx.array(PROMPT), loaded.model.make_cache()).astype(mx.float32))


def source_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        names |= set(mx.load(str(file)))
    return names


def written_names(folder: Path) -> set[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert {f for f in index["weight_map"].values()} == {p.name for p in folder.glob("*.safetensors")}
    return set(index["weight_map"])


@pytest.fixture(scope="module")
def llama_4bit(tiny_llama, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("convert") / "llama-4bit"
    run_convert(tiny_llama, output, dtype="float32", quantize=QUANTIZE_4)
    return output


@pytest.fixture(scope="module")
def qwen2_sharded(tiny_qwen2, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("convert") / "qwen2-fp32"
    run_convert(tiny_qwen2, output, dtype="float32", shard_gb=50e-6)  # ~50 KB shards: several files
    return output


def test_quantized_folder_layout_and_logits_equal_quantizing_at_load(tiny_llama, llama_4bit):
    files = {p.name for p in llama_4bit.iterdir()}
    assert {"model.safetensors", "model.safetensors.index.json", "config.json", RECORD_FILE} <= files
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= files
    config = json.loads((llama_4bit / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    # HF's names (q/k/v and gate/up apart, as the checkpoint has them), each quantized layer's
    # packed weight beside its scales and biases
    names = written_names(llama_4bit)
    dense = {n for n in names if not n.endswith((".scales", ".biases"))}
    assert dense == source_names(tiny_llama)
    assert "model.layers.0.self_attn.q_proj.scales" in names and "model.layers.0.mlp.gate_proj.biases" in names
    assert np.array_equal(logits(llama_4bit), logits(tiny_llama, quantize=QUANTIZE_4))
    record = json.loads((llama_4bit / RECORD_FILE).read_text())
    assert record["source"]["path"] == str(tiny_llama) and len(record["source"]["fingerprint"]) == 64
    assert record["options"]["quantize"]["bits"] == 4 and record["mlxcel"]["version"] and record["date"]


def test_dense_conversion_keeps_names_shards_and_logits(tiny_qwen2, qwen2_sharded):
    assert len(list(qwen2_sharded.glob("model-*-of-*.safetensors"))) > 1
    assert "quantization" not in json.loads((qwen2_sharded / "config.json").read_text())
    assert written_names(qwen2_sharded) == source_names(tiny_qwen2) - {"lm_head.weight"}  # (tied: as loaded)
    assert np.array_equal(logits(qwen2_sharded), logits(tiny_qwen2))
    torch = pytest.importorskip("torch")
    import transformers

    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(qwen2_sharded, dtype=torch.float32)(
            torch.tensor(PROMPT)
        )
    assert np.abs(got.logits.numpy() - logits(tiny_qwen2)).max() <= 1e-4


def test_mlx_lm_loads_the_folders(llama_4bit, qwen2_sharded):
    mlx_lm = pytest.importorskip("mlx_lm")
    for folder in (llama_4bit, qwen2_sharded):
        model, tokenizer = mlx_lm.load(str(folder))
        got = np.array(model(mx.array(PROMPT)).astype(mx.float32))
        assert np.abs(got - logits(folder)).max() <= 1e-4
        assert tokenizer.chat_template


def test_per_layer_overrides_in_config_and_honoured_on_load(tiny_llama, tmp_path):
    output = tmp_path / "mixed"
    layers = {"lm_head": {"bits": 8}, "embed_tokens": False, "model.layers.1.mlp.*": {"group_size": 32}}
    run_convert(tiny_llama, output, dtype="float32", quantize=QUANTIZE_4, layers=layers)
    quantization = json.loads((output / "config.json").read_text())["quantization"]
    assert quantization["lm_head"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert quantization["model.embed_tokens"] is False
    assert quantization["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert "model.layers.0.mlp.down_proj" not in quantization  # (the default)
    model = load_model(str(output), dtype="float32", fuse=False).model
    assert model.lm_head.bits == 8 and type(model.model.embed_tokens).__name__ == "Embedding"
    assert model.model.layers[1].mlp.down_proj.group_size == 32 and model.model.layers[0].mlp.down_proj.bits == 4
    mlx_lm = pytest.importorskip("mlx_lm")
    reference, _ = mlx_lm.load(str(output))
    assert reference.lm_head.bits == 8 and type(reference.model.embed_tokens).__name__ == "Embedding"
    assert np.abs(np.array(reference(mx.array(PROMPT))) - logits(output)).max() <= 1e-4


@pytest.mark.parametrize("mode", ["mxfp4"])
def test_other_modes_of_the_installed_mlx(tiny_llama, tmp_path, mode):
    from mlx import nn

    from mlxcel.convert import list_quantization_modes

    if mode not in list_quantization_modes():
        pytest.skip(f"this MLX has no {mode}")
    output = tmp_path / mode
    run_convert(tiny_llama, output, dtype="float32", quantize={"mode": mode})
    assert json.loads((output / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": mode,
    }
    expected = load_model(str(tiny_llama), dtype="float32", fuse=False).model
    nn.quantize(expected, 32, 4, mode=mode, class_predicate=lambda p, m: hasattr(m, "to_quantized"))
    want = np.array(expected(mx.array(PROMPT), expected.make_cache()))
    assert np.array_equal(logits(output), want)


def test_quantized_source_requantized_and_dequantized(llama_4bit, tmp_path):
    run_convert(llama_4bit, tmp_path / "8bit", quantize={"bits": 8})
    config = json.loads((tmp_path / "8bit" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["dtype"] == "float32"
    run_convert(llama_4bit, tmp_path / "dense", dequantize=True)
    assert "quantization" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    assert not any(n.endswith(".scales") for n in written_names(tmp_path / "dense"))
    assert np.abs(logits(tmp_path / "dense") - logits(llama_4bit)).max() <= 1e-4
    # as it is: the source's quantization copied
    run_convert(llama_4bit, tmp_path / "same")
    assert np.array_equal(logits(tmp_path / "same"), logits(llama_4bit))


def test_gguf_source(tiny_llama, tmp_path):
    pytest.importorskip("gguf")
    from tests.test_gguf_families import write_gguf_from_hf

    path = write_gguf_from_hf(tiny_llama, "llama", tmp_path / "llama.gguf")
    output = tmp_path / "from-gguf"
    run_convert(path, output, dtype="float32")
    # llama.cpp's Q/K permutation undone: HF's names and layout, HF's RoPE
    assert written_names(output) == source_names(tiny_llama)
    config = json.loads((output / "config.json").read_text())
    assert "rope_traditional" not in config and config["model_type"] == "llama"
    assert np.abs(logits(output) - logits(tiny_llama)).max() <= 1e-4
    from mlxcel.tokenizer import load_tokenizer

    assert load_tokenizer(output).encode("hello world") == load_tokenizer(tiny_llama).encode("hello world")
    assert json.loads((output / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_non_empty_output_refused_unless_overwrite(tiny_llama, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    with pytest.raises(ConfigError) as err:
        run_convert(tiny_llama, output)
    assert "convert.output: is not empty" in str(err.value) and "convert.overwrite=true" in str(err.value)
    assert (output / "model-00001-of-00009.safetensors").read_bytes() == b"stale"  # untouched
    run_convert(tiny_llama, output, overwrite=True)
    assert {p.name for p in output.glob("*.safetensors")} == {"model.safetensors"}  # the stale shard gone
    with pytest.raises(ConfigError, match="holds the source checkpoint"):
        run_convert(tiny_llama, tiny_llama, overwrite=True)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quantize": {"bits": 7}}, "convert.quantize.bits: must be one of 1, 2, 3, 4, 5, 6, 8 for mode affine"),
        ({"quantize": {"group_size": 48}}, "convert.quantize.group_size: must be one of 32, 64, 128 for mode affine"),
        ({"quantize": {"mode": "int3"}}, "convert.quantize.mode: must be one of affine"),
        ({"quantize": {"mode": "mxfp4", "group_size": 64}}, "convert.quantize.group_size: must be one of 32 for mode"),
        ({"layers": {"lm_head": False}}, "convert.layers: per-layer overrides need convert.quantize"),
        ({"quantize": {}, "layers": {"lm_head": {"bits": 9}}}, "convert.layers.lm_head.bits: must be one of"),
        ({"quantize": {}, "dequantize": True}, "convert.dequantize: give either"),
        ({"shard_gb": 0}, "convert.shard_gb"),
    ],
)
def test_bad_settings_are_config_errors(settings, message, tiny_llama, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_convert(tiny_llama, tmp_path / "out", **settings)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_output_and_source_failures_are_one_line(tiny_llama, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"convert.output: cannot write there: Not a directory"):
        run_convert(tiny_llama, tmp_path / "file" / "out")
    with pytest.raises(ConfigError, match=r"convert.output: required"):
        run_convert(tiny_llama, None)
    with pytest.raises(ConfigError, match=r"convert.output: is a file"):
        run_convert(tiny_llama, tmp_path / "file")
    broken = make_tiny_checkpoint(tmp_path / "broken", "llama")
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(MlxcelError, match=r"^cannot convert .*broken: .*missing required key") as err:
        run_convert(broken, tmp_path / "out2")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"convert.layers.no_such_layer: matches no layer that quantizes"):
        run_convert(tiny_llama, tmp_path / "out3", quantize={}, layers={"no_such_layer": {"bits": 8}})


def test_command_line_refusals(capsys):
    with pytest.raises(ConfigError, match=r"--q-bits: mlxcel-convert takes overrides: type 'convert\.quantize=\{bits"):
        convert_command(["--q-bits", "4"])
    with pytest.raises(ConfigError, match="not an option of mlxcel-convert"):
        convert_command(["some/model", "out"])
    assert convert_command(["--help"]) == 0
    assert "convert.output" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_converts_a_hub_id_from_the_cache(tiny_llama, tmp_path):
    import subprocess

    from tests.test_hub import make_hub_cache

    make_hub_cache(tmp_path / "cache", "tiny/llama", tiny_llama)
    from tests.helpers import REPO

    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "MLXCEL_BLAS": "off"}
    env["PYTHONPATH"] = str(REPO)  # (this checkout's code)
    command = [sys.executable, "-m", "mlxcel.convert", "model.path=tiny/llama", f"convert.output={tmp_path / 'out'}"]
    import os

    result = subprocess.run(
        [*command, "convert.quantize={bits: 4}", "runner.device=cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "mlxcel-convert: wrote" in result.stderr
    assert json.loads((tmp_path / "out" / RECORD_FILE).read_text())["source"]["model.path"] == "tiny/llama"
    again = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[0].startswith("mlxcel: config error: convert.output: is not empty")
