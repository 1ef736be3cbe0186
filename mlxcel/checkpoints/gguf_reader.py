"""A NumPy GGUF reader for what `mx.load` cannot read: K-quant files (Q4_K_M and friends).

MLX's GGUF reader handles F32/F16/Q4_0/Q4_1/Q8_0 tensors and fails on the whole file at the first
other type, so the header is read here first: a file of native types still goes to `mx.load`;
any other known type sends the file here, where every tensor is dequantized to float32 with
llama.cpp's block layouts (ggml-quants.c `dequantize_row_*`); an unknown type is an error
naming the tensor. Metadata comes back as plain Python values (lists for arrays).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.errors import MlxcelError

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}
MLX_NATIVE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}  # what mx.load reads (quantized ones stay packed)
QK_K = 256

# GGUF metadata value types -> struct format (8: string, 9: array are read by hand)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (GGUF lists dims innermost first)
    type_name: str
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    def __init__(self, data: memoryview, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise MlxcelError(f"{self.path}: GGUF header ends early at byte {self.pos} (is the file complete?)")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.data[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("<I"), self.take("<Q")
            if item in _NUMPY:
                array = np.frombuffer(self.data, _NUMPY[item], count, self.pos)
                self.pos += array.nbytes
                return array.astype(bool).tolist() if item == 7 else array.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise MlxcelError(f"{self.path}: unknown GGUF metadata value type {kind} at byte {self.pos}")
        return self.take(_SCALARS[kind])


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor table; an unknown tensor type is an error naming the tensor."""
    if Path(path).stat().st_size < 4:
        raise MlxcelError(
            f"{path}: empty or truncated ({Path(path).stat().st_size} bytes), not a GGUF file; download it again"
        )
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(data), path)
    if bytes(data[:4]) != b"GGUF":
        raise MlxcelError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r})")
    cursor.pos = 4
    version = cursor.take("<I")
    if version < 2:
        raise MlxcelError(
            f"{path}: GGUF version {version} is not supported (2 or 3 are; re-convert with a recent llama.cpp)"
        )
    n_tensors, n_kv = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    raw = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        raw.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in raw:
        if kind not in GGML_TYPES:
            raise MlxcelError(
                f"{path}: tensor {name!r} has ggml type id {kind}, which mlxcel cannot read (readable: "
                f"{', '.join(sorted(t[0] for t in GGML_TYPES.values()))})"
            )
        type_name, block, size = GGML_TYPES[kind]
        count = int(np.prod(dims)) if dims else 1
        tensors.append(TensorInfo(name, tuple(reversed(dims)), type_name, start + offset, count // block * size))
        if start + offset + count // block * size > len(data):
            raise MlxcelError(f"{path}: tensor {name!r} runs past the end of the file (is the file complete?)")
    return metadata, tensors


def load_gguf_numpy(path: Path, tensors: list[TensorInfo]) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 (F16 stays float16), but MXFP4 ones: packed as MLX's
    mxfp4 (`name.weight` uint32, `name.scales` uint8)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for info in tensors:
        raw = data[info.offset : info.offset + info.nbytes]
        if info.type_name == "MXFP4":  # kept packed, as MLX's mxfp4 mode holds it
            prefix = info.name.removesuffix(".weight")
            out[f"{prefix}.weight"], out[f"{prefix}.scales"] = repack_mxfp4(np.asarray(raw), info.shape)
            continue
        if info.type_name not in DEQUANTIZERS:
            raise MlxcelError(
                f"{path}: tensor {info.name!r} is {info.type_name}, which mlxcel cannot dequantize yet (supported: "
                f"{', '.join(DEQUANTIZERS)}); re-quantize the file as Q4_K_M, Q5_K_M, Q6_K or Q8_0"
            )
        out[info.name] = DEQUANTIZERS[info.type_name](np.asarray(raw)).reshape(info.shape)
    return out


def repack_mxfp4(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 blocks (an E8M0 scale byte, then 16 bytes: element i in byte i's low nibble,
    element i + 16 in its high one) as MLX's mxfp4 layout, exactly: the same E2M1 codes packed two a
    byte in element order (low nibble first) and read as little-endian uint32 words [..., in / 8],
    and the scale bytes [..., in / 32] as they are (both 2^(e - 127) per block)."""
    blocks = raw.reshape(-1, 17)
    codes = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=-1).reshape(-1, 16, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    rows = shape[:-1]
    return packed.reshape(*rows, shape[-1] // 2).view("<u4"), blocks[:, 0].reshape(*rows, shape[-1] // 32).copy()


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 scale at byte `start` of each block, as a float32 column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float32)


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16)


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)
    return (_f16(blocks, 0) * (_nibbles(blocks[:, 2:]).astype(np.float32) - 8)).ravel()


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 20)
    return (_f16(blocks, 0) * _nibbles(blocks[:, 4:]).astype(np.float32) + _f16(blocks, 2)).ravel()


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the 32-bit qh is the fifth bit of element j."""
    bits = qh.copy().view("<u4")
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def dequantize_q5_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 22)
    q = _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])
    return (_f16(blocks, 0) * (q.astype(np.float32) - 16)).ravel()


def dequantize_q5_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 24)
    q = _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])
    return (_f16(blocks, 0) * q.astype(np.float32) + _f16(blocks, 2)).ravel()


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)
    return (_f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)).ravel()


def unpack_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    low, high, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low & 63, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """y = d * scale * q - dmin * min over 8 sub-blocks of 32 (Q4_K, Q5_K)."""
    sc, mins = unpack_k_scales(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return ((d * sc)[:, :, None] * q.astype(np.float32) - (dmin * mins)[:, :, None]).ravel()


def _q4_k_quants(qs: np.ndarray) -> np.ndarray:
    """128 bytes as 4 chunks of 32: chunk c holds sub-block 2c (low nibbles) and 2c+1 (high)."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 144)
    return _k_affine(blocks, _q4_k_quants(blocks[:, 16:]))


def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 176)
    qh = blocks[:, 16:48]  # bit i of qh[l] is the fifth bit of element l of sub-block i
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return _k_affine(blocks, _q4_k_quants(blocks[:, 48:]) | high)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Two halves of 128: ql 64 bytes, qh 32 bytes each; 16 int8 scales, one per 16 elements."""
    blocks = raw.reshape(-1, 210)
    ql = blocks[:, :128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = (low | (high << 4)).astype(np.float32).reshape(-1, 16, 16) - 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return ((_f16(blocks, 208) * scales)[:, :, None] * q).ravel()


DEQUANTIZERS = {
    "F32": dequantize_f32,
    "F16": dequantize_f16,
    "BF16": dequantize_bf16,
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
    "Q5_0": dequantize_q5_0,
    "Q5_1": dequantize_q5_1,
    "Q8_0": dequantize_q8_0,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
}
