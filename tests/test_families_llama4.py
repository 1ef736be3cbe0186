"""Llama 4 text (llama4_text, and the language model of llama4 folders) against transformers 5's
Llama4ForCausalLM on tiny random checkpoints it writes.

The tiny config keeps the released structure at a small scale: 16-position attention chunks on the
RoPE layers (8192 released) and a NoPE full-attention layer (layer 3: every fourth), its queries'
temperature tuning made visible over 120 tokens (floor_scale 16, attn_scale 0.5; 8192 and 0.1
released), QK norm, MoE layers (a shared expert and top-1 sigmoid routing) interleaved with dense
ones (interleave_moe_layer_step 2, as Maverick). Checks: fp32 logits within 1e-3 over a
120-token prompt (seven chunks) and 32 greedy tokens identical; each piece left out shows in the
logits; pieces equal one shot; left-padded rows equal alone; the scheduler with other rows
(chunked layers keep one chunk a row); the prompt cache; decode.kv_bits; batch-invariant (refused
for MoE, as every MoE family; a dense Llama 4 runs it); a llama4 folder (transformers'
Llama4ForConditionalGeneration, its vision tower not loaded); mlx-lm's quantized folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine.scheduler import layer_chunks, layer_windows
from mlxcel.errors import MlxcelError
from mlxcel.models.cache import ChunkedKVCache, KVCache
from tests.family_fixtures import (
    BASE_SHAPE,
    GREEDY_TOKENS,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
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
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

LONG_PROMPT = PROMPT * 3  # 120 tokens: seven 16-position chunks and a part
CHUNK = 16
SHAPE = {
    "head_dim": 32,  # decode.kv_bits groups of 32 along it
    "num_hidden_layers": 4,
    "intermediate_size_mlp": 96,
    "num_local_experts": 4,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": CHUNK,
    "floor_scale": 16,
    "attn_scale": 0.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
SCHEDULER_PROMPTS = [LONG_PROMPT, PROMPT[5:28], PROMPT[:5], PROMPT * 2 + PROMPT[:13]]
VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vision_output_dim": 32,
    "image_size": 28,
    "patch_size": 14,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
}


def text_shape(vocab: int, **overrides) -> dict:
    return {**BASE_SHAPE, **SHAPE, "vocab_size": vocab, **overrides}


def write_llama4(folder: Path, seed: int = 0, **overrides) -> Path:
    """A llama4_text folder as transformers' Llama4ForCausalLM saves it."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config = transformers.Llama4TextConfig(**text_shape(vocab, **overrides), eos_token_id=2, bos_token_id=None)
    config.pad_token_id = 0
    torch.manual_seed(seed)
    save_widened(transformers.Llama4ForCausalLM(config), folder)
    return folder


def write_llama4_vlm(folder: Path, seed: int = 0, **overrides) -> tuple[Path, object]:
    """A llama4 folder (Llama4ForConditionalGeneration: a tiny vision tower, language_model.*)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    text = {**text_shape(vocab, **overrides), "eos_token_id": 2, "bos_token_id": None, "pad_token_id": 0}
    tokens = {"boi_token_index": vocab - 3, "eoi_token_index": vocab - 2, "image_token_index": vocab - 1}
    config = transformers.Llama4Config(text_config=text, vision_config=VISION, **tokens)
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config)
    save_widened(model, folder)
    return folder, model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, on_the_cpu) -> Path:
    return write_llama4(tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def parity(checkpoint) -> dict:
    return measure_parity(checkpoint, LONG_PROMPT)


@pytest.fixture(scope="module")
def model(parity):
    return parity["model"]


def test_matches_transformers(parity, checkpoint):
    """fp32 logits within 1e-3 over 120 tokens, 32 greedy tokens identical: chunked RoPE layers
    0-2, the NoPE layer 3 attends to everything; MoE in layers 1 and 3, dense 0 and 2."""
    check_parity(parity)
    model = parity["model"]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["no_rope_layers"] == [1, 1, 1, 0] and config["moe_layers"] == [1, 3]
    assert layer_chunks(model) == [CHUNK, CHUNK, CHUNK, None] and layer_windows(model) == [None] * 4
    assert [type(c) for c in model.make_cache()] == [ChunkedKVCache] * 3 + [KVCache]
    ropes = [type(layer.self_attn.rope).__name__ for layer in model.model.layers]
    assert ropes == ["RoPE", "RoPE", "RoPE", "NoRoPE"]
    kinds = [type(layer.feed_forward).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "MoE", "MLP", "MoE"]


def test_each_piece_shows_in_the_logits(model, parity):
    """Chunked attention, the NoPE layer's temperature tuning and the QK norm, each left out,
    move the logits well past the tolerance (so the parity above checks them)."""
    expected, ids = parity["reference_logits"], mx.array([LONG_PROMPT])
    attentions = [layer.self_attn for layer in model.model.layers]

    def distance() -> float:
        return float(np.abs(np.array(model(ids, model.make_cache())[0]) - expected).max())

    assert distance() <= 1e-3
    model.layer_chunks = [None] * 4  # every layer attends to everything
    assert distance() > 0.05
    model.layer_chunks = [CHUNK, CHUNK, CHUNK, None]
    temperature, attentions[3].temperature = attentions[3].temperature, None
    assert distance() > 0.05
    attentions[3].temperature = temperature
    eps = attentions[0].qk_norm_eps
    for attention in attentions[:3]:
        attention.qk_norm_eps = None
    assert distance() > 0.05
    for attention in attentions[:3]:
        attention.qk_norm_eps = eps
    assert distance() <= 1e-3


@pytest.mark.parametrize(
    "overrides",
    [
        # top-2 routing, no QK norm (Maverick), the layer lists written out, no temperature tuning,
        # llama3 RoPE scaling (Scout)
        {
            "num_experts_per_tok": 2,
            "use_qk_norm": False,
            "no_rope_layers": [1, 0, 1, 1],
            "moe_layers": [0, 2],
            "attn_temperature_tuning": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        {"moe_layers": [], "attention_chunk_size": 7},  # dense (no MoE layer), a chunk that divides nothing
    ],
    ids=["top2-no-qk-norm-lists-llama3", "dense-chunk7"],
)
def test_other_configurations_match_transformers(tmp_path, overrides):
    result = assert_parity(write_llama4(tmp_path / "variant", seed=3, **overrides), LONG_PROMPT)
    rope_layers = overrides.get("no_rope_layers", [1, 1, 1, 0])
    chunk = overrides.get("attention_chunk_size", CHUNK)
    assert layer_chunks(result["model"]) == [chunk if rope else None for rope in rope_layers]


@pytest.mark.parametrize("piece,tile", [(1, None), (7, None), (16, 8), (50, 32)])
def test_prefill_in_pieces_equals_one_shot(model, piece, tile):
    """Pieces shorter than, equal to and longer than a chunk, straddling chunk boundaries."""
    assert_pieces_match_one_shot(model, LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_match_alone(model):
    """Each row's chunks count from its own first token, past its padding (as transformers')."""
    assert_batch_rows_match_alone(model, [LONG_PROMPT, PROMPT[5:28], PROMPT[:9], PROMPT[:21]])


@pytest.mark.parametrize(
    "prompts", [[LONG_PROMPT], [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]], ids=["batch1", "left_padded"]
)
def test_the_segmented_decode_step_gives_the_eager_logits(model, prompts):
    """The GPU's decode step compiled between attentions (here on the CPU): the NoPE layer's
    temperature from the position array, the chunks' keys from each row's chunk start."""
    from tests.test_segmented_decode import decode_both_ways

    worst, eager_ids, segmented_ids = decode_both_ways(model, prompts)
    assert worst <= 1e-4 and segmented_ids == eager_ids


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
    state = schedule(model, SCHEDULER_PROMPTS, **options)
    assert [r.token_ids for r in state.results] == scheduler_expected


def test_rows_sharing_a_prefix_adopt_it_and_draw_what_they_draw_alone(model):
    check_prefix_adoption(model)


def test_kv_bits_rows_equal_alone_and_batch_invariant_is_refused_for_moe(model):
    """decode.kv_bits quantizes the NoPE layer's pool (the chunks' rings stay as they are): each
    row's tokens as alone. runner.batch_invariant refuses MoE, with the reason."""
    options = {"request": {"kv_bits": 8, "kv_group_size": 32}}
    together = schedule(model, SCHEDULER_PROMPTS, 12, **options)
    alone = [schedule(model, [p], 12, **options).results[0].token_ids for p in SCHEDULER_PROMPTS]
    assert [r.token_ids for r in together.results] == alone
    with pytest.raises(MlxcelError, match="runner.batch_invariant=true cannot run llama4: its mixture-of-experts"):
        schedule(model, SCHEDULER_PROMPTS, 4, batch_invariant=True)


def test_a_dense_llama4_runs_batch_invariant(tmp_path):
    folder = write_llama4(tmp_path / "dense", seed=5, moe_layers=[])
    loaded = load_model(str(folder), dtype="float32").model
    together = schedule(loaded, SCHEDULER_PROMPTS, 12, batch_invariant=True)
    alone = [schedule(loaded, [p], 12, batch_invariant=True).results[0].token_ids for p in SCHEDULER_PROMPTS]
    assert [r.token_ids for r in together.results] == alone


def test_config_errors_name_the_key(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    cases = [
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types must hold 4 entries"),
        ({"attention_chunk_size": 0}, "attention_chunk_size must be a positive integer, got 0"),
        ({"attention_chunk_size": None}, "chunked_attention layers and attention_chunk_size is null"),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for num_hidden_layers=4"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be between 1 and num_local_experts=4"),
    ]
    for i, (change, message) in enumerate(cases):
        folder = tmp_path / str(i)
        shutil.copytree(checkpoint, folder)
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(MlxcelError, match=message):
            load_model(str(folder), dtype="float32")


def test_a_llama4_folder_loads_its_language_model(tmp_path):
    """transformers' Llama4ForConditionalGeneration folder (text_config, language_model.*, a vision
    tower): our load gives its text-only logits, the tower dropped."""
    import torch

    folder, reference = write_llama4_vlm(tmp_path / "vlm")
    got, loaded = mlxcel_logits(folder, LONG_PROMPT)
    assert loaded.config["model_type"] == "llama4" and loaded.info["note"]  # the text-only note
    assert layer_chunks(loaded.model) == [CHUNK, CHUNK, CHUNK, None]
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([LONG_PROMPT])).logits[0].numpy()
    assert np.abs(got - expected).max() <= 1e-3


def test_mlx_lm_quantized_folder_gives_mlx_lms_logits(tmp_path):
    """mlx_lm.convert -q of a llama4 folder (mlx-community's layout: language_model.*, experts as
    SwitchGLU's gate/up/down, 4-bit): our load gives mlx-lm's logits. (mlx-lm 0.32's llama4 reads
    rope_theta / rope_scaling, hard-codes NoPE every fourth layer and top-1 routing, as here, and
    the QK norm's eps at 1e-6, where transformers takes rms_norm_eps: 1e-6 here.)"""
    mlx_lm = pytest.importorskip("mlx_lm")
    source, _ = write_llama4_vlm(tmp_path / "src", seed=2, rms_norm_eps=1e-6)
    config = json.loads((source / "config.json").read_text())
    config["text_config"].update(rope_theta=10000.0, rope_scaling=None)
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q4"
    mlx_lm.convert(str(source), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    ours, loaded = mlxcel_logits(out, LONG_PROMPT)
    assert loaded.model.model.layers[1].feed_forward.experts.gate_up_proj.bits == 4
    theirs, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)


def test_preset_names_the_family_and_requires_a_path(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=llama4"]))
    model = validate_config(compose_run(["model=llama4", f"model.path={tmp_path}"])).model
    assert model.families == ["llama4_text", "llama4"]
    assert {"llama4_text", "llama4"} <= set(list_supported_families())
    assert "meta-llama/Llama-4-Scout-17B-16E-Instruct" in model.hub_ids


def test_a_prompt_cache_folder_keeps_the_chunked_layers_rings(checkpoint, tmp_path):
    """runner.prompt_cache_dir: a job's chunked layers keep their rings (one chunk a row, saved as
    a prefix's states); the next job adopts its rows' prompts from the folder and draws the
    tokens of a run without the cache."""
    from tests.test_prompt_cache_hostile import run_job, tokens

    cache_dir = tmp_path / "cache"
    off = run_job(checkpoint, tmp_path, "off", None)
    first = run_job(checkpoint, tmp_path, "first", cache_dir)
    second = run_job(checkpoint, tmp_path, "second", cache_dir)
    assert off[0] == first[0] == second[0] == "completed"
    assert tokens(first[1]) == tokens(second[1]) == tokens(off[1])
    assert all(r["cached_tokens"] > 0 for r in second[1])  # every row adopted its prompt from the disk
    names = [name for path in cache_dir.rglob("*.safetensors") for name in mx.load(str(path))]
    assert {"0.s0", "0.s1", "3.0", "3.1"} <= set(names) and "0.0" not in names  # rings as states, layer 3 per position


def test_the_api_and_the_server_give_each_row_its_own_tokens(checkpoint, tmp_path):
    """tests/test_new_families_paths.py's checks on this checkpoint: through the Python API (the
    prompt cache on) a batch and a conversation give each row its own tokens and a JSON-schema row
    answers in its schema; the server's chat completion is the API's answer."""
    from mlxcel import load_generator
    from tests import test_new_families_paths as paths
    from tests.serve_fixtures import request_json, running_server

    paths.test_the_api_gives_each_row_its_own_tokens_and_a_schema_row_its_schema(checkpoint)
    overrides = paths.OVERRIDES
    expected = load_generator({"model": {"path": str(checkpoint)}}, overrides=overrides).generate(paths.CONVERSATION)
    with running_server(tmp_path / "run", f"model.path={checkpoint}", *overrides, "serve.model_name=m") as server:
        message = {"model": "m", "messages": paths.CONVERSATION}
        status, body, _ = request_json(f"{server.url}/chat/completions", message)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected.text


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def write_converted_gguf(folder: Path, out: Path, quant: str = "F32") -> Path:
    """As convert_hf_to_gguf.py's Llama4Model writes it: feed_forward_length the dense width and
    expert_feed_forward_length the experts', interleave_moe_layer_step, no chunk or NoPE key (llama.cpp's
    literals), Q/K as transformers keeps them, experts' gate_up split and transposed, llama3 scaling as
    rope_freqs (LlamaModel.generate_extra_tensors); F32, or Q8_0 matrices and experts."""
    import math

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    rope, head_dim = config["rope_parameters"], config["head_dim"]
    writer = gguf.GGUFWriter(str(out), "llama4")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size_mlp"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama4")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, config["num_hidden_layers"])
    tensors = {}
    for name, data in load_file(str(folder / "model.safetensors")).items():
        data = data.astype(np.float32)
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(data.swapaxes(-1, -2), 2, axis=-2)
            tensors[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            tensors[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            tensors[f"{name}.weight"] = data.swapaxes(-1, -2)
        else:
            tensors[name] = data
    if rope.get("rope_type") == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original = rope["original_max_position_embeddings"]
        factors = []
        for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim):
            wavelen = 2 * math.pi / freq
            if wavelen < original / high:
                factors.append(1.0)
            elif wavelen > original / low:
                factors.append(factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for name, data in tensors.items():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quant == "Q8_0" and data.ndim >= 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def released_shape(tmp_path_factory) -> dict:
    """A checkpoint with what llama.cpp hard-codes (8192-token chunks, floor_scale 8192, attn_scale
    0.1, NoPE every fourth layer) and llama3 RoPE scaling, checked against transformers."""
    constants = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1, "rope_parameters": LLAMA3_ROPE}
    folder = write_llama4(tmp_path_factory.mktemp("llama4_gguf"), seed=7, **constants)
    return check_parity(measure_parity(folder, LONG_PROMPT))


def test_gguf_as_llama_cpp_writes_it_gives_the_safetensors_logits(released_shape, tmp_path):
    """transformers 5.25 reads no llama4 GGUF: the oracle is our load of the same safetensors
    (which matches transformers, above); Q8_0 kept packed equals its dequantized load."""
    folder, expected = released_shape["folder"], released_shape["logits"]
    loaded = load_model(str(write_converted_gguf(folder, tmp_path / "f32.gguf")), dtype="float32")
    args = loaded.model.args
    assert args.rope_layers == [True, True, True, False] and args.moe_layers == [1, 3] and args.use_qk_norm
    assert layer_chunks(loaded.model) == [8192, 8192, 8192, None] and len(args.rope_factors) == 16
    got = np.array(loaded.model(mx.array([LONG_PROMPT]), loaded.model.make_cache())[0])
    assert np.abs(got - expected).max() <= 1e-4
    quantized = write_converted_gguf(folder, tmp_path / "q8.gguf", quant="Q8_0")
    packed = load_model(str(quantized), dtype="float32", gguf_weights="quantized")
    dense = load_model(str(quantized), dtype="float32", gguf_weights="dequantize")
    assert packed.info["weights"] == "quantized"
    logits = [np.array(m.model(mx.array([LONG_PROMPT]), m.model.make_cache())[0]) for m in (packed, dense)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-3


def test_a_gguf_without_chunked_attention_is_refused(tmp_path):
    """attention.sliding_window 0 (the converter writes it for MobileLLM: llama.cpp then runs no
    chunks and another NoPE pattern) is refused, not run as Llama 4."""
    from mlxcel.checkpoints.gguf import make_config_from_gguf

    metadata = {
        "general.architecture": "llama4",
        "llama4.embedding_length": 64,
        "llama4.block_count": 4,
        "llama4.attention.head_count": 4,
        "llama4.feed_forward_length": 96,
        "llama4.vocab_size": 320,
        "llama4.attention.sliding_window": 0,
    }
    with pytest.raises(MlxcelError, match="without chunked attention .* not supported"):
        make_config_from_gguf(metadata, tmp_path / "mobile.gguf")


def test_gguf_tokenizer_pre_llama4_splits_as_o200k(tmp_path):
    """Llama 4 files say tokenizer.ggml.pre = "llama4", which llama.cpp splits as GPT4O (o200k's
    regex): words split where the case changes, contractions kept on their word, digits in threes."""
    from mlxcel.tokenizer.gguf import make_byte_level_bpe

    tokenizer = make_byte_level_bpe(["a"], [1], [], "llama4", tmp_path / "t.gguf")
    split = tokenizer.pre_tokenizer.pre_tokenize_str("HelloWORLD don't 12345")
    assert [tokenizer.decoder.decode([piece]) for piece, _ in split] == ["Hello", "WORLD", " don't", " ", "123", "45"]
