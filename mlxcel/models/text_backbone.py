"""What the VLM families built over one of mlxcel's text families share (LLaVA, Mistral 3,
Idefics3): reading the language model's config from `text_config`, making its args, and the
class that is both the VLM and the text family's Model, so the engine and the segmented decoder
see an ordinary text model (`model.model.layers`, `compute_logits`, `make_masks`, caches)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from mlxcel.errors import MlxcelError

# checkpoint prefix -> ours: a vision-language folder's language model under transformers 5's
# in-memory names (model.language_model.*; lm_head.* already at the top) and under the Hub's
# original layout, which mlx-lm, mlx-vlm and transformers' save_pretrained write (language_model.*)
LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}

# transformers' config-class defaults for the keys the text families read: Hub configs save
# text_config as its difference from them (llava-1.5-7b-hf's omits hidden_size, the layer count, ...)
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
    "mistral4": {  # (Mistral4Config's; models/mistral4.py fills its other keys)
        "vocab_size": 131072,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}


def import_text_family(kind: str):
    return importlib.import_module(f"mlxcel.models.{kind}")


def read_text_config(
    config: dict,
    default_text: dict | None = None,
    supported: tuple[str, ...] | None = None,
    default_kind: str = "llama",
) -> dict:
    """The language model's config as its family reads it: text_config (or `default_text` when
    the file has none) over transformers' defaults for its model_type (`default_kind` when unnamed,
    as the VLM's transformers config class assumes)."""
    text = dict(config.get("text_config") or default_text or {})
    kind = text.get("model_type", default_kind)
    supported = supported or tuple(TEXT_CONFIG_DEFAULTS)
    if kind not in supported:
        raise MlxcelError(
            f"{config.get('model_type')}: language model {kind!r} is not supported (supported: {', '.join(supported)})"
        )
    top = {"vocab_size": config["vocab_size"]} if "vocab_size" in config else {}  # older configs keep it here
    merged = {**TEXT_CONFIG_DEFAULTS[kind], **top, **text, "model_type": kind}
    # transformers ties the head when the top level or the text config says so
    merged["tie_word_embeddings"] = bool(config.get("tie_word_embeddings") or merged.get("tie_word_embeddings"))
    return merged


def make_text_args(text_config: dict, **overrides: Any):
    """The text family's ModelArgs for a config from read_text_config."""
    family = import_text_family(text_config["model_type"])
    missing = [key for key in family.REQUIRED_KEYS if key not in text_config]
    if missing:
        raise MlxcelError(f"text_config: missing required key(s) {', '.join(missing)}")
    return family.ModelArgs.from_config(text_config, **overrides)


class OverTextModel:
    """Mixed into a VLM's Model (before nn.Module): `Model(args)` returns an instance of the class
    combining it with `args.text_model_type`'s Model, the VLM's methods first."""

    def __new__(cls, args, *rest, **kwargs):
        if cls.__dict__.get("over_text_model") is None:  # the family's own class, not a combination
            cls = combine_with_text_model(cls, args.text_model_type)
        return super().__new__(cls)


@functools.cache
def combine_with_text_model(vlm_class: type, text_model_type: str) -> type:
    text_model = import_text_family(text_model_type).Model
    name = f"{vlm_class.__name__}Over{text_model.__name__}_{text_model_type}"
    return type(name, (vlm_class, text_model), {"__module__": vlm_class.__module__, "over_text_model": text_model_type})


def rename_language_model(
    weights: dict, dropped: tuple[str, ...], prefixes: dict[str, str] = LANGUAGE_MODEL_PREFIXES
) -> dict:
    """A multimodal (or text-only) folder's language-model tensors under the text family's names;
    those under a `dropped` prefix (towers, projectors, extra heads) left out."""
    renamed = {}
    for key, value in weights.items():
        if key.startswith(dropped):
            continue
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        renamed[prefixes[prefix] + key[len(prefix) :] if prefix else key] = value
    return renamed
