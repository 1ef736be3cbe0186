"""MlxcelTokenizer over a `tokenizers.Tokenizer`: shared by the hf and gguf backends."""

from __future__ import annotations

from tokenizers import Tokenizer, processors


class FastTokenizer:
    """A `tokenizers.Tokenizer` plus the metadata its file format keeps beside it.

    Whether encode() adds bos/eos is decided by the backend tokenizer's post-processor; the
    loaders set that up to match transformers, and `add_bos_token` reports what it does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: str,
        bos_token: str | None = None,
        eos_tokens: list[str] | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_templates: dict[str, str] | None = None,
        eos_token_ids: list[int] | None = None,
        bos_token_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.backend = backend
        # Named templates ("default", "tool_use", ...); chat_template is the default one.
        self.chat_templates = dict(chat_templates or {})
        self.chat_template = self.chat_templates.get("default", next(iter(self.chat_templates.values()), None))
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.unk_token = unk_token
        self.pad_token = pad_token
        # Explicit ids (GGUF metadata) win over a string lookup, which a duplicated string would fool.
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._lookup(bos_token)
        ids = eos_token_ids if eos_token_ids is not None else [self._lookup(t) for t in eos_tokens or []]
        self.eos_token_ids = list(dict.fromkeys(i for i in ids if i is not None))
        self.special_tokens = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Ask the post-processor rather than trusting a config flag: it is what encode() runs.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"FastTokenizer(backend={self.backend!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r})"
        )


def make_post_processor(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`[bos] $A [eos]`, either optional (transformers' `update_post_processor` does the same)."""
    bos_id = tokenizer.token_to_id(bos) if bos is not None else None
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    bos = bos if bos_id is not None else None
    eos = eos if eos_id is not None else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
