"""GGUF files of GLM-4 (llama.cpp's `glm4`) and GLM-4.5 (`glm4moe`), written from tiny transformers
checkpoints the way convert_hf_to_gguf.py's Glm4Model and Glm4MoeModel write them: the safetensors'
tensors, gguf-py's tensor names (GLM-4's gate_up_proj as ffn_up, its post-norms as post_attention_norm
and post_ffw_norm; GLM-4.5's post_attention_layernorm as post_attention_norm), no Q/K permutation,
rope.dimension_count for the partial RoPE, GLM-4.5's experts stacked, e_score_correction_bias as
exp_probs_b.bias, its expert_* / leading_dense_block_count keys and, as the converter does by default,
the multi-token-prediction block appended (block_count + nextn_predict_layers, its nextn.* tensors).

Oracle: our load of the same checkpoint from safetensors, and transformers' logits (transformers'
GGUF loader reads neither architecture). llama.cpp reads no expert groups for glm4moe, so the MoE
checkpoint here routes over one group, as the released GLM-4.5 models do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import mlxcel_generate
from tests.helpers import load_reference
from tests.test_families_glm import make_checkpoint

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(80)]
OTHER_ROW = [(5 * i + 11) % 290 + 7 for i in range(23)]
GREEDY_TOKENS = 32
ARCHS = {"glm4": gguf.MODEL_ARCH.GLM4, "glm4moe": gguf.MODEL_ARCH.GLM4_MOE}
FAMILY = {"glm4": "glm4", "glm4moe": "glm4_moe"}
OVERRIDES = {"glm4": {}, "glm4moe": {"n_group": 1, "topk_group": 1}}


# --- convert_hf_to_gguf.py, as far as these architectures go --------------------------------------


def read_hparams(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def read_tensors(folder: Path, hp: dict, arch: str) -> dict:
    """The safetensors' tensors; for glm4moe, a multi-token-prediction block after the last layer (the
    released checkpoints carry one: a decoder layer plus eh_proj, enorm, hnorm and shared_head.norm)."""
    from safetensors.torch import load_file

    tensors = {n: t.float() for p in sorted(folder.glob("*.safetensors")) for n, t in load_file(p).items()}
    if arch == "glm4moe":
        last, mtp = hp["num_hidden_layers"] - 1, hp["num_hidden_layers"]
        for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
            tensors[name.replace(f".{last}.", f".{mtp}.", 1)] = tensors[name] * 0.5
        hidden = hp["hidden_size"]
        tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.ones(hidden, 2 * hidden)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"model.layers.{mtp}.{norm}.weight"] = torch.ones(hidden)
    return tensors


def write_metadata(writer, arch: str, hp: dict, edits: dict) -> None:
    rope = hp["rope_parameters"]
    extra = 1 if arch == "glm4moe" else 0  # the MTP block the converter keeps unless --no-mtp
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"] + extra)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    # Glm4Model / Glm4MoeModel.set_gguf_parameters
    writer.add_rope_dimension_count(int(hp["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
    if arch == "glm4moe":
        writer.add_expert_used_count(hp["num_experts_per_tok"])
        writer.add_expert_count(hp["n_routed_experts"])
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        writer.add_expert_shared_count(hp["n_shared_experts"])
        writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
        writer.add_expert_gating_func(edits.get("gating", gguf.ExpertGatingFuncType.SIGMOID))
        writer.add_expert_weights_scale(hp["routed_scaling_factor"])
        writer.add_expert_weights_norm(hp["norm_topk_prob"])
        writer.add_nextn_predict_layers(extra)


def convert(tensors: dict, hp: dict, arch: str):
    blocks = hp["num_hidden_layers"] + (1 if arch == "glm4moe" else 0)
    names = gguf.get_tensor_name_map(ARCHS[arch], blocks)
    experts: dict[int, dict] = {}
    for name, t in tensors.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert:  # Glm4MoeModel.modify_tensors: a layer's experts stacked once all are in
            layer = int(expert.group(1))
            experts.setdefault(layer, {})[(int(expert.group(2)), expert.group(3))] = t
            if len(experts[layer]) == hp["n_routed_experts"] * 3:
                for part in ("down_proj", "gate_proj", "up_proj"):
                    stacked = torch.stack([experts[layer][(e, part)] for e in range(hp["n_routed_experts"])])
                    merged = f"model.layers.{layer}.mlp.experts.{part}.weight"
                    yield names.get_name(merged, try_suffixes=(".weight",)), stacked.numpy()
            continue
        if name.endswith("e_score_correction_bias"):  # ModelBase's rename before the name map
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy()


def tensor_type(name: str, data: np.ndarray, quant: str) -> str:
    """prepare_tensors: 1-D tensors, norms, routers and names other than *.weight stay F32."""
    if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")) or not name.endswith(".weight"):
        return "F32"
    return quant


def write_glm_gguf(folder: Path, arch: str, out: Path, quant: str = "F32", **edits) -> Path:
    hp = read_hparams(folder)
    writer = gguf.GGUFWriter(str(out), arch)
    write_metadata(writer, arch, hp, edits)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("glm4")
    writer.add_token_list([f"t{i}" for i in range(hp["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data in convert(read_tensors(folder, hp, arch), hp, arch):
        qtype = gguf.GGMLQuantizationType[tensor_type(name, data, quant)]
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- tests ----------------------------------------------------------------------------------------


def forward(source: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(source), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0]), loaded


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, on_the_cpu):
    built = {}

    def build(arch: str) -> dict:
        if arch not in built:
            folder = make_checkpoint(tmp_path_factory.mktemp(arch), FAMILY[arch], **OVERRIDES[arch])
            logits, loaded = forward(folder)
            with torch.no_grad():
                reference = load_reference(folder)(torch.tensor([PROMPT])).logits[0].numpy()
            greedy = mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS)
            built[arch] = {"folder": folder, "logits": logits, "greedy": greedy, "reference": reference}
        return built[arch]

    return build


@pytest.mark.parametrize("arch", list(ARCHS))
def test_f32_gguf_matches_the_safetensors_load(oracle, arch, tmp_path):
    """fp32 logits within 1e-4 of the safetensors load (1e-3 of transformers), 32 greedy tokens identical
    beside another row; the MTP block is dropped, the settings the metadata leaves out read from tensors."""
    family = oracle(arch)
    path = write_glm_gguf(family["folder"], arch, tmp_path / "f32.gguf")
    got, loaded = forward(path)
    assert np.abs(got - family["logits"]).max() <= 1e-4
    assert np.abs(got - family["reference"]).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS) == family["greedy"]
    args = loaded.model.args
    assert args.model_type == FAMILY[arch] and len(loaded.model.model.layers) == 3
    assert args.partial_rotary_factor == 0.5 and args.rope_traditional == (arch == "glm4") and args.attention_bias
    if arch == "glm4moe":
        assert args.sparse_layers == [False, True, True] and args.use_qk_norm and args.norm_topk_prob
        assert (args.n_routed_experts, args.num_experts_per_tok, args.n_shared_experts) == (8, 3, 1)
        assert args.routed_scaling_factor == 2.5


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_gguf_is_the_bf16_safetensors_load(oracle, arch, tmp_path):
    """The same parameters in the same dtypes (GLM-4.5's router in float32) as from safetensors."""
    folder = oracle(arch)["folder"]
    got = load_model(str(write_glm_gguf(folder, arch, tmp_path / "f32.gguf")), dtype="bfloat16").model
    expected = load_model(str(folder), dtype="bfloat16").model
    dtypes = {k: v.dtype for k, v in tree_flatten(got.parameters())}
    assert dtypes == {k: v.dtype for k, v in tree_flatten(expected.parameters())}
    logits = [np.array(m(mx.array([PROMPT]), m.make_cache())[0].astype(mx.float32)) for m in (got, expected)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-2


@pytest.mark.parametrize("arch", list(ARCHS))
def test_q8_0_gguf_quantized_and_dequantized_agree(oracle, arch, tmp_path):
    """Q8_0 matrices (stacked experts too; norms, routers and biases F32), kept packed or dequantized."""
    family = oracle(arch)
    path = write_glm_gguf(family["folder"], arch, tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized" and loaded.info["gguf_types"]["Q8_0"] > 0
    assert np.abs(dense - packed).max() <= 1e-3
    assert np.abs(dense - family["logits"]).max() > 1e-3  # the file really was quantized
    assert np.abs(dense - q8_0_reference_logits(family["folder"])).max() <= 1e-3


def q8_0_reference_logits(folder: Path) -> np.ndarray:
    """transformers with every matrix the file quantizes (all but the router) through gguf-py's Q8_0
    round trip: an expert's rows are the same blocks stacked or not."""
    reference = load_reference(folder)
    qtype = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() >= 2 and not name.endswith(".mlp.gate.weight"):
                rows = p.reshape(-1, p.shape[-1]).numpy()
                rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)
                p.copy_(torch.from_numpy(rounded).reshape(p.shape))
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


def test_a_gating_function_other_than_sigmoid_is_one_clear_error(oracle, tmp_path):
    softmax = gguf.ExpertGatingFuncType.SOFTMAX
    path = write_glm_gguf(oracle("glm4moe")["folder"], "glm4moe", tmp_path / "softmax.gguf", gating=softmax)
    with pytest.raises(MlxcelError, match=r"expert_gating_func' is 1; GLM-4.5 routes with 2 \(sigmoid\)"):
        load_model(str(path), dtype="float32")


def test_glm4_pre_tokenizer_splits_as_llama_cpp(tmp_path):
    """tokenizer.ggml.pre = "glm4" (GLM-4 and GLM-4.5 files): llama.cpp's CHATGLM4, Llama 3's split
    (numbers in runs of up to three) with its merges applied and no BOS added."""
    from mlxcel.tokenizer.gguf import load_gguf_tokenizer

    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "glm4")
    tokens = ["1", "2", "3", "4", "12", "123", "1234", "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("glm4")
    writer.add_token_list(tokens)
    writer.add_token_merges(["1 2", "12 3", "123 4"])
    writer.add_bos_token_id(7)
    writer.add_eos_token_id(7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = load_gguf_tokenizer(path)
    assert tokenizer.encode("1234") == [tokens.index("123"), tokens.index("4")]
