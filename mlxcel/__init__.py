"""mlxcel: a config-driven LLM inference pipeline on MLX.

Scripts: `from mlxcel import load_generator` (see mlxcel/api.py); the CLI is `mlxcel-run`.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# MLX's CUDA backend (0.32) launches a CUDA graph every MLX_MAX_OPS_PER_BUFFER ops (default 20),
# and a batch-1 decode step is hundreds of small ops: decode was measured host-bound (GPU wait ~0).
# On the H200 (Qwen2.5-0.5B shape, batch 1) 20 -> 200 alone gave ~+10%, and 100 was as fast as
# 200 or faster; later MLX releases pick 100 for Hopper themselves. MLX reads it once, at its
# first GPU commit, so it is set here, before any work. Linux only (CUDA): Metal has its own
# per-device default; the CPU backend never reads it. A value the user set is kept.
if _sys.platform == "linux":
    _os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "100")


def __getattr__(name: str):
    # Lazy, so `import mlxcel` (the CLI's first step) does not load MLX or the models.
    if name in ("load_generator", "load_config", "Generator", "Generation"):
        from mlxcel import api

        return getattr(api, name)
    raise AttributeError(f"module 'mlxcel' has no attribute {name!r}")
