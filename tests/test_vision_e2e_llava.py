"""Tiny LLaVA-1.5 (llava) and LLaVA-NeXT (llava_next) end to end through mlxcel-run: prompt.images
with a llava-hf style chat template (`USER: <image>\\n... ASSISTANT:`), the expanded prompt ids in
generations.jsonl equal to what transformers' LlavaProcessor / LlavaNextProcessor make of the
rendered prompt, greedy tokens equal to transformers' generate on those ids and pixels, the vision
stats, and a mixed JSONL batch (image rows, a text row, a two-image conversation, an unreadable
image) where every good row gives what it gives alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.family_fixtures import save_widened
from tests.helpers import SPECIALS, read_rows, run_cli, write_tiny_tokenizer
from tests.llava_fixtures import CLIP_PROCESSOR, IMAGE, NEXT_PROCESSOR, PINPOINTS, TEXT, VISION, image_runs
from tests.vision_fixtures import assert_batch_rows_equal_their_runs_alone, build_once

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402 -- after importorskip
from transformers.models.llava_next.image_processing_pil_llava_next import (  # noqa: E402 -- after importorskip
    LlavaNextImageProcessorPil,
)

LLAVA_SPECIALS = [*SPECIALS, "<image>"]  # <image> is id 3 == IMAGE, the config's image_token_index
# llava-hf's templates, cut down: `USER: <image>\n... ASSISTANT:`; an image part renders as <image>
# and a newline where it stands, a text part as its text
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n{% else %}{{ m['role'] | upper }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
MAX_TOKENS = 8
# model preset -> (config class, model class, processor class, Pil image processor class, preprocessor_config)
KINDS = {
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", "LlavaProcessor", CLIPImageProcessorPil, CLIP_PROCESSOR),
    "llava_next": (
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        "LlavaNextProcessor",
        LlavaNextImageProcessorPil,
        NEXT_PROCESSOR,
    ),
}


def write_llava_tokenizer(folder) -> int:
    from transformers import AutoTokenizer

    size = write_tiny_tokenizer(folder, LLAVA_SPECIALS, LLAVA_TEMPLATE, vocab_size=330)
    assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<image>") == IMAGE
    return size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """kind -> (folder, transformers model), each built once: llama language model, default strategy."""
    return build_once(tmp_path_factory, make_checkpoint)


def make_checkpoint(folder: Path, kind: str):
    config_class, model_class, _, _, preprocessor = KINDS[kind]
    text_config = {**TEXT, "model_type": "llama", "vocab_size": write_llava_tokenizer(folder)}
    extra = {"image_grid_pinpoints": PINPOINTS} if kind == "llava_next" else {}
    config = getattr(transformers, config_class)(
        vision_config=VISION, text_config=text_config, image_token_index=IMAGE, **extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    save_widened(model, folder)  # std 0.2 matrices, perturbed norms/biases/image_newline; eval mode
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model


def make_processor(kind: str, folder):
    """transformers' processor over the checkpoint's own tokenizer and Pil image processor."""
    _, _, processor_class, image_processor_class, _ = KINDS[kind]
    return getattr(transformers, processor_class)(
        image_processor=image_processor_class.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def transformers_inputs(kind: str, folder, text: str, image_paths: list[str]) -> dict:
    """input_ids, pixel_values (and image_sizes for NeXT) as transformers' processor makes them of
    the rendered prompt `text` (one `<image>` per image)."""
    from transformers.image_utils import load_image

    processor = make_processor(kind, folder)
    images = [load_image(p) for p in image_paths] or None
    return dict(processor(text=[text], images=images, return_tensors="pt"))


def reference_generate(kind: str, folder, model, ids: list[int], image_paths: list[str]) -> list[int]:
    """transformers' greedy tokens on `ids` (already expanded) with the Pil image processor's pixels."""
    from transformers.image_utils import load_image

    kwargs = {}
    if image_paths:
        pixels = KINDS[kind][3].from_pretrained(folder)([load_image(p) for p in image_paths], return_tensors="pt")
        kwargs = {k: pixels[k] for k in ("pixel_values", "image_sizes") if k in pixels}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            **kwargs,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def run_args(kind: str, folder, *extra):
    return (
        f"model={kind}",
        f"model.path={folder}",
        "model.max_context=512",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        *extra,
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_prompt_images_generate_as_transformers(tmp_path, checkpoint, photo_path, kind):
    folder, reference = checkpoint(kind)
    result = run_cli(tmp_path, *run_args(kind, folder, "prompt.text=Describe it.", f"prompt.images=[{photo_path}]"))
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    assert row["prompt"] == "USER: <image>\nDescribe it. ASSISTANT:"
    ids = row["prompt_token_ids"]

    # transformers' processor on the same rendered prompt: the count it expands the one <image> to, and the ids
    theirs = transformers_inputs(kind, folder, row["prompt"], [str(photo_path)])
    (count,) = image_runs(theirs["input_ids"][0].numpy(), IMAGE)
    side = VISION["image_size"] // VISION["patch_size"]  # 4x4 features a tile
    # llava: one tile, CLS dropped. NeXT: the base tile, then the 600x512 photo's 2x2 grid (8x8)
    # unpadded to 8 rows of 6 columns (1 each side dropped), a newline after each row
    assert count == {"llava": side * side, "llava_next": side * side + 8 * (6 + 1)}[kind]
    unexpanded = transformers.AutoTokenizer.from_pretrained(folder)(row["prompt"], add_special_tokens=False)[
        "input_ids"
    ]
    assert unexpanded.count(IMAGE) == 1
    at = unexpanded.index(IMAGE)
    assert ids == unexpanded[:at] + [IMAGE] * count + unexpanded[at + 1 :]  # the one <image>, expanded in place
    assert ids == theirs["input_ids"][0].tolist()

    assert row["token_ids"] == reference_generate(kind, folder, reference, ids, [str(photo_path)])
    assert len(set(row["token_ids"])) >= 2  # not one repeated token
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == count and stats["prompt_tokens"] == len(ids)
    assert stats["image_preprocess_ms"] > 0 and stats["vision_encode_ms"] > 0
    assert f"images: {count} of the prompt tokens | preprocess" in result.stderr


def test_mixed_batch_rows_equal_their_runs_alone(tmp_path, checkpoint, photo_path, odd_images):
    kind = "llava_next"
    folder, reference = checkpoint(kind)
    unreadable = tmp_path / "notes.jpg"  # a text file renamed .jpg
    unreadable.write_text("not a picture, just some notes\n")
    rows = [
        {"id": "photo", "prompt": "Describe it.", "images": [str(photo_path)]},
        {"id": "text", "prompt": "Hello there"},
        {
            "id": "two",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare "},
                        {"type": "image", "path": str(odd_images["gray"])},
                        {"type": "text", "text": " with "},
                        {"type": "image", "path": str(photo_path)},
                    ],
                }
            ],
        },
        {"id": "unreadable", "prompt": "Describe it.", "images": [str(unreadable)]},
    ]
    got = assert_batch_rows_equal_their_runs_alone(
        tmp_path, run_args(kind, folder), rows, {"unreadable": f"{unreadable}: not an image Pillow can read"}
    )
    for row in rows[:3]:
        assert got[(row["id"], 0)]["finish_reason"] == "length" and len(got[(row["id"], 0)]["token_ids"]) == MAX_TOKENS

    # the two-image conversation: ids as LlavaNextProcessor makes them, tokens as transformers generates them
    two, paths = got[("two", 0)], [str(odd_images["gray"]), str(photo_path)]
    assert two["prompt"] == "USER: Compare <image>\n with <image>\n ASSISTANT:"
    theirs = transformers_inputs(kind, folder, two["prompt"], paths)
    assert two["prompt_token_ids"] == theirs["input_ids"][0].tolist()
    counts = image_runs(np.array(two["prompt_token_ids"]), IMAGE)
    # the 150x100 grayscale's 2x2 grid unpads its rows (6 of 8), the photo's its columns
    assert counts == [16 + 6 * (8 + 1), 72]
    assert two["token_ids"] == reference_generate(kind, folder, reference, two["prompt_token_ids"], paths)
    assert got[("text", 0)]["prompt_token_ids"].count(IMAGE) == 0

    stats = json.loads((tmp_path / "batch" / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 72 + sum(counts) and stats["finish_reasons"] == {"error": 1, "length": 3}
    assert stats["occupancy"] > 0 and stats["vision_encode_ms"] > 0  # image rows ran through the scheduler
