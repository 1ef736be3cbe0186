"""GLM-4 dense (glm4) and GLM-4.5 (glm4_moe) against transformers 5 on tiny random checkpoints.

glm4: interleaved RoPE on half of each head, post-norms after attention and after the MLP, the fused
gate_up_proj, Q/K/V biases. glm4_moe: half-split RoPE on half of each head, q/k norms, Q/K/V biases,
one dense first layer, then sparse layers: a sigmoid router whose choice adds a score-correction bias
(set well off zero here: save_widened leaves buffers alone) and keeps 2 of 4 expert groups, 3 of 8
experts, weights renormalised and scaled by 2.5, and a shared expert.

Each family: fp32 logits within 1e-3 over 120 tokens and 32 greedy tokens identical to transformers'
generate; pieces equal one shot; left-padded rows equal alone; the scheduler with other rows; the prompt
cache; mlx-lm's converted and MLX-quantized folders (mlx-lm's own load gives our logits); the fused-experts
and multi-token-prediction layouts; quantize-at-load; bf16 keeps the router in float32; the presets."""

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
    check_scheduler_rows,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
    save_widened,
)
from tests.helpers import write_tiny_tokenizer

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

LONG_PROMPT = PROMPT * 3  # 120 tokens
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
MOE = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "use_qk_norm": True,
    "attention_bias": True,
}
# model_type -> (transformers config class, causal LM class, shape beyond SHAPE)
FAMILIES = {
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", MOE),
}


def make_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config_class, model_class, shape = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **{**SHAPE, **shape, **overrides}, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # a buffer: off zero by hand, so the choice differs from the plain scores'
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    save_widened(model, folder)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory, on_the_cpu):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return {"family": request.param, **measure_parity(folder, LONG_PROMPT)}


def test_logits_and_greedy_tokens_match_transformers(built):
    from mlxcel.checkpoints.loader import FAMILIES as MODULES

    result = check_parity(built)
    assert type(result["model"]).__module__ == f"mlxcel.models.{MODULES[built['family']]}"


def test_the_rotary_layout_and_the_router_are_each_needed(built):
    """The checks above can fail on what makes GLM GLM: the other rotary layout, or the router's
    choice without its correction bias, moves the logits far past the tolerance."""
    from mlxcel.models.switch import GroupedSigmoidRouter

    model = built["model"]
    layers = model.model.layers
    ropes = [layer.self_attn.rope for layer in layers]
    assert {rope.dims for rope in ropes} == {16} and {rope.traditional for rope in ropes} == {built["family"] == "glm4"}
    cache = model.make_cache()
    baseline = np.array(model(mx.array([LONG_PROMPT]), cache)[0])
    for rope in ropes:
        rope.traditional = not rope.traditional
    try:
        flipped = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    finally:
        for rope in ropes:
            rope.traditional = not rope.traditional
    assert np.abs(flipped - baseline).max() > 0.1
    routers = [layer.mlp.gate for layer in layers if isinstance(getattr(layer.mlp, "gate", None), GroupedSigmoidRouter)]
    assert len(routers) == (2 if built["family"] == "glm4_moe" else 0)
    for router in routers:
        router.saved, router.e_score_correction_bias = router.e_score_correction_bias, mx.zeros((8,))
    try:
        unbiased = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    finally:
        for router in routers:
            router.e_score_correction_bias = router.saved
            del router.saved
    assert not routers or np.abs(unbiased - baseline).max() > 0.1


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_prefill_in_pieces_equals_one_shot(built, piece, tile):
    assert_pieces_match_one_shot(built["model"], LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_equal_each_row_alone(built):
    assert_batch_rows_match_alone(built["model"], [LONG_PROMPT, PROMPT[:13], PROMPT[3:70]])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler: rows of 120, 23 and 9 tokens prefilled in pieces of 16 beside one another, then
    decoded together: the long row draws transformers' 32 greedy tokens, each short one its tokens alone."""
    check_scheduler_rows(built, LONG_PROMPT, ragged)


def test_rows_sharing_a_prefix_adopt_it_and_draw_their_own_tokens(built):
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.prompt_cache import PromptCache
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler

    model = built["model"]
    shared = PROMPT * 2
    prompts = [shared + tail for tail in (PROMPT[3:20], PROMPT[11:19], PROMPT[:30])]

    def run(prompts, **options):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12)
        return BatchScheduler(model, 512, 8, chunk_size=32, **options).generate(request)

    state = run(prompts, prompt_cache=PromptCache(10**8))
    assert [r.token_ids for r in state.results] == [run([p]).results[0].token_ids for p in prompts]
    adopted = [r.cached_tokens for r in state.results]
    assert adopted[0] == 0 and all(n >= 64 for n in adopted[1:]), adopted


def test_batch_invariant_runs_dense_glm_and_refuses_the_experts(built, monkeypatch):
    """runner.batch_invariant: GLM-4 dense runs it (rows equal alone); GLM-4.5's experts group
    tokens across rows, refused in one line as every MoE family is."""
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.models import invariant
    from mlxcel.sampling import Sampler

    model = built["model"]
    monkeypatch.setattr(invariant, "pads_matmuls", lambda: True)
    if built["family"] == "glm4_moe":
        with pytest.raises(MlxcelError, match="mixture-of-experts"):
            BatchScheduler(model, 512, 4, batch_invariant=True)
        return
    monkeypatch.undo()
    prompts = [LONG_PROMPT, PROMPT[5:28]]
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12)
    got = [r.token_ids for r in BatchScheduler(model, 512, 4, batch_invariant=True).generate(request).results]
    assert got == [mlxcel_generate(model, [p], 12)[0] for p in prompts]


def test_kv_bits_rows_among_others_equal_each_row_alone(built):
    """decode.kv_bits: the pool quantized (groups of 32 along the 32-wide heads); each row draws what it
    draws alone, and the setting reaches the cache (2 bits draws otherwise)."""
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler

    def run(prompts, bits):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(
            rows, Sampler("greedy"), max_tokens=16, kv_bits=bits, kv_group_size=32, chunk_size=16
        )
        return [r.token_ids for r in BatchScheduler(built["model"], 512, 4).generate(request).results]

    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    together = run(prompts, 8)
    assert together == [run([p], 8)[0] for p in prompts]
    assert run(prompts, 2) != together


# --- other layouts of the same weights ------------------------------------------------------------


def rewrite_checkpoint(src: Path, dst: Path, weights: dict[str, mx.array], config: dict | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def for_mlx_lm(folder: Path, dst: Path) -> Path:
    """The folder as mlx-lm 0.32 reads it: rope_theta and partial_rotary_factor at the top (it reads no
    rope_parameters), rope_scaling named; a positive correction bias, since mlx-lm's grouped choice
    zeroes the dropped groups' scores where transformers' sets them to -inf (the two agree while every
    kept score is positive)."""
    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {k: mx.abs(v) if k.endswith("e_score_correction_bias") else v for k, v in weights.items()}
    return rewrite_checkpoint(folder, dst, weights, config)


def test_mlx_lm_converted_folders_load_and_match_mlx_lm(built, tmp_path):
    """mlx_lm.convert, dense and -q (mlx-community's layout: glm4's gate_up_proj as one packed matrix;
    glm4_moe's experts stacked as switch_mlp.* and packed, the router left dense): our logits are mlx-lm's
    load of the same folder, and the dense one's are ours from the original folder."""
    mlx_lm = pytest.importorskip("mlx_lm")
    src = for_mlx_lm(built["folder"], tmp_path / "src")
    expected, _ = mlxcel_logits(src, LONG_PROMPT)
    for quantize in (False, True):
        out = tmp_path / ("q4" if quantize else "dense")
        mlx_lm.convert(str(src), mlx_path=str(out), quantize=quantize, q_group_size=32, q_bits=4, dtype="float32")
        ours, loaded = mlxcel_logits(out, LONG_PROMPT)
        theirs, _ = mlx_lm.load(str(out))
        np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)
        if not quantize:
            np.testing.assert_allclose(ours, expected, atol=1e-5)
            continue
        layers = loaded.model.model.layers
        assert isinstance(layers[0].self_attn.o_proj, nn.QuantizedLinear)
        if built["family"] == "glm4":
            assert isinstance(layers[0].mlp.gate_up_proj, nn.QuantizedLinear)
        else:
            assert layers[1].mlp.switch_mlp.gate_up_proj.bits == 4
            assert isinstance(layers[1].mlp.shared_experts.gate_up_proj, nn.QuantizedLinear)
            assert layers[1].mlp.gate.weight.dtype == mx.float32 and "scales" not in layers[1].mlp.gate


def test_fused_experts_and_multi_token_prediction_layers_load(built, tmp_path):
    """transformers 5's in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and the released
    checkpoints' multi-token-prediction layer after the last one (model.layers.{num_hidden_layers}.*, not
    used to generate): the same logits."""
    if built["family"] != "glm4_moe":
        pytest.skip("dense: no experts, no MTP layer")
    weights = mx.load(str(built["folder"] / "model.safetensors"))
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate = [weights.pop(f"{prefix}.{e}.gate_proj.weight") for e in range(8)]
        up = [weights.pop(f"{prefix}.{e}.up_proj.weight") for e in range(8)]
        weights[f"{prefix}.gate_up_proj"] = mx.stack([mx.concatenate([g, u]) for g, u in zip(gate, up)])
        weights[f"{prefix}.down_proj"] = mx.stack([weights.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)])
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in weights.items() if k.startswith("model.layers.2.")}
    weights.update(mtp, **{"model.layers.3.eh_proj.weight": mx.zeros((64, 128))})
    got, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "fused", weights), LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-5)


def test_quantize_at_load_runs(built):
    loaded = load_model(str(built["folder"]), dtype="float32", quantize={"bits": 4, "group_size": 32})
    report = loaded.info["quantization"]
    assert report["bits"] == 4 and np.isfinite(report["max_abs_logit_diff"])
    assert isinstance(loaded.model.model.layers[1].self_attn.o_proj, nn.QuantizedLinear)
    tokens = mlxcel_generate(loaded.model, [LONG_PROMPT, PROMPT[:9]], 8)
    assert [len(t) for t in tokens] == [8, 8]


def test_bfloat16_keeps_the_router_in_float32(built):
    """transformers keeps the router's weight and correction bias in float32 whatever the dtype."""
    loaded = load_model(str(built["folder"]), dtype="bfloat16")
    layer = loaded.model.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == mx.bfloat16
    if built["family"] == "glm4_moe":
        assert layer.mlp.gate.weight.dtype == mx.float32 and layer.mlp.gate.e_score_correction_bias.dtype == mx.float32
        assert layer.mlp.shared_experts.down_proj.weight.dtype == mx.bfloat16
    tokens = mlxcel_generate(loaded.model, [PROMPT], 4)[0]
    assert len(tokens) == 4


# --- config.json as the released models write it --------------------------------------------------


def test_released_configs_read_as_transformers_reads_them():
    """GLM-4-9B-0414's and GLM-4.5-Air's config.json (transformers 4 style: rope_theta and
    partial_rotary_factor at the top; no rope_parameters)."""
    from mlxcel.models import glm4, glm4_moe

    glm4_9b = {
        "model_type": "glm4",
        "hidden_size": 4096,
        "intermediate_size": 13696,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "attention_bias": True,
        "rms_norm_eps": 1e-05,
        "vocab_size": 151552,
        "eos_token_id": [151329, 151336, 151338],
    }
    args = glm4.ModelArgs.from_config(glm4_9b)
    assert (args.partial_rotary_factor, args.rope_traditional, args.attention_bias, args.o_proj_bias) == (
        0.5,
        True,
        True,
        False,
    )
    bare = {k: v for k, v in glm4_9b.items() if k not in ("head_dim", "partial_rotary_factor", "attention_bias")}
    args = glm4.ModelArgs.from_config(bare)  # transformers' Glm4Config defaults
    assert (args.head_dim, args.partial_rotary_factor, args.attention_bias) == (128, 0.5, True)
    air = {
        "model_type": "glm4_moe",
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000000,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "use_qk_norm": False,
        "attention_bias": True,
        "num_nextn_predict_layers": 1,
        "vocab_size": 151552,
        "eos_token_id": [151329, 151336, 151338],
    }
    args = glm4_moe.ModelArgs.from_config(air)
    assert args.sparse_layers == [False] + [True] * 45 and not args.rope_traditional and args.head_dim == 128
    with pytest.raises(MlxcelError, match="scoring_func"):
        glm4_moe.ModelArgs.from_config({**air, "scoring_func": "softmax"})
    tiny = {**air, "hidden_size": 64, "num_hidden_layers": 2, "num_experts_per_tok": 200, "vocab_size": 320}
    with pytest.raises(MlxcelError, match="num_experts_per_tok=200"):
        glm4_moe.Model(glm4_moe.ModelArgs.from_config(tiny))


@pytest.mark.parametrize("preset,family", [("glm4", "glm4"), ("glm4_moe", "glm4_moe")])
def test_presets_require_a_path_and_name_their_family(preset, family, tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run([f"model={preset}"]))
    model = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"])).model
    assert model.families == [family] and family in list_supported_families()
    assert model.hub_ids
