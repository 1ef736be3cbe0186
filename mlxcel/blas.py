"""Linux CPUs: run MLX on an optimized BLAS instead of the reference BLAS the mlx-cpu wheel
bundles, whose fp32 matmuls are an order of magnitude slower (docs/benchmarks.md).

libmlx resolves `cblas_*`/`sgemm_` through the dynamic linker, so preloading OpenBLAS makes MLX
use it; the results are unchanged (tests compare logits and greedy tokens). LD_PRELOAD only acts
at process start, so the CLI re-executes itself once with it set. Nothing happens on macOS (MLX
uses Accelerate there), when OpenBLAS is not installed (a one-line hint instead), or with
MLXCEL_BLAS=off.
"""

from __future__ import annotations

import ctypes.util
import glob
import importlib.util
import os
import sys
from pathlib import Path

MARKER = "MLXCEL_BLAS_PRELOADED"  # set in the re-executed process: never loop
OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
HINT = (
    "mlxcel: tip: MLX here uses a slow reference BLAS; install OpenBLAS (Debian/Ubuntu: "
    "apt-get install libopenblas0-pthread) for ~15x faster CPU prefill (MLXCEL_BLAS=off hides this)"
)


def has_reference_blas() -> bool:
    """The mlx-cpu wheel bundles netlib's reference libblas next to libmlx (mlx_cpu.libs/)."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    site = Path(list(spec.submodule_search_locations)[0]).parent
    return bool(glob.glob(str(site / "mlx_cpu.libs" / "libblas*.so*")))


def find_openblas() -> str | None:
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")  # a soname the dynamic linker finds, or None


def plan_blas_preload(environ: dict[str, str]) -> tuple[str | None, str | None]:
    """(library to preload, or None; a hint to print, or None) for this process."""
    if sys.platform != "linux" or environ.get("MLXCEL_BLAS", "").lower() == "off" or MARKER in environ:
        return None, None
    if "openblas" in environ.get("LD_PRELOAD", "") or not has_reference_blas():
        return None, None
    library = find_openblas()
    return (library, None) if library else (None, HINT)


def print_tip_at_terminal(hint: str) -> None:
    if sys.stderr.isatty():  # a tip for people at a terminal, not noise in logs and pipes
        print(hint, file=sys.stderr)


def reexec_with_openblas(argv: list[str], module: str = "mlxcel", show_hint=print_tip_at_terminal) -> None:
    """Replace this process with `python -m module argv` of this mlxcel, OpenBLAS preloaded;
    returns only when there is nothing to do (`show_hint` gets the tip where OpenBLAS is missing)."""
    library, hint = plan_blas_preload(dict(os.environ))
    if hint:
        show_hint(hint)
        return
    if library is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{library}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else library
    env[MARKER] = library
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, rerun_command(module, argv), env)


def rerun_command(module: str, argv: list[str]) -> list[str]:
    """A command that runs `module` of this same mlxcel again. `python -m mlxcel` would put the
    current folder first on the path, so in a checkout an installed mlxcel-run would re-execute
    the checkout's code; this imports the package that is running now."""
    root = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import runpy, sys; sys.path[:] = [{root!r}] + [p for p in sys.path if p not in ('', '.')]; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *argv]


def advise_api_blas(environ: dict[str, str] | None = None) -> str | None:
    """For the Python API, which cannot re-execute its caller: the one-line tip to start Python
    with OpenBLAS preloaded (or to install it), where MLX would otherwise run on its reference
    BLAS; None elsewhere."""
    library, hint = plan_blas_preload(dict(os.environ) if environ is None else environ)
    if library:
        return (
            f"mlxcel: tip: this Python runs MLX on its slow reference BLAS (mlxcel-run preloads OpenBLAS: "
            f"~15x faster CPU prefill); start Python with LD_PRELOAD={library} for the same speed (MLXCEL_BLAS=off "
            "hides this)"
        )
    return hint


def describe_blas() -> str:
    """For the run's environment record."""
    if sys.platform == "darwin":
        return "accelerate"
    if MARKER in os.environ or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas (preloaded)"
    return "reference (mlx-cpu wheel)" if has_reference_blas() else "bundled"
