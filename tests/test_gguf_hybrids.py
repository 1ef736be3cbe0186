"""GGUF files of the hybrid families (llama.cpp's `qwen35`), written from tiny transformers
checkpoints the way convert_hf_to_gguf.py writes them: its tensor names (gguf-py's tensor map), its
transforms (Qwen3NextModel.modify_tensors: A_log -> -exp(A_log), dt_bias -> ssm_dt.bias, conv kernel
squeezed, zero-centred norms + 1; _LinearAttentionVReorderBase: value heads grouped -> tiled), its
tensor types (1-D, norms and the conv kept F32) and its metadata (ssm.* keys, full_attention_interval,
rope.dimension_count). Oracle: our load of the same checkpoint from safetensors (and transformers for
the logits); transformers' GGUF loader does not read these architectures."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from tests.family_fixtures import mlxcel_generate, save_widened
from tests.helpers import load_reference, write_tiny_tokenizer

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(80)]  # past the gated delta rule's 64-token chunk
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
ARCHS = {"qwen35": gguf.MODEL_ARCH.QWEN35}


def make_qwen35_checkpoint(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config = transformers.Qwen3_5TextConfig(
        **{**QWEN35_SHAPE, **overrides}, vocab_size=vocab, eos_token_id=2, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(0)
    save_widened(transformers.Qwen3_5ForCausalLM(config), folder)
    return folder


# --- convert_hf_to_gguf.py, as far as these architectures go --------------------------------------


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
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    if nk == nv or "linear_attn." not in name:
        return t
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


def convert_tensors(state: dict, hp: dict, arch: str):
    """(GGUF name, float32 array) for each tensor, as the converter's modify_tensors yields them."""
    names = gguf.get_tensor_name_map(ARCHS[arch], hp["num_hidden_layers"])
    for name, t in state.items():
        name = name.replace("language_model.", "")
        if name.startswith("mtp"):
            continue
        t = reorder_linear_attention(name, t, hp)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy().astype(np.float32)


def tensor_type(name: str, data: np.ndarray, quant: str) -> str:
    """prepare_tensors' rule: 1-D tensors, norms, the conv kernel, routers and names other than
    *.weight stay F32; the rest take the file type."""
    kept = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
    if data.ndim <= 1 or name.endswith(("_norm.weight", *kept)) or not name.endswith(".weight"):
        return "F32"
    return quant


def write_hybrid_gguf(folder: Path, arch: str, out: Path, quant: str = "F32", **metadata_overrides) -> Path:
    """The file convert_hf_to_gguf.py writes for `folder` (its metadata keys as set_gguf_parameters
    writes them; `metadata_overrides` replace ssm.* values to build broken files)."""
    hp = transformers.AutoConfig.from_pretrained(folder).to_dict()
    hp = {**hp, **hp.get("text_config", {})}
    state = load_reference(folder).state_dict()
    writer = gguf.GGUFWriter(str(out), arch)
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    # Qwen3NextModel.set_gguf_parameters (partial_rotary_factor read at the top level, default 0.25)
    ssm = {
        "conv_kernel": hp["linear_conv_kernel_dim"],
        "state_size": hp["linear_key_head_dim"],
        "group_count": hp["linear_num_key_heads"],
        "time_step_rank": hp["linear_num_value_heads"],
        "inner_size": hp["linear_value_head_dim"] * hp["linear_num_value_heads"],
        **metadata_overrides,
    }
    for key, value in ssm.items():
        writer.add_uint32(f"{arch}.ssm.{key}", value)
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(hp["vocab_size"])])
    writer.add_eos_token_id(2)
    for name, data in convert_tensors(state, hp, arch):
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
    return np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0]), loaded


def q8_0_reference_logits(folder: Path) -> np.ndarray:
    """transformers with each matrix (the converter's Q8_0 set: every 2-D parameter) passed through
    gguf-py's Q8_0 round trip in the file's layout: value heads reordered as the converter does first
    (out_proj's columns move, and a head narrower than a group changes what each group holds)."""
    reference = load_reference(folder)
    hp = reference.config.to_dict()
    qtype = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() == 2:
                stored = reorder_linear_attention(name, p, hp).numpy()
                rounded = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype))
                p.copy_(reorder_linear_attention(name, rounded, hp, inverse=True))
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """The checkpoint, our safetensors load's logits and greedy rows, and transformers' logits."""
    folder = make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35"))
    logits, loaded = forward(folder)
    with torch.no_grad():
        reference = load_reference(folder)(torch.tensor([PROMPT])).logits[0].numpy()
    greedy = mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS)
    return {"folder": folder, "logits": logits, "greedy": greedy, "reference": reference}


def test_qwen35_f32_gguf_matches_the_safetensors_load(qwen35, tmp_path):
    path = write_hybrid_gguf(qwen35["folder"], "qwen35", tmp_path / "f32.gguf")
    got, loaded = forward(path)
    assert loaded.model.args.model_type == "qwen3_5_text" and not loaded.model.args.rope_traditional
    assert loaded.model.args.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert loaded.model.args.partial_rotary_factor == 0.25
    assert np.abs(got - qwen35["logits"]).max() <= 1e-4
    assert np.abs(got - qwen35["reference"]).max() <= 1e-3
    assert mlxcel_generate(loaded.model, [PROMPT, OTHER_ROW], GREEDY_TOKENS) == qwen35["greedy"]


def test_qwen35_value_heads_must_be_put_back(qwen35, tmp_path, monkeypatch):
    """The tiny checkpoint has two value heads per key head, so the converter's reordering moves
    them: a loader that skipped undoing it would be caught by the test above."""
    import mlxcel.checkpoints.gguf as gguf_module

    path = write_hybrid_gguf(qwen35["folder"], "qwen35", tmp_path / "f32.gguf")
    monkeypatch.setattr(gguf_module, "untile_layer_value_heads", lambda weights, prefix, config: None)
    skipped, _ = forward(path)
    assert np.abs(skipped - qwen35["logits"]).max() > 0.1


def test_qwen35_q8_0_gguf_quantized_and_dequantized_agree(qwen35, tmp_path):
    """Q8_0 matrices (the conv kernel, norms and 1-D tensors stay F32): kept packed, the value-head
    reordering moves whole rows and whole quantization groups (a head is 32 columns)."""
    path = write_hybrid_gguf(qwen35["folder"], "qwen35", tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized" and loaded.info["gguf_types"]["Q8_0"] > 0
    assert np.abs(dense - packed).max() <= 1e-3
    assert np.abs(dense - q8_0_reference_logits(qwen35["folder"])).max() <= 1e-3
    assert np.abs(dense - qwen35["logits"]).max() > 1e-3  # the file really was quantized


def test_qwen35_q8_0_heads_narrower_than_a_group(tmp_path):
    """Value heads of 16 columns split a 32-column Q8_0 group: out_proj is dequantized to be put back."""
    folder = make_qwen35_checkpoint(tmp_path / "narrow", linear_value_head_dim=16)
    path = write_hybrid_gguf(folder, "qwen35", tmp_path / "q8.gguf", quant="Q8_0")
    dense, _ = forward(path, "dequantize")
    packed, loaded = forward(path, "quantized")
    assert loaded.info["weights"] == "quantized"
    assert np.abs(dense - packed).max() <= 1e-3
    assert np.abs(dense - q8_0_reference_logits(folder)).max() <= 1e-3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"inner_size": 101}, r"ssm\.inner_size 101, ssm\.time_step_rank 4 .* whole number of value heads"),
        ({"group_count": 3}, r"q8\.gguf: the tensors of model\.layers\.0\.linear_attn do not fit"),
    ],
)
def test_qwen35_metadata_that_does_not_fit_is_one_clear_error(qwen35, tmp_path, override, message):
    path = write_hybrid_gguf(qwen35["folder"], "qwen35", tmp_path / "q8.gguf", **override)
    with pytest.raises(MlxcelError, match=message) as caught:
        load_model(str(path), dtype="float32")
    assert "\n" not in str(caught.value)
