"""GGUF files of the newer families (qwen3, gemma, gemma2, gemma3, phi3), written from tiny HF
checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them (tensor names, metadata keys,
Gemma norms stored as 1 + w). Oracle: transformers on the original checkpoint; for the
architectures whose config survives the trip, transformers' own GGUF loader as well."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import make_family_checkpoint
from tests.helpers import load_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

PROMPT = [(11 * i + 7) % 300 + 3 for i in range(40)]
ARCHS = {"qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
# GGUF cannot say query_pre_attn_scalar (llama.cpp derives head_dim) nor a free layer pattern
OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3_text": {"query_pre_attn_scalar": 16, "num_hidden_layers": 7, "layer_types": None},
}
COMMON = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
FOUR_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(name: str, arch: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**COMMON, **(FOUR_NORMS if arch in ("gemma2", "gemma3") else {})}
    return f"blk.{layer}.{names[module]}.{kind}"


def write_gguf(folder: Path, arch: str, out: Path, quant: str = "F32", extra=None) -> Path:
    """`extra(writer)` adds keys and tensors of its own before the checkpoint's."""
    config = json.loads((folder / "config.json").read_text())
    state = load_reference(folder).state_dict()
    writer = gguf.GGUFWriter(str(out), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if config.get("sliding_window") and arch != "phi3":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", config["final_logit_softcapping"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if extra is not None:
        extra(writer)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", arch.startswith("gemma")):
            continue
        data = tensor.numpy().astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp: GGML's RMSNorm multiplies by the weight itself
        if quant == "Q8_0" and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name, arch), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def logits_of(path: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0]), loaded


@pytest.fixture(scope="module", params=list(ARCHS))
def family_gguf(request, tmp_path_factory):
    family = request.param
    folder = make_family_checkpoint(tmp_path_factory.mktemp(family), family, **OVERRIDES.get(family, {}))
    with torch.no_grad():
        expected = load_reference(folder)(torch.tensor([PROMPT])).logits[0].numpy()
    return family, folder, expected


def test_f32_gguf_matches_the_checkpoint(family_gguf, tmp_path):
    family, folder, expected = family_gguf
    path = write_gguf(folder, ARCHS[family], tmp_path / "f32.gguf")
    got, loaded = logits_of(path)
    assert loaded.model.args.model_type == family and not loaded.model.args.rope_traditional
    assert np.abs(got - expected).max() <= 1e-3
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    if family == "phi3":  # transformers' GGUF loader reads its config whole (not qwen3's head_dim, gemma's scalar)
        import transformers

        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        )
        with torch.no_grad():
            assert np.abs(reference(torch.tensor([PROMPT])).logits[0].numpy() - got).max() <= 1e-3


def test_q8_0_gguf_quantized_and_dequantized_agree(family_gguf, tmp_path):
    family, folder, expected = family_gguf
    path = write_gguf(folder, ARCHS[family], tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = logits_of(path, "dequantize")
    packed, loaded = logits_of(path, "quantized")
    assert loaded.info["weights"] == "quantized"
    assert np.abs(dense - packed).max() <= 1e-3
    # the oracle: transformers with each matrix passed through gguf-py's Q8_0 round trip
    reference = load_reference(folder)
    qtype = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
        rounded = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(dense - rounded).max() <= 1e-3
    assert np.abs(dense - expected).max() > 1e-3  # the file really was quantized


def test_gemma_norms_without_the_offset_differ(tmp_path_factory):
    """The +1 the converter adds must be taken off: writing the norms as they are (w, not 1 + w)
    gives different logits, so the test above would catch a loader that skips it."""
    folder = make_family_checkpoint(tmp_path_factory.mktemp("gemma_raw"), "gemma")
    path = write_gguf(folder, "gemma", tmp_path_factory.mktemp("g") / "g.gguf")
    good, _ = logits_of(path)
    import mlxcel.checkpoints.gguf as gguf_module

    original = gguf_module.undo_gemma_norm_offset
    gguf_module.undo_gemma_norm_offset = lambda weights: weights
    try:
        bad, _ = logits_of(path)
    finally:
        gguf_module.undo_gemma_norm_offset = original
    assert np.abs(good - bad).max() > 0.1


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        MlxcelError, match=r"m\.gguf: GGUF architecture 'mamba' is not supported \(supported: deepseek2, gemma, gemma2"
    ):
        load_model(str(tmp_path / "m.gguf"), dtype="float32")


def test_phi3_longrope_from_gguf_factor_tensors(tmp_path):
    """llama.cpp writes longrope as rope_factors_long/short tensors plus rope.scaling.* keys; short
    factors within the original context, long past it (an 80-token prompt past 64)."""
    import math

    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(4)],
        "long_factor": [2.0 + 1.5 * i for i in range(4)],
    }
    folder = make_family_checkpoint(
        tmp_path / "phi4",
        "phi3",
        seed=14,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
        rope_scaling=scaling,
        original_max_position_embeddings=64,
        max_position_embeddings=256,
    )

    def add_longrope(writer):
        writer.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(256 / 64) / math.log(64)))
        writer.add_uint32("phi3.rope.scaling.original_context_length", 64)
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))

    path = write_gguf(folder, "phi3", tmp_path / "phi4.gguf", extra=add_longrope)
    loaded = load_model(str(path), dtype="float32")
    rope = loaded.model.model.layers[0].self_attn.rope
    assert (rope.dims, rope.original_max) == (8, 64) and rope.attention_factor > 1.0
    reference = load_reference(folder)
    for length in (40, 80):
        ids = [(11 * i + 7) % 300 + 3 for i in range(length)]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].numpy()
        got = np.array(loaded.model(mx.array([ids]), loaded.model.make_cache())[0])
        assert np.abs(got - expected).max() <= 1e-3, length
