"""mlxcel: a config-driven LLM inference pipeline on MLX.

Scripts: `from mlxcel import load_generator` (see mlxcel/api.py); the CLI is `mlxcel-run`.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import mlxcel` (the CLI's first step) does not load MLX or the models.
    if name in ("load_generator", "load_config", "Generator", "Generation"):
        from mlxcel import api

        return getattr(api, name)
    raise AttributeError(f"module 'mlxcel' has no attribute {name!r}")
