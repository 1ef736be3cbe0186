"""The tokenizer interface every backend satisfies, whatever file it was built from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# Backend names, also the values of `tokenizer.kind` (besides "auto").
TOKENIZER_KINDS = ("hf", "sentencepiece", "tiktoken", "gguf")


@runtime_checkable
class MlxcelTokenizer(Protocol):
    """One encode()/decode() whatever the backend (docs/tokenizers.md).

    `special_tokens` holds every added/control token (content -> id): the tokens matched whole
    in the text; `control_tokens` the special ones among them (HF added tokens with special=true,
    SentencePiece/GGUF control pieces, tiktoken's specials). encode()'s `literal_spans` are
    character ranges of the text (a user's content under a chat template) where a control token's
    text is text (mlxcel/tokenizer/literal.py). `eos_token_ids` come from the tokenizer's own
    config only; the model and `generation_config.json` add theirs elsewhere. `vocab_size` counts added tokens too (the
    whole id space, like `len(transformers_tokenizer)`). `chat_templates` holds the model's
    templates by name ("default", "tool_use", ...); `chat_template` is the default one.
    """

    backend: str
    special_tokens: dict[str, int]
    control_tokens: dict[str, int]
    bos_token_id: int | None
    eos_token_ids: list[int]
    bos_token: str | None
    eos_token: str | None
    vocab_size: int
    chat_template: str | None
    chat_templates: dict[str, str]
    add_bos_token: bool

    def encode(
        self, text: str, add_special_tokens: bool = True, literal_spans: Sequence[tuple[int, int]] = ()
    ) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...
