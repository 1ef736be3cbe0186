"""models/cuda_kernel.py: MLX keeps a custom kernel's compiled module by name and template alone,
so our kernels' names carry their source's digest and every call's template its inputs' dtypes.
On the CPU against a recording stand-in for mx.fast.cuda_kernel; on a GPU (`-m cuda`), one
kernel called with float32 and then bfloat16 inputs computes both right (one shared module read
the second call's inputs as the first's type)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import cuda_kernel as module
from mlxcel.sampling import cuda_draw


@pytest.fixture
def recorded(monkeypatch):
    made, calls = [], []

    def fake_cuda_kernel(**spec):
        made.append(spec)
        return lambda **options: calls.append((spec["name"], options))

    monkeypatch.setattr(module.mx.fast, "cuda_kernel", fake_cuda_kernel)
    return made, calls


def test_a_kernels_name_changes_with_its_source_and_header(recorded):
    made, _ = recorded
    module.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];")
    module.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];")
    module.cuda_kernel("k", ["x"], ["y"], "y[0] = 2 * x[0];")
    module.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];", header="#define A 1")
    names = [spec["name"] for spec in made]
    assert names[0] == names[1] and len(set(names)) == 3
    assert all(name.startswith("k_") for name in names)


def test_every_call_names_its_inputs_dtypes_after_its_own_template(recorded):
    _, calls = recorded
    kernel = module.cuda_kernel("k", ["a", "b"], ["y"], "")
    a, b = mx.zeros((2,), mx.float32), mx.zeros((3,), mx.int32)
    kernel(inputs=[a, b], template=[("T", mx.float32), ("D", 4)], grid=(1, 1, 1))
    kernel(inputs=[a.astype(mx.bfloat16), b], grid=(1, 1, 1))
    (_, first), (_, second) = calls
    assert first["template"] == [("T", mx.float32), ("D", 4), ("INPUT0_T", mx.float32), ("INPUT1_T", mx.int32)]
    assert second["template"] == [("INPUT0_T", mx.bfloat16), ("INPUT1_T", mx.int32)]
    assert first["grid"] == (1, 1, 1) and first["inputs"][0] is a


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_draw.is_available(), reason="MLX's CUDA backend only")
def test_one_kernel_reads_inputs_of_either_dtype_right():
    kernel = module.cuda_kernel(
        "mlxcel_test_scale", ["x"], ["y"], "int i = threadIdx.x; y[i] = static_cast<float>(x[i]) * 2.0f;"
    )
    values = np.arange(64, dtype=np.float32) - 20.5
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        x = mx.array(values).astype(dtype)
        (y,) = kernel(
            inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32]
        )
        assert np.array_equal(np.array(y), np.array(x.astype(mx.float32)) * 2), dtype
