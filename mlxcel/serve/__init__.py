"""mlxcel-serve: the OpenAI-compatible server (docs/serve.md)."""
