"""Tokenizer backends against transformers: the SmolLM2 GGUF, tiny HF folders, synthetic GGUFs."""

from __future__ import annotations

import json
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer import detect_tokenizer_kind, load_tokenizer
from tests.helpers import (
    CORPUS,
    HF_SPECIALS,
    HF_TEMPLATE,
    HF_TRAINING_TEXT,
    find_smollm2_gguf,
    load_hf_pair,
    load_reference_smollm2,
    load_smollm2,
    make_hf_folder,
    requires_smollm2,
)


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    return make_hf_folder(tmp_path_factory.mktemp("hf_tok"))


# --- SmolLM2 GGUF vs transformers ---------------------------------------------------------------


def has_non_ascii_numeric(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") and not c.isascii() for c in text)


@lru_cache(maxsize=1)
def load_reference_smollm2_digits() -> Tokenizer:
    """transformers' GGUF tokenizer with SmolLM2's own pre-tokenizer put back.

    transformers ignores `tokenizer.ggml.pre == "smollm"` and splits text with GPT-2's regex
    alone. llama.cpp (and SmolLM2's tokenizer.json, Digits(individual_digits) then ByteLevel)
    first isolate every \\p{N} character. With this vocabulary that only shows on non-ASCII
    numerics after a space (" ½" is ĠÂ + ½ for transformers, Ġ + Â½ for llama.cpp).
    """
    fixed = Tokenizer.from_str(load_reference_smollm2().backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return fixed


@requires_smollm2
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smollm2_gguf_encodes_like_transformers(add_special_tokens):
    ours, ref = load_smollm2(), load_reference_smollm2()
    for text in CORPUS:
        if not has_non_ascii_numeric(text):
            assert ours.encode(text, add_special_tokens) == ref.encode(text, add_special_tokens=add_special_tokens), (
                text
            )
        fixed = load_reference_smollm2_digits().encode(text, add_special_tokens=add_special_tokens).ids
        assert ours.encode(text, add_special_tokens) == fixed, text
    assert any(has_non_ascii_numeric(text) for text in CORPUS)


@requires_smollm2
def test_smollm2_gguf_numeric_split_differs_from_transformers_on_purpose():
    ours, ref = load_smollm2(), load_reference_smollm2()
    assert [ours.id_to_token(i) for i in ours.encode(" ½")] == ["Ġ", "Â½"]
    assert ref.convert_ids_to_tokens(ref.encode(" ½")) == ["ĠÂ", "½"]


@requires_smollm2
def test_smollm2_gguf_decodes_like_transformers():
    ours, ref = load_smollm2(), load_reference_smollm2()
    for text in CORPUS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in ours.decode(ours.encode(CORPUS[10]), skip_special_tokens=True)


@requires_smollm2
def test_smollm2_gguf_metadata_matches_transformers():
    ours, ref = load_smollm2(), load_reference_smollm2()
    assert ours.backend == "gguf"
    assert (ours.bos_token, ours.bos_token_id) == (ref.bos_token, ref.bos_token_id) == ("<|im_start|>", 1)
    assert (ours.eos_token, ours.eos_token_ids) == (ref.eos_token, [ref.eos_token_id]) == ("<|im_end|>", [2])
    assert ours.vocab_size == len(ref) == 49152
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items()}
    assert ours.special_tokens["<|im_start|>"] == 1 and len(ours.special_tokens) == 17
    assert ours.chat_template == ref.chat_template and "<|im_start|>" in ours.chat_template
    assert ours.add_bos_token is False and ours.encode("Hi")[0] != ours.bos_token_id
    assert [ours.id_to_token(i) for i in (0, 1, 2)] == ref.convert_ids_to_tokens([0, 1, 2])


@requires_smollm2
def test_smollm2_gguf_splits_digits_like_llama_cpp():
    # llama.cpp's "smollm" pre-tokenizer isolates every digit first (transformers skips that step,
    # which only matters for a vocabulary with multi-digit merges; see the synthetic test below).
    pieces = [p for p, _ in load_smollm2().tokenizer.pre_tokenizer.pre_tokenize_str("in 2024")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4"]


@requires_smollm2
def test_gguf_metadata_passed_in_and_folder_path():
    import mlx.core as mx

    path = find_smollm2_gguf()
    _, metadata = mx.load(str(path), return_metadata=True)
    from_meta = load_tokenizer(path, kind="gguf", gguf_metadata=metadata)
    from_folder = load_tokenizer(path.parent)  # the package folder holds exactly one .gguf
    assert from_folder.backend == "gguf"
    for text in CORPUS[:4]:
        assert from_meta.encode(text) == from_folder.encode(text) == load_smollm2().encode(text)


@requires_smollm2
def test_gguf_unsupported_metadata_errors():
    import mlx.core as mx

    path = find_smollm2_gguf()
    _, metadata = mx.load(str(path), return_metadata=True)
    with pytest.raises(MlxcelError, match="tokenizer.ggml.pre='mystery'"):
        load_tokenizer(path, gguf_metadata={**metadata, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(MlxcelError, match="tokenizer.ggml.model='bert' is not supported yet"):
        load_tokenizer(path, gguf_metadata={**metadata, "tokenizer.ggml.model": "bert"})
    without = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(MlxcelError, match="no tokenizer"):
        load_tokenizer(path, gguf_metadata=without)


# --- synthetic GGUFs: each pre-tokenizer name vs transformers' GGUF conversion ------------------

PRE_TEXTS = [
    "Hello WORLD it's 2024-11-29, 1234567 cats!!\n\n\n  x\t\ty",
    "DON'T I'LL we'Re",
    "日本語 한국어 😀👍🏽 e\u0301",
    "<|im_start|>user\n hi 42<|im_end|>",
]


@pytest.fixture(scope="module")
def gguf_vocab():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(HF_TRAINING_TEXT + PRE_TEXTS * 10 + ["1234567 2024 11 29 42"] * 10, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def write_gguf(path: Path, tokens: list[str], merges: list[str], pre: str, add_bos: bool) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre,add_bos", [("gpt-2", False), ("llama-bpe", True), ("qwen2", False)])
def test_synthetic_gguf_pre_tokenizers_match_transformers(tmp_path, gguf_vocab, pre, add_bos):
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / f"{pre}.gguf", *gguf_vocab, pre=pre, add_bos=add_bos)
    ours = load_tokenizer(path)
    ref = transformers.TokenizersBackend.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in PRE_TEXTS + CORPUS:
        assert ours.encode(text) == ref.encode(text), (pre, text)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    assert ours.add_bos_token is add_bos and (ours.encode("x")[0] == 1) is add_bos


def test_synthetic_gguf_smollm_isolates_digits(tmp_path, gguf_vocab):
    ours = load_tokenizer(write_gguf(tmp_path / "s.gguf", *gguf_vocab, pre="smollm", add_bos=False))
    gpt2 = load_tokenizer(write_gguf(tmp_path / "g.gguf", *gguf_vocab, pre="gpt-2", add_bos=False))
    digits = [ours.id_to_token(i) for i in ours.encode(" 1234567")]
    assert digits == ["Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert len(gpt2.encode(" 1234567")) < len(digits)  # this vocabulary has digit merges
    assert ours.decode(ours.encode(CORPUS[1])) == CORPUS[1]


# --- HF folders vs transformers -----------------------------------------------------------------

BOS_CASES = {
    # name: (tokenizer.json post-processor, tokenizer_config.json keys, adds bos, adds eos).
    # transformers 5 drops the config's add_bos_token/add_eos_token when tokenizer.json exists.
    "json_adds_bos": ("bos", {}, True, False),
    "json_no_post_processor": (None, {}, False, False),
    "json_bytelevel": ("bytelevel", {}, False, False),
    "config_flag_on_ignored": ("bytelevel", {"add_bos_token": True}, False, False),
    "config_flag_off_ignored": ("bos", {"add_bos_token": False}, True, False),
    "config_bos_eos_flags_ignored": (None, {"add_bos_token": True, "add_eos_token": True}, False, False),
}


@pytest.mark.parametrize("case", sorted(BOS_CASES))
def test_hf_folder_encodes_like_transformers(tmp_path, case):
    post, config, adds_bos, adds_eos = BOS_CASES[case]
    ours, ref = load_hf_pair(str(make_hf_folder(tmp_path, post=post, config=config)))
    assert ours.backend == "hf"
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, add_special_tokens=special), (case, text)
    ids = ours.encode("hello world")
    assert (ids[0] == ref.bos_token_id) is adds_bos and (ids[-1] == ref.eos_token_id) is adds_eos
    assert ours.add_bos_token is adds_bos
    assert ours.encode("hello world", add_special_tokens=False) == ids[int(adds_bos) : len(ids) - int(adds_eos)]


def test_hf_folder_decodes_and_describes_like_transformers(hf_folder):
    ours, ref = load_hf_pair(str(hf_folder))
    for text in CORPUS:
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert (ours.bos_token, ours.bos_token_id, ours.eos_token) == (ref.bos_token, ref.bos_token_id, ref.eos_token)
    assert ours.eos_token_ids == [ref.eos_token_id]
    assert ours.vocab_size == len(ref)
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items()}
    assert ours.chat_template == ref.chat_template == HF_TEMPLATE


@pytest.mark.parametrize("placement", ["config", "list"])
def test_hf_chat_template_sources(tmp_path, placement):
    ours, ref = load_hf_pair(str(make_hf_folder(tmp_path, template=placement)))
    expected = ref.chat_template if isinstance(ref.chat_template, str) else ref.chat_template["default"]
    assert ours.chat_template == expected == HF_TEMPLATE


def test_hf_jinja_file_wins_over_config(tmp_path):
    folder = make_hf_folder(tmp_path, config={"chat_template": "CONFIG TEMPLATE"})
    ours, ref = load_hf_pair(str(folder))
    assert ours.chat_template == ref.chat_template == HF_TEMPLATE


def test_hf_added_token_dict_and_special_tokens_map(tmp_path):
    # bos/eos given as AddedToken dicts, eos only in special_tokens_map.json
    folder = make_hf_folder(
        tmp_path, config={"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": None}
    )
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    ours, ref = load_hf_pair(str(folder))
    assert (ours.bos_token, ours.eos_token, ours.eos_token_ids) == (ref.bos_token, ref.eos_token, [ref.eos_token_id])
    assert (ours.eos_token, ours.eos_token_ids) == ("<|im_end|>", [HF_SPECIALS.index("<|im_end|>")])


def test_hf_config_added_tokens_match_transformers(tmp_path):
    # added_tokens_decoder entries missing from tokenizer.json, a named special that is a plain
    # vocabulary word ("hello" as pad), and additional_special_tokens: transformers adds them all.
    def added(content: str, special: bool) -> dict:
        return {"__type": "AddedToken", "content": content, "special": special, "normalized": False}

    config = {
        "added_tokens_decoder": {"400": added("<think>", False), "401": added("<tool>", True)},
        "pad_token": "hello",
        "additional_special_tokens": ["<extra>"],
    }
    ours, ref = load_hf_pair(str(make_hf_folder(tmp_path, config=config)))
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items()}
    assert {"<think>", "<tool>", "<extra>", "hello"} <= set(ours.special_tokens)
    assert ours.vocab_size == len(ref)
    for text in ["a<think>b<tool>c hello <extra>", "hello world", *CORPUS[:3]]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode("a<think>b<tool>"), skip_special_tokens=True) == "a<think>b"


# --- detection and errors -----------------------------------------------------------------------


def test_detect_kind(tmp_path):
    for name, kind in [("tokenizer.model", "sentencepiece"), ("qwen.tiktoken", "tiktoken"), ("tokenizer.json", "hf")]:
        folder = tmp_path / kind
        folder.mkdir()
        (folder / name).write_text("")
        assert detect_tokenizer_kind(folder) == detect_tokenizer_kind(folder / name) == kind
    llama3 = tmp_path / "llama3"
    llama3.mkdir()
    (llama3 / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")  # tiktoken ranks under SentencePiece's name
    assert detect_tokenizer_kind(llama3) == "tiktoken"
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert detect_tokenizer_kind(gguf_file) == "gguf"


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(MlxcelError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(MlxcelError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)
    for expected in ("tokenizer.json", "tokenizer.model", "*.tiktoken", ".gguf"):
        assert expected in str(info.value)


def test_unknown_kind_and_missing_files(tmp_path):
    with pytest.raises(MlxcelError, match="tokenizer.kind=bpe: unknown kind"):
        load_tokenizer(tmp_path, kind="bpe")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(MlxcelError, match="tokenizer.model: cannot read the SentencePiece model"):
        load_tokenizer(tmp_path)
    with pytest.raises(MlxcelError, match="tokenizer.model: the ranks file is empty"):
        load_tokenizer(tmp_path, kind="tiktoken")  # a tokenizer.model may hold tiktoken ranks (Llama 3)
    with pytest.raises(MlxcelError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path, kind="hf")
    with pytest.raises(MlxcelError, match="exactly one .gguf"):
        load_tokenizer(tmp_path, kind="gguf")


def test_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(MlxcelError, match="cannot read the tokenizer"):
        load_tokenizer(tmp_path)
