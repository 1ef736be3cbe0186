"""GGUF files of the latent-attention families: llama.cpp's `deepseek2` (DeepSeek V3 with its sigmoid router,
DeepSeek V2 with its softmax one; Kimi K2 converts as V3) and `mistral4`, written from the tiny transformers
checkpoints of tests/test_families_deepseek.py and tests/test_families_mistral4.py the way
convert_hf_to_gguf.py's DeepseekV2Model (and Mistral3Model's Mistral4Model) writes them: the experts stacked
(Mistral 4's already are, gate and up as one tensor), kv_b_proj split per head into attn_k_b (transposed) and
attn_v_b with the heads' widths as key_length_mla / value_length_mla (or, as older converters wrote it,
attn_kv_b whole), head_count_kv 1, the router's keys (expert_gating_func from config.json's scoring_func,
groups, weights' norm and scale, leading dense blocks), e_score_correction_bias as exp_probs_b.bias, YaRN with
yarn_log_multiplier = 0.1 * mscale_all_dim, no Q/K permutation.

Oracle: our load of the same checkpoint from safetensors (itself checked against transformers in the family
tests; transformers' logits are checked here too). transformers 5.25's own GGUF loader reads neither
architecture (its GGUF_CONFIG_MAPPING has no deepseek2 nor mistral4), so it cannot be the oracle."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import PROMPT, mlxcel_generate, reference_logits
from tests.helpers import load_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from tests import test_families_deepseek as deepseek_tests  # noqa: E402 -- after importorskip
from tests import test_families_mistral4 as mistral4_tests  # noqa: E402 -- (it registers Mistral4 for Auto*)

pytestmark = pytest.mark.usefixtures("on_the_cpu")

LONG_PROMPT = PROMPT * 4  # 160 tokens: one-shot prefill in the plain form, decode absorbed
OTHER_ROW = [(5 * i + 11) % 290 + 7 for i in range(23)]
GREEDY_TOKENS = 32
ARCH = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "mistral4": "mistral4"}
GGUF_ARCH = {"deepseek2": gguf.MODEL_ARCH.DEEPSEEK2, "mistral4": gguf.MODEL_ARCH.MISTRAL4}
NEXTN_TENSORS = {
    "eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
    "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
    "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM,
    "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}
# as in the released configs: heads and KV heads alike (the converter splits kv_b by num_key_value_heads)
DEEPSEEK_OVERRIDES = {"num_key_value_heads": 4}
YARN = {  # DeepSeek-V2-Lite's kind of YaRN (its rotary mscale equal to mscale_all_dim, as the file keeps one)
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}


def make_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    if family == "mistral4":
        return mistral4_tests.make_checkpoint(folder, seed, **overrides)
    return deepseek_tests.make_checkpoint(folder, family, seed, **{**DEEPSEEK_OVERRIDES, **overrides})


# --- convert_hf_to_gguf.py, as far as these architectures go --------------------------------------


def read_hparams(folder: Path) -> dict:
    """config.json, with the router's scoring_func as DeepSeek's released configs carry it (transformers'
    DeepseekV3Config does not save it; the converter reads it for expert_gating_func)."""
    hp = json.loads((folder / "config.json").read_text())
    if hp["model_type"] == "deepseek_v3":
        hp.setdefault("scoring_func", "sigmoid")
    elif hp["model_type"] == "deepseek_v2":
        hp.setdefault("scoring_func", "softmax")
    return hp


def write_metadata(writer, hp: dict, legacy: bool, edits: dict) -> None:
    rope = hp.get("rope_parameters") or {}
    # TextModel.set_gguf_parameters (after DeepseekV2Model's num_key_value_heads = 1)
    writer.add_block_count(hp["num_hidden_layers"] + edits.get("nextn", 0))
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(1)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_expert_count(hp["n_routed_experts"])
    writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_expert_group_count(hp["n_group"])
    writer.add_expert_group_used_count(hp["topk_group"])
    gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    if "gating" in edits:
        # (3: newer llama.cpp's sqrt-softplus, which gguf-py 0.19 does not name)
        writer.add_uint32(f"{writer.arch}.expert_gating_func", int(edits["gating"]))
    elif hp.get("scoring_func"):
        writer.add_expert_gating_func(gating[hp["scoring_func"]])
    # DeepseekV2Model.set_gguf_parameters
    writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
    writer.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(hp["q_lora_rank"])
    rank, nope, rot, v = hp["kv_lora_rank"], hp["qk_nope_head_dim"], hp["qk_rope_head_dim"], hp["v_head_dim"]
    writer.add_kv_lora_rank(rank)
    if legacy:  # convert_hf_to_gguf.py before llama.cpp split kv_b (the heads' widths as key/value length)
        writer.add_key_length(nope + rot)
        writer.add_value_length(v)
    else:
        writer.add_key_length(rank + rot)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rot)
        writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    writer.add_expert_shared_count(hp["n_shared_experts"])
    if hp.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rot)
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if edits.get("nextn"):
        writer.add_nextn_predict_layers(edits["nextn"])
    if "temperature_scale" in edits:
        writer.add_attn_temperature_scale(edits["temperature_scale"])


def read_tensors(folder: Path, hp: dict, nextn: int) -> dict:
    """The safetensors' tensors; with `nextn`, a multi-token-prediction block after the last layer as the
    released DeepSeek V3 and GLM-4.7-Flash checkpoints carry one (a decoder layer plus eh_proj, enorm, hnorm
    and shared_head.norm)."""
    from safetensors.torch import load_file

    tensors = {n: t.float() for p in sorted(folder.glob("*.safetensors")) for n, t in load_file(p).items()}
    if nextn:
        last, mtp = hp["num_hidden_layers"] - 1, hp["num_hidden_layers"]
        for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
            tensors[name.replace(f".{last}.", f".{mtp}.", 1)] = tensors[name] * 0.5
        hidden = hp["hidden_size"]
        tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.ones(hidden, 2 * hidden)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"model.layers.{mtp}.{norm}.weight"] = torch.ones(hidden)
    return tensors


def convert(tensors: dict, hp: dict, arch: str, legacy: bool, nextn: int):
    """DeepseekV2Model.modify_tensors (Mistral4Model's: experts already stacked, `.weight` added)."""
    blocks = hp["num_hidden_layers"] + nextn
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], blocks)
    experts: dict[int, dict] = {}
    for name, t in tensors.items():
        if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue
        if name.endswith((".experts.down_proj", ".experts.gate_up_proj")):
            name += ".weight"
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert:  # a layer's experts stacked once all are in
            layer = int(expert.group(1))
            experts.setdefault(layer, {})[(int(expert.group(2)), expert.group(3))] = t
            if len(experts[layer]) == hp["n_routed_experts"] * 3:
                for part in ("down_proj", "gate_proj", "up_proj"):
                    stacked = torch.stack([experts[layer][(e, part)] for e in range(hp["n_routed_experts"])])
                    merged = f"model.layers.{layer}.mlp.experts.{part}.weight"
                    yield names.get_name(merged, try_suffixes=(".weight",)), stacked.numpy()
            continue
        mtp = re.fullmatch(r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm)\.weight", name)
        if mtp:  # (gguf-py 0.19 maps no nextn tensor for deepseek2: llama.cpp's names, as GLM's files hold them)
            kind = NEXTN_TENSORS[mtp.group(2)]
            yield gguf.TENSOR_NAMES[kind].format(bid=mtp.group(1)) + ".weight", t.numpy()
            continue
        if name.endswith("e_score_correction_bias"):  # ModelBase's rename before the name map
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("kv_b_proj.weight") and not legacy:  # split per head, k_b transposed
            heads, nope, v = hp["num_key_value_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
            k_b, v_b = torch.split(t.view(heads, nope + v, t.shape[-1]), [nope, v], dim=1)
            yield names.get_name(name.replace("kv_b_proj", "k_b_proj"), (".weight",)), k_b.transpose(1, 2).numpy()
            yield names.get_name(name.replace("kv_b_proj", "v_b_proj"), (".weight",)), v_b.numpy()
            continue
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy()


def tensor_type(name: str, data: np.ndarray, quant: str) -> str:
    """prepare_tensors: 1-D tensors, norms, routers and names other than *.weight stay F32; a row whose
    width no block divides falls back to F16."""
    if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")) or not name.endswith(".weight"):
        return "F32"
    if quant != "F32" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]][0]:
        return "F16"
    return quant


def write_mla_gguf(
    folder: Path, out: Path, quant: str = "F32", legacy: bool = False, rounded: str | None = None, **edits
) -> Path:
    """`rounded`: every tensor as F32 holding the values `rounded` (Q8_0) would store, the dequantized
    file's exact values."""
    hp = read_hparams(folder)
    arch = ARCH[hp["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    write_metadata(writer, hp, legacy, edits)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(hp["vocab_size"])])
    writer.add_eos_token_id(2)
    nextn = edits.get("nextn", 0)
    for name, data in convert(read_tensors(folder, hp, nextn), hp, arch, legacy, nextn):
        data = data.astype(np.float32)
        if rounded is not None:
            kind = gguf.GGMLQuantizationType[tensor_type(name, data, rounded)]
            data = gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[tensor_type(name, data, quant)]
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- tests ----------------------------------------------------------------------------------------


def forward(source: Path, gguf_weights: str = "dequantize") -> tuple[np.ndarray, object]:
    loaded = load_model(str(source), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([LONG_PROMPT]), loaded.model.make_cache())[0]), loaded


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, on_the_cpu):
    built = {}

    def build(family: str) -> dict:
        if family not in built:
            folder = make_checkpoint(tmp_path_factory.mktemp(family), family)
            logits, loaded = forward(folder)
            greedy = mlxcel_generate(loaded.model, [LONG_PROMPT, OTHER_ROW], GREEDY_TOKENS)
            built[family] = {"folder": folder, "logits": logits, "greedy": greedy}
        return built[family]

    return build


@pytest.mark.parametrize("legacy", [False, True], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize("family", list(ARCH))
def test_f32_gguf_matches_the_safetensors_load(oracle, family, legacy, tmp_path):
    """fp32 logits over 160 tokens within 1e-4 of the safetensors load (1e-3 of transformers), 32 greedy tokens
    identical beside another row; the family, router and MLA sizes read from the metadata, kv_b from either
    form into mla.py's embed_q / unembed_out."""
    built = oracle(family)
    got, loaded = forward(write_mla_gguf(built["folder"], tmp_path / "f32.gguf", legacy=legacy))
    assert np.abs(got - built["logits"]).max() <= 1e-4
    reference = reference_logits(load_reference(built["folder"]), LONG_PROMPT)
    assert np.abs(got - reference).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [LONG_PROMPT, OTHER_ROW], GREEDY_TOKENS) == built["greedy"]
    expected_model = load_model(str(built["folder"]), dtype="float32").model
    args, expected = loaded.model.args, expected_model.args
    assert args.model_type == family and type(loaded.model).__module__ == type(expected_model).__module__
    for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert getattr(args, name) == getattr(expected, name), name
    for name in ("sparse_layers", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "topk_method"):
        assert getattr(args, name) == getattr(expected, name), name
    assert loaded.model.model.layers[0].self_attn.cache_dims == (32, args.qk_rope_head_dim)


@pytest.mark.parametrize("family", list(ARCH))
def test_q8_0_gguf_quantized_and_dequantized_agree(oracle, family, tmp_path):
    """Q8_0 matrices (stacked experts, k_b and v_b where a block divides their rows; F16 where none does;
    norms and routers F32), dequantized: the logits of an F32 file of the values Q8_0 stores, within 1e-4;
    kept packed: within 1e-3 of those (the experts and v_b packed, k_b dense); off the original weights'."""
    built = oracle(family)
    path = write_mla_gguf(built["folder"], tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized" and loaded.info["gguf_types"]["Q8_0"] > 0
    attention = loaded.model.model.layers[1].self_attn
    assert attention.unembed_out.bits == 8 and "scales" not in attention.embed_q  # (16 wide: F16 in the file)
    assert loaded.model.model.layers[1].mlp.switch_mlp.gate_up_proj.bits == 8
    exact, _ = forward(write_mla_gguf(built["folder"], tmp_path / "rounded.gguf", rounded="Q8_0"))
    assert np.abs(dense - exact).max() <= 1e-4
    assert np.abs(packed - exact).max() <= 1e-3
    assert np.abs(dense - built["logits"]).max() > 1e-3  # (the file really was quantized)


def test_a_packed_file_through_the_scheduler_draws_each_rows_tokens(oracle, tmp_path):
    """The Q8_0 file kept packed (v_b and the experts quantized) in BatchScheduler's paged pool: rows of 160,
    23 and 9 tokens prefilled in pieces of 16 beside one another, then decoded together, each drawing what
    it draws alone through the batch engine."""
    from tests.family_fixtures import schedule

    path = write_mla_gguf(oracle("deepseek_v3")["folder"], tmp_path / "q8.gguf", quant="Q8_0")
    model = load_model(str(path), dtype="float32", gguf_weights="quantized").model
    prompts = [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]]
    state = schedule(model, prompts, 16, max_rows=4, chunk_size=16)
    assert [r.token_ids for r in state.results] == [mlxcel_generate(model, [p], 16)[0] for p in prompts]


def test_yarn_with_its_log_multiplier_matches_the_safetensors_load(tmp_path):
    """DeepSeek's YaRN (factor 4 over 64 positions, mscale = mscale_all_dim = 0.707): the file's
    yarn_log_multiplier (0.1 x 0.707) back to mscale_all_dim, the softmax scale times its mscale^2."""
    folder = make_checkpoint(tmp_path / "yarn", "deepseek_v3", seed=1, rope_parameters=YARN)
    expected, hf = forward(folder)
    got, loaded = forward(write_mla_gguf(folder, tmp_path / "yarn.gguf"))
    assert np.abs(got - expected).max() <= 1e-4
    attention, reference = loaded.model.model.layers[0].self_attn, hf.model.model.layers[0].self_attn
    assert attention.scale == pytest.approx(reference.scale) and attention.scale != 24**-0.5
    assert loaded.model.args.rope_scaling["mscale_all_dim"] == pytest.approx(0.707)


def test_multi_token_prediction_blocks_are_dropped(oracle, tmp_path):
    """A file with nextn_predict_layers 1 (its block after the decoder's, with nextn.* tensors: GLM-4.7-Flash's
    deepseek2 files carry one): the decoder's layers only, the same logits."""
    built = oracle("deepseek_v3")
    got, loaded = forward(write_mla_gguf(built["folder"], tmp_path / "mtp.gguf", nextn=1))
    assert len(loaded.model.model.layers) == 3
    assert np.abs(got - built["logits"]).max() <= 1e-4


def test_mistral4_query_scale_is_the_files_or_the_released_configs(oracle, tmp_path):
    """The converter drops llama_4_scaling_beta: a file without attention.temperature_scale takes the released
    config's 0.1 (the safetensors load's logits); one with it, its value (0 here: no scale, other logits)."""
    built = oracle("mistral4")
    got, loaded = forward(write_mla_gguf(built["folder"], tmp_path / "plain.gguf"))
    assert loaded.model.args.llama_4_scaling_beta == 0.1 and np.abs(got - built["logits"]).max() <= 1e-4
    got, loaded = forward(write_mla_gguf(built["folder"], tmp_path / "off.gguf", temperature_scale=0.0))
    assert loaded.model.args.llama_4_scaling_beta == 0.0 and np.abs(got - built["logits"]).max() > 0.1


@pytest.mark.parametrize(
    "family,edits,message",
    [
        ("deepseek_v2", {"gating": 3}, r"expert_gating_func' is 3; deepseek2 routes with 1 \(softmax\) or 2"),
        ("mistral4", {"gating": gguf.ExpertGatingFuncType.SIGMOID}, r"is 2; mistral4 routes with 1 \(softmax\)"),
    ],
)
def test_a_router_no_family_reads_is_one_clear_error(oracle, family, edits, message, tmp_path):
    path = write_mla_gguf(oracle(family)["folder"], tmp_path / "bad.gguf", **edits)
    with pytest.raises(MlxcelError, match=message) as caught:
        load_model(str(path), dtype="float32")
    assert "\n" not in str(caught.value)


def test_a_softmax_router_asking_for_renormalised_weights_is_refused(oracle, tmp_path):
    """DeepSeek V2's softmax router never renormalises (transformers' DeepseekV2 reads no norm_topk_prob):
    a deepseek2 softmax file with expert_weights_norm true is refused, not run otherwise than llama.cpp."""
    folder = oracle("deepseek_v2")["folder"]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    try:
        path = write_mla_gguf(folder, tmp_path / "norm.gguf")
    finally:
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxcelError, match="never renormalises"):
        load_model(str(path), dtype="float32")
