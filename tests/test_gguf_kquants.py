"""Our NumPy GGUF dequantizers against gguf-py's (llama.cpp's Python reference), and the reader
against gguf-py's writer: random blocks of each type, files with mixed types, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.errors import MlxcelError
from mlxcel.models import gguf_reader
from mlxcel.models.gguf_reader import DEQUANTIZERS, load_gguf_numpy, read_gguf_header

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
# byte offsets of each block's fp16 scales (random bytes there could be inf/nan)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw quantized rows [rows, bytes per row] with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[type_name]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for start in FP16_FIELDS[type_name]:
        raw[..., start : start + 2] = rng.normal(0, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


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
        "a.weight": ("Q4_K", (3, 512)), "b.weight": ("Q6_K", (2, 256)), "c.weight": ("Q8_0", (5, 64)), "d.weight": ("F32", (2, 3)),
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
