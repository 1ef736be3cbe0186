"""What the LLaVA tests share (test_families_llava against transformers, test_vision_e2e_llava
through mlxcel-run): tiny LLaVA-1.5 / LLaVA-NeXT shapes, their preprocessor configs, and the
image-placeholder runs in a prompt."""

from __future__ import annotations

import numpy as np

IMAGE = 3  # the image token id (family_fixtures.PROMPT's ids are all >= 5)
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": 56,
    "patch_size": 14,
}
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "bos_token_id": None,
    "pad_token_id": 0,
}
PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
CLIP_PROCESSOR = {  # LLaVA-1.5's preprocessor_config.json at 56 px: resize to 64, centre crop 56
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 64},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 56, "width": 56},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
NEXT_PROCESSOR = {
    **CLIP_PROCESSOR,
    "image_processor_type": "LlavaNextImageProcessor",
    "processor_class": "LlavaNextProcessor",
    "size": {"shortest_edge": 56},
    "image_grid_pinpoints": PINPOINTS,
    "aspect_ratio_setting": "anyres",
}


def image_runs(ids: np.ndarray, token: int) -> list[int]:
    """Lengths of the runs of `token` (one run per image when text separates them)."""
    runs, length = [], 0
    for t in [*ids.tolist(), None]:
        if t == token:
            length += 1
        elif length:
            runs, length = [*runs, length], 0
    return runs
