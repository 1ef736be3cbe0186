"""Chat template rendering and prompt building against transformers' apply_chat_template."""

from __future__ import annotations

import datetime
import json

import pytest

from mlxcel.errors import MlxcelError
from mlxcel.template import (
    PromptTokens,
    build_prompt,
    load_template_source,
    render_prompt,
)
from mlxcel.tokenizer import load_tokenizer
from tests.helpers import (
    HF_TEMPLATE,
    load_hf_pair,
    load_reference_smollm2,
    load_smollm2,
    make_hf_folder,
    requires_smollm2,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋 日本語"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "  Tell me a joke.\n"},
    ],
]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    return load_hf_pair(str(make_hf_folder(tmp_path_factory.mktemp("tpl"))))


def reference_ids(ref, messages, **kwargs) -> list[int]:
    out = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_against_transformers(ours, ref, messages):
    source = load_template_source(ours)
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert render_prompt(source, messages, ours, add_generation_prompt=gen) == expected
    prompt = build_prompt(ours, messages, source)
    assert prompt.text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.token_ids == reference_ids(ref, messages)
    history = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    history = list(history["input_ids"] if hasattr(history, "keys") else history)
    assert 0 < prompt.history_tokens == len(history) < len(prompt.token_ids)
    assert prompt.token_ids[: prompt.history_tokens] == history


@requires_smollm2
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(index):
    check_against_transformers(load_smollm2(), load_reference_smollm2(), CONVERSATIONS[index])


@requires_smollm2
def test_smollm2_prompt_shape():
    tok = load_smollm2()
    prompt = build_prompt(tok, CONVERSATIONS[0], load_template_source(tok))
    assert prompt.text.startswith("<|im_start|>system\n") and prompt.text.endswith("<|im_start|>assistant\n")
    assert prompt.token_ids[0] == tok.special_tokens["<|im_start|>"]
    assert tok.decode(prompt.token_ids[prompt.history_tokens :]) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_hf_template_matches_transformers(hf_pair, index):
    ours, ref = hf_pair
    check_against_transformers(ours, ref, CONVERSATIONS[index])
    # the template writes bos itself, and encoding adds none on top (the folder's post-processor would)
    assert build_prompt(ours, CONVERSATIONS[index], load_template_source(ours)).token_ids.count(ours.bos_token_id) == 1


def test_hf_tojson_strftime_and_extra_variables_match_transformers(hf_pair):
    ours, ref = hf_pair
    source = (
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ eos_token }}|{{ tools_note }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') }}"
    )
    messages = [{"role": "user", "content": "<b>&'\"</b> é 日本 😀"}, {"role": "assistant", "content": "ok"}]
    expected = ref.apply_chat_template(messages, chat_template=source, tokenize=False, tools_note="T")
    assert render_prompt(source, messages, ours, add_generation_prompt=False, tools_note="T") == expected
    assert "<b>&'\\\"</b> é 日本 😀" in expected and expected.endswith(str(datetime.date.today().year))


def test_history_boundary_zero_when_not_a_prefix(hf_pair):
    ours, _ = hf_pair
    source = "{% if add_generation_prompt %}A:{% else %}B:{% endif %}{{ messages[0].content }}"
    prompt = build_prompt(ours, CONVERSATIONS[0], source)
    assert prompt.text == "A:" + CONVERSATIONS[0][0]["content"]
    assert prompt.history_tokens == 0


def test_history_boundary_zero_when_tokens_merge_across_it(hf_pair):
    """The history text is a prefix of the prompt text, but BPE merges across the boundary
    ("hel" + "lo" -> "hello"): the history ids are not a prefix, so there is no history piece."""
    ours, _ = hf_pair
    source = "{{ messages[0].content }}{% if add_generation_prompt %}lo world{% endif %}"
    prompt = build_prompt(ours, [{"role": "user", "content": "hel"}], source)
    history = ours.encode("hel", add_special_tokens=False)
    assert prompt.text == "hello world" and prompt.token_ids[: len(history)] != history
    assert prompt.history_tokens == 0


def test_raw_completion_without_template(hf_pair):
    ours, ref = hf_pair
    text = "Once upon a time"
    prompt = build_prompt(ours, [{"role": "user", "content": text}], None, enabled=False)
    assert prompt == PromptTokens(text=text, token_ids=ref.encode(text), history_tokens=0)
    assert prompt.token_ids[0] == ours.bos_token_id  # this folder's tokenizer adds bos
    two = build_prompt(ours, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, enabled=False)
    assert two.text == "a\nb"
    with pytest.raises(MlxcelError, match="template=none renders user messages only.*system"):
        build_prompt(ours, CONVERSATIONS[1], None, enabled=False)


def test_overrides(hf_pair, tmp_path):
    ours, _ = hf_pair
    assert load_template_source(ours) == HF_TEMPLATE
    assert load_template_source(ours, text="{{ messages[0].content }}!") == "{{ messages[0].content }}!"
    file = tmp_path / "t.jinja"
    file.write_text("FILE {{ messages[0].content }}")
    source = load_template_source(ours, file=file)
    assert render_prompt(source, CONVERSATIONS[0], ours) == "FILE " + CONVERSATIONS[0][0]["content"]
    with pytest.raises(MlxcelError, match="template.file=.*missing.jinja: no such file"):
        load_template_source(ours, file=tmp_path / "missing.jinja")
    with pytest.raises(MlxcelError, match="both set"):
        load_template_source(ours, text="x", file=file)


def test_render_errors_name_the_source(hf_pair):
    ours, _ = hf_pair
    with pytest.raises(MlxcelError, match=r"template.text: invalid Jinja template at line 2: .*endfor"):
        render_prompt(load_template_source(ours, text="ok\n{% for m in messages %}"), CONVERSATIONS[0], ours)
    with pytest.raises(
        MlxcelError, match="tokenizer's chat template: the template refused this conversation: unknown role tool"
    ):
        render_prompt(load_template_source(ours), [{"role": "tool", "content": "x"}], ours)
    with pytest.raises(MlxcelError, match="template.text: failed to render at line 2: UndefinedError"):
        render_prompt(load_template_source(ours, text="ok\n{{ messages[5].content.x }}"), CONVERSATIONS[0], ours)


def test_template_file_syntax_error_names_file_and_line(hf_pair, tmp_path):
    ours, _ = hf_pair
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}")
    with pytest.raises(MlxcelError, match=r"template.file=.*broken.jinja: invalid Jinja template at line 3: "):
        render_prompt(load_template_source(ours, file=path), CONVERSATIONS[0], ours)


@pytest.mark.parametrize(
    "messages,expected",
    [
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            r"message 1 \(counting from 0\): unknown role 'bot'; use one of system, user",
        ),
        ([{"role": "user"}], r"message 0 \(counting from 0\) \(role 'user'\): missing 'content'"),
        ([{"role": "user", "content": "a"}, "hello"], r"message 1 \(counting from 0\): must be a mapping"),
        ([], "the conversation has no messages"),
    ],
)
def test_bad_messages_name_the_index(hf_pair, messages, expected):
    ours, _ = hf_pair
    with pytest.raises(MlxcelError, match=expected):
        build_prompt(ours, messages, load_template_source(ours))


def test_named_templates_and_builtins(tmp_path):
    """Named templates as transformers picks them: tool_use when tools are given, else default,
    or by name; a built-in kind replaces the model's template."""
    ours, ref = load_hf_pair(str(make_hf_folder(tmp_path, template="list")))
    assert set(ours.chat_templates) == {"default", "tool_use"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert load_template_source(ours) == ref.get_chat_template() == HF_TEMPLATE
    assert load_template_source(ours, tools=tools) == ref.get_chat_template(tools=tools) == "TOOLS"
    assert load_template_source(ours, name="tool_use") == ref.get_chat_template("tool_use")
    with pytest.raises(
        MlxcelError,
        match=r"template.name: the model has no chat template of that name "
        r"\(it has: default, tool_use\) \(got 'nope'\)",
    ):
        load_template_source(ours, name="nope")
    chatml = load_template_source(ours, kind="chatml")
    assert render_prompt(chatml, CONVERSATIONS[0], ours) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_json_file(tmp_path):
    """chat_template.json (a processor's file) between the config's and chat_template.jinja."""
    folder = make_hf_folder(tmp_path, template="config")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ messages[0].content }}"}))
    ours, _ = load_hf_pair(str(folder))
    assert ours.chat_template == "JSON {{ messages[0].content }}"
    (folder / "chat_template.jinja").write_text("JINJA")
    assert load_tokenizer(folder).chat_template == "JINJA"


def test_sandbox_blocks_attribute_escapes(hf_pair):
    ours, _ = hf_pair
    with pytest.raises(MlxcelError, match="SecurityError"):
        render_prompt("{{ messages.__class__.__subclasses__() }}", CONVERSATIONS[0], ours)
    with pytest.raises(MlxcelError, match="SecurityError"):
        render_prompt("{% set x = messages.append(1) %}", CONVERSATIONS[0], ours)


def test_no_template_available(tmp_path):
    ours, ref = load_hf_pair(str(make_hf_folder(tmp_path, template="none")))
    assert ours.chat_template is None and ref.chat_template is None
    assert load_template_source(ours) is None
    with pytest.raises(
        MlxcelError, match="no chat template.*template=none.*template=chatml.*template.text=.*template.file="
    ):
        build_prompt(ours, CONVERSATIONS[0], load_template_source(ours))
