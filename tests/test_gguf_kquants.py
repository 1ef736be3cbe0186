"""Our NumPy GGUF dequantizers against gguf-py's (llama.cpp's Python reference), and the reader
against gguf-py's writer: random blocks of each type, files with mixed types, and the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints import gguf_reader
from mlxcel.checkpoints.gguf_reader import DEQUANTIZERS, load_gguf_numpy, read_gguf_header
from mlxcel.errors import MlxcelError
from tests.gguf_fixtures import FP16_FIELDS, random_blocks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("type_name", list(FP16_FIELDS))
def test_dequantizer_matches_gguf_py(type_name):
    raw = random_blocks(type_name, 4, 512)
    expected = gguf.quants.dequantize(raw, T[type_name])
    got = DEQUANTIZERS[type_name](raw.ravel()).reshape(expected.shape)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got, expected)


def test_bf16_and_f16():
    x = np.random.default_rng(1).normal(size=64).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_allclose(DEQUANTIZERS["BF16"](bf16.view(np.uint8)), x, rtol=1e-2)
    np.testing.assert_array_equal(DEQUANTIZERS["F16"](x.astype(np.float16).view(np.uint8)), x.astype(np.float16))


def write_file(path, tensors: dict[str, tuple[str, np.ndarray]], **metadata):
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    writer.add_token_list(["a", "b", "c"])
    writer.add_array("test.floats", [0.5, 1.5])
    for name, (type_name, data) in tensors.items():
        if type_name == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reader_reads_metadata_and_mixed_types(tmp_path):
    tensors = {
        "a.weight": ("Q4_K", random_blocks("Q4_K", 3, 512, 1)),
        "b.weight": ("Q6_K", random_blocks("Q6_K", 2, 256, 2)),
        "c.weight": ("Q8_0", random_blocks("Q8_0", 5, 64, 3)),
        "d.weight": ("F32", np.arange(6, dtype=np.float32).reshape(2, 3)),
    }
    path = write_file(tmp_path / "mixed.gguf", tensors, **{"test.name": "x", "test.count": 7})
    metadata, infos = read_gguf_header(path)
    assert metadata["test.name"] == "x" and metadata["test.count"] == 7
    assert metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"] and metadata["test.floats"] == [0.5, 1.5]
    assert {i.name: (i.type_name, i.shape) for i in infos} == {
        "a.weight": ("Q4_K", (3, 512)),
        "b.weight": ("Q6_K", (2, 256)),
        "c.weight": ("Q8_0", (5, 64)),
        "d.weight": ("F32", (2, 3)),
    }
    arrays = load_gguf_numpy(path, infos)
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(arrays[tensor.name], expected.reshape(arrays[tensor.name].shape))


def test_unreadable_type_names_the_tensor(tmp_path, monkeypatch):
    path = write_file(tmp_path / "q2.gguf", {"blk.0.ffn_down.weight": ("Q2_K", np.zeros((1, 84), np.uint8))})
    _, infos = read_gguf_header(path)
    with pytest.raises(MlxcelError, match=r"blk\.0\.ffn_down\.weight.*Q2_K"):
        load_gguf_numpy(path, infos)
    monkeypatch.setitem(gguf_reader.GGML_TYPES, 99, ("X", 1, 1))
    monkeypatch.delitem(gguf_reader.GGML_TYPES, 10)  # Q2_K's id, now unknown
    with pytest.raises(MlxcelError, match=r"blk\.0\.ffn_down\.weight.*type id 10"):
        read_gguf_header(path)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = write_file(tmp_path / "t.gguf", {"w.weight": ("F32", np.ones((64, 64), np.float32))})
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(MlxcelError, match="runs past the end"):
        read_gguf_header(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(MlxcelError, match="ends early"):
        read_gguf_header(tmp_path / "head.gguf")


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (gguf-py has none): per 16 weights an int8 scale of one fp16 d,
    6-bit quants packed as ggml's dequantize_row_q6_K reads them."""
    n = x.size // 256
    sub = x.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(-1) / 31
    d = (sub_scale.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(sub_scale / np.where(d == 0, 1, d.astype(np.float32))), -128, 127).astype(np.int8)
    eff = (d.astype(np.float32) * sc)[..., None]
    u = (np.clip(np.round(sub / np.where(eff == 0, 1, eff)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    a, b, c, e = (u[..., i * 32 : (i + 1) * 32] for i in range(4))
    ql = np.concatenate([(a & 15) | ((c & 15) << 4), (b & 15) | ((e & 15) << 4)], -1).reshape(n, 128)
    qh = ((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], -1).reshape(x.shape[0], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer: per 32 weights a 6-bit scale and min of two fp16 super-scales."""
    n = x.size // 256
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / 15, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.round((sub + (dmin.astype(np.float32) * m)[..., None]) / np.where(eff == 0, 1, eff)), 0, 15).astype(
        np.uint8
    )
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        -1,
    )
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], -1).reshape(x.shape[0], -1)


@pytest.mark.parametrize(("type_name", "quantize"), [("Q4_K", quantize_q4_k), ("Q6_K", quantize_q6_k)])
def test_the_test_quantizers_round_trip(type_name, quantize):
    x = np.random.default_rng(5).normal(0, 0.2, size=(4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x), T[type_name])
    assert np.abs(back - x).max() < (0.05 if type_name == "Q4_K" else 0.01)


def test_k_quant_model_matches_transformers_gguf_loader(tmp_path):
    """A Q4_K_M-style llama file (Q4_K matrices, Q6_K ffn_down and output) through our reader
    and transformers' GGUF loader (gguf-py's dequantizers): the same logits."""
    torch = pytest.importorskip("torch")
    import transformers

    from mlxcel.checkpoints.loader import load_model
    from tests.gguf_fixtures import PROMPT, gguf_name, permute_for_llama_cpp
    from tests.helpers import make_tiny_checkpoint

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    folder = make_tiny_checkpoint(tmp_path / "hf", "llama", **shape)
    state = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32").state_dict()
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for key, value in [
        ("context_length", 512),
        ("embedding_length", 256),
        ("block_count", 2),
        ("feed_forward_length", 512),
    ]:
        getattr(writer, f"add_{key}")(value)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(state["model.embed_tokens.weight"].shape[0])])
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        data = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_for_llama_cpp(data, 4 if "q_proj" in name else 2)
        if data.ndim == 2:
            six = name.endswith(("down_proj.weight", "lm_head.weight"))
            writer.add_tensor(
                gguf_name(name), (quantize_q6_k if six else quantize_q4_k)(data), raw_dtype=T.Q6_K if six else T.Q4_K
            )
        else:
            writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = load_model(str(tmp_path / "k.gguf"), dtype="float32")
    assert loaded.info["gguf_types"] == {"Q4_K": 13, "Q6_K": 3, "F32": 5} and loaded.info["weights"] == "dequantized"
    got = np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="k.gguf", dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(got - expected).max() <= 1e-3
    with torch.no_grad():
        original = (
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")(torch.tensor([PROMPT]))
            .logits[0]
            .numpy()
        )
    assert 1e-3 < np.abs(got - original).max()  # the file really is quantized
