"""gpt-oss (gpt_oss) on tiny random checkpoints written by transformers 5 (the oracle: its eager
attention with the sinks, its clamped SwiGLU experts, its YaRN).

The tiny config keeps the released one's structure: sliding layers (window 8 here, 128 released)
alternating with full ones, biases on attention, router and experts, YaRN as transformers' default
(factor 32, truncate false); its clamp is tighter (swiglu_limit 1.5, alpha 1.3) so the clamp and
the config's alpha show in the logits, and the sinks and biases are widened so they show too.
Checks: fp32 logits within 1e-3 over an 80-token prompt and 32 greedy tokens identical; pieces equal
one shot; left-padded rows equal alone; the scheduler with other rows; the prompt cache; the
released MXFP4 layout loaded packed (MLX's mxfp4 mode) against transformers' dequantization of the
same blocks; mlx-lm's layouts (its convert of that folder, plain and 8-bit) against mlx-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, layer_windows
from mlxcel.models import gpt_oss
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
    reference_logits,
    save_widened,
)
from tests.helpers import load_reference, write_tiny_tokenizer

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

LONG_PROMPT = PROMPT * 2  # 80 tokens: ten windows of 8
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 64,  # a multiple of MXFP4's 32-wide blocks, as hidden_size
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # decode.kv_bits groups of 32 along it
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 1.5,
    "swiglu_alpha": 1.3,
}
# mlx-lm 0.32 reads rope_theta / rope_scaling (not transformers 5's rope_parameters) and takes
# YaRN's correction range truncated whatever `truncate` says: its comparisons use truncate true
MLX_LM_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": True,
    "original_max_position_embeddings": 4096,
}


def make_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config = transformers.GptOssConfig(
        **{**SHAPE, **overrides}, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    save_widened(model, folder)
    with torch.no_grad():  # sinks and biases of the size that shows: a sink near 0 still weighs like a key
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("router.bias"):
                p.normal_(0.0, 1.0)
            elif name.endswith("_proj_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def write_mxfp4_folder(src: Path, dst: Path) -> Path:
    """`src` as the released checkpoints store it: each expert tensor in MXFP4 (blocks [E, out,
    in/32, 16] uint8 and E8M0 scales [E, out, in/32], out-major: gate_up's rows interleaved as its
    columns were), quantization_config mxfp4. MLX's mxfp4 quantizer packs them (the same codes)."""
    dst.mkdir(parents=True, exist_ok=True)
    weights = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed, scales = mx.quantize(value.swapaxes(1, 2), group_size=32, bits=4, mode="mxfp4")
            experts, rows, _ = packed.shape
            weights[f"{key}_blocks"] = packed.view(mx.uint8).reshape(experts, rows, -1, 16)
            weights[f"{key}_scales"] = scales
        else:
            weights[key] = value
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    for file in src.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, dst / file.name)
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory, on_the_cpu):
    folder = make_checkpoint(tmp_path_factory.mktemp("gpt_oss"))
    return measure_parity(folder, LONG_PROMPT)


@pytest.fixture(scope="module")
def model(built):
    return built["model"]


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory, on_the_cpu):
    """A checkpoint mlx-lm reads as transformers does (its rope keys, the released clamp), and its
    MXFP4 folder."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    # (mlx-lm's activation takes the released alpha and limit whatever config.json says)
    src = make_checkpoint(root / "dense", seed=1, rope_parameters=MLX_LM_ROPE, swiglu_limit=7.0, swiglu_alpha=1.702)
    config = json.loads((src / "config.json").read_text())
    config.update(rope_scaling=config["rope_parameters"], rope_theta=config["rope_parameters"]["rope_theta"])
    (src / "config.json").write_text(json.dumps(config))
    return write_mxfp4_folder(src, root / "mxfp4")


def test_logits_and_greedy_tokens_match_transformers(built):
    result = check_parity(built)
    model = result["model"]
    assert type(model).__module__ == "mlxcel.models.gpt_oss"
    assert layer_windows(model) == [8, None, 8, None]  # transformers' default layer_types: even layers slide
    attention = model.model.layers[0].self_attn
    assert attention.sinks.shape == (4,) and attention.rope.base is None  # YaRN's frequencies
    # YaRN's attention factor (0.1 ln 32 + 1, squared) in the softmax scale, not on q and k each step
    assert attention.scale == pytest.approx(32**-0.5 * 1.3465735902799727**2) and attention.rope.attention_factor == 1


def test_the_sinks_the_clamp_and_the_biases_each_show_in_the_logits(built, tmp_path):
    """Each piece this family adds, left out, moves the logits well past the tolerance (so the
    parity above checks it)."""
    model, expected = built["model"], built["reference_logits"]
    ids = mx.array([LONG_PROMPT])
    layers = model.model.layers

    def logits() -> np.ndarray:
        return np.array(model(ids, model.make_cache())[0])

    assert np.abs(logits() - expected).max() <= 1e-3
    sinks = [layer.self_attn.sinks for layer in layers]
    for layer in layers:
        layer.self_attn.sinks = mx.full((4,), -1e9)  # no sink: a plain softmax
    assert np.abs(logits() - expected).max() > 0.05
    for layer, saved in zip(layers, sinks):
        layer.self_attn.sinks = saved
    limit = layers[0].mlp.experts.limit
    for layer in layers:
        layer.mlp.experts.limit = 1e9
    assert np.abs(logits() - expected).max() > 0.05
    for layer in layers:
        layer.mlp.experts.limit = limit
    bias = layers[0].mlp.router.bias
    layers[0].mlp.router.bias = mx.zeros_like(bias)
    assert np.abs(logits() - expected).max() > 0.05
    layers[0].mlp.router.bias = bias
    assert np.abs(logits() - expected).max() <= 1e-3


@pytest.mark.parametrize("piece", [3, 8, 13, 50])
def test_prefill_in_pieces_equals_one_shot(model, piece):
    """Pieces shorter than, equal to and longer than the 8-position window."""
    assert_pieces_match_one_shot(model, LONG_PROMPT, piece, tile=None)


def test_tile_padded_pieces_equal_one_shot(model):
    assert_pieces_match_one_shot(model, LONG_PROMPT, 16, tile=32)


def test_left_padded_batch_rows_equal_each_row_alone(model):
    assert_batch_rows_match_alone(model, [LONG_PROMPT, PROMPT[:13], PROMPT[3:30]])


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
def test_each_row_through_the_scheduler_draws_its_own_tokens(built, ragged):
    """BatchScheduler, rows of 80, 23 and 9 tokens prefilled in pieces of 16 beside one another,
    then decoded together past several windows: the long row draws transformers' 32 greedy tokens,
    each short one the tokens it draws alone."""
    check_scheduler_rows(built, LONG_PROMPT, ragged)


def test_rows_sharing_a_prefix_adopt_it_from_the_prompt_cache(model):
    from mlxcel.engine.prompt_cache import PromptCache

    shared = LONG_PROMPT
    prompts = [shared + tail for tail in (PROMPT[3:20], PROMPT[11:19], PROMPT[:30])]

    def run(prompts, **options):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12)
        return BatchScheduler(model, 512, 8, chunk_size=32, **options).generate(request)

    state = run(prompts, prompt_cache=PromptCache(10**8))
    assert [r.token_ids for r in state.results] == [run([p]).results[0].token_ids for p in prompts]
    adopted = [r.cached_tokens for r in state.results]
    assert adopted == [0, len(shared), len(shared)], adopted


def test_mxfp4_experts_load_packed_and_match_transformers_dequantized(mxfp4):
    """The released layout: experts stay MXFP4 (4-bit codes, E8M0 scales, MLX's mxfp4 mode), and
    the logits are transformers' own, which dequantizes the same blocks (no triton on the CPU)."""
    reference = load_reference(mxfp4)
    expected = reference_logits(reference, LONG_PROMPT)
    got, loaded = mlxcel_logits(mxfp4, LONG_PROMPT)
    assert np.abs(got - expected).max() <= 1e-3
    experts = loaded.model.model.layers[1].mlp.experts
    for proj in (experts.gate_up_proj, experts.down_proj):  # (gate and up fused at load)
        assert isinstance(proj, gpt_oss.QuantizedBiasedSwitchLinear)
        assert (proj.mode, proj.bits, proj.group_size) == ("mxfp4", 4, 32)
        assert proj.weight.dtype == mx.uint32 and proj.scales.dtype == mx.uint8
    # the dense checkpoint the blocks came from is far off: the 4-bit codes are what loaded
    dense, _ = mlxcel_logits(mxfp4.parent / "dense", LONG_PROMPT)
    assert np.abs(dense - expected).max() > 0.1


def test_mxfp4_blocks_are_mlx_mxfp4_bit_for_bit():
    """transformers' dequantization of random blocks and scales (every code, low nibble first)
    equals MLX's mxfp4 dequantization of the words our loader makes of them."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)
    scales = rng.integers(115, 140, (3, 8, 4), dtype=np.uint8)
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    weights = {
        "e.gate_up_proj_blocks": mx.array(blocks),
        "e.gate_up_proj_scales": mx.array(scales),
        "e.gate_up_proj_bias": mx.zeros((3, 8)),
        "e.down_proj_blocks": mx.array(blocks),
        "e.down_proj_scales": mx.array(scales),
        "e.down_proj_bias": mx.zeros((3, 8)),
    }
    unpacked = gpt_oss.unpack_mxfp4_experts(weights, "e")
    down = mx.dequantize(unpacked["e.down_proj.weight"], unpacked["e.down_proj.scales"], mode="mxfp4", group_size=32)
    np.testing.assert_array_equal(np.array(down.astype(mx.float32)), expected.transpose(1, 2).numpy())
    gate = mx.dequantize(unpacked["e.gate_proj.weight"], unpacked["e.gate_proj.scales"], mode="mxfp4", group_size=32)
    np.testing.assert_array_equal(np.array(gate.astype(mx.float32)), expected.transpose(1, 2).numpy()[:, ::2])


@pytest.mark.parametrize("quantize", [False, True], ids=["mxfp4", "mxfp4-q8"])
def test_mlx_lm_convert_folder_loads_and_matches_mlx_lm(mxfp4, quantize, tmp_path):
    """mlx-community's layout: mlx_lm.convert of the MXFP4 folder keeps the experts mxfp4
    (experts.{gate,up,down}_proj.{weight,scales,bias}); with -q the rest 8-bit affine (the router
    too, by mlx-lm's override without a mode). Dev-only cross-check against mlx-lm's own load."""
    mlx_lm = pytest.importorskip("mlx_lm")
    out = tmp_path / "mlx"
    options = {"quantize": True, "q_group_size": 64, "q_bits": 8} if quantize else {}
    mlx_lm.convert(str(mxfp4), mlx_path=str(out), **options)
    ours, loaded = mlxcel_logits(out, LONG_PROMPT)
    theirs, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)
    layer = loaded.model.model.layers[0]
    assert layer.mlp.experts.gate_up_proj.mode == "mxfp4"
    assert (getattr(layer.mlp.router, "bits", None) == 8) == quantize


def test_dense_experts_fuse_gate_and_up(built):
    """Fused at load (model.fuse, the default); separate projections give the same logits."""
    folder = built["folder"]
    fused = load_model(str(folder), dtype="float32", fuse=True).model
    separate = load_model(str(folder), dtype="float32", fuse=False).model
    assert "gate_up_proj" in fused.model.layers[0].mlp.experts
    assert "gate_proj" in separate.model.layers[0].mlp.experts
    ids = mx.array([LONG_PROMPT])
    a, b = fused(ids, fused.make_cache()), separate(ids, separate.make_cache())
    assert np.abs(np.array(a) - np.array(b)).max() <= 1e-5


def test_kv_bits_rows_among_others_equal_each_row_alone(model):
    """decode.kv_bits: the full-attention layers' pool quantized (their sinks still in the softmax),
    the sliding ones' not; each row draws what it draws alone, and the setting reaches the cache."""

    def run(prompts, bits):
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        request = GenerationRequest(
            rows, Sampler("greedy"), max_tokens=16, kv_bits=bits, kv_group_size=32, chunk_size=16
        )
        return [r.token_ids for r in BatchScheduler(model, 512, 4).generate(request).results]

    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    together = run(prompts, 8)
    assert together == [run([p], 8)[0] for p in prompts]
    assert run(prompts, 2) != together


def test_batch_invariant_is_refused_with_the_reason(model):
    from mlxcel.errors import MlxcelError

    with pytest.raises(MlxcelError, match="mixture-of-experts"):
        BatchScheduler(model, 512, 8, batch_invariant=True)


def test_preset_requires_a_path_and_names_the_family(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=gpt_oss"]))
    model = validate_config(compose_run(["model=gpt_oss", f"model.path={tmp_path}"])).model
    assert model.path == str(tmp_path) and "gpt_oss" in model.families
    assert "gpt_oss" in list_supported_families()


# --- GGUF (llama.cpp's gpt-oss arch) --------------------------------------------------------------

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's MXFP4 rows as ggml's MXFP4 blocks (what GptOssModel.repack_mxfp4 writes): per 32
    elements a scale byte, then 16 bytes holding element i in the low nibble, element i + 16 in the high."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    joined = np.concatenate([scales[..., None], packed], axis=-1)
    return joined.reshape(*joined.shape[:-2], -1)


def convert_gpt_oss(folder: Path):
    """(name, array, ggml type name) as convert_hf_to_gguf.py's GptOssModel writes the MXFP4 folder:
    gate/up rows (and biases) de-interleaved, experts MXFP4, sinks as attn_sinks.weight."""
    tensors = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    for name, data in tensors.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            yield (
                {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}.get(name, "output")
                + ".weight",
                data,
                None,
            )
            continue
        _, _, layer, rest = name.split(".", 3)
        block = f"blk.{layer}"
        if rest == "self_attn.sinks":
            yield f"{block}.attn_sinks.weight", data, "F32"
        elif rest.startswith("mlp.experts."):
            proj = rest.removeprefix("mlp.experts.")
            if proj.endswith("_scales"):
                continue
            if proj.endswith("_blocks"):
                proj = proj.removesuffix("_blocks")
                scales = tensors[name.replace("_blocks", "_scales")]
                if proj == "down_proj":
                    yield f"{block}.ffn_down_exps.weight", ggml_mxfp4(data, scales), "MXFP4"
                    continue
                for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    yield f"{block}.ffn_{part}_exps.weight", ggml_mxfp4(data[:, rows], scales[:, rows]), "MXFP4"
            elif proj == "down_proj_bias":
                yield f"{block}.ffn_down_exps.bias", data, "F32"
            else:
                for part, columns in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    yield f"{block}.ffn_{part}_exps.bias", data[:, columns], "F32"
        else:
            module, kind = rest.rsplit(".", 1)
            yield f"{block}.{GGUF_NAMES[module]}.{kind}", data, None


def write_gpt_oss_gguf(folder: Path, out: Path, quant: str = "F32") -> Path:
    """The file llama.cpp's converter writes for `folder` (an MXFP4 checkpoint): `quant` for the matrices
    the file type sets (attention, embeddings, output), F32 for 1-D tensors, norms and the router."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data, kind in convert_gpt_oss(folder):
        if kind == "MXFP4":
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        if kind is None:
            kind = "F32" if data.ndim <= 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name else quant
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gguf_oracle(mxfp4, tmp_path_factory):
    """The MXFP4 folder with the released YaRN (truncate false: a GGUF says nothing of it, and the model
    is what config.json says), our load of it and transformers' (which dequantizes the same codes)."""
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("gpt_oss_gguf") / "hf"
    shutil.copytree(mxfp4, folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        config[key] = {**config[key], "truncate": False}
    (folder / "config.json").write_text(json.dumps(config))
    logits, loaded = mlxcel_logits(folder, LONG_PROMPT)
    reference = reference_logits(load_reference(folder), LONG_PROMPT)
    greedy = mlxcel_generate(loaded.model, [LONG_PROMPT, PROMPT[:9]], 32)
    return {"folder": folder, "logits": logits, "reference": reference, "greedy": greedy}


@pytest.mark.parametrize("gguf_weights", ["quantized", "dequantize"])
def test_mxfp4_gguf_matches_the_safetensors_load(gguf_oracle, gguf_weights, tmp_path):
    """llama.cpp's MXFP4 file (experts MXFP4, the rest F32): its experts kept packed as MLX's mxfp4 (or
    dequantized when asked), the model the same safetensors give (1e-4) and transformers' (1e-3), the
    same 32 greedy tokens beside another row."""
    path = write_gpt_oss_gguf(gguf_oracle["folder"], tmp_path / "mxfp4.gguf")
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    model = loaded.model
    got = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    assert np.abs(got - gguf_oracle["logits"]).max() <= 1e-4
    assert np.abs(got - gguf_oracle["reference"]).max() <= 1e-3
    assert mlxcel_generate(model, [LONG_PROMPT, PROMPT[:9]], 32) == gguf_oracle["greedy"]
    assert loaded.info["gguf_types"]["MXFP4"] == 3 * SHAPE["num_hidden_layers"]
    assert layer_windows(model) == [8, None, 8, None]
    experts = model.model.layers[0].mlp.experts.down_proj
    if gguf_weights == "quantized":
        assert isinstance(experts, gpt_oss.QuantizedBiasedSwitchLinear) and experts.mode == "mxfp4"
    else:
        assert isinstance(experts, gpt_oss.BiasedSwitchLinear) and loaded.info["weights"] == "dequantized"


def test_q8_0_gguf_with_mxfp4_experts(gguf_oracle, tmp_path):
    """A file whose attention and embeddings are Q8_0 beside the MXFP4 experts: a file of types MLX
    cannot read goes through gguf_reader, which dequantizes the Q8_0 matrices (as for K-quant files)
    and keeps the experts MXFP4. The logits are the safetensors model's with those matrices passed
    through gguf-py's Q8_0 round trip."""
    import gguf
    from mlx.utils import tree_flatten, tree_unflatten

    path = write_gpt_oss_gguf(gguf_oracle["folder"], tmp_path / "q8.gguf", quant="Q8_0")
    loaded = load_model(str(path), dtype="float32", gguf_weights="quantized")
    model = loaded.model
    got = np.array(model(mx.array([LONG_PROMPT]), model.make_cache())[0])
    attention, experts = model.model.layers[0].self_attn, model.model.layers[0].mlp.experts
    assert type(attention.o_proj) is nn.Linear and loaded.info["gguf_types"]["Q8_0"] > 0
    assert experts.down_proj.mode == "mxfp4"
    reference = load_model(str(gguf_oracle["folder"]), dtype="float32", fuse=False).model
    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = [
        (name, mx.array(gguf.quants.dequantize(gguf.quants.quantize(np.array(value), q8), q8)))
        for name, value in tree_flatten(reference.parameters())
        if name.endswith(".weight") and value.ndim == 2 and ".router." not in name and ".experts." not in name
    ]
    reference.update(tree_unflatten(rounded))
    expected = np.array(reference(mx.array([LONG_PROMPT]), reference.make_cache())[0])
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(got - gguf_oracle["logits"]).max() > 1e-3  # the file really was quantized


def test_gguf_tokenizer_pre_gpt_4o_splits_as_o200k(tmp_path):
    """gpt-oss files say tokenizer.ggml.pre = "gpt-4o" (llama.cpp's GPT4O: the o200k tokenizer.json
    regex): words split where the case changes, contractions kept on their word, digits in threes."""
    from mlxcel.tokenizer.gguf import make_byte_level_bpe

    def pieces(pre: str) -> list[str]:
        tokenizer = make_byte_level_bpe(["a"], [1], [], pre, tmp_path / "t.gguf")
        split = tokenizer.pre_tokenizer.pre_tokenize_str("HelloWORLD don't 12345")
        return [tokenizer.decoder.decode([piece]) for piece, _ in split]

    assert pieces("gpt-4o") == ["Hello", "WORLD", " don't", " ", "123", "45"]
    assert pieces("llama3") == ["HelloWORLD", " don", "'t", " ", "123", "45"]
