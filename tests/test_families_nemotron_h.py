"""Nemotron-H (Mamba-2 hybrid) against transformers on tiny random checkpoints it writes: Mamba-2,
attention, MLP and MoE blocks; a prompt past transformers' SSD chunk (16 here) and ours (64).

fp32 logits and 32 greedy tokens as transformers gives them; a prompt prefilled in any pieces is
prefilled once; rows of a left-padded batch and rows among others in the scheduler get what they
get alone; mlx-lm's layout (backbone names, conv1d [C, K, 1], stacked experts), its quantized
folders and quantization at load all load."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from mlxcel.checkpoints.quantize import dequantize_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, kv_bytes_per_position, recurrent_layers
from mlxcel.errors import MlxcelError
from mlxcel.models.cache import KVCache
from mlxcel.models.recurrent import RecurrentCache
from mlxcel.models.ssd import CHUNK
from mlxcel.models.switch import QuantizedSwitchLinear
from mlxcel.sampling import Sampler
from tests.family_fixtures import (
    GREEDY_TOKENS,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    check_parity,
    decode_logits,
    measure_parity,
    mlxcel_generate,
    mlxcel_logits,
    reference_greedy,
    save_widened,
)
from tests.helpers import compose_run, write_tiny_tokenizer

pytest.importorskip("torch")

LONG_PROMPT = PROMPT * 3  # 120 tokens: past transformers' chunk (16) and ours (64)
assert len(LONG_PROMPT) > CHUNK
LAYERS = ["linear_attention", "full_attention", "mlp", "linear_attention", "moe", "linear_attention"]
SHAPE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# the first is the parity prompt (its 32 tokens are measured once); one short enough to run token by token
SCHEDULER_PROMPTS = [LONG_PROMPT, PROMPT[5:28], PROMPT[:5], PROMPT * 2 + PROMPT[:13]]


def write_nemotron_h(folder: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    shape = {**SHAPE, "layers_block_type": LAYERS, **overrides}
    config = transformers.NemotronHConfig(vocab_size=vocab, **shape, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    save_widened(transformers.NemotronHForCausalLM(config), folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_nemotron_h(tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def parity(checkpoint) -> dict:
    return measure_parity(checkpoint, LONG_PROMPT)


@pytest.fixture(scope="module")
def model(parity):
    return parity["model"]


def test_matches_transformers(parity):
    """fp32 logits within 1e-3 over 120 tokens (past both SSD chunk sizes), 32 greedy tokens identical."""
    check_parity(parity)


def test_moe_with_latent_projection_and_group_routing_matches_transformers(tmp_path):
    """Nemotron 3's MoE: experts behind a latent projection, chosen within the best 2 of 4 groups."""
    folder = write_nemotron_h(
        tmp_path / "moe",
        seed=1,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        moe_latent_size=32,
        routed_scaling_factor=2.5,
    )
    result = assert_parity(folder, LONG_PROMPT)
    assert "fc1_latent_proj" in result["model"].model.layers[1].mlp


def test_nvidias_first_config_spelling_loads(checkpoint, parity, tmp_path):
    """The released configs: hybrid_override_pattern ("M*-ME M" as characters), num_hidden_layers,
    mamba_* aliases and a time_step_limit of [0.0, Infinity] (Python's JSON reads it)."""
    folder = tmp_path / "nvidia"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("layers_block_type", "time_step_limit", "n_groups", "conv_kernel"):
        config.pop(key)
    config.update(
        hybrid_override_pattern="M*-MEM", num_hidden_layers=6, mamba_n_groups=2, mamba_d_conv=4, model_type="nemotron_h"
    )
    text = json.dumps(config).replace("}", ', "time_step_limit": [0.0, Infinity]}', 1)
    (folder / "config.json").write_text(text)
    got, loaded = mlxcel_logits(folder, LONG_PROMPT)
    assert loaded.model.args.time_step_limit == (0.0, math.inf) and loaded.model.args.n_groups == 2
    assert np.abs(got - parity["logits"]).max() <= 1e-5


def test_a_config_with_an_unknown_block_kind_is_refused(checkpoint, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layers_block_type"] = ["linear_attention", "cross_attention", *LAYERS[2:]]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxcelError, match=r"layers_block_type holds \['cross_attention'\]"):
        load_model(str(folder), dtype="float32")


def test_blocks_and_their_caches(model):
    """One cache entry per block that keeps something (Mamba, attention); MLP and MoE blocks none.
    A row's state: per Mamba layer, the conv window (3 x (128 + 2 x 2 x 16) fp32) and the SSM state
    (8 heads x 16 x 16 fp32); keys and values only in the attention layer."""
    assert [layer.kind for layer in model.model.layers] == ["mamba", "attention", "mlp", "mamba", "moe", "mamba"]
    assert recurrent_layers(model) == [True, False, True, True]
    assert [type(c) for c in model.make_cache(1)] == [RecurrentCache, KVCache, RecurrentCache, RecurrentCache]
    assert model.state_bytes_per_row() == 3 * (3 * 192 * 4 + 8 * 16 * 16 * 4)
    assert kv_bytes_per_position(model) == 2 * 2 * 16 * 4


@pytest.mark.parametrize("piece", [1, 5, 16, 50, 64, 65])
def test_prefill_in_pieces_equals_one_shot(model, piece):
    assert_pieces_match_one_shot(model, LONG_PROMPT, piece, None)


def test_any_split_of_the_prompt_equals_one_shot(model):
    """Pieces of uneven sizes: short ones token by token, long ones chunked, cut mid-chunk."""
    whole = model.make_cache(1)
    one_shot = np.array(model(mx.array([LONG_PROMPT]), whole)[0, -1])
    split = model.make_cache(1)
    for start, end in zip([0, 3, 4, 71, 77, 118], [3, 4, 71, 77, 118, len(LONG_PROMPT)]):
        logits = np.array(model(mx.array([LONG_PROMPT[start:end]]), split)[0, -1])
    assert np.abs(logits - one_shot).max() <= 1e-4
    follow = [11, 42, 7, 99, 5]
    assert np.abs(decode_logits(model, whole, follow) - decode_logits(model, split, follow)).max() <= 1e-4


def test_left_padded_batch_rows_match_alone(model):
    assert_batch_rows_match_alone(model, [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]])


def write_mlx_lm_layout(checkpoint: Path, folder: Path, quantize: dict | None = None) -> Path:
    """The folder mlx_lm.convert writes: its sanitize's names (backbone.*, mixer.*, conv1d
    [C, K, 1], routed experts stacked as switch_mlp.fc1/fc2), and with `quantize` every Linear,
    the embedding and the experts packed (not conv1d, not the router)."""
    shutil.copytree(checkpoint, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    out = {}
    for name, value in weights.items():
        if name.endswith("conv1d.weight"):
            value = value.moveaxis(2, 1)
        out[name] = value
    for i, kind in enumerate(config["layers_block_type"]):
        prefix = f"backbone.layers.{i}.mixer"
        if kind == "moe":
            for source, target in (("up_proj", "fc1"), ("down_proj", "fc2")):
                stacked = [out.pop(f"{prefix}.experts.{e}.{source}.weight") for e in range(config["n_routed_experts"])]
                out[f"{prefix}.switch_mlp.{target}.weight"] = mx.stack(stacked)
    if quantize:
        for name in [n for n, v in out.items() if v.ndim >= 2]:
            module = name.rsplit(".", 1)[0]
            if module.endswith(("conv1d", ".gate")) or out[name].shape[-1] % quantize["group_size"]:
                continue
            out[name], out[f"{module}.scales"], out[f"{module}.biases"] = mx.quantize(
                out[name], quantize["group_size"], quantize["bits"]
            )
        config.update(quantization={**quantize, "mode": "affine"}, quantization_config={**quantize, "mode": "affine"})
        (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), out, {"format": "mlx"})
    return folder


def test_mlx_lm_layout_loads_and_matches(checkpoint, parity, tmp_path):
    folder = write_mlx_lm_layout(checkpoint, tmp_path / "mlx")
    got, _ = mlxcel_logits(folder, LONG_PROMPT)
    assert np.abs(got - parity["logits"]).max() <= 1e-5


def test_mlx_lm_quantized_folder_matches_its_dequantized_form(checkpoint, tmp_path):
    folder = write_mlx_lm_layout(checkpoint, tmp_path / "q4", {"bits": 4, "group_size": 32})
    quantized = load_model(str(folder), dtype="float32")
    layers = quantized.model.model.layers
    assert layers[0].mixer.in_proj.bits == 4 and type(layers[0].mixer.conv1d) is nn.Conv1d
    assert isinstance(layers[4].mlp.switch_mlp.fc1, QuantizedSwitchLinear)
    assert layers[4].mlp.gate.weight.dtype == mx.float32  # the router stays dense
    reference = load_model(str(folder), dtype="float32")
    dequantize_model(reference.model)
    ours, theirs = (np.array(m.model(mx.array([LONG_PROMPT]), m.model.make_cache())[0]) for m in (quantized, reference))
    assert np.abs(ours - theirs).max() <= 1e-3
    assert mlxcel_generate(quantized.model, [PROMPT], 16) == mlxcel_generate(reference.model, [PROMPT], 16)


def test_quantize_at_load(checkpoint):
    loaded = load_model(str(checkpoint), dtype="float32", quantize={"bits": 4, "group_size": 32})
    report = loaded.info["quantization"]
    assert report["source"] == "model.quantize" and report["max_abs_logit_diff"] > 0
    layers = loaded.model.model.layers
    assert layers[0].mixer.out_proj.bits == 4 and isinstance(layers[4].mlp.switch_mlp.fc2, QuantizedSwitchLinear)
    dequantized = load_model(str(checkpoint), dtype="float32", quantize={"bits": 4, "group_size": 32})
    dequantize_model(dequantized.model)
    assert mlxcel_generate(loaded.model, [LONG_PROMPT], 16) == mlxcel_generate(dequantized.model, [LONG_PROMPT], 16)


@pytest.fixture(scope="module")
def scheduler_expected(parity) -> list[list[int]]:
    others = [reference_greedy(parity["reference"], p, GREEDY_TOKENS) for p in SCHEDULER_PROMPTS[1:]]
    return [parity["reference_greedy"], *others]


@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 16}, {"max_rows": 2, "chunk_size": 7}, {"ragged": True, "chunk_size": 16}],
    ids=["whole", "pieces16", "two-slots-pieces7", "ragged"],
)
def test_each_row_among_others_in_the_scheduler_draws_transformers_tokens(model, scheduler_expected, options):
    """32 greedy tokens each, as transformers draws them alone: whole prompts, pieces that carry
    the state (ending mid-chunk), two slots that rows join and leave, ragged pieces."""
    options = dict(options)
    ragged = options.pop("ragged", None)
    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 8), **options)
    if ragged is not None:  # the GPU's ragged prefill: several rows' pieces in one call, padding before each
        scheduler.ragged_prefill = ragged
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(SCHEDULER_PROMPTS)]
    state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=GREEDY_TOKENS))
    assert [r.token_ids for r in state.results] == scheduler_expected


def test_preset_names_the_family_and_requires_a_path(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=nemotron_h"]))
    model = validate_config(compose_run(["model=nemotron_h", f"model.path={tmp_path}"])).model
    assert model.families == ["nemotron_h"] and "nemotron_h" in list_supported_families()
    assert all(hub.startswith("nvidia/") for hub in model.hub_ids)


def test_batch_invariant_rows_equal_alone_and_moe_is_refused(model, tmp_path):
    """Nemotron-H without MoE runs batch-invariant on the CPU (each row's tokens as alone);
    Nemotron 3's MoE layers group tokens by expert across rows: refused with that reason."""
    with pytest.raises(MlxcelError, match="mixture-of-experts"):
        BatchScheduler(model, 512, 8, batch_invariant=True)
    dense_layers = ["linear_attention", "full_attention", "mlp"]
    folder = write_nemotron_h(tmp_path / "dense", seed=2, layers_block_type=dense_layers)
    dense = load_model(str(folder), dtype="float32").model

    def run(prompts):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12)
        return [r.token_ids for r in BatchScheduler(dense, 512, 8, batch_invariant=True).generate(request).results]

    assert run(SCHEDULER_PROMPTS) == [run([p])[0] for p in SCHEDULER_PROMPTS]


def test_rows_sharing_a_prefix_adopt_it_with_its_mamba_states(model):
    """The prompt cache on Nemotron-H: the first row's piece ends where the shared prefix does (its
    Mamba layers' states are recorded there); the others adopt the attention layer's keys and
    values and the Mamba states, and draw the tokens they draw alone."""
    from mlxcel.engine.prompt_cache import PromptCache

    shared = PROMPT * 2
    prompts = [shared + tail for tail in (PROMPT[3:20], PROMPT[11:19], PROMPT[:30])]

    def run(prompts, **options):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12)
        return BatchScheduler(model, 512, 8, chunk_size=32, **options).generate(request)

    state = run(prompts, prompt_cache=PromptCache(10**8))
    assert [r.token_ids for r in state.results] == [run([p]).results[0].token_ids for p in prompts]
    assert [r.cached_tokens for r in state.results] == [0, len(shared), len(shared)]
