"""Real chat templates (tests/data/templates, SmolLM2's from its GGUF, the built-ins) rendered by
mlxcel and by transformers' apply_chat_template on the same template string: multi-turn,
system-prompt and tool-call conversations, with and without the generation prompt."""

from __future__ import annotations

import pytest

from mlxcel.errors import MlxcelError
from mlxcel.template import (
    BUILTIN_TEMPLATES,
    TemplateSource,
    build_prompt,
    render_prompt,
)
from tests.helpers import (
    TEMPLATES,
    TOOL_CALL,
    TOOLS,
    WEATHER_TOOL,
    load_hf_pair,
    load_smollm2,
    make_hf_folder,
    requires_smollm2,
)

USER = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = [
    {"role": "system", "content": "You are terse. Answer in one word."},
    {"role": "user", "content": "Capital of 日本? 🗾"},
]
MULTI = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "  Tell me a joke.\n"},
    {"role": "assistant", "content": "Why did the <b>chicken</b> cross the road?"},
    {"role": "user", "content": "Why?"},
]
CONVERSATIONS = {"user": USER, "system": SYSTEM, "multi": MULTI, "tools": TOOLS}
# Conversations each template supports (Gemma has no system role, Phi-3 and the
# built-ins no tool calls; the refusals are tested below).
CASES = {
    "llama3.2": ["user", "system", "multi", "tools"],
    "qwen2.5": ["user", "system", "multi", "tools"],
    "gemma2": ["user", "multi"],
    "mistral_v3": ["user", "system", "multi", "tools"],
    "phi3": ["user", "system", "multi"],
    "indented": ["user", "system", "multi"],
}


def read_template(name: str) -> TemplateSource:
    return TemplateSource((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), f"{name}.jinja")


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    return load_hf_pair(str(make_hf_folder(tmp_path_factory.mktemp("real_tpl"))))


def check_renders_like_transformers(ours, ref, source: str, messages: list[dict], **kwargs) -> list[str]:
    rendered = []
    for gen in (True, False):
        expected = ref.apply_chat_template(
            messages, chat_template=str(source), tokenize=False, add_generation_prompt=gen, **kwargs
        )
        got = render_prompt(source, messages, ours, add_generation_prompt=gen, **kwargs)
        assert got == expected, (gen, messages)
        rendered.append(got)
    return rendered


@pytest.mark.parametrize("name,conversation", [(n, c) for n, cs in CASES.items() for c in cs])
def test_real_template_matches_transformers(hf_pair, name, conversation):
    ours, ref = hf_pair
    messages = CONVERSATIONS[conversation]
    kwargs = {"tools": [WEATHER_TOOL]} if conversation == "tools" else {}
    with_prompt, without = check_renders_like_transformers(ours, ref, read_template(name), messages, **kwargs)
    assert messages[-1].get("content", "Paris").strip()[:8] in with_prompt or conversation == "tools"
    if conversation == "tools":
        assert "get_weather" in with_prompt and "Paris" in with_prompt
    # The history boundary: the ids of the rendering without the generation prompt, when they
    # prefix the prompt's ids. Otherwise there is no history piece (0): Phi-3 ends the history
    # rendering with eos (not a prefix of the prompt text); in indented.jinja the text is a
    # prefix but BPE merges the newline with the next line's indentation across it.
    prompt = build_prompt(ours, messages, read_template(name), kwargs=kwargs)
    history = ours.encode(without, add_special_tokens=False)
    assert with_prompt.startswith(without) is (name != "phi3")
    if name in ("phi3", "indented"):
        assert prompt.token_ids[: len(history)] != history and prompt.history_tokens == 0
    else:
        assert prompt.token_ids[: prompt.history_tokens] == history and 0 < prompt.history_tokens == len(history)


@pytest.mark.parametrize("kind", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("conversation", ["user", "system", "multi"])
def test_builtin_templates_match_transformers(hf_pair, kind, conversation):
    ours, ref = hf_pair
    source = TemplateSource(BUILTIN_TEMPLATES[kind], kind)
    with_prompt, without = check_renders_like_transformers(ours, ref, source, CONVERSATIONS[conversation])
    assert with_prompt.startswith(without)
    assert CONVERSATIONS[conversation][-1]["content"].strip() in with_prompt
    if conversation == "system":
        assert CONVERSATIONS["system"][0]["content"] in with_prompt


@requires_smollm2
@pytest.mark.parametrize("conversation", ["user", "system", "multi"])
def test_smollm2_gguf_template_with_the_tiny_reference(hf_pair, conversation):
    _, ref = hf_pair
    tok = load_smollm2()
    source = TemplateSource(tok.chat_template, "SmolLM2 GGUF")
    # bos/eos differ between the two tokenizers: pass SmolLM2's to both
    tokens = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    check_renders_like_transformers(tok, ref, source, CONVERSATIONS[conversation], **tokens)


def test_template_refusals_show_their_message(hf_pair):
    ours, ref = hf_pair
    with pytest.raises(
        MlxcelError, match=r"gemma2.jinja: the template refused this conversation: System role not supported"
    ):
        render_prompt(read_template("gemma2"), SYSTEM, ours)
    with pytest.raises(Exception, match="System role not supported"):
        ref.apply_chat_template(SYSTEM, chat_template=str(read_template("gemma2")), tokenize=False)
    bad_id = [*TOOLS[:2], {"role": "assistant", "tool_calls": [{**TOOL_CALL, "id": "short"}]}]
    with pytest.raises(
        MlxcelError,
        match="mistral_v3.jinja: the template refused this conversation: Tool call IDs should be alphanumeric",
    ):
        render_prompt(read_template("mistral_v3"), bad_id, ours, tools=[WEATHER_TOOL])


def test_template_kwargs_reach_the_template(hf_pair):
    """template.kwargs: an enable_thinking switch like Qwen3's, and documents, as transformers passes them."""
    ours, ref = hf_pair
    source = TemplateSource(
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
        "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[-1].content }}"
        "{% if tools is none %} (no tools){% endif %}",
        "kwargs test",
    )
    documents = [{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "beta"}]
    rendered, _ = check_renders_like_transformers(ours, ref, source, USER, enable_thinking=False, documents=documents)
    assert rendered.startswith("<think>\n\n</think>\n\n[Doc A] alpha\n") and rendered.endswith("(no tools)")
    prompt = build_prompt(ours, USER, source, kwargs={"enable_thinking": True})
    assert prompt.text == USER[0]["content"] + " (no tools)"
