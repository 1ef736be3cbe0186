"""OLMo 2 and OLMo 3 against transformers on tiny random checkpoints it writes: norms after the
attention and the MLP (before each residual add, none before), an RMSNorm over the whole query
and key projections (all heads at once), and for OLMo 3 sliding-window layers (16 positions
here, three layers in four) beside full-attention layers whose RoPE is YaRN-scaled (factor 8 over
64 original positions here) with a theta of their own (transformers 5 writes one per layer type).

fp32 logits over a 120-token prompt (past the window and YaRN's original length) and 32 greedy
tokens as transformers gives them; pieces equal one shot; left-padded rows and rows among others
in the scheduler (with the prompt cache on) get what they get alone; mlx-lm's quantized folders
load and give mlx-lm's logits; the released configs' spelling (rope_theta + rope_scaling) loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine.scheduler import layer_windows
from mlxcel.models.cache import KVCache
from mlxcel.models.rotating_cache import RotatingKVCache
from tests.family_fixtures import (
    BASE_SHAPE,
    GREEDY_TOKENS,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_pieces_match_one_shot,
    check_parity,
    check_prefix_adoption,
    measure_parity,
    mlxcel_logits,
    reference_greedy,
    save_widened,
    schedule,
)
from tests.helpers import compose_run, write_tiny_tokenizer

pytest.importorskip("torch")

LONG_PROMPT = PROMPT * 3  # 120 tokens: past the window (16) and YaRN's original length (64)
WINDOW = 16
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
SHAPES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"head_dim": 32, "rope_theta": 10000.0}),
    # transformers 5 gives the full-attention layers rope_theta and YaRN, the sliding ones its
    # default theta (500000): two thetas, as its config.json then says per layer type
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {"head_dim": 32, "num_hidden_layers": 4, "sliding_window": WINDOW, "rope_theta": 10000.0, "rope_scaling": YARN},
    ),
}
SCHEDULER_PROMPTS = [LONG_PROMPT, PROMPT[5:28], PROMPT[:5], PROMPT * 2 + PROMPT[:13]]


def write_olmo(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config_class, model_class, defaults = SHAPES[family]
    shape = {**BASE_SHAPE, **defaults, "vocab_size": vocab, **overrides}
    config = getattr(transformers, config_class)(**shape, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    save_widened(getattr(transformers, model_class)(config), folder)
    return folder


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory) -> Path:
    return write_olmo(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def parity(checkpoint) -> dict:
    return measure_parity(checkpoint, LONG_PROMPT)


@pytest.fixture(scope="module")
def model(parity):
    return parity["model"]


def test_matches_transformers(parity):
    """fp32 logits within 1e-3 over 120 tokens, 32 greedy tokens identical."""
    check_parity(parity)


@pytest.mark.parametrize("family", ["olmo3"], indirect=True)
def test_olmo3_layers_slide_and_scale_their_rope_by_kind(family, model, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 500000.0  # what transformers wrote
    assert layer_windows(model) == [WINDOW, WINDOW, WINDOW, None]
    assert [type(c) for c in model.make_cache(1)] == [RotatingKVCache] * 3 + [KVCache]
    ropes = [layer.self_attn.rope for layer in model.model.layers]
    assert [r.base for r in ropes] == [500000.0] * 3 + [None]  # the last one's frequencies are YaRN's
    assert [r.attention_factor for r in ropes[:3]] == [1.0] * 3
    assert ropes[3].attention_factor == pytest.approx(0.1 * np.log(8) + 1)


@pytest.mark.parametrize("piece,tile", [(1, None), (7, None), (16, 8), (50, 32)])
def test_prefill_in_pieces_equals_one_shot(model, piece, tile):
    assert_pieces_match_one_shot(model, LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_match_alone(model):
    assert_batch_rows_match_alone(model, [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]])


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
    """32 greedy tokens each, as transformers draws them alone: whole prompts, pieces (shorter and
    longer than the window), two slots that rows join and leave, ragged pieces."""
    state = schedule(model, SCHEDULER_PROMPTS, **options)
    assert [r.token_ids for r in state.results] == scheduler_expected


def test_rows_sharing_a_prefix_adopt_it_and_draw_what_they_draw_alone(model):
    """The prompt cache on: the later rows adopt the shared 80 tokens (past the window) and draw
    the tokens they draw alone."""
    check_prefix_adoption(model)


def test_batch_invariant_and_kv_bits_rows_equal_alone(model):
    """runner.batch_invariant (on the CPU) and an 8-bit KV cache: each row's tokens as alone."""
    for options in ({"batch_invariant": True}, {"request": {"kv_bits": 8, "kv_group_size": 32}}):
        together = schedule(model, SCHEDULER_PROMPTS, 12, **options)
        alone = [schedule(model, [p], 12, **options).results[0].token_ids for p in SCHEDULER_PROMPTS]
        assert [r.token_ids for r in together.results] == alone, options


@pytest.mark.parametrize("prompts", [[PROMPT], [PROMPT, PROMPT[5:28], PROMPT[:9]]], ids=["batch1", "left_padded"])
def test_the_segmented_decode_step_gives_the_eager_logits(model, prompts):
    """The GPU's decode step compiled between attentions (engine/segmented.py) reaches OLMo's
    blocks through input_layernorm (the identity here) and finish_block: the eager step's logits."""
    from tests.test_segmented_decode import decode_both_ways

    worst, eager_ids, segmented_ids = decode_both_ways(model, prompts)
    assert worst <= 1e-4 and segmented_ids == eager_ids


@pytest.mark.parametrize("family", ["olmo3"], indirect=True)
def test_the_api_runs_rows_as_alone_and_a_json_schema_row_beside_them(family, checkpoint):
    """The Python API on OLMo 3 (the prompt cache on, as by default): a batch gives each row's
    tokens alone, and a row constrained to a JSON schema answers in it."""
    import jsonschema

    from mlxcel import load_generator

    overrides = ["model.dtype=float32", "decode.max_tokens=12", "decode.ignore_eos=true", "runner.device=cpu"]
    generator = load_generator({"model": {"path": str(checkpoint)}}, overrides=overrides)
    prompts = ["def add(a, b):", "The capital of Italy is", "Numbers 0123456789"]
    together = [o.token_ids for o in generator.generate(prompts)]
    assert together == [generator.generate(p).token_ids for p in prompts]
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    answer = generator.generate("Answer in JSON.", max_tokens=40, constraint={"json_schema": schema})
    assert answer.finish_reason == "stop", answer
    jsonschema.validate(json.loads(answer.text), schema)


def write_released_spelling(checkpoint: Path, folder: Path) -> Path:
    """config.json as the released OLMo 3 folders have it (transformers 4.57): rope_theta and a
    rope_scaling for the full-attention layers, no rope_parameters (mlx-lm reads only this)."""
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    if "full_attention" in params:
        full = dict(params["full_attention"])
        config["rope_theta"] = full.pop("rope_theta")
        config["rope_scaling"] = full if full.pop("rope_type") != "default" else None
        if config["rope_scaling"] is not None:
            config["rope_scaling"]["rope_type"] = "yarn"
    else:
        config["rope_theta"] = params["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family", ["olmo3"], indirect=True)
def test_olmo3_released_config_spelling_gives_every_layer_rope_theta(family, checkpoint, tmp_path):
    """rope_theta + rope_scaling: the full-attention layers take both, the sliding ones the same
    theta unscaled (transformers 4.57, mlx-lm and vLLM read it so; transformers 5.25 gives the
    sliding layers its default 500000 instead, the same on the released models, whose theta it is)."""
    folder = write_released_spelling(checkpoint, tmp_path / "released")
    loaded = load_model(str(folder), dtype="float32")
    ropes = [layer.self_attn.rope for layer in loaded.model.model.layers]
    assert [r.base for r in ropes[:3]] == [10000.0] * 3 and ropes[3].base is None and ropes[3].attention_factor > 1


def test_mlx_lm_quantized_folder_gives_mlx_lms_logits(family, checkpoint, tmp_path):
    """mlx_lm.convert -q (mlx-community's layout, 4-bit): our load gives mlx-lm's logits."""
    mlx_lm = pytest.importorskip("mlx_lm")
    source = write_released_spelling(checkpoint, tmp_path / "src")
    out = tmp_path / "q4"
    mlx_lm.convert(str(source), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    ours, loaded = mlxcel_logits(out, LONG_PROMPT)
    attention = loaded.model.model.layers[0].self_attn
    assert "qkv_proj" in attention and attention.qkv_proj.bits == 4  # quantized, fused at load
    theirs, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)


def test_yarn_frequencies_are_transformers_for_the_released_7b():
    """Olmo-3-7B's YaRN (head_dim 128, factor 8 over 8192, rope_theta 500000) against
    transformers' own computation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mlxcel.models.olmo3 import make_rope, read_layer_type_ropes

    released = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "max_position_embeddings": 65536,
        "rope_theta": 500000,
        "rope_scaling": {
            "attention_factor": 1.2079441541679836,
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "yarn",
        },
    }
    ropes = read_layer_type_ropes(released)
    assert ropes["sliding_attention"] == {"rope_theta": 500000, "rope_type": "default"}
    rope = make_rope(128, ropes["full_attention"], False, 65536)
    freqs, factor = rope._freqs, rope.attention_factor
    config = transformers.Olmo3Config(**released)
    inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, layer_type="full_attention")
    np.testing.assert_allclose(1.0 / np.array(freqs), inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor)


@pytest.mark.parametrize(
    "preset,hub", [("olmo2", "allenai/OLMo-2-1124-7B-Instruct"), ("olmo3", "allenai/Olmo-3-7B-Instruct")]
)
def test_presets_name_the_family_and_require_a_path(preset, hub, tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run([f"model={preset}"]))
    model = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"])).model
    assert model.families == [preset] and preset in list_supported_families() and hub in model.hub_ids


# --- GGUF: the files llama.cpp's convert_hf_to_gguf.py writes (Olmo2Model, for Olmo2ForCausalLM and
# Olmo3ForCausalLM alike: arch olmo2, Q/K as transformers has them; SmolLM3Model: Q/K permuted) ---

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
OLMO_NORMS = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensor_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in top or name == "lm_head.weight":
        return top.get(name, "output.weight")
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**GGUF_NAMES, **(OLMO_NORMS if arch == "olmo2" else {})}
    return f"blk.{layer}.{names[module]}.{kind}"


def write_converted_gguf(folder: Path, arch: str, out: Path, quant: str = "F32") -> Path:
    """TextModel.set_gguf_parameters' keys (the full-attention layers' rope_theta and YaRN keys,
    the sliding layers' theta as freq_base_swa), Olmo2Model's sliding_window and per-layer pattern,
    LlamaModel's Q/K permutation for smollm3; F32 or Q8_0 matrices."""
    import gguf
    from safetensors.numpy import load_file

    from tests.gguf_fixtures import permute_for_llama_cpp

    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    full, sliding = rope.get("full_attention", rope), rope.get("sliding_attention")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    writer.add_rope_freq_base(full["rope_theta"])
    if sliding is not None:
        writer.add_rope_freq_base_swa(sliding["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if arch == "olmo2" and "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data in load_file(str(folder / "model.safetensors")).items():
        data = data.astype(np.float32)
        if arch == "smollm3" and name.endswith("q_proj.weight"):
            data = permute_for_llama_cpp(data, heads)
        elif arch == "smollm3" and name.endswith("k_proj.weight"):
            data = permute_for_llama_cpp(data, kv_heads)
        if quant == "Q8_0" and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_tensor_name(name, arch), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name, arch), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_logits(path: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([LONG_PROMPT]), loaded.model.make_cache())[0]), loaded


def test_gguf_as_llama_cpp_writes_it_gives_the_safetensors_logits(family, checkpoint, parity, tmp_path):
    """transformers reads no olmo2 GGUF: the oracle is our load of the same weights from
    safetensors (and through it transformers). An olmo2 file with a sliding window is OLMo 3."""
    path = write_converted_gguf(checkpoint, "olmo2", tmp_path / "f32.gguf")
    got, loaded = gguf_logits(path)
    assert loaded.model.args.model_type == family and not loaded.model.args.rope_traditional
    assert layer_windows(loaded.model) == layer_windows(parity["model"])
    assert np.abs(got - parity["logits"]).max() <= 1e-4
    assert np.abs(got - parity["reference_logits"]).max() <= 1e-3


def test_q8_0_gguf_kept_quantized_agrees_with_its_dequantized_form(family, checkpoint, tmp_path):
    path = write_converted_gguf(checkpoint, "olmo2", tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = gguf_logits(path, "dequantize")
    packed, loaded = gguf_logits(path, "quantized")
    assert loaded.info["weights"] == "quantized"
    assert np.abs(dense - packed).max() <= 1e-3
