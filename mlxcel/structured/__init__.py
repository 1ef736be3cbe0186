"""Structured output: rows constrained to a JSON schema, a regex, a choice list or a grammar (docs/structured.md)."""
