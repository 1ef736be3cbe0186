"""GGUF files of the hybrid families (llama.cpp's `qwen35`, `qwen35moe`, `qwen3next` and
`nemotron_h`), written from tiny transformers checkpoints the way convert_hf_to_gguf.py writes
them: the tensors it reads (the safetensors files), its tensor names (gguf-py's tensor map), its
transforms, its tensor types (1-D tensors, norms, conv kernels and routers kept F32) and its
metadata keys.

- qwen35 / qwen35moe (Qwen3_5TextModel, Qwen3_5MoeTextModel): Qwen3NextModel.modify_tensors (A_log ->
  -exp(A_log), dt_bias -> ssm_dt.bias, conv kernel squeezed, zero-centred norms + 1) after
  _LinearAttentionVReorderBase's value heads grouped -> tiled; experts stacked (Qwen2MoeModel); ssm.*
  keys, full_attention_interval, rope.dimension_count, expert_* keys.
- qwen3next (Qwen3NextModel): no reordering of value heads, in_proj_qkvz split per key head into
  attn_qkv (all q, all k, all v) and attn_gate (all z), in_proj_ba kept as it is.
- nemotron_h (NemotronHModel -> GraniteHybridModel): Mamba blocks through Mamba2Model.modify_tensors
  (A -> -exp(A_log) [H, 1], D [H, 1], norm [groups, width], conv squeezed), attention blocks through
  LlamaModel's q/k permutation; per-layer head_count_kv and feed_forward_length arrays.

Oracle: our load of the same checkpoint from safetensors (and transformers for the logits);
transformers' GGUF loader reads none of these architectures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import mlxcel_generate, save_widened
from tests.gguf_fixtures import permute_for_llama_cpp
from tests.helpers import load_reference, write_tiny_tokenizer

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(80)]  # past the gated delta rule's and the SSD's 64-token chunk
OTHER_ROW = [(5 * i + 11) % 290 + 7 for i in range(23)]
GREEDY_TOKENS = 32
# three Gated DeltaNet layers to one full-attention layer; two value heads per key head, so the
# converter's value-head reordering is not the identity
QWEN35_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MOE_SHAPE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
# Qwen 3.5 MoE's config has no intermediate_size (no dense MLP); Qwen3-Next's has one
QWEN35MOE_SHAPE = {**{k: v for k, v in QWEN35_SHAPE.items() if k != "intermediate_size"}, **MOE_SHAPE}
QWEN3NEXT_SHAPE = {**QWEN35_SHAPE, **MOE_SHAPE}
NEMOTRON_H_SHAPE = {
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
    "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN35_SHAPE),
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN35MOE_SHAPE),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3NEXT_SHAPE),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_H_SHAPE),
}
ARCHS = {
    "qwen35": gguf.MODEL_ARCH.QWEN35,
    "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT,
    "nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H,
}


def make_checkpoint(folder: Path, arch: str, **overrides) -> Path:
    config_class, model_class, shape = FAMILIES[arch]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config = getattr(transformers, config_class)(
        **{**shape, **overrides}, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(0)
    save_widened(getattr(transformers, model_class)(config), folder)
    return folder


# --- convert_hf_to_gguf.py, as far as these architectures go --------------------------------------


def read_checkpoint(folder: Path) -> dict:
    """The tensors as the converter reads them: the safetensors files' names and values."""
    from safetensors.torch import load_file

    return {name: t.float() for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}


def reorder_v_heads(t, dim: int, key_heads: int, per_key: int, head_dim: int):
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped by key head -> tiled."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1 :])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def reorder_linear_attention(name: str, t, hp: dict, inverse: bool = False):
    """_LinearAttentionVReorderBase.modify_tensors (more value heads than key heads only); `inverse`
    puts the heads back (tiled -> grouped: the same permutation with the two counts swapped)."""
    if "linear_attn." not in name or hp["linear_num_key_heads"] == hp["linear_num_value_heads"]:
        return t
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    groups = (nv // nk, nk) if inverse else (nk, nv // nk)
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    qk = 2 * dk * nk
    if ".in_proj_qkv." in name:
        return torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, *groups, dv)], dim=0)
    if ".in_proj_z." in name:
        return reorder_v_heads(t, 0, *groups, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return reorder_v_heads(t, 0, *groups, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(t.unsqueeze(-1), 0, *groups, 1).squeeze(-1)
    if ".conv1d" in name:
        t = t.squeeze()
        return torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, *groups, dv)], dim=0)
    if ".out_proj." in name:
        return reorder_v_heads(t, 1, *groups, dv)
    return t


def qwen35_hparams(folder: Path) -> dict:
    """ModelBase.load_hparams: AutoConfig's dict, text_config moved to the top (TextModel)."""
    hp = transformers.AutoConfig.from_pretrained(folder).to_dict()
    return {**hp, **hp.get("text_config", {})}


def write_qwen35_metadata(writer, arch: str, hp: dict, ssm_overrides: dict) -> None:
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_experts") is not None:
        writer.add_expert_count(hp["num_experts"])
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    # Qwen2MoeModel.set_gguf_parameters
    if hp.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    # Qwen3NextModel.set_gguf_parameters (partial_rotary_factor read at the top level, default 0.25)
    ssm = {
        "conv_kernel": hp["linear_conv_kernel_dim"],
        "state_size": hp["linear_key_head_dim"],
        "group_count": hp["linear_num_key_heads"],
        "time_step_rank": hp["linear_num_value_heads"],
        "inner_size": hp["linear_value_head_dim"] * hp["linear_num_value_heads"],
    }
    for key, value in {**ssm, **ssm_overrides}.items():
        writer.add_uint32(f"{arch}.ssm.{key}", value)
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))


def split_qkvz(t, hp: dict) -> tuple:
    """Qwen3NextModel.modify_tensors: in_proj_qkvz's rows, per key head [q, k, v, z], as attn_qkv
    (all q, all k, all v) and attn_gate (all z)."""
    nk, dk, dv = hp["linear_num_key_heads"], hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    per_key = hp["linear_num_value_heads"] // nk
    sizes = [dk, dk, per_key * dv, per_key * dv]
    q, k, v, z = torch.split(t.permute(1, 0).contiguous().view(-1, nk, sum(sizes)), sizes, dim=-1)
    hidden = hp["hidden_size"]
    flat = [part.contiguous().view(hidden, -1) for part in (q, k, v, z)]
    return torch.cat(flat[:3], dim=-1).permute(1, 0).contiguous(), flat[3].permute(1, 0).contiguous()


def convert_qwen(tensors: dict, hp: dict, arch: str):
    names = gguf.get_tensor_name_map(ARCHS[arch], hp["num_hidden_layers"])
    experts: dict[int, dict] = {}
    for name, t in tensors.items():
        name = name.replace("language_model.", "")  # Qwen2MoeModel.modify_tensors
        if name.startswith("mtp"):
            continue
        if arch != "qwen3next":
            t = reorder_linear_attention(name, t, hp)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if "in_proj_qkvz.weight" in name:
            qkv, z = split_qkvz(t, hp)
            layer = name.split(".")[2]
            yield f"blk.{layer}.attn_qkv.weight", qkv.numpy()
            yield f"blk.{layer}.attn_gate.weight", z.numpy()
        elif expert:  # Qwen2MoeModel: a layer's experts stacked once all of them are in
            layer = int(expert.group(1))
            experts.setdefault(layer, {})[(int(expert.group(2)), expert.group(3))] = t
            if len(experts[layer]) == hp["num_experts"] * 3:
                for part in ("down_proj", "gate_proj", "up_proj"):
                    stacked = torch.stack([experts[layer][(e, part)] for e in range(hp["num_experts"])])
                    merged = f"model.layers.{layer}.mlp.experts.{part}.weight"
                    yield names.get_name(merged, try_suffixes=(".weight",)), stacked.numpy()
        else:
            yield names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy()


NEMOTRON_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}


def nemotron_h_hparams(folder: Path) -> dict:
    """The config.json NVIDIA ships (the one llama.cpp's Nemotron-H files were converted from): the
    block pattern as a string, rms eps as norm_eps, no MoE keys (transformers 5's config object
    always has num_experts_per_tok and spells the kinds differently, which sends the converter down
    its nemotron_h_moe path)."""
    hp = json.loads((folder / "config.json").read_text())
    pattern = "".join(NEMOTRON_PATTERN[kind] for kind in hp.pop("layers_block_type"))
    for key in ("num_experts_per_tok", "n_routed_experts", "moe_intermediate_size"):
        hp.pop(key, None)
    return {**hp, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern), "norm_eps": 1e-5}


def write_nemotron_h_metadata(writer, arch: str, hp: dict, ssm_overrides: dict) -> None:
    pattern, layers = hp["hybrid_override_pattern"], hp["num_hidden_layers"]
    # TextModel / LlamaModel / GraniteModel (head_dim popped) / GraniteHybridModel / NemotronHModel
    writer.add_block_count(layers)
    writer.add_context_length(2**20)  # no RoPE: GraniteHybridModel's "any length"
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_layer_norm_rms_eps(hp["norm_eps"])
    writer.add_layer_norm_eps(hp["layer_norm_epsilon"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
    ssm = {
        "conv_kernel": hp["conv_kernel"],
        "state_size": hp["ssm_state_size"],
        "group_count": hp["n_groups"],
        "inner_size": hp["mamba_num_heads"] * hp["mamba_head_dim"],
        "time_step_rank": hp["mamba_num_heads"],
    }
    for key, value in {**ssm, **ssm_overrides}.items():
        writer.add_uint32(f"{arch}.ssm.{key}", value)
    writer.add_head_count_kv([hp["num_key_value_heads"] if kind == "*" else 0 for kind in pattern])
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_feed_forward_length([hp["intermediate_size"] if kind == "-" else 0 for kind in pattern])


def convert_nemotron_h(tensors: dict, hp: dict, arch: str):
    """GraniteHybridModel.modify_tensors: Mamba blocks through Mamba2Model's, attention blocks
    through LlamaModel's (q/k permuted), the rest through the name map alone."""
    pattern = hp["hybrid_override_pattern"]
    names = gguf.get_tensor_name_map(ARCHS[arch], hp["num_hidden_layers"])
    groups, inner = hp["n_groups"], hp["mamba_num_heads"] * hp["mamba_head_dim"]
    for name, t in tensors.items():
        layer = re.search(r"\.(\d+)\.", name)
        kind = pattern[int(layer.group(1))] if layer else None
        if kind == "M":
            if name.endswith(".dt_bias"):
                name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
            new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new_name.endswith("ssm_conv1d.weight"):
                t = t.squeeze()
            elif new_name.endswith(("ssm_a", "ssm_d")):
                t = t.reshape(*t.shape, 1)
            elif new_name.endswith("ssm_norm.weight"):
                t = t.reshape(groups, inner // groups)
            if name.endswith(".A_log"):
                t = -torch.exp(t)
            yield new_name, t.numpy()
            continue
        data = t.numpy()
        if kind == "*" and name.endswith("q_proj.weight"):
            data = permute_for_llama_cpp(data, hp["num_attention_heads"])
        elif kind == "*" and name.endswith("k_proj.weight"):
            data = permute_for_llama_cpp(data, hp["num_key_value_heads"])
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), data


CONVERTERS = {
    "qwen35": (qwen35_hparams, write_qwen35_metadata, convert_qwen),
    "qwen35moe": (qwen35_hparams, write_qwen35_metadata, convert_qwen),
    "qwen3next": (qwen35_hparams, write_qwen35_metadata, convert_qwen),
    "nemotron_h": (nemotron_h_hparams, write_nemotron_h_metadata, convert_nemotron_h),
}


def tensor_type(name: str, data: np.ndarray, quant: str, f32: tuple[str, ...] = ()) -> str:
    """prepare_tensors' rule: 1-D tensors, norms, conv kernels, routers and names other than
    *.weight stay F32; the rest take the file type (but those ending in `f32`)."""
    kept = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", *f32)
    if data.ndim <= 1 or name.endswith(("_norm.weight", *kept)) or not name.endswith(".weight"):
        return "F32"
    return quant


def write_hybrid_gguf(
    folder: Path, arch: str, out: Path, quant: str = "F32", f32: tuple[str, ...] = (), **ssm_overrides
) -> Path:
    """The file convert_hf_to_gguf.py writes for `folder` (`f32`: name endings kept F32, as a
    quantizer's mix of types would; `ssm_overrides` replace ssm.* values, to build files whose
    metadata does not fit their tensors)."""
    read_hparams, write_metadata, convert = CONVERTERS[arch]
    hp = read_hparams(folder)
    writer = gguf.GGUFWriter(str(out), arch)
    write_metadata(writer, arch, hp, ssm_overrides)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(hp["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data in convert(read_checkpoint(folder), hp, arch):
        qtype = gguf.GGMLQuantizationType[tensor_type(name, data, quant, f32)]
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


F32_MATRICES = (".mlp.gate.weight", ".shared_expert_gate.weight")  # routers: F32 in every file


def q8_0_reference_logits(folder: Path) -> np.ndarray:
    """transformers with each matrix (the converter's Q8_0 set: every matrix, stacked experts too, but
    the conv kernels and the routers) passed through
    gguf-py's Q8_0 round trip in the file's layout: value heads reordered as the converter does first
    (out_proj's columns move, and a head narrower than a group changes what each group holds)."""
    reference = load_reference(folder)
    hp = reference.config.to_dict()
    qtype = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name and not name.endswith(F32_MATRICES):
                stored = reorder_linear_attention(name, p, hp).numpy()
                rounded = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype))
                p.copy_(reorder_linear_attention(name, rounded, hp, inverse=True))
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """arch -> its checkpoint, our safetensors load's logits and greedy rows (beside another row), and
    transformers' logits; each built once for the module."""
    built = {}

    def build(arch: str) -> dict:
        if arch not in built:
            folder = make_checkpoint(tmp_path_factory.mktemp(arch), arch)
            logits, loaded = forward(folder)
            with torch.no_grad():
                reference = load_reference(folder)(torch.tensor([PROMPT])).logits[0].numpy()
            greedy = mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS)
            built[arch] = {"folder": folder, "logits": logits, "greedy": greedy, "reference": reference}
        return built[arch]

    return build


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_f32_gguf_matches_the_safetensors_load(oracle, arch, tmp_path):
    """fp32 logits within 1e-4 of the same checkpoint loaded from safetensors (1e-3 of transformers),
    and 32 greedy tokens identical, beside another row."""
    family = oracle(arch)
    path = write_hybrid_gguf(family["folder"], arch, tmp_path / "f32.gguf")
    got, loaded = forward(path)
    assert np.abs(got - family["logits"]).max() <= 1e-4
    assert np.abs(got - family["reference"]).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS) == family["greedy"]
    args = loaded.model.args
    if arch == "nemotron_h":
        assert args.layer_types == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
        assert (args.num_key_value_heads, args.intermediate_size, args.n_groups) == (2, 128, 2)
        return
    assert args.model_type == {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}.get(arch, "qwen3_next")
    assert args.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert args.partial_rotary_factor == 0.25 and not args.rope_traditional
    if arch != "qwen35":
        assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 32)
        assert args.shared_expert_intermediate_size == 64 and all(args.sparse_layers)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_bf16_gguf_is_the_bf16_safetensors_load(oracle, arch, tmp_path):
    """In bfloat16 too the file gives the model the safetensors give: the same tensors in bf16 and the
    family's float32 ones (float32_weights: A_log, Nemotron-H's D and dt_bias) in float32, the rest
    (Qwen's dt_bias) in bf16 (it stayed float32 from GGUF: logits up to 1.6 apart on these models)."""
    folder = oracle(arch)["folder"]
    path = write_hybrid_gguf(folder, arch, tmp_path / "f32.gguf")
    got = load_model(str(path), dtype="bfloat16", gguf_weights="dequantize").model
    expected = load_model(str(folder), dtype="bfloat16").model
    dtypes = {k: v.dtype for k, v in tree_flatten(got.parameters())}
    assert dtypes == {k: v.dtype for k, v in tree_flatten(expected.parameters())}
    logits = [np.array(m(mx.array([PROMPT]), m.make_cache())[0].astype(mx.float32)) for m in (got, expected)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-2


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_q8_0_gguf_quantized_and_dequantized_agree(oracle, arch, tmp_path):
    """Q8_0 matrices (conv kernels, norms and 1-D tensors stay F32), kept packed or dequantized, against
    transformers with the same matrices rounded. Qwen 3.5's value-head reordering moves whole rows and
    whole quantization groups (a head is 32 columns)."""
    family = oracle(arch)
    path = write_hybrid_gguf(family["folder"], arch, tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized" and loaded.info["gguf_types"]["Q8_0"] > 0
    assert np.abs(dense - packed).max() <= 1e-3
    assert np.abs(dense - q8_0_reference_logits(family["folder"])).max() <= 1e-3
    assert np.abs(dense - family["logits"]).max() > 1e-3  # the file really was quantized


def test_qwen35_value_heads_must_be_put_back(oracle, tmp_path, monkeypatch):
    """The tiny checkpoint has two value heads per key head, so the converter's reordering moves
    them: a loader that skipped undoing it would be caught by the parity test."""
    import mlxcel.checkpoints.gguf as gguf_module

    family = oracle("qwen35")
    path = write_hybrid_gguf(family["folder"], "qwen35", tmp_path / "f32.gguf")
    monkeypatch.setattr(gguf_module, "untile_layer_value_heads", lambda weights, prefix, config: None)
    skipped, _ = forward(path)
    assert np.abs(skipped - family["logits"]).max() > 0.1


def test_qwen35_q8_0_heads_narrower_than_a_group(tmp_path):
    """Value heads of 16 columns split a 32-column Q8_0 group: out_proj is dequantized to be put back."""
    folder = make_checkpoint(tmp_path / "narrow", "qwen35", linear_value_head_dim=16)
    path = write_hybrid_gguf(folder, "qwen35", tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized"
    assert np.abs(dense - packed).max() <= 1e-3
    assert np.abs(dense - q8_0_reference_logits(folder)).max() <= 1e-3


def test_qwen3next_projections_stored_differently_are_joined(oracle, tmp_path):
    """Qwen3-Next's in_proj_qkvz comes as two tensors a quantizer may store differently (attn_qkv
    Q8_0, attn_gate F32 here): both are joined dense, and the logits are those of the packed file's
    dequantized load."""
    family = oracle("qwen3next")
    out = tmp_path / "mixed.gguf"
    path = write_hybrid_gguf(family["folder"], "qwen3next", out, quant="Q8_0", f32=("attn_gate.weight",))
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    layer = loaded.model.model.layers[0].linear_attn
    assert isinstance(layer.out_proj, nn.QuantizedLinear) and not isinstance(layer.in_proj_qkvz, nn.QuantizedLinear)
    assert np.abs(dense - packed).max() <= 1e-3


@pytest.mark.parametrize(
    ("arch", "override", "message"),
    [
        ("qwen35", {"inner_size": 101}, r"ssm\.inner_size 101, ssm\.time_step_rank 4 .* whole number of value heads"),
        ("qwen35", {"group_count": 3}, r"m\.gguf: the tensors of model\.layers\.0\.linear_attn do not fit"),
        ("nemotron_h", {"inner_size": 129}, r"ssm\.inner_size 129 and ssm\.time_step_rank 8: .* whole number"),
    ],
)
def test_metadata_that_does_not_fit_is_one_clear_error(oracle, tmp_path, arch, override, message):
    path = write_hybrid_gguf(oracle(arch)["folder"], arch, tmp_path / "m.gguf", **override)
    with pytest.raises(MlxcelError, match=message) as caught:
        load_model(str(path), dtype="float32")
    assert "\n" not in str(caught.value)


def test_qwen35_pre_tokenizer_keeps_combining_marks_with_their_letters(tmp_path):
    """Real qwen35 files say tokenizer.ggml.pre = "qwen35": llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35 regex,
    Qwen2's with combining marks (\\p{M}) in words and out of punctuation runs, single digits."""
    from mlxcel.tokenizer.gguf import make_byte_level_bpe

    def pieces(pre: str) -> list[str]:
        tokenizer = make_byte_level_bpe(["a"], [1], [], pre, tmp_path / "t.gguf")
        return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("cafe\u0301 na\u0308ive 42")]

    assert len(pieces("qwen35")) == 5  # "café", " naïve", " ", "4", "2" (byte-level spelled)
    assert len(pieces("qwen2")) == 7  # each mark split off its word
