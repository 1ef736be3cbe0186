"""The text families against transformers (the oracle), in one module parametrized by family.

The module-scoped `family` fixture only builds: each family's tiny checkpoint, its loaded model, and
both sides of the parity check (measure_parity). The checks run in the tests, so a mismatch fails
that family's test instead of erroring every test of the family. After the checks every family
shares: variants that need a checkpoint of their own, then each family's own checks, on the same
build (`only(name)`)."""

from __future__ import annotations

import dataclasses
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.models.cache import KVCache
from mlxcel.models.rotating_cache import RotatingKVCache
from tests.family_fixtures import (
    LOGIT_TOLERANCE,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    check_parity,
    longrope,
    make_family_checkpoint,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
)
from tests.helpers import TINY_SHAPES, make_tiny_checkpoint

pytest.importorskip("torch")

THREE_ROWS = (PROMPT, PROMPT[5:28], PROMPT[:9])
FOUR_ROWS = (PROMPT, PROMPT[5:28], PROMPT[:9], PROMPT[3:34])
FOUR_GEMMA_ROWS = (PROMPT, PROMPT[6:30], PROMPT[:11], PROMPT[2:39])
TWO_SPLITS = ((16, None), (12, 8))  # (piece, tile): pieces alone, then tile-padded ones


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # a family_fixtures.FAMILIES key, or llama/qwen2 (conftest's session checkpoints)
    windows: tuple  # model.layer_windows: None for a full-attention layer
    tied: bool  # tie_word_embeddings: no lm_head
    batch: tuple  # prompts batched together, each row against its run alone
    seed: int = 0
    overrides: dict = dataclasses.field(default_factory=dict)
    batch_tokens: int = 12
    splits: tuple = TWO_SPLITS  # (piece, tile) pairs: prefill in pieces against one shot...
    split_prompts: tuple = (len(PROMPT),)  # ...over prompts of these lengths
    padded_prefill: bool = True  # pieces may be tile-padded


CASES = {
    "llama": Case("llama", (None, None), tied=False, batch=THREE_ROWS),
    "qwen2": Case("qwen2", (None, None), tied=True, batch=THREE_ROWS),  # q/k/v biases
    # Mistral: sliding window on every layer; the 40-token prompt and 32 greedy tokens run far
    # past the 16-position window
    "mistral": Case(
        "mistral", (16, 16), tied=False, batch=FOUR_ROWS, seed=3, splits=((7, None), (12, 8), (16, 16), (5, 4))
    ),
    # Qwen3: q/k RMSNorm per head, head_dim 32 != hidden / heads
    "qwen3": Case("qwen3", (None, None), tied=True, batch=(PROMPT, PROMPT[4:21], PROMPT[:7]), seed=5),
    # Gemma: scaled embeddings, 1 + weight RMSNorm, GeGLU
    "gemma": Case("gemma", (None, None), tied=True, batch=(PROMPT, PROMPT[6:30], PROMPT[:11]), seed=7),
    # Gemma 2: soft-capping, alternating sliding window, pre/post norms
    "gemma2": Case("gemma2", (16, None, 16, None), tied=True, batch=FOUR_GEMMA_ROWS, seed=8),
    # Gemma 3 text: local/global RoPE bases, q/k norm, sliding window pattern
    "gemma3_text": Case("gemma3_text", (16, 16, None, 16), tied=True, batch=FOUR_GEMMA_ROWS, seed=10),
    # Phi-3: fused qkv_proj and gate_up_proj
    "phi3": Case("phi3", (None, None), tied=False, batch=FOUR_GEMMA_ROWS, seed=13),
    # Phi-4-mini's shape: partial rotary (here half the head) and longrope whose long factors start
    # mid-decode (40 prompt + 32 generated > 64 positions), as transformers switches. Batch rows
    # generate 30 tokens to cross 64 positions; pieces of 24 over an 80-token prompt cross 64 in
    # the third piece; no tile padding (the factors follow the padded length).
    "phi4_mini": Case(
        "phi3",
        (None, None),
        tied=True,
        batch=FOUR_GEMMA_ROWS,
        seed=14,
        overrides={"partial_rotary_factor": 0.5, "tie_word_embeddings": True, **longrope(4, 64)},
        batch_tokens=30,
        splits=((24, None),),
        split_prompts=(40, 80),
        padded_prefill=False,
    ),
    # Mixture of experts: Mixtral (with a sliding window), Qwen3-MoE
    "mixtral": Case("mixtral", (16, 16), tied=False, batch=FOUR_ROWS, seed=11, splits=((7, None), (12, 8))),
    "qwen3_moe": Case("qwen3_moe", (None, None), tied=False, batch=FOUR_ROWS, seed=11),
}


@dataclasses.dataclass
class Built:
    case: Case
    parity: dict  # measure_parity's: both sides' logits and greedy tokens, the folder, the models

    @property
    def model(self):
        return self.parity["model"]

    @property
    def folder(self):
        return self.parity["folder"]


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory) -> Built:
    """Builds only (checkpoint, model, transformers' outputs): the tests compare."""
    case = CASES[request.param]
    if case.family in TINY_SHAPES:  # the session's tiny_llama / tiny_qwen2, shared with other modules
        folder = request.getfixturevalue(f"tiny_{case.family}")
    else:
        folder = make_family_checkpoint(
            tmp_path_factory.mktemp(f"tiny_{request.param}"), case.family, case.seed, **case.overrides
        )
    return Built(case, measure_parity(folder))


def windows_of(model) -> list:
    """Each layer's attention window; llama and qwen2 (no sliding window) attend fully on every layer."""
    return getattr(model, "layer_windows", [None] * len(model.model.layers))


def only(name: str):
    """A family's own check, on the module's build of that family."""
    return pytest.mark.parametrize("family", [name], indirect=True)


# --- what every family checks ---------------------------------------------------------------------


def test_matches_transformers(family):
    """fp32 logits over the 40-token prompt within LOGIT_TOLERANCE, and 32 greedy tokens identical."""
    check_parity(family.parity)


def test_loaded_model_follows_its_config(family):
    case, model = family.case, family.model
    assert model.eos_token_ids() == [2]
    assert model.args.tie_word_embeddings == case.tied and ("lm_head" in model) == (not case.tied)
    assert windows_of(model) == list(case.windows)
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache if w else KVCache for w in case.windows]
    assert model.supports_multi_piece_prefill and model.supports_padded_prefill == case.padded_prefill


def test_batch_rows_match_alone(family):
    assert_batch_rows_match_alone(family.model, list(family.case.batch), family.case.batch_tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """A prompt prefilled in pieces of `piece` tokens, each padded to a multiple of `tile`.
    eq=False (compared by identity): as a module-scoped parameter, one made for each test, it
    groups no tests together, so pytest orders these by family and builds each family once."""

    piece: int
    tile: int | None
    length: int  # the prompt's


def pieces_params() -> list:
    params = []
    for name, case in CASES.items():
        for length in case.split_prompts:
            for piece, tile in case.splits:
                suffix = f"-{length}" if length != len(PROMPT) else ""
                params.append(pytest.param(name, Split(piece, tile, length), id=f"{name}-{piece}-{tile}{suffix}"))
    return params


# scope="module": mixed with a direct argument, the indirect `family` would be function-scoped
# otherwise, and rebuilt for each of these tests
@pytest.mark.parametrize("family,split", pieces_params(), indirect=["family"], scope="module")
def test_pieces_match_one_shot(family, split):
    assert_pieces_match_one_shot(family.model, (PROMPT * 2)[: split.length], split.piece, split.tile)


# --- variants: a checkpoint of their own ----------------------------------------------------------


def make_checkpoint(folder, family: str, seed: int, **overrides):
    if family in TINY_SHAPES:
        return make_tiny_checkpoint(folder, family, seed, **overrides)
    return make_family_checkpoint(folder, family, seed, **overrides)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}

# id -> (family, seed, config overrides, the layer windows expected)
VARIANTS = {
    "llama3-rope-scaling": ("llama", 2, {"rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True}, [None, None]),
    "gemma2-without-softcaps": (
        "gemma2",
        9,
        {"attn_logit_softcapping": None, "final_logit_softcapping": None},
        [16, None, 16, None],
    ),
    "mistral-without-window-is-llama": ("mistral", 4, {"sliding_window": None}, [None, None]),
    "qwen3-sliding-window-layers": (
        "qwen3",
        6,
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
        [None, 12],
    ),
    # Unlike dense Qwen3, transformers' Qwen3-MoE slides every layer when use_sliding_window
    # (max_window_layers is ignored: reading it as Qwen3 does gives |dlogit| ~7 here).
    "qwen3_moe-sliding-window-covers-every-layer": (
        "qwen3_moe",
        13,
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
        [12, 12],
    ),
    "phi3-longrope-past-the-original-context-from-the-prompt": ("phi3", 15, longrope(8, 32), [None, None]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_transformers(variant, tmp_path):
    family_name, seed, overrides, windows = VARIANTS[variant]
    result = assert_parity(make_checkpoint(tmp_path / "v", family_name, seed, **overrides))
    assert windows_of(result["model"]) == windows


# --- Qwen3: q/k RMSNorm per head ------------------------------------------------------------------


@only("qwen3")
def test_qwen3_fuses_qkv_and_norms_q_k_per_head(family):
    attn = family.model.model.layers[0].self_attn
    assert "qkv_proj" in attn and attn.q_norm.weight.shape == (32,)  # head_dim 32 != hidden / heads


# --- Gemma 3 text: local/global RoPE bases, sliding window pattern -------------------------------


@only("gemma3_text")
def test_gemma3_local_and_global_rope_bases(family):
    bases = [layer.self_attn.rope.base for layer in family.model.model.layers]
    assert bases == [10000.0, 10000.0, 1000000.0, 10000.0]


def test_gemma3_linear_scaled_global_rope_matches_transformers(tmp_path):
    folder = make_family_checkpoint(
        tmp_path / "g", "gemma3_text", seed=11, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    model = assert_parity(folder)["model"]
    assert [layer.self_attn.rope.scale for layer in model.model.layers] == [1.0, 1.0, 0.125, 1.0]


def test_gemma3_reads_pre_transformers5_rope_keys(tmp_path):
    """Hub configs from before transformers 5: rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern and no layer_types; the same model as the new layout."""
    import json

    from mlxcel.models import gemma3

    folder = make_family_checkpoint(
        tmp_path / "g", "gemma3_text", seed=12, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    new = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
        num_hidden_layers=6,
    )
    new_args = gemma3.ModelArgs.from_config({**new, "num_hidden_layers": 6, "layer_types": None})
    old_args = gemma3.ModelArgs.from_config(old)
    for args in (new_args, old_args):
        assert args.layer_windows == [16, 16, 16, 16, 16, None]
        assert (args.rope_theta, args.rope_local_theta) == (1e6, 1e4)
        assert args.rope_scaling["rope_type"] == "linear" and args.rope_scaling["factor"] == 8.0


# --- Mistral: sliding window on every layer, the rotating KV cache --------------------------------


@only("mistral")
def test_mistral_cache_keeps_only_the_window(family):
    model = family.model
    cache = model.make_cache(1)
    model(mx.array([PROMPT]), cache)
    for token in range(30):
        model(mx.array([[token + 5]]), cache)
    assert all(isinstance(c, RotatingKVCache) for c in cache)
    assert cache[0].offset == 70 and cache[0].keys.shape[2] == 16


@only("mistral")
def test_compiled_decode_falls_back_to_the_eager_step_on_sliding_window_layers(family, monkeypatch):
    from mlxcel.engine.compiled import CompiledDecoder

    model = family.model
    assert not CompiledDecoder.can_drive(model.make_cache(1))  # rotating caches
    eager = mlxcel_generate(model, [PROMPT], 8)
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert mlxcel_generate(model, [PROMPT], 8) == eager


# --- Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, partial rotary, longrope, sliding window ------


@only("phi3")
def test_phi3_loads_the_fused_checkpoint_projections(family):
    layer = family.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64) and "q_proj" not in layer.self_attn
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert family.model.supports_compiled_decode


@only("phi4_mini")
def test_phi4_mini_partial_rotary_longrope_switches_mid_decode(family):
    rope = family.model.model.layers[0].self_attn.rope
    assert rope.dims == 8 and rope.original_max == 64 and rope.attention_factor > 1.0
    assert family.model.supports_compiled_decode is False


def test_phi3_mini_4k_sliding_window(tmp_path):
    folder = make_family_checkpoint(tmp_path / "p", "phi3", seed=16, sliding_window=16)
    result = assert_parity(folder)
    assert result["model"].layer_windows == [16, 16]
    assert_pieces_match_one_shot(result["model"], PROMPT, 12, 8)


def test_phi3_longrope_without_factors_is_a_clear_error():
    from mlxcel.errors import MlxcelError
    from mlxcel.models import phi3

    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 300,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8},
    }
    with pytest.raises(MlxcelError, match="long_factor"):
        phi3.ModelArgs.from_config(config)


@only("phi4_mini")
def test_longrope_rows_run_through_the_scheduler_across_the_switch(family):
    """The paged cache gives each row its own positions, from which longrope picks its factors; a
    row that passes the switch (mid-decode, or in a prefill piece) runs its sequence again in one
    piece, as the batch engine does, so every row equals its run alone, beside rows that stay short."""
    from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
    from mlxcel.engine.prompt_cache import PromptCache
    from mlxcel.engine.scheduler import BatchScheduler, supports_scheduling
    from mlxcel.sampling import Sampler

    model = family.model
    long_prompt = (PROMPT * 3)[:100]
    # (prompt, max_tokens): crosses mid-decode; stays short; crosses in its prefill pieces; starts long
    shapes = [(PROMPT[:40], 40), (PROMPT[:9], 30), (long_prompt[:70], 12), (long_prompt, 10), (PROMPT[:30], 36)]
    rows = [RowRequest(p, row_id=i, max_tokens=m) for i, (p, m) in enumerate(shapes)]
    greedy = Sampler("greedy")
    assert supports_scheduling(model, GenerationRequest(rows, greedy))
    with mx.stream(mx.cpu):
        alone = [
            DirectEngine(model, 256).generate(GenerationRequest([row], greedy)).results[0].token_ids for row in rows
        ]
        for max_rows, chunk in [(2, 16), (5, None), (3, 7)]:
            scheduled = BatchScheduler(model, 256, max_rows, chunk_size=chunk).generate(GenerationRequest(rows, greedy))
            assert [r.token_ids for r in scheduled.results] == alone, (max_rows, chunk)
        # the prompt cache keeps no KV computed with the long factors for rows that stay short:
        # follow-ups of every row (answers kept, as in a chat) equal their cache-off runs
        cache = PromptCache(1 << 30)
        BatchScheduler(model, 256, 5, prompt_cache=cache, keep_answers=True).generate(GenerationRequest(rows, greedy))
        follow_ups = [
            RowRequest(p + ids + [5, 6, 7], row_id=i, max_tokens=4)
            for i, ((p, _), ids) in enumerate(zip(shapes, alone))
        ]
        # (a follow-up that stays below the switch, with the start of an answer that crossed it)
        follow_ups += [
            RowRequest(p + ids[:6] + [5, 6], row_id=9 + i, max_tokens=4)
            for i, ((p, _), ids) in enumerate(zip(shapes, alone))
        ]
        follow_ups = [r for r in follow_ups if len(r.prompt_ids) < 200]
        on = BatchScheduler(model, 256, 5, prompt_cache=cache).generate(GenerationRequest(follow_ups, greedy))
        off = BatchScheduler(model, 256, 5).generate(GenerationRequest(follow_ups, greedy))
        assert [r.token_ids for r in on.results] == [r.token_ids for r in off.results]
        assert any(r.cached_tokens for r in on.results)
    assert [len(ids) for ids in alone] == [m for _, m in shapes]


# --- Mixture of experts: Mixtral, Qwen3-MoE -------------------------------------------------------


def flip_routing_normalisation(model) -> None:
    for layer in model.model.layers:
        moe = layer.block_sparse_moe if "block_sparse_moe" in layer else layer.mlp
        if hasattr(moe, "normalize"):
            moe.normalize = not moe.normalize


def assert_normalisation_matters(model, expected: np.ndarray) -> None:
    """The fixture's router weights are far enough from one-hot that renormalising or not shows
    in the logits (`expected`: transformers' over PROMPT): the parity check would catch the wrong choice."""
    flip_routing_normalisation(model)
    try:
        flipped = np.array(model(mx.array([PROMPT]), model.make_cache())[0])
    finally:
        flip_routing_normalisation(model)
    assert np.abs(flipped - expected).max() > 100 * LOGIT_TOLERANCE


@only("mixtral")
def test_mixtral_stacks_its_experts_and_renormalises_top_k(family):
    model = family.model
    moe = model.model.layers[0].block_sparse_moe
    assert moe.normalize and moe.top_k == 2
    assert moe.switch_mlp.gate_up_proj.weight.shape == (4, 256, 64)  # 4 experts stacked, gate and up fused
    assert moe.switch_mlp.down_proj.weight.shape == (4, 64, 128)
    assert_normalisation_matters(model, family.parity["reference_logits"])


@only("mixtral")
def test_mixtral_loads_transformers_stacked_experts(family, tmp_path):
    """save_original_format=False keeps transformers 5's in-memory names: mlp.experts.gate_up_proj
    [E, 2I, H] and mlp.experts.down_proj, no per-expert tensors."""
    from safetensors import safe_open

    folder = tmp_path / "stacked"
    family.parity["reference"].save_pretrained(folder, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(family.folder / name, folder / name)
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    stacked, _ = mlxcel_logits(folder, PROMPT)
    np.testing.assert_allclose(stacked, family.parity["logits"], atol=1e-5)  # the per-expert folder's


@only("mixtral")
def test_model_quantize_at_load_reaches_the_experts(family):
    """model.quantize: the stacked experts quantize through to_quantized (the fused gate/up stays
    fused); 8 bits keeps most argmaxes of this random model (its router is quantized too)."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.models.switch import QuantizedSwitchLinear

    loaded = load_model(str(family.folder), dtype="float32", quantize={"bits": 8, "group_size": 32})
    switch = loaded.model.model.layers[0].block_sparse_moe.switch_mlp
    assert isinstance(switch.gate_up_proj, QuantizedSwitchLinear) and switch.gate_up_proj.bits == 8
    assert isinstance(switch.down_proj, QuantizedSwitchLinear)
    assert loaded.info["quantization"]["mean_abs_logit_diff"] > 0
    fp32 = np.array(family.model(mx.array([PROMPT]), family.model.make_cache())[0])
    q8 = np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0])
    assert (q8.argmax(-1) == fp32.argmax(-1)).mean() >= 0.9


@only("mixtral")
def test_quantized_moe_matches_its_dequantized_form(family):
    """The quantized experts turn back into dense SwitchLinears with the same weights: logits
    equal and greedy tokens identical (the reference a quantized checkpoint is compared with)."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.checkpoints.quantize import dequantize_model
    from mlxcel.models.switch import SwitchLinear

    quantized = load_model(str(family.folder), dtype="float32", quantize={"bits": 4, "group_size": 32})
    dense = load_model(str(family.folder), dtype="float32", quantize={"bits": 4, "group_size": 32})
    dequantize_model(dense.model)
    switch = dense.model.model.layers[0].block_sparse_moe.switch_mlp
    assert type(switch.gate_up_proj) is SwitchLinear and type(switch.down_proj) is SwitchLinear
    q = np.array(quantized.model(mx.array([PROMPT]), quantized.model.make_cache())[0])
    d = np.array(dense.model(mx.array([PROMPT]), dense.model.make_cache())[0])
    assert np.abs(q - d).max() <= 1e-3
    assert mlxcel_generate(quantized.model, [PROMPT], 16) == mlxcel_generate(dense.model, [PROMPT], 16)


@only("qwen3_moe")
def test_qwen3_moe_sparse_layers_and_expert_shapes(family):
    model = family.model
    assert model.args.sparse_layers == [True, True] and model.args.norm_topk_prob
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (32,)
    assert model.model.layers[1].mlp.switch_mlp.down_proj.weight.shape == (4, 64, 48)


def test_qwen3_moe_dense_layers_and_unnormalised_routing_match_transformers(tmp_path):
    """decoder_sparse_step=2 makes layers 1 and 3 sparse, mlp_only_layers=[3] turns 3 dense
    again; norm_topk_prob=False (Qwen3-30B-A3B's own setting is True) keeps the raw top-k probabilities."""
    folder = make_family_checkpoint(
        tmp_path / "q",
        "qwen3_moe",
        seed=12,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    )
    result = assert_parity(folder)
    model = result["model"]
    assert model.args.sparse_layers == [False, True, False, False]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, nn.Linear)  # dense: intermediate_size
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)
    assert model.model.layers[1].mlp.normalize is False
    assert_normalisation_matters(model, result["reference_logits"])


@only("qwen3_moe")
def test_qwen3_moe_compiled_decode_matches_eager(family, monkeypatch):
    """Routing, top-k and the expert gather trace into the compiled step (no sliding window here)."""
    from mlxcel.engine.compiled import CompiledDecoder

    model = family.model
    assert CompiledDecoder.can_drive(model.make_cache(1))
    eager = mlxcel_generate(model, list(FOUR_ROWS), 12)
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert mlxcel_generate(model, list(FOUR_ROWS), 12) == eager
