"""mx.fast.cuda_kernel under a name that carries everything its compiled module depends on.

MLX keeps a custom kernel's compiled module by its name and template arguments alone: in the
process, and on disk ($MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx) for later processes. The
source it compiles also spells out each input's dtype, so two calls that differ only there would
share the first one's module (the second's inputs read as the first's types: wrong values or an
illegal memory access), and a kernel whose source changed would load its old module from disk.
Here the name ends with a digest of the source and every call's template names its inputs' dtypes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import mlx.core as mx


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "") -> Callable:
    """mx.fast.cuda_kernel's callable (same keyword arguments), keyed on the source and input dtypes."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:12]
    kernel = mx.fast.cuda_kernel(
        name=f"{name}_{digest}", input_names=input_names, output_names=output_names, source=source, header=header
    )

    def call(*, inputs: list[mx.array], template: list | tuple = (), **options):
        dtypes = [(f"INPUT{i}_T", x.dtype) for i, x in enumerate(inputs)]
        return kernel(inputs=inputs, template=[*template, *dtypes], **options)

    return call
