"""Per-family image preprocessing, driven by the checkpoint's preprocessor_config.json and equal
to transformers' Pillow-backend image processors (the test oracle)."""
