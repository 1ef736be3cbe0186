"""Mistral 4 (mistral4) against transformers 5 on a tiny random checkpoint: multi-head latent attention
(models/mla.py) with Llama 4's query scale by position, and a softmax router over expert groups.

The checkpoint: q through a low-rank q_a / q_b pair, a 32-wide interleaved RoPE key (so decode.kv_bits'
groups of 32 divide it); YaRN (factor 4) over 16 original positions, so llama_4_scaling_beta 0.1 scales
the queries from position 16 on (1 + 0.1 log(1 + floor(p / 16)): up to 1.23 over 160 tokens); one dense
first layer, then experts: 3 of 8 in the best of 2 groups (a group scored by its two best), renormalised,
times 1.5, beside a shared expert.

fp32 logits within 1e-3 over 160 tokens (one shot: the plain form) and 32 greedy tokens (decode: the
absorbed form) identical to transformers' generate; the two forms within 1e-4; pieces equal one shot;
left-padded rows equal alone (each row scaled at its own positions); the scheduler with other rows; the
prompt cache; what the pool keeps a position; decode.kv_bits on the latent; mlx-lm's converted and
MLX-quantized folders (mlx-lm 0.32 has mistral4: its own load gives our logits); Mistral Large 4 refused."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import (
    PROMPT,
    assert_batch_rows_match_alone,
    assert_pieces_match_one_shot,
    check_parity,
    check_prefix_adoption,
    check_scheduler_rows,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
    save_widened,
    schedule,
)
from tests.helpers import write_tiny_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU
# transformers 5.25's AutoModelForCausalLM does not map Mistral4Config (family_fixtures loads the oracle through it)
transformers.AutoModelForCausalLM.register(transformers.Mistral4Config, transformers.Mistral4ForCausalLM, exist_ok=True)

LONG_PROMPT = PROMPT * 4  # 160 tokens
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": ROPE,
}


def make_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config = transformers.Mistral4Config(
        **{**SHAPE, **overrides}, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    save_widened(transformers.Mistral4ForCausalLM(config), folder)
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory, on_the_cpu):
    return measure_parity(make_checkpoint(tmp_path_factory.mktemp("mistral4")), LONG_PROMPT)


def set_forms(model, absorbed_max_queries: int) -> None:
    for layer in model.model.layers:
        layer.self_attn.absorbed_max_queries = absorbed_max_queries


def forward(model, prompt: list[int] = LONG_PROMPT) -> np.ndarray:
    return np.array(model(mx.array([prompt]), model.make_cache())[0])


def test_logits_and_greedy_tokens_match_transformers(built):
    from mlxcel.models.mla import ABSORBED_MAX_QUERIES, MultiHeadLatentAttention

    result = check_parity(built)
    assert type(result["model"]).__module__ == "mlxcel.models.mistral4"
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in result["model"].model.layers)
    assert len(LONG_PROMPT) > ABSORBED_MAX_QUERIES  # the one-shot prefill above ran the plain form


def test_the_absorbed_and_plain_forms_agree(built):
    """Every call absorbed, then every call plain: the same logits within 1e-4 (fp32), over the prompt in one
    shot and over decode steps after it (past position 160: the query scale at 1.23)."""
    from mlxcel.models.mla import ABSORBED_MAX_QUERIES

    model, follow, out = built["model"], [11, 42, 7, 99, 5, 18], {}
    try:
        for name, limit in (("absorbed", 10**9), ("plain", 0)):
            set_forms(model, limit)
            cache = model.make_cache()
            prompt = np.array(model(mx.array([LONG_PROMPT]), cache)[0])
            steps = [np.array(model(mx.array([[t]]), cache)[0, -1]) for t in follow]
            out[name] = (prompt, np.stack(steps))
    finally:
        set_forms(model, ABSORBED_MAX_QUERIES)
    for absorbed, plain in zip(out["absorbed"], out["plain"]):
        assert np.abs(absorbed - plain).max() <= 1e-4
    for prompt, _ in out.values():
        assert np.abs(prompt - built["reference_logits"]).max() <= 1e-3


def test_the_query_scale_and_the_expert_groups_are_each_needed(built):
    """The checks above can fail on what makes Mistral 4 Mistral 4: without the query scale by position, or
    routing over all 8 experts instead of the best group's, the logits move far past the tolerance."""
    model, baseline = built["model"], built["logits"]
    attentions = [layer.self_attn for layer in model.model.layers]
    assert {a.query_scaling for a in attentions} == {(0.1, 16)}
    for attention in attentions:
        attention.query_scaling = (0.0, 16)
    try:
        unscaled = forward(model)
    finally:
        for attention in attentions:
            attention.query_scaling = (0.1, 16)
    assert np.abs(unscaled - baseline).max() > 0.1
    routers = [layer.mlp.router for layer in model.model.layers[1:]]
    assert {r.groups for r in routers} == {(2, 1)}
    for router in routers:
        router.groups = None
    try:
        ungrouped = forward(model)
    finally:
        for router in routers:
            router.groups = (2, 1)
    assert np.abs(ungrouped - baseline).max() > 0.1


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8), (140, None)])
def test_prefill_in_pieces_equals_one_shot(built, piece, tile):
    """Pieces of 16 and 12 (absorbed), 140 then 20 (plain then absorbed), against one shot (plain)."""
    assert_pieces_match_one_shot(built["model"], LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_equal_each_row_alone(built):
    """Each row's queries scaled at its own positions, its padding left out."""
    assert_batch_rows_match_alone(built["model"], [LONG_PROMPT, PROMPT[:13], PROMPT[3:70]])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler: rows of 160, 23 and 9 tokens prefilled in pieces of 16 beside one another, then decoded
    together: the long row draws transformers' 32 greedy tokens, each short one its tokens alone."""
    check_scheduler_rows(built, LONG_PROMPT, ragged)


def test_rows_sharing_a_prefix_adopt_it_and_draw_their_own_tokens(built):
    """The prompt cache on (rows adopt the shared 80-token prefix) and off: the same tokens."""
    check_prefix_adoption(built["model"])


def test_the_pool_keeps_the_latent_and_the_rope_key_a_position(built):
    """What the KV budget counts a position: each layer's latent (32) and RoPE key (32), one KV head, fp32;
    per-head keys and values would be 4 x ((16 + 32) + 16) a layer."""
    from mlxcel.engine.scheduler import kv_bytes_per_position

    model = built["model"]
    assert {layer.self_attn.cache_dims for layer in model.model.layers} == {(32, 32)}
    assert kv_bytes_per_position(model) == 3 * (32 + 32) * 4


def test_kv_bits_quantizes_the_latent(built):
    """decode.kv_bits 8 in groups of 32 on the latent and the RoPE key: each row among others draws what it
    draws alone, the batch engine's quantized cache the same tokens; 2 bits draws otherwise (it reaches the
    cache)."""
    from mlxcel.checkpoints.fingerprint import read_head_dim

    model, prompts = built["model"], [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    assert read_head_dim(json.loads((built["folder"] / "config.json").read_text())) == 32
    request = {"kv_group_size": 32, "chunk_size": 16}

    def run(prompts, bits):
        state = schedule(model, prompts, 16, request={"kv_bits": bits, **request}, max_rows=4)
        return [r.token_ids for r in state.results]

    together = run(prompts, 8)
    assert together == [run([p], 8)[0] for p in prompts]
    assert together == [mlxcel_generate(model, [p], 16, kv_bits=8, **request)[0] for p in prompts]
    assert run(prompts, 2) != together


def test_bfloat16_keeps_the_router_in_float32(built):
    loaded = load_model(str(built["folder"]), dtype="bfloat16")
    layer = loaded.model.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == mx.bfloat16 and layer.mlp.gate.weight.dtype == mx.float32
    assert len(mlxcel_generate(loaded.model, [PROMPT], 4)[0]) == 4


def test_mlx_lm_converted_folders_load_and_match_mlx_lm(built, tmp_path):
    """mlx_lm.convert, dense and -q 4 bits in groups of 32 (mlx-community's layout: kv_b_proj split into
    embed_q / unembed_out by mlx-lm, quantized where a group divides their input; experts stacked as
    switch_mlp.*, the router packed too): our logits are mlx-lm's load of the same folder, and the dense
    folder's ours from the original one."""
    mlx_lm = pytest.importorskip("mlx_lm")
    for quantize in (False, True):
        out = tmp_path / ("q4" if quantize else "dense")
        mlx_lm.convert(
            str(built["folder"]), mlx_path=str(out), quantize=quantize, q_group_size=32, q_bits=4, dtype="float32"
        )
        ours, loaded = mlxcel_logits(out, LONG_PROMPT)
        theirs, _ = mlx_lm.load(str(out))
        np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)
        if not quantize:
            np.testing.assert_allclose(ours, built["logits"], atol=1e-5)
            continue
        layer = loaded.model.model.layers[1]
        assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear) and layer.self_attn.unembed_out.bits == 4
        assert layer.mlp.switch_mlp.gate_up_proj.bits == 4 and layer.mlp.gate.bits == 4
        assert np.abs(ours - built["logits"]).max() > 1e-3  # (the folder really was quantized)


def test_fp8_release_layout_is_dequantized_by_its_scales(built, tmp_path):
    """Mistral's FP8 layout (mlx-lm's mistral4 reads the same): each projection's weight as e4m3 bytes with a
    float32 weight_scale_inv a tensor, the stacked experts' with one an expert ([E, 1, 1]: `_scale_inv` after
    the tensor's name), static activation_scale tensors beside (dropped). Loaded, the logits of the weights
    dequantized by hand (bfloat16, as the release is meant to be read)."""
    weights = mx.load(str(built["folder"] / "model.safetensors"))
    packed, dense = dict(weights), dict(weights)
    for key, value in weights.items():
        stacked = key.endswith((".experts.gate_up_proj", ".experts.down_proj"))
        if not (stacked or (key.endswith("proj.weight") and value.ndim == 2)):
            continue
        axes = (1, 2) if stacked else None
        scale = mx.abs(value).max(axis=axes, keepdims=stacked) / 448.0  # e4m3's largest finite value
        fp8 = mx.to_fp8(value / scale)
        packed[key] = fp8
        packed[f"{key}_scale_inv"] = scale
        packed[key.replace(".weight", "") + ".activation_scale"] = mx.array(1.0)
        dense[key] = (mx.from_fp8(fp8, dtype=mx.float32) * scale).astype(mx.bfloat16).astype(mx.float32)
    got, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "fp8", packed), LONG_PROMPT)
    expected, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "dense", dense), LONG_PROMPT)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert np.abs(got - built["logits"]).max() > 1e-3  # (the weights did change: the test can fail)


def rewrite_checkpoint(src: Path, dst: Path, weights: dict[str, mx.array]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    return dst


# --- Mistral-Small-4's released layout: a Mistral 3 vision-language folder over mistral4 ---------------------


def test_a_mistral3_folder_over_mistral4_reads_images_and_text_as_transformers(tmp_path, photo_path):
    """Mistral-Small-4's folders are Mistral 3's (model_type mistral3, Pixtral tower and projector) with a
    mistral4 text_config: a two-image prompt (ids, logits, 24 greedy tokens) and a text prompt through the
    engine as transformers' Mistral3ForConditionalGeneration over Mistral4Model gives them."""
    import torch

    from mlxcel.vision.images import load_image
    from tests import test_families_mistral3 as mistral3_tests
    from tests.family_fixtures import reference_greedy, reference_logits
    from tests.vision_fixtures import mlxcel_greedy_after

    folder = tmp_path / "mistral_small_4"
    folder.mkdir()
    text = {k: v for k, v in SHAPE.items() if k != "tie_word_embeddings"}
    reference = mistral3_tests.make_checkpoint(folder, "mistral4", {**text, "head_dim": 48}, tie_word_embeddings=False)
    model = load_model(str(folder), dtype="float32").model
    assert type(model).__mro__[1].__module__ == "mlxcel.models.mistral3" and model.args.model_type == "mistral4"
    photo = load_image(photo_path)
    images = [photo, photo.crop((0, 100, 512, 250))]
    ids = mistral3_tests.tokenize(folder, mistral3_tests.TWO_IMAGES)
    expanded, got, cache = mistral3_tests.mlxcel_image_prefill(model, ids, images)
    theirs = mistral3_tests.transformers_inputs(folder, mistral3_tests.TWO_IMAGES, images)
    assert expanded == theirs["input_ids"][0].tolist()
    pixels = {"pixel_values": theirs["pixel_values"], "image_sizes": theirs["image_sizes"]}
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([expanded]), **pixels).logits[0].numpy()
        out = reference.generate(
            input_ids=torch.tensor([expanded]), **pixels, max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    assert np.abs(got - want).max() <= 1e-3
    assert mlxcel_greedy_after(model, got, cache, 24) == out[0, len(expanded) :].tolist()
    assert np.abs(forward(model, LONG_PROMPT) - reference_logits(reference, LONG_PROMPT)).max() <= 1e-3
    assert mlxcel_generate(model, [LONG_PROMPT], 32)[0] == reference_greedy(reference, LONG_PROMPT, 32)


# --- config.json as transformers writes it, and refusals ----------------------------------------------


def test_a_config_without_rope_parameters_takes_mistral4_configs():
    """transformers fills a missing rope_parameters with YaRN (factor 128 over 8192 positions, mscale 1) and
    llama_4_scaling_beta 0.1, and a missing q_lora_rank with 1024: so do we."""
    from mlxcel.models import mistral4

    config = {
        "model_type": "mistral4",
        "vocab_size": 320,
        **{k: v for k, v in SHAPE.items() if k not in ("rope_parameters", "q_lora_rank")},
    }
    args = mistral4.ModelArgs.from_config(config)
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["factor"] == 128.0
    assert (args.llama_4_scaling_beta, args.llama_4_scaling_length, args.q_lora_rank) == (0.1, 8192, 1024)
    assert args.sparse_layers == [False, True, True] and args.norm_topk_prob and args.rope_interleave
    broken = {**config, "rope_parameters": {**ROPE, "original_max_position_embeddings": None}}
    with pytest.raises(MlxcelError, match="original_max_position_embeddings, which is None"):
        mistral4.ModelArgs.from_config(broken)


@pytest.mark.parametrize("model_type", ["mistral_large4", "mistral_large4_text"])
def test_mistral_large_4_is_refused_naming_what_is_missing(model_type, tmp_path):
    """Mistral Large 4 is not Mistral 4's architecture (transformers' mistral_large4: sparse attention with
    an indexer, NoPE layers, layers sharing another's latent cache): refused in one line."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **SHAPE, "vocab_size": 320}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(MlxcelError, match="indexer") as caught:
        load_model(str(tmp_path), dtype="float32")
    assert "\n" not in str(caught.value)


def test_the_preset_requires_a_path_and_names_its_family(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=mistral4"]))
    model = validate_config(compose_run(["model=mistral4", f"model.path={tmp_path}"])).model
    assert model.families == ["mistral4", "mistral3"] and "mistral4" in list_supported_families() and model.hub_ids
