"""Image inputs in prompts: config forms, and images given to a text-only model (one error row,
the other rows complete)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mlxcel.config import Message, PromptConfig, PromptRow
from tests.helpers import by_key, job_args, read_rows, run_cli, write_rows


def test_images_go_before_the_text_of_the_user_turn():
    prompt = PromptConfig(text="Describe it.", images=["a.jpg", "b.png"], system="Be brief.")
    assert prompt.to_messages() == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "a.jpg"},
                {"type": "image", "path": "b.png"},
                {"type": "text", "text": "Describe it."},
            ],
        },
    ]
    assert PromptRow(prompt="Hi", images=["a.jpg"]).to_messages()[0]["content"][0] == {"type": "image", "path": "a.jpg"}


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: PromptConfig(images=["a.jpg"], messages=[{"role": "user", "content": "hi"}]),
            "prompt.images go with prompt.text",
        ),
        (
            lambda: PromptRow(messages=[{"role": "user", "content": "hi"}], images=["a.jpg"]),
            "'images' goes with 'prompt'",
        ),
        (lambda: Message(role="user", content=[{"type": "image", "text": "x"}]), "an image part needs 'path'"),
        (
            lambda: Message(role="user", content=[{"type": "text", "text": "x", "path": "a.jpg"}]),
            "a text part takes 'text', not 'path'",
        ),
        (lambda: Message(role="user", content=[]), "must not be an empty list"),
        (lambda: Message(role="user", content=[{"type": "video", "path": "a.mp4"}]), "type"),
    ],
)
def test_bad_image_inputs_are_config_errors(make, message):
    with pytest.raises(ValidationError, match=message):
        make()


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_text_only_model_given_an_image_fails_that_row_only(tmp_path, tiny_llama, photo_path):
    rows = [
        {"id": "picture", "prompt": "What is in it?", "images": [str(photo_path)]},
        {
            "id": "parts",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
            ],
        },
        {"id": "plain", "prompt": "Hello there"},
    ]
    result = run_cli(tmp_path, *job_args(tiny_llama, write_rows(tmp_path / "rows.jsonl", rows)))
    assert result.returncode == 0, result.stderr
    got = by_key(read_rows(tmp_path / "run"))
    error = got[("picture", 0)]["error"]
    assert got[("picture", 0)]["finish_reason"] == "error"
    assert "1 image(s) given" in error and str(photo_path) in error and "text-only model" in error
    # text parts render as the same text; both text rows generate
    assert got[("parts", 0)]["prompt_token_ids"] == got[("plain", 0)]["prompt_token_ids"]
    assert got[("parts", 0)]["token_ids"] == got[("plain", 0)]["token_ids"] and len(got[("plain", 0)]["token_ids"]) == 6
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 0 and stats["finish_reasons"] == {"error": 1, "length": 2}


@pytest.mark.parametrize(
    "part, path, message",
    [
        ({"type": "image"}, "prompt.messages.0.content.1.path", "an image part needs 'path'"),
        ({"type": "imgae", "path": "a.jpg"}, "prompt.messages.0.content.1.type", "must be one of: text, image"),
    ],
)
def test_a_bad_part_is_one_issue_at_its_own_path(part, path, message):
    """Only the part's own error, not also "content must be a string" from the text form."""
    from mlxcel.config import format_errors

    with pytest.raises(ValidationError) as caught:
        Message(role="user", content=[{"type": "text", "text": "hi"}, part])
    issues = format_errors(Message, caught.value.errors(), ("prompt", "messages", 0))
    assert [(i.path, i.message) for i in issues] == [(path, message)]
