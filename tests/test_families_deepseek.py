"""DeepSeek V3 (deepseek_v3, and Kimi K2 / K2.5 over it) and DeepSeek V2 (deepseek_v2) against transformers 5
on tiny random checkpoints: multi-head latent attention (models/mla.py) with its latent in the cache.

deepseek_v3: q through a low-rank q_a / q_b pair, 8-wide interleaved RoPE; one dense first layer, then sparse
layers: a sigmoid router whose choice adds a score-correction bias (set well off zero: save_widened leaves
buffers alone) and keeps 1 of 2 expert groups, 3 of 8 experts, renormalised and scaled by 2.5, a shared
expert. deepseek_v2: a plain q_proj, 32-wide RoPE (so decode.kv_bits' groups of 32 divide the RoPE key), a
softmax router keeping the 2 best of 8 experts in the best of 2 groups (a group scored by its best),
scaled by 1.5, two shared experts' worth. A YaRN variant (factor 4, mscale 0.8, mscale_all_dim 1) checks
the rotary scaling and the softmax scale's mscale^2.

Each: fp32 logits within 1e-3 over 160 tokens (one shot: past ABSORBED_MAX_QUERIES, so the plain form)
and 32 greedy tokens (decode: the absorbed form) identical to transformers' generate; the absorbed and
plain forms within 1e-4; pieces equal one shot; left-padded rows equal alone; the segmented and compiled
decode steps; the scheduler with other rows; the prompt cache (in memory, and a job's folder); what the
pool keeps a position; decode.kv_bits; the API, a JSON-schema row and the server; mlx-lm's converted and
MLX-quantized folders (mlx-lm's own load gives our logits); Kimi K2 and the Kimi K2.5 folder; the FP8
release layout; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.bench.checkpoints import DEEPSEEK_V2_LITE_SMALL
from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import (
    GREEDY_TOKENS,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_pieces_match_one_shot,
    check_parity,
    check_prefix_adoption,
    check_scheduler_rows,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
    reference_logits,
    save_widened,
    schedule,
)
from tests.helpers import write_tiny_tokenizer

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

LONG_PROMPT = PROMPT * 4  # 160 tokens
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "first_k_dense_replace": 1,
}
V3 = {
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
V2 = {
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "group_limited_greedy",
    "routed_scaling_factor": 1.5,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
# model_type -> (transformers config class, causal LM class, shape beyond SHAPE)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", V3),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", V2),
}


def offset_correction_bias(model) -> None:
    """The router's score-correction bias (a buffer: save_widened leaves it at zero) well off zero."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)


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
    offset_correction_bias(model)
    save_widened(model, folder)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory, on_the_cpu):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return {"family": request.param, **measure_parity(folder, LONG_PROMPT)}


def set_forms(model, absorbed_max_queries: int) -> None:
    for layer in model.model.layers:
        layer.self_attn.absorbed_max_queries = absorbed_max_queries


def test_logits_and_greedy_tokens_match_transformers(built):
    from mlxcel.models.mla import ABSORBED_MAX_QUERIES, MultiHeadLatentAttention

    result = check_parity(built)
    assert type(result["model"]).__module__ == "mlxcel.models.deepseek_v3"
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in result["model"].model.layers)
    assert len(LONG_PROMPT) > ABSORBED_MAX_QUERIES  # the one-shot prefill above ran the plain form


def test_the_absorbed_and_plain_forms_agree(built):
    """Every call absorbed, then every call plain: the same logits within 1e-4 (fp32), over a prompt
    in one shot and over decode steps after it; each within the parity tolerance of transformers."""
    model = built["model"]
    follow = [11, 42, 7, 99, 5, 18]
    out = {}
    try:
        for name, limit in (("absorbed", 10**9), ("plain", 0)):
            set_forms(model, limit)
            cache = model.make_cache()
            prompt = np.array(model(mx.array([LONG_PROMPT]), cache)[0])
            steps = [np.array(model(mx.array([[t]]), cache)[0, -1]) for t in follow]
            out[name] = (prompt, np.stack(steps))
    finally:
        from mlxcel.models.mla import ABSORBED_MAX_QUERIES

        set_forms(model, ABSORBED_MAX_QUERIES)
    for absorbed, plain in zip(out["absorbed"], out["plain"]):
        assert np.abs(absorbed - plain).max() <= 1e-4
    for prompt, _ in out.values():
        assert np.abs(prompt - built["reference_logits"]).max() <= 1e-3


def test_the_router_and_the_interleaved_rotary_layout_are_each_needed(built):
    """The checks above can fail on what makes DeepSeek DeepSeek: the half-split rotary layout, or V3's
    choice without its correction bias, moves the logits far past the tolerance."""
    from mlxcel.models.switch import GroupedSigmoidRouter

    model, baseline = built["model"], built["logits"]
    ropes = [layer.self_attn.rope for layer in model.model.layers]
    assert {rope.traditional for rope in ropes} == {True}
    for rope in ropes:
        rope.traditional = False
    try:
        flipped = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    finally:
        for rope in ropes:
            rope.traditional = True
    assert np.abs(flipped - baseline).max() > 0.1
    gates = [layer.mlp.get("gate") for layer in model.model.layers]
    routers = [gate for gate in gates if isinstance(gate, GroupedSigmoidRouter)]
    assert len(routers) == (2 if built["family"] == "deepseek_v3" else 0)
    for router in routers:
        router.saved, router.e_score_correction_bias = router.e_score_correction_bias, mx.zeros((8,))
    try:
        unbiased = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    finally:
        for router in routers:
            router.e_score_correction_bias = router.saved
            del router.saved
    assert not routers or np.abs(unbiased - baseline).max() > 0.1


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8), (140, None)])
def test_prefill_in_pieces_equals_one_shot(built, piece, tile):
    """Pieces of 16 and 12 (absorbed), 140 then 20 (plain then absorbed), against one shot (plain)."""
    assert_pieces_match_one_shot(built["model"], LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_equal_each_row_alone(built):
    assert_batch_rows_match_alone(built["model"], [LONG_PROMPT, PROMPT[:13], PROMPT[3:70]])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler: rows of 160, 23 and 9 tokens prefilled in pieces of 16 beside one another, then decoded
    together: the long row draws transformers' 32 greedy tokens, each short one its tokens alone."""
    check_scheduler_rows(built, LONG_PROMPT, ragged)


def test_rows_sharing_a_prefix_adopt_it_and_draw_their_own_tokens(built):
    """The prompt cache on (rows adopt the shared 80-token prefix) and off: the same tokens."""
    check_prefix_adoption(built["model"])


@pytest.mark.parametrize("step", ["segmented", "compiled"])
def test_compiled_decode_steps_give_the_eager_tokens(built, step, monkeypatch):
    """decode.step segmented (the GPU default: compiled between the attentions, MLA's prepare / attend /
    finish halves) and compiled (whole buffers, an array mask): each row's eager tokens, at batch 1 and in
    a left-padded batch; the segmented step's logits within 1e-4 of the eager ones."""
    from mlxcel.engine import DirectEngine
    from tests.test_segmented_decode import decode_both_ways

    model, prompts = built["model"], [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    if step == "segmented":
        for rows in (prompts[:1], prompts):
            worst, eager_ids, segmented_ids = decode_both_ways(model, rows)
            assert worst <= 1e-4 and segmented_ids == eager_ids
    eager = mlxcel_generate(model, prompts, 16)
    monkeypatch.setenv("MLXCEL_DECODE_STEP", step)
    assert type(DirectEngine(model, 512).engine.decoder).__name__ == f"{step.capitalize()}Decoder"
    assert mlxcel_generate(model, prompts, 16) == eager


def record_caches(scheduler) -> list:
    """The layer caches of each run of `scheduler` (appended as it builds them)."""
    caches: list = []
    original = scheduler.run_rows

    def record(state, waiting, table, layer_caches, *rest):
        caches.extend(layer_caches)
        return original(state, waiting, table, layer_caches, *rest)

    scheduler.run_rows = record
    return caches


def test_the_pool_keeps_the_latent_and_the_rope_key_a_position(built):
    """What the scheduler's paged pool holds per position and layer: the latent (kv_lora_rank) as its keys
    and the rotated RoPE key as its values, one KV head, nothing decompressed; the KV budget counts that."""
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler, kv_bytes_per_position
    from mlxcel.models.paged_cache import PagedKVCache
    from mlxcel.sampling import Sampler

    model = built["model"]
    rope = V3["qk_rope_head_dim"] if built["family"] == "deepseek_v3" else V2["qk_rope_head_dim"]
    scheduler = BatchScheduler(model, 512, 4)
    caches = record_caches(scheduler)
    rows = [RowRequest(p, row_id=i) for i, p in enumerate([LONG_PROMPT, PROMPT[:9]])]
    scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=4))
    assert len(caches) == 3 and all(type(c) is PagedKVCache for c in caches)
    for cache in caches:
        assert (cache.keys.shape[0], cache.keys.shape[2], cache.values.shape[2]) == (1, 32, rope)  # heads first
    assert kv_bytes_per_position(model) == 3 * (32 + rope) * 4


def test_a_job_saves_the_latent_in_the_prompt_cache_folder_and_the_next_adopts_it(built, tmp_path):
    """runner.prompt_cache_dir through a job: what a position keeps on disk is the latent [1, R] and the RoPE
    key [1, P] of each layer; the next job adopts its rows' prompts from the folder and draws the tokens of a
    run without the cache."""
    from tests.test_prompt_cache_hostile import run_job, tokens

    folder, cache_dir = built["folder"], tmp_path / "cache"
    off = run_job(folder, tmp_path, "off", None)
    first = run_job(folder, tmp_path, "first", cache_dir)
    second = run_job(folder, tmp_path, "second", cache_dir)
    assert off[0] == first[0] == second[0] == "completed"
    assert tokens(first[1]) == tokens(second[1]) == tokens(off[1])
    assert all(r["cached_tokens"] > 0 for r in second[1])
    rope = FAMILIES[built["family"]][2]["qk_rope_head_dim"]
    shapes = {name: a.shape[1:] for path in cache_dir.rglob("*.safetensors") for name, a in mx.load(str(path)).items()}
    assert {shapes[f"{layer}.0"] for layer in range(3)} == {(1, 32)}
    assert {shapes[f"{layer}.1"] for layer in range(3)} == {(1, rope)}


def test_a_paged_rows_mask_attends_each_row_over_its_own_positions():
    """Batch-invariant decode on a GPU hands attention a PagedRows mask (each row over exactly its own
    positions, in a call of its own): the latent attention runs it in either form, giving what a boolean
    mask over the padded keys gives."""
    from mlxcel.models.mla import MultiHeadLatentAttention
    from mlxcel.models.paged_cache import PagedRows

    mx.random.seed(0)
    attention = MultiHeadLatentAttention(64, 4, 32, 16, 8, 16)
    x = mx.random.normal((2, 1, 64))
    latent, k_pe = mx.random.normal((2, 1, 20, 32)), mx.random.normal((2, 1, 20, 8))
    ends = [20, 13]
    visible = (mx.arange(20)[None, :] < mx.array(ends)[:, None])[:, None, None, :]
    for limit in (10**9, 0):  # absorbed, plain
        attention.absorbed_max_queries = limit
        q, _, _ = attention.prepare(x, mx.array([19, 12]))
        rows = attention.finish(attention.attend(q, latent, k_pe, PagedRows(ends, None)))
        masked = attention.finish(attention.attend(q, latent, k_pe, visible))
        assert mx.abs(rows - masked).max().item() <= 1e-5


def test_a_v2_lite_shaped_pool_keeps_under_an_eighth_of_the_decompressed_keys_and_values():
    """DeepSeek-V2-Lite's shape (27 layers, 16 heads, latent 512, RoPE key 64, heads' keys 192 and values
    128 wide; no weights read): a position costs 27 x 576 values in the pool, 1/8.9 of the 27 x 16 x 320
    that per-head keys and values would."""
    from mlxcel.engine.scheduler import kv_bytes_per_position
    from mlxcel.models import deepseek_v3

    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_config(V2_LITE))
    per_position = kv_bytes_per_position(model)
    assert per_position == 27 * (512 + 64) * 4
    decompressed = 27 * 16 * ((128 + 64) + 128) * 4
    assert per_position * 8 <= decompressed


# deepseek-ai/DeepSeek-V2-Lite's released config.json (the bench's shape, at its 27 layers)
V2_LITE = {**DEEPSEEK_V2_LITE_SMALL, "num_hidden_layers": 27}


def test_kv_bits_quantizes_the_latent_or_is_refused(built):
    """decode.kv_bits on the latent and the RoPE key (groups of 32: deepseek_v2's 32-wide RoPE key): each row
    among others draws what it draws alone, the batch engine's quantized cache draws the same tokens, and
    the setting reaches the cache (2 bits draws otherwise). deepseek_v3's 8-wide RoPE key takes no group of
    32: refused in one line by the batch engine and before loading."""
    from mlxcel.checkpoints.fingerprint import read_head_dim

    model = built["model"]
    config = json.loads((built["folder"] / "config.json").read_text())
    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    request = {"kv_group_size": 32, "chunk_size": 16}
    if built["family"] == "deepseek_v3":
        assert read_head_dim(config) == 8  # (pipeline.check_before_loading: the group must divide it)
        with pytest.raises(MlxcelError, match="kv_group_size=32 does not divide"):
            mlxcel_generate(model, [PROMPT[:9]], 4, kv_bits=8, **request)
        # the scheduler's quantized pool too (a request whose kv_bits skipped the check before loading)
        with pytest.raises(MlxcelError, match="kv_group_size=32 does not divide"):
            schedule(model, [PROMPT[:9]], 4, request={"kv_bits": 8, **request}, max_rows=2)
        return
    assert read_head_dim(config) == 32

    def run(prompts, bits):
        state = schedule(model, prompts, 16, request={"kv_bits": bits, **request}, max_rows=4)
        return [r.token_ids for r in state.results]

    together = run(prompts, 8)
    assert together == [run([p], 8)[0] for p in prompts]
    assert together == [mlxcel_generate(model, [p], 16, kv_bits=8, **request)[0] for p in prompts]
    assert run(prompts, 2) != together


def test_batch_invariant_is_refused_for_the_experts(built, monkeypatch):
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.models import invariant

    monkeypatch.setattr(invariant, "pads_matmuls", lambda: True)
    with pytest.raises(MlxcelError, match="mixture-of-experts"):
        BatchScheduler(built["model"], 512, 4, batch_invariant=True)


def test_bfloat16_keeps_the_router_in_float32(built):
    loaded = load_model(str(built["folder"]), dtype="bfloat16")
    layer = loaded.model.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == mx.bfloat16
    assert layer.mlp.gate.weight.dtype == mx.float32
    assert layer.mlp.shared_experts.down_proj.weight.dtype == mx.bfloat16
    assert len(mlxcel_generate(loaded.model, [PROMPT], 4)[0]) == 4


def test_quantize_at_load_runs(built):
    loaded = load_model(str(built["folder"]), dtype="float32", quantize={"bits": 4, "group_size": 32})
    report = loaded.info["quantization"]
    assert report["bits"] == 4 and np.isfinite(report["max_abs_logit_diff"])
    attention = loaded.model.model.layers[1].self_attn
    assert isinstance(attention.o_proj, nn.QuantizedLinear) and attention.unembed_out.bits == 4
    tokens = mlxcel_generate(loaded.model, [LONG_PROMPT, PROMPT[:9]], 8)
    assert [len(t) for t in tokens] == [8, 8]


def test_yarn_scaling_matches_transformers(tmp_path):
    """YaRN (factor 4 over 64 original positions; mscale 0.8 against mscale_all_dim 1: the rotated
    dimensions scaled by their ratio, every logit by mscale_all_dim's square), over 160 tokens: logits,
    greedy tokens, and the two forms."""
    from mlxcel.models.mla import softmax_scale

    folder = make_checkpoint(tmp_path / "yarn", "deepseek_v3", seed=1, rope_parameters=YARN)
    result = check_parity(measure_parity(folder, LONG_PROMPT))
    attention = result["model"].model.layers[0].self_attn
    assert attention.rope.attention_factor != 1.0 and attention.scale == softmax_scale(24, YARN) != 24**-0.5
    set_forms(result["model"], 0)
    plain = np.array(result["model"](mx.array([PROMPT]), result["model"].make_cache())[0])
    set_forms(result["model"], 10**9)
    absorbed = np.array(result["model"](mx.array([PROMPT]), result["model"].make_cache())[0])
    assert np.abs(plain - absorbed).max() <= 1e-4


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
    """The folder as mlx-lm 0.32 reads it: rope_theta at the top (it reads no rope_parameters), and for
    deepseek_v2, which always builds YaRN, a factor of 1 (YaRN's frequencies are then RoPE's); a positive
    correction bias, since mlx-lm's grouped choice zeroes the dropped groups' scores where transformers'
    sets them to -inf (the two agree while every kept score is positive)."""
    config = json.loads((folder / "config.json").read_text())
    plain = {"type": "yarn", "factor": 1.0} if config["model_type"] == "deepseek_v2" else None
    config.update(rope_theta=config["rope_parameters"]["rope_theta"], rope_scaling=plain)
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {k: mx.abs(v) if k.endswith("e_score_correction_bias") else v for k, v in weights.items()}
    return rewrite_checkpoint(folder, dst, weights, config)


def test_mlx_lm_converted_folders_load_and_match_mlx_lm(built, tmp_path):
    """mlx_lm.convert, dense and -q (mlx-community's layout): deepseek_v3's kv_b_proj split into embed_q /
    unembed_out by mlx-lm (quantized where the group divides their input), deepseek_v2's kept whole and
    quantized (we split it: its packed value rows as they are, the key part dequantized, so the folder's
    numbers exactly); experts stacked as switch_mlp.* and packed,
    the router left dense. Our logits are mlx-lm's load of the same folder, and the dense one's ours from the
    original folder."""
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
        written = mx.load(str(out / "model.safetensors"))
        split_by_mlx_lm = "model.layers.0.self_attn.unembed_out.scales" in written
        assert split_by_mlx_lm == (built["family"] == "deepseek_v3")
        layer = loaded.model.model.layers[1]
        assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear) and layer.self_attn.unembed_out.bits == 4
        assert "scales" not in layer.self_attn.embed_q  # (16 wide: no group of 32 divides it)
        assert layer.mlp.switch_mlp.gate_up_proj.bits == 4
        assert layer.mlp.gate.weight.dtype == mx.float32 and "scales" not in layer.mlp.gate


def test_fused_experts_and_multi_token_prediction_layers_load(built, tmp_path):
    """transformers 5's in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and the released
    checkpoints' multi-token-prediction layer after the last one (model.layers.{num_hidden_layers}.*, not
    used to generate): the same logits."""
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


def test_fp8_release_layout_is_dequantized_by_its_block_scales(built, tmp_path):
    """DeepSeek's and Kimi's FP8 releases: each projection's weight as e4m3 bytes and weight_scale_inv, a
    float32 scale per 128 x 128 block (here one partial block a weight). Loaded, the same logits as the
    weights dequantized by hand (bfloat16, as the release is meant to be read)."""
    if built["family"] != "deepseek_v3":
        pytest.skip("the layout is the checkpoints', not the family's: checked once")
    weights = mx.load(str(built["folder"] / "model.safetensors"))
    packed, dense = dict(weights), dict(weights)
    for key, value in weights.items():
        if key.endswith("proj.weight") and value.ndim == 2:
            scale = mx.abs(value).max() / 448.0  # e4m3's largest finite value
            fp8 = mx.to_fp8(value / scale)
            packed[key], packed[key.replace(".weight", ".weight_scale_inv")] = fp8, scale.reshape(1, 1)
            dense[key] = (mx.from_fp8(fp8, dtype=mx.float32) * scale).astype(mx.bfloat16).astype(mx.float32)
    got, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "fp8", packed), LONG_PROMPT)
    expected, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "dense", dense), LONG_PROMPT)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert np.abs(got - built["logits"]).max() > 1e-3  # (the weights did change: the test can fail)


def test_kimi_k2_is_a_deepseek_v3_text_model(built, tmp_path):
    """Kimi K2's config.json names model_type kimi_k2 over DeepSeek V3's weights and keys."""
    if built["family"] != "deepseek_v3":
        pytest.skip("Kimi K2 is DeepSeek V3")
    config = json.loads((built["folder"] / "config.json").read_text())
    weights = mx.load(str(built["folder"] / "model.safetensors"))
    folder = rewrite_checkpoint(built["folder"], tmp_path / "kimi_k2", weights, {**config, "model_type": "kimi_k2"})
    got, loaded = mlxcel_logits(folder, LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-6)
    assert loaded.info["arch"] == "kimi_k2"


def test_kimi_k25_folder_loads_its_language_model_and_refuses_images(tmp_path):
    """Kimi K2.5's vision-language folder as transformers writes it (language_model.model.*, the vision
    tower and projector beside it; its text_config a DeepSeek V3): the language model loads, its logits and
    greedy tokens are transformers' text-only forward's; an image is refused in one line."""
    import torch
    import transformers

    from mlxcel.vision.stage import check_images_allowed

    folder = tmp_path / "kimi_k25"
    folder.mkdir()
    vocab = write_tiny_tokenizer(folder)
    text = {**SHAPE, **V3, "num_hidden_layers": 2, "n_group": 1, "topk_group": 1, "model_type": "kimi_k2"}
    text.update(vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    vision = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64}
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config={**vision, "pos_emb_height": 4, "pos_emb_width": 4},
        projection_hidden_size=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    model = transformers.Kimi_K25ForConditionalGeneration(config)
    offset_correction_bias(model)
    save_widened(model, folder)
    written = mx.load(str(folder / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in written) and any(k.startswith("language_model.") for k in written)
    reference = model.eval()
    got, loaded = mlxcel_logits(folder, LONG_PROMPT)
    assert np.abs(got - reference_logits(reference, LONG_PROMPT)).max() <= 1e-3
    assert loaded.info["arch"] == "kimi_k25" and "not loaded" in loaded.info["note"]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        greedy = reference.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None)
    assert mlxcel_generate(loaded.model, [PROMPT], GREEDY_TOKENS)[0] == greedy[0, len(PROMPT) :].tolist()
    with pytest.raises(MlxcelError, match="kimi_k25 is a text-only model"):
        check_images_allowed(loaded.model, "kimi_k25", ["cat.png"])


# --- config.json as the released models write it, and refusals -------------------------------------


def test_released_configs_read_as_transformers_reads_them():
    """DeepSeek-V2-Lite's, DeepSeek-V3's and Kimi K2's config.json (transformers 4 style: rope_theta and
    rope_scaling with `type`): the MLA sizes, the layers' kinds, the routing and the YaRN scale."""
    from mlxcel.models import deepseek_v3
    from mlxcel.models.mla import softmax_scale

    args = deepseek_v3.ModelArgs.from_config(V2_LITE)
    assert (args.q_lora_rank, args.kv_lora_rank, args.topk_method, args.norm_topk_prob) == (None, 512, "greedy", False)
    assert args.sparse_layers == [False] + [True] * 26 and args.rope_scaling["rope_type"] == "yarn"
    # mscale_all_dim 0.707 at factor 40: the softmax scale times (0.1 * 0.707 * ln 40 + 1)^2
    assert softmax_scale(192, args.rope_scaling) == pytest.approx(192**-0.5 * (0.0707 * np.log(40) + 1) ** 2)
    v3 = {
        **V2_LITE,
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
    }
    args = deepseek_v3.ModelArgs.from_config(v3)
    assert args.sparse_layers == [False] * 3 + [True] * 58 and args.rope_interleave and args.norm_topk_prob
    kimi = {**v3, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "n_routed_experts": 384}
    assert deepseek_v3.ModelArgs.from_config(kimi).topk_method == "noaux_tc"
    with pytest.raises(MlxcelError, match="topk_method greedy or group_limited_greedy; got 'noaux_tc'"):
        deepseek_v3.ModelArgs.from_config({**V2_LITE, "topk_method": "noaux_tc"})
    tiny = {**V2_LITE, "hidden_size": 64, "num_hidden_layers": 2, "num_experts_per_tok": 200, "vocab_size": 320}
    with pytest.raises(MlxcelError, match="num_experts_per_tok=200"):
        deepseek_v3.Model(deepseek_v3.ModelArgs.from_config(tiny))


@pytest.mark.parametrize(
    "model_type,missing",
    [("deepseek_v32", "lightning indexer"), ("deepseek_v4", "compressed sparse attention")],
)
def test_deepseek_v32_and_v4_are_refused_naming_what_is_missing(model_type, missing, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**V2_LITE, "model_type": model_type}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(MlxcelError, match=missing) as caught:
        load_model(str(tmp_path), dtype="float32")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "preset,families",
    [
        ("deepseek_v2", ["deepseek_v2"]),
        ("deepseek_v3", ["deepseek_v3", "kimi_k2", "kimi_k25"]),
        ("kimi_k2", ["kimi_k2", "kimi_k25"]),
    ],
)
def test_presets_require_a_path_and_name_their_family(preset, families, tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run([f"model={preset}"]))
    model = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"])).model
    assert model.families == families and set(families) <= set(list_supported_families()) and model.hub_ids


def test_the_api_and_the_server_give_each_row_its_own_tokens(built, tmp_path):
    """tests/test_new_families_paths.py's checks on this checkpoint: through the Python API (the prompt cache
    on) a batch and a conversation give each row its own tokens and a JSON-schema row answers in its schema;
    the server's chat completion is the API's answer."""
    from mlxcel import load_generator
    from tests import test_new_families_paths as paths
    from tests.serve_fixtures import request_json, running_server

    if built["family"] != "deepseek_v3":
        pytest.skip("the paths are the family's: checked once")
    folder, overrides = built["folder"], paths.OVERRIDES
    paths.test_the_api_gives_each_row_its_own_tokens_and_a_schema_row_its_schema(folder)
    expected = load_generator({"model": {"path": str(folder)}}, overrides=overrides).generate(paths.CONVERSATION)
    with running_server(tmp_path / "run", f"model.path={folder}", *overrides, "serve.model_name=m") as server:
        status, body, _ = request_json(f"{server.url}/chat/completions", {"model": "m", "messages": paths.CONVERSATION})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected.text
