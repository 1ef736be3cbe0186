"""mlxcel: a config-driven LLM inference pipeline on MLX."""

__version__ = "0.1.0"
