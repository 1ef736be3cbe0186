"""Qwen 3.5 dense (qwen3_5_text), Qwen 3.5 MoE (qwen3_5_moe_text) and Qwen3-Next (qwen3_next):
Gated DeltaNet layers beside gated full attention, on tiny random checkpoints written by
transformers 5 (the oracle: its torch chunked / recurrent gated-delta functions and conv fallback).

Each family: fp32 logits within 1e-3 over a prompt longer than the 64-token chunk and 32 greedy
tokens identical to transformers' generate; a prompt prefilled in pieces (any split, across chunk
boundaries) leaves the state one shot leaves; a left-padded batch's rows equal each row alone; the
vision-language folders' language model; mlx-lm's converted layout, dense and MLX-quantized; the
fused-experts layout; quantize-at-load; the presets."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from tests.family_fixtures import (
    PROMPT,
    assert_batch_rows_match_alone,
    assert_pieces_match_one_shot,
    check_parity,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
    save_widened,
)
from tests.helpers import write_tiny_tokenizer

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

LONG_PROMPT = PROMPT * 3  # 120 tokens: one 64-token chunk and part of a second

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40}

# model_type -> (transformers config class, causal LM class, shape beyond SHAPE)
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {"intermediate_size": 96, "tie_word_embeddings": True}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
    # layer 2 dense (mlp_only_layers); the top-k weights not renormalised (Qwen 3.5 MoE always does)
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**MOE, "intermediate_size": 96, "mlp_only_layers": [2], "norm_topk_prob": False},
    ),
}
MOE_FAMILIES = ("qwen3_5_moe_text", "qwen3_next")
# the vision-language folders: model_type -> (config class, model class, their text model's family)
VISION_LANGUAGE = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}
TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 8,
    "num_position_embeddings": 16,
}
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", "_norm.weight")


def make_checkpoint(folder: Path, family: str, seed: int = 0) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config_class, model_class, shape = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **SHAPE, **shape, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    save_widened(getattr(transformers, model_class)(config), folder)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory, on_the_cpu):
    """One family's checkpoint and both sides of its parity check (built once per family)."""
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return {"family": request.param, **measure_parity(folder, LONG_PROMPT)}


def test_logits_and_greedy_tokens_match_transformers(built):
    from mlxcel.checkpoints.loader import FAMILIES as MODULES

    result = check_parity(built)
    assert type(result["model"]).__module__ == f"mlxcel.models.{MODULES[built['family']]}"


@pytest.mark.parametrize("piece", [7, 16, 64, 100])
def test_prefill_in_pieces_equals_one_shot(built, piece):
    """7: each piece token by token (the recurrent form); 16 and 100: chunks cut mid-way; 64: whole
    chunks. The state after the prompt, and each decode step after it, as one shot leaves them."""
    assert_pieces_match_one_shot(built["model"], LONG_PROMPT, piece, tile=None)


def test_chunked_form_keeps_fp32_precision_under_strong_decay():
    """Random checkpoints decay hard (g down to -20 a token, the log decay over a chunk in the
    hundreds): the chunked form's within-chunk decays, taken as differences of those sums, were
    off by 1.5e-6 against a float64 recurrence (50x the token-by-token form's error), enough for
    the pieces above to differ by 1e-4 in the logits. Summed per segment, it is the recurrence's."""
    from mlxcel.models import gated_delta as gd

    rng = np.random.default_rng(0)
    length, heads, dim = 120, 4, 16
    q, k = (rng.normal(size=(1, length, 2, dim)) for _ in range(2))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dim**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v, g = rng.normal(size=(1, length, heads, dim)), -rng.uniform(0, 20, size=(1, length, heads))
    beta = 1 / (1 + np.exp(-rng.normal(size=(1, length, heads))))
    state, expected = np.zeros((1, heads, dim, dim)), []
    for t in range(length):  # float64 recurrence, each key head serving two value heads
        q_t, k_t = np.repeat(q[:, t], 2, axis=1), np.repeat(k[:, t], 2, axis=1)
        state = state * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - (state * k_t[..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + k_t[..., None] * delta[..., None, :]
        expected.append((state * q_t[..., None]).sum(-2))
    inputs = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta)]
    y, _ = gd.chunked(*inputs, mx.zeros((1, heads, dim, dim)))
    assert np.abs(np.array(y) - np.stack(expected, axis=1)).max() < 2e-7


def test_left_padded_batch_rows_equal_each_row_alone(built):
    """Padding of 107 and 53 positions before the short rows: the recurrent layers skip it."""
    assert_batch_rows_match_alone(built["model"], [LONG_PROMPT, PROMPT[:13], PROMPT[3:70]])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler, rows of 120, 23 and 9 tokens prefilled in pieces of 16 beside one another (ragged:
    a row's padding before its piece), then decoded together: the long row draws transformers' 32
    greedy tokens, each short one the tokens it draws alone."""
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler, recurrent_layers
    from mlxcel.sampling import Sampler

    model = built["model"]
    assert recurrent_layers(model) == [True, True, True, False]
    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    scheduler = BatchScheduler(model, 512, 4, chunk_size=16)
    scheduler.ragged_prefill = ragged
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=32))
    got = [r.token_ids for r in state.results]
    assert got[0] == built["reference_greedy"]
    assert got[1:] == [mlxcel_generate(model, [p], 32)[0] for p in prompts[1:]]


def test_decoder_sparse_step_and_mlp_only_layers_choose_the_dense_layers():
    from mlxcel.models import qwen3_5_moe, qwen3_next

    config = {
        **SHAPE,
        **MOE,
        "model_type": "qwen3_next",
        "intermediate_size": 96,
        "vocab_size": 320,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    args = qwen3_next.ModelArgs.from_config(config)
    assert args.sparse_layers == [False, True, False, False]
    assert args.partial_rotary_factor == 0.25  # transformers' Qwen3-Next default when config.json names none
    model = qwen3_next.Model(args)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "SharedExpertMoeBlock", "MLP", "MLP"]
    assert isinstance(model.model.layers[0].linear_attn, qwen3_next.GatedDeltaNet)
    # Qwen 3.5 MoE's config has no intermediate_size and no dense layer
    moe = {k: v for k, v in config.items() if k not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers")}
    assert qwen3_5_moe.ModelArgs.from_config(moe).sparse_layers == [True] * 4


# --- other layouts of the same weights ---------------------------------------------------------------


def rewrite_checkpoint(src: Path, dst: Path, weights: dict[str, mx.array], config: dict | None = None) -> Path:
    """`src`'s tokenizer and config (or `config`) beside `weights` in `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def to_mlx_lm_layout(weights: dict[str, mx.array], family: str, num_experts: int) -> dict[str, mx.array]:
    """What mlx-lm's convert writes: norms shifted (1 + w stored as is), conv1d [C, K, 1], experts stacked
    as switch_mlp.*; Qwen 3.5 under language_model.* (mlx-lm loads it as the vision-language model);
    Qwen3-Next's in_proj_qkvz / in_proj_ba kept in their per-key-head order."""
    out = {}
    for key, value in weights.items():
        if key.endswith("conv1d.weight"):
            value = value.moveaxis(2, 1)
        elif key.endswith(ZERO_CENTRED) and ".linear_attn." not in key:
            value = value + 1.0
        out[key] = value
    for layer in range(SHAPE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        for name in ("gate_proj", "up_proj", "down_proj"):
            experts = [out.pop(f"{prefix}.experts.{e}.{name}.weight", None) for e in range(num_experts)]
            if experts[0] is not None:
                out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(experts)
    if family != "qwen3_next":
        out = {f"language_model.{key}": value for key, value in out.items()}
    return out


def quantize_as_mlx_lm(weights: dict[str, mx.array], group_size: int = 32, bits: int = 4) -> tuple[dict, dict]:
    """mlx_lm.convert -q: every matrix whose rows the group divides, packed; the routers (mlp.gate,
    shared_expert_gate) at 8 bits in groups of 64, as its qwen3_next / qwen3_5 predicate says, named
    in config.json by mlx-lm's module path. Returns (weights, config.json's quantization)."""
    out, spec = {}, {"group_size": group_size, "bits": bits, "mode": "affine"}
    for key, value in weights.items():
        path = key[: -len(".weight")]
        router = path.endswith(("mlp.gate", "shared_expert_gate"))
        group, width = (64, 8) if router else (group_size, bits)
        if not key.endswith(".weight") or value.ndim < 2 or "conv1d" in key or value.shape[-1] % group:
            out[key] = value
            continue
        out[key], out[f"{path}.scales"], out[f"{path}.biases"] = mx.quantize(value, group, width)
        if router:
            spec[path] = {"group_size": group, "bits": width}
    return out, spec


def dequantize_all(weights: dict[str, mx.array], spec: dict) -> dict[str, mx.array]:
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".scales")]:
        path = key[: -len(".scales")]
        layout = spec.get(path, spec)
        out[f"{path}.weight"] = mx.dequantize(
            out.pop(f"{path}.weight"), out.pop(key), out.pop(f"{path}.biases"), layout["group_size"], layout["bits"]
        )
    return out


def test_mlx_lm_layout_loads_with_the_same_logits(built, tmp_path):
    folder = built["folder"]
    original = mx.load(str(folder / "model.safetensors"))
    converted = to_mlx_lm_layout(original, built["family"], MOE["num_experts"])
    assert any(v.shape[-1] == 1 for k, v in converted.items() if k.endswith("conv1d.weight"))
    copy = rewrite_checkpoint(folder, tmp_path / "mlx-lm", converted)
    got, _ = mlxcel_logits(copy, LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-5)


def test_mlx_quantized_folder_loads_packed(built, tmp_path):
    """mlx_lm.convert -q's folder (packed weights, the routers' 8-bit overrides named by mlx-lm's module
    path): the same logits as its weights dequantized. Qwen3-Next's regrouped rows move packed
    weights, scales and biases alike; Qwen 3.5's overrides name `language_model.model.layers.N`."""
    folder = built["folder"]
    converted = to_mlx_lm_layout(mx.load(str(folder / "model.safetensors")), built["family"], MOE["num_experts"])
    packed, spec = quantize_as_mlx_lm(converted)
    config = json.loads((folder / "config.json").read_text())
    quantized = rewrite_checkpoint(folder, tmp_path / "q4", packed, {**config, "quantization": spec})
    dense = rewrite_checkpoint(folder, tmp_path / "dense", dequantize_all(packed, spec))
    got, loaded = mlxcel_logits(quantized, LONG_PROMPT)
    expected, _ = mlxcel_logits(dense, LONG_PROMPT)
    np.testing.assert_allclose(got, expected, atol=1e-3)
    layers = loaded.model.model.layers
    assert isinstance(layers[0].linear_attn.out_proj, nn.QuantizedLinear)
    if built["family"] in MOE_FAMILIES:
        assert layers[0].mlp.gate.bits == 8 and layers[0].mlp.switch_mlp.gate_up_proj.bits == 4


def test_fused_experts_layout_loads_with_the_same_logits(built, tmp_path):
    """The released Qwen 3.5 MoE checkpoints store each layer's experts fused: gate_up_proj [E, 2I, H]
    and down_proj [E, H, I] (transformers 5's in-memory layout)."""
    if built["family"] not in MOE_FAMILIES:
        pytest.skip("dense: no experts")
    folder = built["folder"]
    weights = mx.load(str(folder / "model.safetensors"))
    for layer in range(SHAPE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in weights:
            continue  # a dense layer
        experts = range(MOE["num_experts"])
        gate = [weights.pop(f"{prefix}.{e}.gate_proj.weight") for e in experts]
        up = [weights.pop(f"{prefix}.{e}.up_proj.weight") for e in experts]
        weights[f"{prefix}.gate_up_proj"] = mx.stack([mx.concatenate([g, u]) for g, u in zip(gate, up)])
        weights[f"{prefix}.down_proj"] = mx.stack([weights.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    got, _ = mlxcel_logits(rewrite_checkpoint(folder, tmp_path / "fused", weights), LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-5)


def test_quantize_at_load_runs(built):
    loaded = load_model(str(built["folder"]), dtype="float32", quantize={"bits": 4, "group_size": 32})
    report = loaded.info["quantization"]
    assert report["bits"] == 4 and np.isfinite(report["max_abs_logit_diff"])
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.linear_attn.out_proj, nn.QuantizedLinear)
    assert isinstance(loaded.model.model.layers[3].self_attn.o_proj, nn.QuantizedLinear)
    tokens = mlxcel_generate(loaded.model, [LONG_PROMPT, PROMPT[:9]], 8)
    assert [len(t) for t in tokens] == [8, 8]


# --- the vision-language folders (`qwen3_5`, `qwen3_5_moe`): their language model -----------------


@pytest.mark.parametrize("model_type", list(VISION_LANGUAGE))
def test_vision_language_checkpoint_loads_its_language_model(model_type, tmp_path):
    """transformers' Qwen3_5(Moe)ForConditionalGeneration on a text prompt (its three M-RoPE
    sections see one position) against the language model loaded from the same folder. The
    folder's own tie_word_embeddings decides, as in transformers, over its text_config's."""
    import torch
    import transformers

    config_class, model_class, text_family = VISION_LANGUAGE[model_type]
    vocab = write_tiny_tokenizer(tmp_path)
    text = {**SHAPE, **FAMILIES[text_family][2], "vocab_size": vocab, "eos_token_id": 2, "pad_token_id": 0}
    config = getattr(transformers, config_class)(
        text_config={**text, "tie_word_embeddings": True},
        vision_config=TINY_VISION,
        tie_word_embeddings=False,
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 4,
    )
    torch.manual_seed(3)
    reference = getattr(transformers, model_class)(config)
    save_widened(reference, tmp_path)
    with torch.no_grad():
        expected = reference(torch.tensor([LONG_PROMPT])).logits[0].numpy()
    got, loaded = mlxcel_logits(tmp_path, LONG_PROMPT)
    assert loaded.info["arch"] == model_type and "text only" in loaded.info["note"]
    assert not loaded.model.args.tie_word_embeddings
    assert float(np.abs(got - expected).max()) <= 1e-3


# --- presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,families",
    [
        ("qwen3_5", ["qwen3_5", "qwen3_5_text"]),
        ("qwen3_5_moe", ["qwen3_5_moe", "qwen3_5_moe_text"]),
        ("qwen3_next", ["qwen3_next"]),
    ],
)
def test_presets_require_a_path_and_name_their_families(preset, families, tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run([f"model={preset}"]))
    model = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"])).model
    assert sorted(model.families) == families and set(families) <= set(list_supported_families())
    assert model.hub_ids and all(repo.startswith("Qwen/") for repo in model.hub_ids)
