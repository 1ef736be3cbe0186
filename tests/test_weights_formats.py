"""Weight formats of HF folders: fp16/bf16 safetensors, sharded checkpoints (and their broken
forms), MLX affine-quantized folders as `mlx_lm.convert -q` writes them (built here with
mx.quantize; cross-checked against mlx_lm when it is installed), model.quantize at load, and
config/weight shape mismatches. Oracle: transformers on the same (rounded) weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel.checkpoints.loader import load_model
from mlxcel.checkpoints.quantize import dequantize_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.errors import MlxcelError
from mlxcel.sampling import Sampler
from tests.helpers import load_reference, make_tiny_checkpoint, requires_smollm2

torch = pytest.importorskip("torch")
PROMPT = [(13 * i + 5) % 300 + 3 for i in range(40)]


def logits_of(model) -> np.ndarray:
    return np.array(model(mx.array([PROMPT]), model.make_cache())[0].astype(mx.float32))


def greedy(model, n: int = 32) -> list[int]:
    request = GenerationRequest([RowRequest(PROMPT)], Sampler("greedy"), max_tokens=n)
    return DirectEngine(model, 512).generate(request).results[0].token_ids


def reference_logits(folder: Path) -> np.ndarray:
    with torch.no_grad():
        return load_reference(folder)(torch.tensor([PROMPT])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp32"), "llama", seed=3)


@pytest.mark.parametrize("saved", ["float16", "bfloat16"])
def test_half_precision_safetensors(checkpoint, tmp_path, saved):
    """Saved in half precision, run in fp32: equals transformers on the same rounded weights."""
    folder = tmp_path / saved
    shutil.copytree(checkpoint, folder)
    load_reference(checkpoint).to(getattr(torch, saved)).save_pretrained(folder)
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.model.model.embed_tokens.weight.dtype == mx.float32
    assert np.abs(logits_of(loaded.model) - reference_logits(folder)).max() <= 1e-3
    as_saved = load_model(str(folder), dtype=saved)
    assert as_saved.model.model.layers[0].mlp.down_proj.weight.dtype == getattr(mx, saved)
    assert as_saved.info["dtype"] == saved


def make_sharded(checkpoint: Path, folder: Path) -> Path:
    shutil.copytree(checkpoint, folder)
    (folder / "model.safetensors").unlink()
    load_reference(checkpoint).save_pretrained(folder, max_shard_size="60KB")
    return folder


def test_sharded_checkpoint_equals_the_single_file(checkpoint, tmp_path):
    folder = make_sharded(checkpoint, tmp_path / "sharded")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and (folder / "model.safetensors.index.json").exists()
    got = logits_of(load_model(str(folder), dtype="float32").model)
    np.testing.assert_array_equal(got, logits_of(load_model(str(checkpoint), dtype="float32").model))


def test_missing_shard_names_the_file(checkpoint, tmp_path):
    folder = make_sharded(checkpoint, tmp_path / "sharded")
    victim = sorted(folder.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(MlxcelError, match=f"{victim.name}: listed in model.safetensors.index.json but missing"):
        load_model(str(folder), dtype="float32")
    (folder / "model.safetensors.index.json").unlink()  # without the index: found by the -of-N name
    with pytest.raises(MlxcelError, match=f"{victim.name}: shard 2 of"):
        load_model(str(folder), dtype="float32")


def test_index_naming_a_missing_file_or_tensor(checkpoint, tmp_path):
    folder = make_sharded(checkpoint, tmp_path / "sharded")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        MlxcelError, match="model-extra.safetensors: listed in model.safetensors.index.json but missing"
    ):
        load_model(str(folder), dtype="float32")
    first = min(folder.glob("model-*-of-*.safetensors")).name
    index["weight_map"] = {**index["weight_map"], "model.norm.weight": first, "model.extra.weight": first}
    index_path.write_text(json.dumps(index))
    with pytest.raises(MlxcelError, match=f"{first}: lacks tensor model.extra.weight"):
        load_model(str(folder), dtype="float32")


def test_shape_that_does_not_fit_the_config_names_file_and_tensor(checkpoint, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(
        MlxcelError,
        match=r"bad/model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\), "
        r"but the config gives \(96, 64\)",
    ):
        load_model(str(folder), dtype="float32")


def test_tied_checkpoint_carrying_an_lm_head_copy(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tied", "qwen2")
    weights = mx.load(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    loaded = load_model(str(folder), dtype="float32")
    assert "lm_head" not in loaded.model and loaded.model.args.tie_word_embeddings
    assert np.abs(logits_of(loaded.model) - reference_logits(folder)).max() <= 1e-3


def write_mlx_quantized(
    checkpoint: Path, folder: Path, bits: int = 4, group_size: int = 32, overrides: dict | None = None
) -> Path:
    """What mlx_lm.convert -q writes: packed weight + scales + biases for each Linear and the
    embedding, `quantization` (and `quantization_config`) in config.json, per-layer overrides
    keyed by module path (a dict, or false for a layer kept dense)."""
    overrides = overrides or {}
    shutil.copytree(checkpoint, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    out = {}
    for name, value in weights.items():
        module = name.rsplit(".", 1)[0]
        spec = overrides.get(module, {"bits": bits, "group_size": group_size})
        if value.ndim == 2 and spec is not False:
            out[name], out[f"{module}.scales"], out[f"{module}.biases"] = mx.quantize(
                value, spec["group_size"], spec["bits"]
            )
        else:
            out[name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), out, {"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
    config.update(quantization=quantization, quantization_config=quantization)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


OVERRIDES = {"model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}, "model.layers.1.self_attn.o_proj": False}


def test_mlx_quantized_folder_matches_its_dequantized_form(checkpoint, tmp_path):
    folder = write_mlx_quantized(checkpoint, tmp_path / "q4", overrides=OVERRIDES)
    quantized = load_model(str(folder), dtype="float32")
    layers = quantized.model.model.layers
    down = layers[0].mlp.down_proj
    assert (type(down).__name__, down.bits, down.group_size) == ("QuantizedLinear", 8, 64)
    assert type(layers[1].self_attn.o_proj).__name__ == "Linear"
    assert quantized.model.model.embed_tokens.bits == 4
    assert quantized.info["quantization"] == {"bits": 4, "group_size": 32, "source": "checkpoint", "layer_overrides": 2}
    reference = load_model(str(folder), dtype="float32")
    dequantize_model(reference.model)
    assert not any(k.endswith(".scales") for k, _ in tree_flatten(reference.model.parameters()))
    assert np.abs(logits_of(quantized.model) - logits_of(reference.model)).max() <= 1e-3
    assert greedy(quantized.model) == greedy(reference.model)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_at_load_reports_its_error(checkpoint, bits):
    dense = load_model(str(checkpoint), dtype="float32")
    loaded = load_model(str(checkpoint), dtype="float32", quantize={"bits": bits, "group_size": 32})
    report = loaded.info["quantization"]
    assert report["source"] == "model.quantize" and report["bits"] == bits
    assert loaded.model.model.layers[0].mlp.down_proj.bits == bits
    # the figure is the real difference, on the probe: re-measure it here
    from mlxcel.checkpoints.quantize import PROBE_IDS

    probe = mx.array([PROBE_IDS])
    diff = np.abs(
        np.array(loaded.model(probe, loaded.model.make_cache()))
        - np.array(dense.model(probe, dense.model.make_cache()))
    )
    assert report["max_abs_logit_diff"] == pytest.approx(diff.max(), rel=1e-4, abs=1e-6)
    assert report["mean_abs_logit_diff"] == pytest.approx(diff.mean(), rel=1e-4, abs=1e-6)
    assert report["mean_abs_logit_diff"] > 0
    dequantized = load_model(str(checkpoint), dtype="float32", quantize={"bits": bits, "group_size": 32})
    dequantize_model(dequantized.model)
    assert greedy(loaded.model) == greedy(dequantized.model)


def test_quantization_error_falls_with_more_bits(checkpoint):
    errors = {
        b: load_model(str(checkpoint), dtype="float32", quantize={"bits": b, "group_size": 32}).info["quantization"]
        for b in (4, 8)
    }
    assert errors[8]["mean_abs_logit_diff"] < errors[4]["mean_abs_logit_diff"] / 8
    assert errors[8]["max_abs_logit_diff"] < errors[4]["max_abs_logit_diff"] / 8


def test_quantize_with_a_bad_bit_width_is_a_clear_error(checkpoint):
    with pytest.raises(MlxcelError, match="model.quantize: .*bits: 2, 3, 4, 5, 6 or 8"):
        load_model(str(checkpoint), dtype="float32", quantize={"bits": 7, "group_size": 32})


def test_mlx_lm_convert_folder_loads_and_matches_mlx_lm(checkpoint, tmp_path):
    """A folder written by mlx_lm.convert -q itself (dev-only cross-check; not a runtime import)."""
    mlx_lm = pytest.importorskip("mlx_lm")
    out = tmp_path / "mlx_lm_q4"
    mlx_lm.convert(str(checkpoint), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    ours = load_model(str(out), dtype="float32")
    assert ours.info["quantization"]["bits"] == 4
    theirs, _ = mlx_lm.load(str(out))
    expected = np.array(theirs(mx.array([PROMPT]))[0].astype(mx.float32))
    assert np.abs(logits_of(ours.model) - expected).max() <= 1e-3


@requires_smollm2
@pytest.mark.slow
def test_quantized_smollm2_speaks_as_its_dequantized_form():
    """The real model quantized at load (8-bit, group 64) and the same weights dequantized to
    fp32: identical greedy answers on the test prompts; and the answers are still right."""
    from mlxcel.template import build_prompt, load_template_source
    from mlxcel.tokenizer import load_tokenizer

    spec = {"bits": 8, "group_size": 64}
    quantized = load_model("embedded:smollm2", dtype="float32", gguf_weights="dequantize", quantize=spec)
    reference = load_model("embedded:smollm2", dtype="float32", gguf_weights="dequantize", quantize=spec)
    dequantize_model(reference.model)
    tokenizer = load_tokenizer(quantized.path, gguf_metadata=quantized.gguf_metadata)
    answers = []
    for question in ("What is the capital of France?", "Name three primary colors."):
        ids = build_prompt(
            tokenizer, [{"role": "user", "content": question}], load_template_source(tokenizer)
        ).token_ids
        request = GenerationRequest([RowRequest(ids)], Sampler("greedy"), max_tokens=24, stop_token_ids=frozenset([2]))
        tokens = [DirectEngine(m.model, 8192).generate(request).results[0].token_ids for m in (quantized, reference)]
        assert tokens[0] == tokens[1]
        answers.append(tokenizer.decode(tokens[0]))
    assert "Paris" in answers[0] and "Red" in answers[1]
    assert 0 < quantized.info["quantization"]["mean_abs_logit_diff"] < 0.5
