"""LoRA adapters (issue 44 items 1, 3 and 5, and the model side of item 2): `model.adapter` in PEFT's
and mlx-lm's formats against transformers + PEFT and mlx-lm; merged, unmerged and mixed batches
agree; bad adapters fail with one line naming the module and the shapes, before the weights load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints import loader
from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import ConfigError, MlxcelError
from tests.helpers import load_reference, make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("on_the_cpu")

PROMPT = [5, 17, 42, 9, 33, 21, 8, 40]
TOKENS = 6  # greedy tokens compared


def train_peft_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    """A PEFT LoRA adapter trained a few Adam steps (lora_B starts at zero: the steps make it count)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_reference(base), LoraConfig(**lora))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = torch.randint(3, 90, (2, 12))
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("adapter_base"), "llama", seed=3)


@pytest.fixture(scope="module")
def peft_adapter(base, tmp_path_factory) -> Path:
    """Every projection, rank 4 with rank_pattern / alpha_pattern overrides."""
    return train_peft_adapter(
        base,
        tmp_path_factory.mktemp("peft_a"),
        seed=0,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 3},
    )


@pytest.fixture(scope="module")
def rslora_adapter(base, tmp_path_factory) -> Path:
    """Attention only (q, v), rsLoRA, another rank."""
    return train_peft_adapter(
        base,
        tmp_path_factory.mktemp("peft_b"),
        seed=1,
        r=8,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["q_proj", "v_proj"],
    )


def peft_reference(base: Path, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base), adapter).eval()


def reference_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def mlxcel_logits(model, ids: list[list[int]]) -> np.ndarray:
    return np.array(model(mx.array(ids), model.make_cache(len(ids))).astype(mx.float32))


def greedy_mlxcel(model, ids: list[int], n: int) -> list[int]:
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache)
    return out


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


# ---- item 1 + 3: PEFT's format against transformers + PEFT ----


@pytest.mark.parametrize("which", ["peft_adapter", "rslora_adapter"])
def test_a_peft_adapter_gives_transformers_peft_logits_and_tokens(request, base, which):
    adapter = request.getfixturevalue(which)
    reference = peft_reference(base, adapter)
    loaded = load_model(str(base), "float32", adapter=str(adapter))
    assert loaded.info["adapters"]["merged"] and loaded.info["adapters"]["formats"] == ["peft"]
    ours, theirs = mlxcel_logits(loaded.model, [PROMPT])[0], reference_logits(reference, PROMPT)
    plain = reference_logits(load_reference(base), PROMPT)
    assert np.abs(theirs - plain).max() > 1e-2  # the adapter changes the logits: the test can fail
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert greedy_mlxcel(loaded.model, PROMPT, TOKENS) == greedy_reference(reference, PROMPT, TOKENS)


def test_unmerged_unfused_and_merged_agree(base, peft_adapter):
    merged = mlxcel_logits(load_model(str(base), "float32", adapter=str(peft_adapter)).model, [PROMPT])
    for fuse in (True, False):
        loaded = load_model(str(base), "float32", adapter=str(peft_adapter), merge_adapter=False, fuse=fuse)
        assert not loaded.info["adapters"]["merged"]
        np.testing.assert_allclose(mlxcel_logits(loaded.model, [PROMPT]), merged, atol=1e-4, rtol=0)


def test_a_quantized_base_keeps_the_adapter_beside_its_weights(base, peft_adapter, tmp_path):
    """An MLX-quantized folder: the adapter is not merged into packed weights but added beside them."""
    from mlxcel.checkpoints.quantize import dequantize_model

    dense = load_model(str(base), "float32", quantize={"bits": 8, "group_size": 32}, fuse=False)
    adapted = load_model(str(base), "float32", quantize={"bits": 8, "group_size": 32}, adapter=str(peft_adapter))
    assert adapted.info["adapters"]["merged"]  # quantize-at-load: merged into the dense weights, then quantized
    folder = write_quantized_folder(dense, base, tmp_path / "q8")
    on_packed = load_model(str(folder), "float32", adapter=str(peft_adapter))
    assert not on_packed.info["adapters"]["merged"]
    dequantize_model(dense.model)  # the same packed weights, dense: the adapter merges into them
    expected = load_into(dense.model, peft_adapter)
    np.testing.assert_allclose(mlxcel_logits(on_packed.model, [PROMPT]), expected, atol=1e-4, rtol=0)


def write_quantized_folder(loaded, base: Path, folder: Path) -> Path:
    from mlx.utils import tree_flatten

    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(loaded.model.parameters())))
    config = json.loads((base / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def load_into(model, adapter: Path) -> np.ndarray:
    from mlxcel.checkpoints.adapters import plan_adapters

    plan = plan_adapters(str(adapter), None)
    plan.check(model)
    plan.merge_into(model)
    assert plan.merged
    return mlxcel_logits(model, [PROMPT])


# ---- item 2, the model's side: several adapters in one forward call ----


@pytest.fixture(scope="module")
def several(base, peft_adapter, rslora_adapter):
    loaded = load_model(str(base), "float32", adapters={"a": str(peft_adapter), "b": str(rslora_adapter)})
    alone = {
        name: mlxcel_logits(load_model(str(base), "float32", adapter=str(path)).model, [PROMPT, PROMPT[::-1]])
        for name, path in (("a", peft_adapter), ("b", rslora_adapter))
    }
    alone["none"] = mlxcel_logits(load_model(str(base), "float32").model, [PROMPT, PROMPT[::-1]])
    return loaded, alone


def test_rows_with_different_adapters_match_each_adapter_merged_alone(several):
    loaded, alone = several
    model, control = loaded.model, loaded.model.adapter_control
    assert control.names == ("a", "b") and loaded.info["adapters"]["names"] == ["a", "b"]
    rows = [PROMPT, PROMPT[::-1], PROMPT]
    control.set_tokens([0, 1, -1])  # one adapter a row
    out = mlxcel_logits(model, rows)
    np.testing.assert_allclose(out[0], alone["a"][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[1], alone["b"][1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[2], alone["none"][0], atol=1e-4, rtol=0)
    control.set_tokens(np.array([[1] * len(PROMPT), [0] * len(PROMPT)], dtype=np.int32))  # one a token
    out = mlxcel_logits(model, [PROMPT, PROMPT[::-1]])
    np.testing.assert_allclose(out[0], alone["b"][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[1], alone["a"][1], atol=1e-4, rtol=0)
    control.clear()  # no index: the base model
    np.testing.assert_allclose(mlxcel_logits(model, [PROMPT]), alone["none"][:1], atol=1e-4, rtol=0)


def test_a_per_token_index_follows_logits_at(several):
    """The last layer's MLP runs at the asked positions only: the index given with logits_at fits it."""
    loaded, alone = several
    model, control = loaded.model, loaded.model.adapter_control
    index = mx.array([[0] * len(PROMPT), [1] * len(PROMPT)], dtype=mx.int32)
    control.set_tokens(index, logits_at=len(PROMPT) - 1)
    out = model(mx.array([PROMPT, PROMPT[::-1]]), model.make_cache(2), logits_at=len(PROMPT) - 1)
    np.testing.assert_allclose(np.array(out[0, -1]), alone["a"][0, -1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(out[1, -1]), alone["b"][1, -1], atol=1e-4, rtol=0)
    control.clear()
    with pytest.raises(MlxcelError, match=r"values must be in \[-1, 1\]"):
        control.set_tokens([0, 2])


# ---- item 3: mlx-lm's format against mlx-lm ----


def test_an_mlx_lm_adapter_gives_mlx_lm_logits(base, tmp_path):
    pytest.importorskip("mlx_lm")
    from mlx.utils import tree_flatten
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm_load(str(base))
    params = {
        "rank": 4,
        "scale": 10.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"],
    }
    model.freeze()  # as mlx_lm.lora does: only the LoRA matrices are trainable, and saved
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(0)
    adapters = {k: mx.random.normal(v.shape) * 0.05 for k, v in tree_flatten(model.trainable_parameters())}
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), adapters)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    reference, _ = mlx_lm_load(str(base), adapter_path=str(tmp_path))
    theirs = np.array(reference(mx.array([PROMPT])).astype(mx.float32))
    loaded = load_model(str(base), "float32", adapter=str(tmp_path))
    assert loaded.info["adapters"]["formats"] == ["mlx-lm"]
    np.testing.assert_allclose(mlxcel_logits(loaded.model, [PROMPT]), theirs, atol=1e-4, rtol=0)


# ---- item 5: bad adapters ----


def write_peft(folder: Path, tensors: dict[str, tuple], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {f"base_model.model.{k}": mx.zeros(shape) for k, shape in tensors.items()}
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), arrays)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    return folder


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (  # another model size
            {f"{Q}.lora_A.weight": (4, 32), f"{Q}.lora_B.weight": (32, 4)},
            {},
            f"{Q}: the adapter maps 32 -> 32 (rank 4) but this llama model's layer maps 64 -> 64",
        ),
        (  # another architecture (GPT-2's names)
            {
                "transformer.h.0.attn.c_attn.lora_A.weight": (4, 64),
                "transformer.h.0.attn.c_attn.lora_B.weight": (192, 4),
            },
            {},
            "the adapter adapts transformer.h.0.attn.c_attn, which this llama model does not have",
        ),
        (  # the config's rank is not the tensors'
            {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (64, 4)},
            {"r": 8},
            f"{Q} has rank 4 (A (4, 64), B (64, 4)) but adapter_config.json says 8",
        ),
        (  # A and B of different ranks
            {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (64, 2)},
            {},
            f"{Q} has LoRA A (4, 64) and B (64, 2), which do not share a rank",
        ),
        (  # a target module without tensors
            {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (64, 4)},
            {"target_modules": ["q_proj", "v_proj"]},
            "target_modules names 'v_proj' but adapter_model.safetensors holds no LoRA tensors for it",
        ),
        (  # DoRA
            {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (64, 4)},
            {"use_dora": True},
            "use_dora: DoRA is not supported",
        ),
        (  # an embedding adapter
            {"model.embed_tokens.lora_embedding_A": (4, 64), "model.embed_tokens.lora_embedding_B": (64, 4)},
            {},
            "adapters on embedding layers are not supported",
        ),
    ],
    ids=["shape", "architecture", "rank", "ranks", "targets", "dora", "embedding"],
)
def test_a_bad_adapter_is_one_line_before_any_weight_loads(base, tmp_path, monkeypatch, tensors, config, message):
    adapter = write_peft(tmp_path / "bad", tensors, **config)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the adapter was checked")

    monkeypatch.setattr(loader, "load_safetensors", no_weights)
    with pytest.raises(MlxcelError) as raised:
        load_model(str(base), "float32", adapter=str(adapter))
    text = str(raised.value)
    assert message in text and "\n" not in text


def test_an_mlx_lm_dora_adapter_is_refused(base, tmp_path):
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    config = {"fine_tune_type": "dora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 1.0}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        MlxcelError, match="fine_tune_type 'dora' is not supported: fuse it into the base with mlx_lm.fuse"
    ):
        load_model(str(base), "float32", adapter=str(tmp_path))


def test_the_config_checks_adapter_names_and_folders(tmp_path):
    from mlxcel.config import validate_config

    base = {"model": {"path": "embedded:smollm2"}, "prompt": {"text": "hi"}}

    def first_error(**model) -> str:
        with pytest.raises(ConfigError) as raised:
            validate_config({**base, "model": {**base["model"], **model}})
        return raised.value.format().splitlines()[0]

    assert "model.adapters: adapter name 'a:b' must be 1-64 letters" in first_error(adapters={"a:b": str(tmp_path)})
    assert "model.adapters.x: must be an adapter folder" in first_error(adapters={"x": str(tmp_path / "none")})
    assert "model.adapter: must be an adapter folder" in first_error(adapter=str(tmp_path / "none"))
    assert "not both" in first_error(adapter=str(tmp_path), adapters={"x": str(tmp_path)})
    assert validate_config({**base, "model": {**base["model"], "adapters": {"sql-v2": str(tmp_path)}}}).model.adapters


# ---- item 4's convert.adapter: the folder holds the merged model ----


def convert_with(source: Path, output: Path, **settings) -> dict:
    from mlxcel.cli import compose_config
    from mlxcel.config import validate_config
    from mlxcel.convert import convert, validate_convert_config

    cfg = validate_config(compose_config([f"model.path={source}", "runner.device=cpu"]))
    return convert(cfg, validate_convert_config({"output": str(output), "progress": "off", **settings}))


def folder_logits(path: Path, **load) -> np.ndarray:
    return mlxcel_logits(load_model(str(path), "float32", **load).model, [PROMPT])


def test_convert_merges_an_adapter_into_the_folder(base, peft_adapter, tmp_path):
    record = convert_with(base, tmp_path / "merged", dtype="float32", adapter=str(peft_adapter))
    assert record["options"]["adapter"] == str(peft_adapter)
    merged_at_load = folder_logits(base, adapter=str(peft_adapter))
    assert np.abs(merged_at_load - folder_logits(base)).max() > 1e-2  # (the adapter changes the logits)
    np.testing.assert_allclose(folder_logits(tmp_path / "merged"), merged_at_load, atol=1e-5, rtol=0)


def test_convert_merges_into_a_quantized_source_and_requantizes_it_alike(base, peft_adapter, tmp_path):
    """A quantized source: dequantized, merged, quantized again as it was (as mlx_lm.fuse does)."""
    quantization = {"bits": 4, "group_size": 32}
    convert_with(base, tmp_path / "q4", dtype="float32", quantize=quantization, layers={"lm_head": {"bits": 8}})
    convert_with(tmp_path / "q4", tmp_path / "q4-merged", adapter=str(peft_adapter))
    written = json.loads((tmp_path / "q4-merged" / "config.json").read_text())["quantization"]
    assert written == json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    # the reference: the same packed weights made dense, then merged and quantized by hand
    convert_with(tmp_path / "q4", tmp_path / "dense", dequantize=True)
    convert_with(
        tmp_path / "dense",
        tmp_path / "by-hand",
        adapter=str(peft_adapter),
        quantize=quantization,
        layers={"lm_head": {"bits": 8}},
    )
    merged = folder_logits(tmp_path / "q4-merged")
    assert np.abs(merged - folder_logits(tmp_path / "q4")).max() > 1e-2  # (the adapter counts)
    np.testing.assert_allclose(merged, folder_logits(tmp_path / "by-hand"), atol=1e-5, rtol=0)


def test_convert_refuses_a_bad_adapter_before_writing(base, tmp_path):
    with pytest.raises(MlxcelError, match=r"convert.adapter=.*: not a folder"):
        convert_with(base, tmp_path / "out", adapter=str(tmp_path / "missing"))
    bad = write_peft(tmp_path / "bad", {f"{Q}.lora_A.weight": (4, 32), f"{Q}.lora_B.weight": (32, 4)})
    with pytest.raises(MlxcelError, match=f"{Q}: the adapter maps 32 -> 32"):
        convert_with(base, tmp_path / "out", adapter=str(bad))
    assert not any((tmp_path / "out").glob("*.safetensors"))
