"""Gemma 4 text (gemma4_text, and the language model of gemma4 folders) against transformers 5.25's
Gemma4ForCausalLM (eager attention) on tiny random checkpoints.

Three variants of a six-layer model (sliding, sliding, global, sliding | sliding, global), its last
two layers reusing the keys and values of layers 3 (sliding) and 2 (global), a window of 8 under
an 80-token prompt, global heads twice as wide as sliding ones, proportional RoPE on them:
- ple: per-layer input embeddings, double-wide MLPs in the shared layers, final soft-capping;
- k_eq_v: attention_k_eq_v (global layers' keys are their values, one KV head there), no PLE;
- moe: the experts beside the dense MLP, with PLE.
Each: fp32 logits within 1e-3 and 32 greedy tokens identical; pieces (tile-padded) = one shot;
left-padded rows = alone; the scheduler with other rows, and with the prompt cache on; the KV
cache holds the shared layers' keys once. Then the multimodal folder's language model, the
config layouts (per_layer_config, global_head_dim), mlx-lm's layout dense and MLX-quantized
(mlx-lm's own load of the same folder gives our logits), quantize-at-load, and the preset."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.errors import MlxcelError
from mlxcel.models.cache import KVCache
from mlxcel.models.rotating_cache import RotatingKVCache
from mlxcel.sampling import Sampler
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

LONG_PROMPT = PROMPT * 2  # 80 tokens, ten windows
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"] + [
    "sliding_attention",
    "full_attention",
]
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 8,
    "layer_types": TYPES,
    "num_kv_shared_layers": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    # untied heads: a tied random model mostly predicts its input token again (weak greedy checks);
    # tying is checked on the multimodal folder
    "tie_word_embeddings": False,
}
VARIANTS = {
    "ple": {"hidden_size_per_layer_input": 8, "use_double_wide_mlp": True, "final_logit_softcapping": 30.0},
    "k_eq_v": {"hidden_size_per_layer_input": 0, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "moe": {
        "hidden_size_per_layer_input": 8,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 48,
    },
}
SOURCES = [None, None, None, None, 3, 2]  # layer 4 reuses layer 3's KV (sliding), layer 5 layer 2's (global)


def make_config(vocab: int, variant: str, **overrides):
    import transformers

    shape = {**SHAPE, **VARIANTS[variant], **overrides}
    return transformers.Gemma4TextConfig(
        **shape, vocab_size=vocab, vocab_size_per_layer_input=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )


def make_checkpoint(folder: Path, variant: str, seed: int = 0) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = make_config(write_tiny_tokenizer(folder), variant)
    torch.manual_seed(seed)
    save_widened(scale_layers(transformers.Gemma4ForCausalLM(config)), folder)
    return folder


def scale_layers(model):
    """Each layer's output scalar (a buffer: save_widened moves only parameters) off one."""
    for layer in model.get_decoder().layers:
        layer.layer_scalar.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request, tmp_path_factory, on_the_cpu):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return {"variant": request.param, **measure_parity(folder, LONG_PROMPT)}


def test_logits_and_greedy_tokens_match_transformers(built):
    result = check_parity(built)
    assert type(result["model"]).__module__ == "mlxcel.models.gemma4"
    config = json.loads((built["folder"] / "config.json").read_text())
    assert "per_layer_config" in config and "global_head_dim" not in config  # what transformers 5.25 writes


def test_shared_layers_keep_no_cache_of_their_own(built):
    """make_cache: one entry per layer that computes its keys and values (the first four), sliding
    ones windowed; the shared layers attend to their source's, so their KV is held once."""
    model = built["model"]
    assert model.kv_sources == SOURCES
    cache = model.make_cache(1)
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    assert [c.window for c in cache if isinstance(c, RotatingKVCache)] == [8, 8, 8]
    layers = model.model.layers
    assert all("k_proj" not in layer.self_attn and "v_proj" not in layer.self_attn for layer in layers[4:])
    dims = [(a.n_kv_heads, a.head_dim) for a in model.cache_attentions()]
    global_kv = 1 if built["variant"] == "k_eq_v" else 2
    assert dims == [(2, 16), (2, 16), (global_kv, 32), (2, 16)]
    if built["variant"] == "k_eq_v":
        # (projections fused at load) the global layer's: queries and keys only, 4 x 32 + 1 x 32
        assert layers[2].self_attn.qkv_proj.weight.shape[0] == 160 and layers[2].self_attn.k_eq_v
        assert layers[0].self_attn.qkv_proj.weight.shape[0] == 64 + 2 * 32 and not layers[0].self_attn.k_eq_v


@pytest.mark.parametrize("piece,tile", [(5, None), (16, 8), (33, 16)])
def test_prefill_in_pieces_equals_one_shot(built, piece, tile):
    """Pieces shorter and longer than the window, tile-padded (the padding trimmed from the caches;
    the shared layers run the last real query alone), leave the caches one shot leaves."""
    assert_pieces_match_one_shot(built["model"], LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_equal_each_row_alone(built):
    assert_batch_rows_match_alone(built["model"], [LONG_PROMPT, PROMPT[:13], PROMPT[3:50]])


def schedule(model, prompts, max_tokens=32, **options):
    ragged = options.pop("ragged", None)
    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 4), **options)
    if ragged is not None:
        scheduler.ragged_prefill = ragged
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=max_tokens))
    return [r.token_ids for r in state.results], state


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler, rows of 80, 23 and 9 tokens prefilled in pieces of 16 beside one another,
    then decoded together on the paged cache: the long row draws transformers' 32 greedy tokens,
    each short one the tokens it draws alone."""
    check_scheduler_rows(built, LONG_PROMPT, ragged)


def test_rows_sharing_a_prefix_adopt_it_from_the_prompt_cache(built):
    """The prompt cache on: rows after the first adopt the shared 48-token prefix (the sources'
    keys and values, the shared layers' too) and draw what they draw alone."""
    model = built["model"]
    shared = LONG_PROMPT[:48]
    prompts = [shared + tail for tail in (PROMPT[:7], PROMPT[9:20], PROMPT[21:25])]
    alone = [schedule(model, [p], max_tokens=16)[0][0] for p in prompts]
    got, state = schedule(model, prompts, max_tokens=16, prompt_cache=PromptCache(10**8), chunk_size=16)
    assert got == alone
    adopted = [r.cached_tokens for r in state.results]
    assert adopted[0] == 0 and all(n >= 32 for n in adopted[1:]), adopted


def test_quantized_kv_cache_runs_on_both_engines(built):
    """decode.kv_bits=8: the global layers' caches quantized, the shared layers reading their
    source's dequantized keys; the batch engine and the scheduler, each prefilling a prompt in one
    piece (pieces would attend to earlier pieces' quantized keys: other rounding), draw the same tokens."""
    model = built["model"]
    request = {"kv_bits": 8, "kv_group_size": 32}
    rows = [RowRequest(LONG_PROMPT, row_id=0), RowRequest(PROMPT[:9], row_id=1)]
    direct = DirectEngine(model, 512).generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=12, **request))
    scheduled = BatchScheduler(model, 512, 4).generate(
        GenerationRequest(rows, Sampler("greedy"), max_tokens=12, **request)
    )
    assert [r.token_ids for r in scheduled.results] == [r.token_ids for r in direct.results]
    assert all(len(r.token_ids) == 12 for r in direct.results)


def test_batch_invariant_rows_equal_alone_or_moe_is_refused(built):
    model = built["model"]
    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    if built["variant"] == "moe":
        with pytest.raises(MlxcelError, match="mixture-of-experts"):
            BatchScheduler(model, 512, 4, batch_invariant=True)
        return
    got, _ = schedule(model, prompts, max_tokens=12, batch_invariant=True)
    assert got == [schedule(model, [p], max_tokens=12)[0][0] for p in prompts]


def test_forward_from_embeddings_needs_no_per_layer_inputs_or_refuses(built):
    """An image row's forward call has input embeddings and no ids: without PLE it is the text
    forward; with PLE it is refused in one line (the per-layer embeddings are looked up by id)."""
    model = built["model"]
    ids = mx.array([PROMPT[:20]])
    if built["variant"] == "k_eq_v":
        by_id = model(ids, model.make_cache(1))
        by_embedding = model.forward_with_embeddings(model.embed_tokens(ids), model.make_cache(1))
        assert np.abs(np.array(by_id) - np.array(by_embedding)).max() == 0
        return
    with pytest.raises(MlxcelError, match="per-layer input embeddings"):
        model.forward_with_embeddings(model.embed_tokens(ids), model.make_cache(1))


def test_quantize_at_load_runs(built):
    loaded = load_model(str(built["folder"]), dtype="float32", quantize={"bits": 4, "group_size": 32})
    assert np.isfinite(loaded.info["quantization"]["max_abs_logit_diff"])
    assert isinstance(loaded.model.model.layers[4].self_attn.q_proj, nn.QuantizedLinear)
    tokens = mlxcel_generate(loaded.model, [LONG_PROMPT, PROMPT[:9]], 8)
    assert [len(t) for t in tokens] == [8, 8]


# --- config layouts --------------------------------------------------------------------------------


def rewrite_checkpoint(src: Path, dst: Path, weights: dict[str, mx.array] | None = None, config: dict | None = None):
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if weights is None or (file.suffix != ".safetensors" and file.name != "model.safetensors.index.json"):
            (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if weights is not None:
        mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def with_global_keys(config: dict, variant: str) -> dict:
    """The config as transformers before 5.25 (and the Hub's Gemma 4 folders) write it: global_head_dim
    and num_global_key_value_heads in place of per_layer_config (mlx-lm reads only these)."""
    config = {k: v for k, v in config.items() if k != "per_layer_config"}
    config["global_head_dim"] = SHAPE["global_head_dim"]
    if "num_global_key_value_heads" in VARIANTS[variant]:
        config["num_global_key_value_heads"] = VARIANTS[variant]["num_global_key_value_heads"]
    return config


def test_global_head_keys_read_as_per_layer_config(built, tmp_path):
    config = with_global_keys(json.loads((built["folder"] / "config.json").read_text()), built["variant"])
    got, _ = mlxcel_logits(rewrite_checkpoint(built["folder"], tmp_path / "old", config=config), LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-6)


def test_real_checkpoints_shared_layer_kv_weights_are_dropped(built, tmp_path):
    """The Hub's checkpoints keep k_proj/v_proj/k_norm for the shared layers (transformers ignores them)."""
    folder = built["folder"]
    weights = mx.load(str(folder / "model.safetensors"))
    for layer in (4, 5):
        weights[f"model.layers.{layer}.self_attn.k_proj.weight"] = mx.zeros((32, 64))
        weights[f"model.layers.{layer}.self_attn.k_norm.weight"] = mx.zeros((16,))
    got, _ = mlxcel_logits(rewrite_checkpoint(folder, tmp_path / "extra", weights), LONG_PROMPT)
    np.testing.assert_allclose(got, built["logits"], atol=1e-6)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_kv_shared_layers": 6}, "must be below num_hidden_layers"),
        ({"layer_types": ["full_attention"] * 4 + ["sliding_attention", "full_attention"]}, "no layer before"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"per_layer_config": {"9": {"head_dim": 32}}}, "per_layer_config"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k"),
    ],
)
def test_configs_it_cannot_run_are_refused_by_key(change, message):
    from mlxcel.models import gemma4

    config = {**SHAPE, "model_type": "gemma4_text", "vocab_size": 320, "hidden_size_per_layer_input": 0, **change}
    with pytest.raises(MlxcelError, match=message):
        gemma4.ModelArgs.from_config(config)


# --- the multimodal folders (`gemma4`): their language model -------------------------------------


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """transformers' Gemma4ForConditionalGeneration (a one-layer vision tower) on a text prompt
    against the language model loaded from the same folder: embeddings tied, as the folder says;
    placeholder ids in the text embedded (and looked up per layer) as the pad token."""
    import torch
    import transformers

    vocab = write_tiny_tokenizer(tmp_path)
    text = make_config(vocab, "ple", tie_word_embeddings=True).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 4,
        "position_embedding_size": 64,
        "pooling_kernel_size": 2,
    }
    specials = dict(zip(["image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"], range(vocab - 1, 0, -1)))
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **specials)
    torch.manual_seed(3)
    reference = scale_layers(transformers.Gemma4ForConditionalGeneration(config))
    save_widened(reference, tmp_path)
    # two placeholder ids in the text: embedded as the pad token, as transformers does
    prompt = LONG_PROMPT[:30] + [specials["image_token_id"]] + LONG_PROMPT[30:60] + [specials["video_token_id"]]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].numpy()
    got, loaded = mlxcel_logits(tmp_path, prompt)
    assert loaded.info["arch"] == "gemma4" and "text only" in loaded.info["note"]
    assert loaded.model.args.tie_word_embeddings and "lm_head" not in loaded.model
    assert float(np.abs(got - expected).max()) <= 1e-3


# --- mlx-lm's layout ---------------------------------------------------------------------------------


def mlx_lm_logits(folder: Path, ids: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model as mlx_lm_load

    model, _ = mlx_lm_load(folder)
    return np.array(model(mx.array([ids]), cache=model.make_cache())[0])


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "q4"])
def test_mlx_lm_folders_load_with_mlx_lm_logits(built, tmp_path, quantize):
    """mlx_lm.convert's folder (its sanitize: experts as switch_glu, shared layers' K/V dropped;
    with -q, packed weights and the routers at 8 bits): our load gives mlx-lm's own logits."""
    pytest.importorskip("mlx_lm")  # the peer: not a dependency (a CI machine has none)
    from mlx_lm import convert

    source = built["folder"]
    config = with_global_keys(json.loads((source / "config.json").read_text()), built["variant"])
    hf = rewrite_checkpoint(source, tmp_path / "hf", config=config)
    out = tmp_path / "mlx"
    convert(str(hf), mlx_path=str(out), quantize=quantize, q_group_size=32, q_bits=4, dtype="float32")
    names = mx.load(str(next(out.glob("*.safetensors"))))
    if built["variant"] == "moe":
        assert "model.layers.0.experts.switch_glu.gate_proj.weight" in names
    expected = mlx_lm_logits(out, LONG_PROMPT)
    got, loaded = mlxcel_logits(out, LONG_PROMPT)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    if not quantize:
        np.testing.assert_allclose(got, built["logits"], atol=1e-4)
        return
    layers = loaded.model.model.layers
    assert isinstance(layers[0].self_attn.o_proj, nn.QuantizedLinear)
    if built["variant"] == "moe":
        assert layers[0].router.proj.bits == 8 and layers[0].experts.switch_glu.gate_up_proj.bits == 4


# --- preset ----------------------------------------------------------------------------------------------


def test_preset_requires_a_path_and_names_its_families(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=gemma4"]))
    model = validate_config(compose_run(["model=gemma4", f"model.path={tmp_path}"])).model
    assert sorted(model.families) == ["gemma4", "gemma4_text"] and set(model.families) <= set(list_supported_families())
    assert model.hub_ids and all(repo.startswith("google/gemma-4-") for repo in model.hub_ids)


# --- GGUF: the files llama.cpp's converter writes (Gemma4Model: arch gemma4, the text model's tensors) ---

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
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "router.proj": "ffn_gate_inp",
}
GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
GGUF_WHOLE = {  # whole tensors (Gemma4Model.filter_tensors / modify_tensors)
    "layer_scalar": "layer_output_scale.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}


def gguf_tensor_name(name: str) -> str:
    if name in GGUF_TOP:
        return GGUF_TOP[name]
    _, _, layer, rest = name.split(".", 3)
    if rest in GGUF_WHOLE:
        return f"blk.{layer}.{GGUF_WHOLE[rest]}"
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_converted_gguf(folder: Path, variant: str, out: Path, quant: str = "F32") -> Path:
    """Gemma4Model.set_gguf_parameters' keys from the Hub's config layout (global_head_dim,
    num_global_key_value_heads): per-layer KV heads and feed-forward widths, the sliding pattern,
    key_length(_swa), shared_kv_layers, the per-layer input width, expert keys; rope_freqs (1 for the
    rotated pairs, 1e30 for the rest); norms as they are; the hidden layers' K/V weights where the
    checkpoint keeps them; F32 or Q8_0 matrices (experts too)."""
    import gguf
    from safetensors.numpy import load_file

    config = with_global_keys(json.loads((folder / "config.json").read_text()), variant)
    n, types = config["num_hidden_layers"], config["layer_types"]
    slides = [t == "sliding_attention" for t in types]
    shared = config["num_kv_shared_layers"]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_block_count(n)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    ff = config["intermediate_size"]
    wide = config.get("use_double_wide_mlp")
    writer.add_feed_forward_length([ff * (2 if wide and i >= n - shared else 1) for i in range(n)] if wide else ff)
    writer.add_head_count(config["num_attention_heads"])
    kv, global_kv = config["num_key_value_heads"], config.get("num_global_key_value_heads")
    writer.add_head_count_kv([kv if s else global_kv for s in slides] if global_kv else kv)
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("num_experts"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(slides)
    global_dim = config["global_head_dim"]
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    writer.add_rope_dimension_count(global_dim)
    writer.add_rope_dimension_count_swa(config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    rotated = int(global_dim * config["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated), np.float32))
    weights = load_file(str(folder / "model.safetensors"))
    # the Hub's checkpoints keep (unused) K weights in the shared layers: the converter writes them too
    weights[f"model.layers.{n - 1}.self_attn.k_proj.weight"] = np.zeros((global_dim, config["hidden_size"]), np.float32)
    for name, data in weights.items():
        data = data.astype(np.float32)
        if quant == "Q8_0" and data.ndim >= 2 and data.shape[-1] % 32 == 0:  # (else the converter keeps F16/F32)
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_logits(path: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([LONG_PROMPT]), loaded.model.make_cache())[0]), loaded


def test_gguf_as_llama_cpp_writes_it_gives_the_safetensors_logits(built, tmp_path):
    """transformers 5.25's GGUF loader maps few gemma4 keys (not the sliding head size, the layer
    kinds, the shared layers nor the per-layer input width: its defaults stand in) and refuses the
    per-layer arrays llama.cpp writes (feed_forward_length here: "expected int, got list"), so the
    oracle is our load of the same weights from safetensors (and through it transformers)."""
    pytest.importorskip("gguf")
    path = write_converted_gguf(built["folder"], built["variant"], tmp_path / "f32.gguf")
    got, loaded = gguf_logits(path)
    args, expected = loaded.model.args, built["model"].args
    assert loaded.info["arch"] == "gemma4_text" and not args.rope_traditional
    for key in ("layer_types", "head_dims", "kv_heads", "kv_sources", "intermediate_sizes", "attention_k_eq_v", "rope"):
        assert getattr(args, key) == getattr(expected, key), key
    assert np.abs(got - built["logits"]).max() <= 1e-4
    assert np.abs(got - built["reference_logits"]).max() <= 1e-3


def test_q8_0_gguf_kept_quantized_agrees_with_its_dequantized_form(built, tmp_path):
    pytest.importorskip("gguf")
    path = write_converted_gguf(built["folder"], built["variant"], tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = gguf_logits(path, "dequantize")
    packed, loaded = gguf_logits(path, "quantized")
    assert loaded.info["weights"] == "quantized"
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear)
    if built["variant"] == "moe":
        assert layer.experts.switch_glu.gate_up_proj.bits == 8
    assert np.abs(dense - packed).max() <= 1e-3


def test_the_scheduler_budgets_each_layer_at_its_own_head_size(built):
    """kv_bytes_per_position: the three sliding layers' and the global layer's own KV heads and head
    sizes (the global heads twice as wide), fp32; the shared layers hold nothing of their own."""
    from mlxcel.engine.scheduler import kv_bytes_per_position

    model = built["model"]
    expected = sum(2 * a.n_kv_heads * a.head_dim * 4 for a in model.cache_attentions())
    sliding, full = model.cache_attentions()[0], model.cache_attentions()[2]
    assert full.head_dim == 2 * sliding.head_dim
    assert kv_bytes_per_position(model) == expected
