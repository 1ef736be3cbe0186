"""Tokenizers (hf, sentencepiece, tiktoken, gguf), the streaming detokenizer and stop strings."""

from mlxcel.tokenizer.base import TOKENIZER_KINDS, MlxcelTokenizer
from mlxcel.tokenizer.detokenizer import (
    DeferredTextStream,
    StopStringFilter,
    StreamingDetokenizer,
    TextStream,
)
from mlxcel.tokenizer.loader import detect_tokenizer_kind, load_tokenizer

__all__ = [
    "TOKENIZER_KINDS",
    "DeferredTextStream",
    "MlxcelTokenizer",
    "StopStringFilter",
    "StreamingDetokenizer",
    "TextStream",
    "detect_tokenizer_kind",
    "load_tokenizer",
]
