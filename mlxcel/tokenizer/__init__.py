"""Tokenizers (hf, gguf; sentencepiece and tiktoken to come) and the streaming detokenizer."""

from mlxcel.tokenizer.base import TOKENIZER_KINDS, MlxcelTokenizer
from mlxcel.tokenizer.detokenizer import StreamingDetokenizer
from mlxcel.tokenizer.loader import detect_tokenizer_kind, load_tokenizer

__all__ = ["TOKENIZER_KINDS", "MlxcelTokenizer", "StreamingDetokenizer", "detect_tokenizer_kind", "load_tokenizer"]
