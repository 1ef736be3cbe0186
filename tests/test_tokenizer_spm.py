"""SentencePiece tokenizers (tokenizer.model, GGUF `llama` vocabularies) against sentencepiece and transformers.

The models are mistral-common's v1, v3 and v7 SentencePiece files (tests/data/sentencepiece,
Apache-2.0): v1 is Mistral 7B's 32000-piece vocabulary, v3/v7 add 750/748 control pieces such
as [INST] and [TOOL_CALLS].
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path

import pytest
import sentencepiece as spm

from mlxcel.errors import MlxcelError
from mlxcel.tokenizer import load_tokenizer
from tests.gguf_spm_fixtures import write_spm_gguf
from tests.helpers import CORPUS, check_stream

DATA = Path(__file__).parent / "data" / "sentencepiece"
VERSIONS = ("v1", "v3", "v7")
SPECIAL_TEXTS = [
    "<s>Hello</s>world",
    "text</s>glued<s> and </s> or <s>",
    "[INST] What is 2+2? [/INST] 4</s>[INST]Again[/INST]",
    '[AVAILABLE_TOOLS][{"name": "f"}][/AVAILABLE_TOOLS][INST]call f[/INST][TOOL_CALLS]',
    "a<s><s>b [INST][INST] c",
]


def model_path(version: str) -> Path:
    return DATA / f"mistral_{version}.model"


@cache
def load_processor(version: str, dummy_prefix: bool = True) -> spm.SentencePieceProcessor:
    if dummy_prefix:
        return spm.SentencePieceProcessor(model_file=str(model_path(version)))
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2", reason="needs protobuf")
    proto = pb.ModelProto()
    proto.ParseFromString(model_path(version).read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor


def make_folder(folder: Path, version: str, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_path(version), folder / "tokenizer.model")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def specials_of(version: str) -> list[str]:
    sp = load_processor(version)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)]


def encode_segments(version: str, text: str, prefix_every_segment: bool) -> list[int]:
    """The reference split, written independently: control pieces cut the text, each plain part
    goes to SentencePiece (llama.cpp's SPM path); with prefix_every_segment false only the first
    part keeps SentencePiece's dummy-prefix space."""
    sp = load_processor(version)
    controls = sorted(specials_of(version), key=len, reverse=True)
    ids: list[int] = []
    for index, part in enumerate(re.split("(" + "|".join(map(re.escape, controls)) + ")", text)):
        if part in controls:
            ids.append(sp.piece_to_id(part))
        elif part and (prefix_every_segment or index == 0):
            ids += sp.encode(part)
        elif part:
            ids += load_processor(version, dummy_prefix=False).encode(part)
    return ids


@pytest.mark.parametrize("version", VERSIONS)
def test_plain_text_equals_sentencepiece(tmp_path, version):
    ours, sp = load_tokenizer(make_folder(tmp_path, version)), load_processor(version)
    assert ours.backend == "sentencepiece"
    plain = [text for text in CORPUS if not any(s in text for s in ("<s>", "</s>"))]
    for text in plain:
        ids = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [sp.bos_id()] + ids  # bos by default, as llama.cpp and mistral-common
        assert ours.decode(ids) == sp.decode(ids) == text, text
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, [2], sp.get_piece_size())
    assert len(ours.special_tokens) == len(specials_of(version))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("legacy", [True, False])
def test_special_tokens_cut_the_text_before_sentencepiece(tmp_path, version, legacy):
    config = {"legacy": legacy} if not legacy else {}  # absent means the llama.cpp behaviour
    ours = load_tokenizer(make_folder(tmp_path, version, config))
    for text in SPECIAL_TEXTS + CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == encode_segments(version, text, prefix_every_segment=legacy), text
        assert ours.decode(ids) == text, text  # the dummy space is stripped exactly where it was added
        check_stream(ours, ids)
    if version != "v1":
        assert ours.encode("[INST]x", add_special_tokens=False)[0] == ours.special_tokens["[INST]"] == 3


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_special_tokens_match_transformers(tmp_path, version):
    """transformers' LlamaTokenizer (converted from the same .model) with legacy=false and bos/eos
    flags from the config. Its BPE conversion splits runs of spaces differently from
    SentencePiece itself, so only texts without them are compared here."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf", reason="transformers converts .model files with protobuf")
    config = {"legacy": False, "add_bos_token": True, "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>"}
    folder = make_folder(tmp_path, version, config)
    ours = load_tokenizer(folder)
    ref = transformers.LlamaTokenizer.from_pretrained(str(folder), legacy=False, add_bos_token=True, add_eos_token=True)
    texts = [t for t in SPECIAL_TEXTS + CORPUS if "  " not in t and "\n" not in t and "\t" not in t and t == t.strip()]
    assert len(texts) >= 10
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


def test_config_added_tokens_and_flags(tmp_path):
    # A fine-tune that adds ChatML tokens past the SentencePiece vocabulary, and named tokens.
    def added(content: str) -> dict:
        return {"content": content, "special": True, "normalized": False}

    config = {
        "added_tokens_decoder": {
            "32000": added("<|im_start|>"),
            "32001": added("<|im_end|>"),
            "32002": {**added("<think>"), "special": False},  # kept by skip_special_tokens
        },
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
    }
    ours = load_tokenizer(make_folder(tmp_path, "v1", config))
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 32000 and ids[-1] == 32001 and ours.eos_token_ids == [32001]
    assert ids[1:-1] == load_processor("v1").encode("user\nHi")
    assert ours.vocab_size == 32003 and ours.id_to_token(32001) == "<|im_end|>"
    assert ours.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert ours.decode(ids, skip_special_tokens=True) == "user\nHi"
    think = ours.encode("<think>x</s>", add_special_tokens=False)
    assert think[0] == 32002 and ours.decode(think, skip_special_tokens=True) == "<think>x"
    assert (ours.chat_template, ours.chat_templates["tool_use"]) == ("D", "T")
    # longest first: a special token that contains another one wins
    config["added_tokens_decoder"]["32003"] = added("<|im_start|>user")
    longest = load_tokenizer(make_folder(tmp_path / "l", "v1", config))
    assert longest.encode("<|im_start|>user\nHi")[0] == 32003


@pytest.mark.parametrize("version", ["v1", "v7"])
def test_byte_fallback_streams_like_one_shot(tmp_path, version):
    ours = load_tokenizer(make_folder(tmp_path, version))
    for text in CORPUS + SPECIAL_TEXTS:
        check_stream(ours, ours.encode(text))
    rare = ours.encode("𓀀🧿ꙮ", add_special_tokens=False)
    assert sum(load_processor(version).is_byte(i) for i in rare) == 11  # byte-fallback pieces
    check_stream(ours, rare)


# --- GGUF llama vocabularies: the same pieces written into a GGUF (llama.cpp's ids: test_tokenizer_gguf_spm.py)

TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"


@pytest.mark.parametrize("version", VERSIONS)
def test_gguf_llama_vocab_equals_sentencepiece(tmp_path, version):
    pytest.importorskip("gguf")
    ours = load_tokenizer(write_spm_gguf(tmp_path / "m.gguf", version, chat_template=TEMPLATE))
    sp = load_processor(version)
    assert ours.backend == "gguf" and ours.vocab_size == sp.get_piece_size()
    for text in CORPUS + SPECIAL_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == encode_segments(version, text, prefix_every_segment=True), text
        assert ours.decode(ids) == text
    assert ours.encode("Hi")[0] == 1 and ours.eos_token_ids == [2]
    assert ours.chat_template.startswith("{{ bos_token }}")
    for text in CORPUS[:8]:
        check_stream(ours, ours.encode(text))


def test_gguf_llama_vocab_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_spm_gguf(tmp_path / "m.gguf", "v1")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(path)
    # transformers' conversion splits runs of spaces differently from SentencePiece: left out
    texts = [t for t in CORPUS if "  " not in t and "\n" not in t and "<" not in t and t == t.strip()]
    assert len(texts) >= 8
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_gguf_llama_without_unknown_token(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["a", "b"])
    writer.add_token_scores([0.0, 0.0])
    writer.add_token_types([1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MlxcelError, match="no unknown token"):
        load_tokenizer(tmp_path / "bad.gguf")


def test_corrupt_model_file(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01 definitely not a protobuf" * 10)
    with pytest.raises(MlxcelError, match=r"tokenizer.model: cannot read the SentencePiece model .*corrupt"):
        load_tokenizer(tmp_path)
    with pytest.raises(MlxcelError, match="has no tokenizer.model"):
        load_tokenizer(tmp_path.parent, kind="sentencepiece")


def test_runner_dry_run_with_a_forced_tokenizer_and_builtin_template(tmp_path, tiny_llama):
    """The config surface end to end: tokenizer=sentencepiece with tokenizer.path, template=mistral,
    prompt.system; the dry run's prompt ids are SentencePiece's with [INST] matched whole."""
    from mlxcel import load_config
    from mlxcel.runner import run

    folder = make_folder(tmp_path / "tok", "v3")
    cfg = load_config(
        {"model": {"path": str(tiny_llama)}},
        overrides=[
            "tokenizer=sentencepiece",
            f"tokenizer.path={folder}",
            "template=mistral",
            "prompt.text=Hi 😀",
            "prompt.system=Be brief.",
            "runner.dry_run=true",
        ],
    )
    assert (cfg.tokenizer.kind, cfg.template.kind) == ("sentencepiece", "mistral")
    result = run(cfg, tmp_path / "out", stream=None, log=None)
    row = json.loads((result.out_dir / "prompts.jsonl").read_text())
    assert row["prompt_text"] == "<s> [INST] Be brief.\n\nHi 😀 [/INST]"
    expected = [1] + encode_segments("v3", " ", True) + [3] + encode_segments("v3", " Be brief.\n\nHi 😀 ", True) + [4]
    assert row["prompt_token_ids"] == expected
    assert row["history_tokens"] == len(expected)  # this template adds no generation prompt


def test_run_without_a_template_fails_once_with_the_fix(tmp_path, tiny_llama):
    from mlxcel import load_config
    from mlxcel.errors import MlxcelError as Error
    from mlxcel.runner import run

    folder = make_folder(tmp_path / "tok", "v1")  # a bare tokenizer.model: no chat template
    cfg = load_config(
        {"model": {"path": str(tiny_llama)}}, overrides=[f"tokenizer.path={folder}", "runner.dry_run=true"]
    )
    with pytest.raises(
        Error, match=r"template=auto: the tokenizer of .*tok has no chat template; set template=none .*template=chatml"
    ):
        run(cfg, tmp_path / "out", stream=None, log=None)
