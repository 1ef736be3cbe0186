"""Mixture-of-experts GGUF files: Mixtral (arch llama with experts) and Qwen3-MoE (arch qwen3moe),
written from tiny HF checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them: each
layer's per-expert tensors stacked into ffn_{gate,up,down}_exps [E, out, in], the router as
ffn_gate_inp (always F32), Q/K permuted for llama only, and a tensor whose rows Q8_0 blocks cannot
tile written F16 instead. Oracle: transformers on the original checkpoint."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from mlxcel.models.switch import QuantizedSwitchLinear, SwitchLinear
from tests.family_fixtures import (
    GREEDY_TOKENS,
    PROMPT,
    make_family_checkpoint,
    mlxcel_generate,
    reference_greedy,
    reference_logits,
)
from tests.gguf_fixtures import permute_for_llama_cpp, random_blocks
from tests.helpers import load_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
T = gguf.GGMLQuantizationType

ARCHS = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
OVERRIDES = {"mixtral": {"sliding_window": None}}  # llama.cpp's llama arch has no sliding window
MOE_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
# checkpoint projection names -> llama.cpp's ffn_{name}_exps
EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
TENSOR_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
}
TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight")


def rename_tensor(name: str) -> str:
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{TENSOR_NAMES[module]}.{kind}"


def convert_tensors(folder: Path, config: dict, arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names: experts stacked per layer and projection
    in expert order, Q/K permuted for interleaved RoPE on llama."""
    from safetensors.numpy import load_file

    tensors, experts = {}, defaultdict(dict)
    for name, data in load_file(folder / "model.safetensors").items():
        if match := EXPERT.fullmatch(name):
            layer, expert, projection = match.groups()
            experts[f"blk.{layer}.ffn_{EXPERT_PROJECTIONS[projection]}_exps.weight"][int(expert)] = data
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = permute_for_llama_cpp(data, heads)
        tensors[rename_tensor(name)] = data
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def encode_f32(name: str, data: np.ndarray) -> tuple[np.ndarray, T]:
    return data.astype(np.float32), T.F32


def make_encoder(qtype: T):
    """As convert_hf_to_gguf.py --outtype q8_0 writes (gguf-py quantizes Q4_0/Q4_1 the same way):
    norms and the router stay F32; rows the 32-element blocks cannot tile fall back to F16 (its
    QuantError path)."""

    def encode(name: str, data: np.ndarray) -> tuple[np.ndarray, T]:
        if data.ndim == 1 or ".ffn_gate_inp." in name:
            return encode_f32(name, data)
        if data.shape[-1] % 32:
            return data.astype(np.float16), T.F16
        return gguf.quants.quantize(data.astype(np.float32), qtype), qtype

    return encode


def make_metadata(config: dict, arch: str) -> dict[str, int | float]:
    """The `{arch}.*` keys convert_hf_to_gguf.py writes for these models (LlamaModel adds the
    vocabulary size and RoPE width, Qwen2MoeModel the expert width)."""
    keys = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "rope.freq_base": float(config["rope_parameters"]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "expert_count": config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
    }
    if config.get("head_dim"):
        keys.update({"attention.key_length": config["head_dim"], "attention.value_length": config["head_dim"]})
    if arch == "llama":
        keys.update(
            {
                "vocab_size": config["vocab_size"],
                "rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
            }
        )
    else:
        keys["expert_feed_forward_length"] = config["moe_intermediate_size"]
    return keys


def write_moe_gguf(folder: Path, family: str, out: Path, encode=encode_f32, edits: dict | None = None) -> Path:
    """`edits`: metadata keys (without the arch prefix) to set, or with None to leave out; tensor
    names with None to leave out."""
    arch, edits = ARCHS[family], edits or {}
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in {**make_metadata(config, arch), **edits}.items():
        if value is not None and not key.startswith("blk."):
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data in convert_tensors(folder, config, arch).items():
        if name not in edits:
            array, qtype = encode(name, data)
            writer.add_tensor(name, array, raw_dtype=qtype if array.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def run_logits(model) -> np.ndarray:
    return np.array(model(mx.array([PROMPT]), model.make_cache())[0])


def load_logits(path: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    return run_logits(loaded.model), loaded


def find_moe(model, family: str, layer: int = 0):
    return getattr(model.model.layers[layer], MOE_BLOCK[family])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> its tiny checkpoint folder, each built once for the module."""
    folders = {}

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = make_family_checkpoint(
                tmp_path_factory.mktemp(family), family, seed=11, **OVERRIDES.get(family, {})
            )
        return folders[family]

    return get


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_case(request, checkpoints):
    """family, checkpoint folder, transformers' logits over PROMPT and its greedy continuation."""
    family = request.param
    folder = checkpoints(family)
    reference = load_reference(folder)
    return family, folder, reference_logits(reference, PROMPT), reference_greedy(reference, PROMPT, GREEDY_TOKENS)


def test_f32_moe_gguf_matches_transformers(moe_case, tmp_path):
    family, folder, expected, expected_greedy = moe_case
    got, loaded = load_logits(write_moe_gguf(folder, family, tmp_path / "f32.gguf"))
    args, moe = loaded.model.args, find_moe(loaded.model, family)
    assert args.model_type == family and args.rope_traditional is (family == "mixtral")
    assert moe.top_k == 2 and moe.normalize  # llama.cpp renormalises the top-k weights for both
    assert moe.switch_mlp.down_proj.weight.shape[0] == 4 and type(moe.switch_mlp.down_proj) is SwitchLinear
    assert np.abs(got - expected).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [PROMPT], GREEDY_TOKENS)[0] == expected_greedy


def round_trip(reference, encode) -> None:
    """transformers' weights as the quantized file holds them (gguf-py's own quantize/dequantize;
    quantizing gate_up [E, 2I, H] row by row equals quantizing gate and up apart)."""
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() >= 2 and not name.endswith(".gate.weight"):
                array, qtype = encode(name, p.detach().numpy())
                p.copy_(torch.from_numpy(gguf.quants.dequantize(array, qtype).astype(np.float32)))


@pytest.mark.parametrize("type_name,bits", [("Q8_0", 8), ("Q4_1", 4)])
def test_quantized_moe_gguf_packed_experts_match_dequantized(moe_case, type_name, bits, tmp_path):
    """Q8_0/Q4_1 experts stay packed (QuantizedSwitchLinear); Qwen3-MoE's down_proj, 48 wide,
    is F16 in the file and loads dense. Tolerance 1e-3 on logits: the packed and dense forms hold
    the same weights, so at most float32 summation order differs (0 measured on the CPU)."""
    family, folder, expected, _ = moe_case
    encode = make_encoder(T[type_name])
    path = write_moe_gguf(folder, family, tmp_path / "q.gguf", encode=encode)
    dense, dense_loaded = load_logits(path, "dequantize")
    packed, loaded = load_logits(path, "quantized")
    switch = find_moe(loaded.model, family).switch_mlp
    assert loaded.info["weights"] == "quantized" and loaded.info["gguf_types"][type_name] > 0
    assert isinstance(switch.gate_up_proj, QuantizedSwitchLinear) and switch.gate_up_proj.bits == bits
    assert isinstance(switch.down_proj, SwitchLinear if family == "qwen3_moe" else QuantizedSwitchLinear)
    assert np.abs(packed - dense).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [PROMPT], GREEDY_TOKENS) == mlxcel_generate(
        dense_loaded.model, [PROMPT], GREEDY_TOKENS
    )
    reference = load_reference(folder)
    round_trip(reference, encode)
    assert np.abs(dense - reference_logits(reference, PROMPT)).max() <= 1e-3
    assert np.abs(dense - expected).max() > 1e-3  # the file really was quantized


def test_k_quant_experts_are_dequantized(tmp_path, monkeypatch):
    """Q4_K gate/up and Q6_K down experts (random blocks: gguf-py cannot quantize K-quants) load
    as gguf-py dequantizes them; K-quant rows need 256 elements, hence the wider model."""
    folder = make_family_checkpoint(tmp_path / "wide", "qwen3_moe", seed=5, hidden_size=256, moe_intermediate_size=256)
    blocks = {}

    def encode_k_quants(name: str, data: np.ndarray) -> tuple[np.ndarray, T]:
        if "_exps." not in name:
            return encode_f32(name, data)
        type_name = "Q6_K" if "down" in name else "Q4_K"
        raw = random_blocks(type_name, data.shape[0] * data.shape[1], data.shape[2], seed=len(blocks))
        blocks[name] = (raw.reshape(*data.shape[:2], -1), T[type_name])
        return blocks[name]

    path = write_moe_gguf(folder, "qwen3_moe", tmp_path / "k.gguf", encode=encode_k_quants)
    monkeypatch.setenv("MLXCEL_FUSE", "0")  # gate and up apart, to compare each
    loaded = load_model(str(path), dtype="float32")
    assert loaded.info["weights"] == "dequantized" and loaded.info["gguf_types"] == {"F32": 21, "Q4_K": 4, "Q6_K": 2}
    for layer in range(2):
        switch = find_moe(loaded.model, "qwen3_moe", layer).switch_mlp
        for projection in ("gate", "up", "down"):
            raw, qtype = blocks[f"blk.{layer}.ffn_{projection}_exps.weight"]
            got = np.array(getattr(switch, f"{projection}_proj").weight)
            np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
    assert np.isfinite(run_logits(loaded.model)).all()


@pytest.mark.parametrize(
    "family,edits,message",
    [
        ("qwen3_moe", {"expert_count": None}, r"GGUF metadata lacks 'qwen3moe\.expert_count'"),
        (
            "mixtral",
            {"expert_count": None},
            r"tensor 'blk\.0\.ffn_down_exps\.weight' belongs to a mixture of experts, "
            r"but the GGUF metadata lacks 'llama\.expert_count'",
        ),
        (
            "mixtral",
            {"blk.1.ffn_up_exps.weight": None},
            r"MoE GGUF \('llama\.expert_count' = 4\) lacks tensor 'blk\.1\.ffn_up_exps\.weight'",
        ),
        (
            "qwen3_moe",
            {"blk.0.ffn_gate_inp.weight": None},
            r"MoE GGUF \('qwen3moe\.expert_count' = 4\) lacks tensor 'blk\.0\.ffn_gate_inp\.weight'",
        ),
        (
            "mixtral",
            {"expert_count": 8},
            r"tensor 'blk\.0\.ffn_gate_inp\.weight' holds 4 experts, but 'llama\.expert_count' says 8",
        ),
    ],
)
def test_bad_moe_gguf_is_one_clear_error(checkpoints, family, edits, message, tmp_path):
    path = write_moe_gguf(checkpoints(family), family, tmp_path / "bad.gguf", edits=edits)
    with pytest.raises(MlxcelError, match=rf"bad\.gguf: {message}"):
        load_model(str(path), dtype="float32")
