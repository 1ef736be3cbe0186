"""What the Qwen2-VL tests share (test_families_qwen2_vl and _images against transformers,
test_vision_e2e through mlxcel-run): the tiny language and vision shapes, and a preprocessor
config small enough for a fast photo."""

from __future__ import annotations

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}
VISION = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    # window 56 px = 2x2 merge units: the photo's 8x7 merged grid needs padded windows
    "qwen2_5_vl": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
}
# Qwen2-VL-2B's preprocessor_config.json with a small max_pixels: the photo becomes 16x14 patches.
PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 50_000,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}
