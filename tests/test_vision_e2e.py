"""A tiny Qwen2-VL end to end through mlxcel-run: prompt.images with the chat template's
placeholders, the expanded prompt ids in generations.jsonl, greedy tokens equal to transformers'
generate on the same ids and pixels, the vision stats, and a mixed JSONL batch (image rows, a text
row, a bad image) where every good row gives what it gives alone."""

from __future__ import annotations

import json

import pytest

from tests.helpers import SPECIALS, by_key, read_rows, run_cli, write_rows, write_tiny_tokenizer
from tests.qwen2_vl_fixtures import PREPROCESSOR, TEXT, VISION
from tests.vision_fixtures import assert_batch_rows_equal_their_runs_alone

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VLM_SPECIALS = [*SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]  # ids 3, 4, 5
VISION_START, VISION_END, IMAGE = 3, 4, 5
# Qwen2-VL's template, cut down: an image part renders as <|vision_start|><|image_pad|><|vision_end|>
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_TOKENS = 8


def write_vlm_tokenizer(folder) -> int:
    from transformers import AutoTokenizer

    size = write_tiny_tokenizer(folder, VLM_SPECIALS, VLM_TEMPLATE, vocab_size=330)
    assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(VLM_SPECIALS[3:]) == [
        VISION_START,
        VISION_END,
        IMAGE,
    ]
    return size


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen2_vl")
    config = transformers.Qwen2VLConfig(
        text_config={**TEXT, "vocab_size": write_vlm_tokenizer(folder)},
        vision_config=VISION["qwen2_vl"],
        image_token_id=IMAGE,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder, model


def reference_generate(folder, model, ids: list[int], image_paths: list[str]) -> list[int]:
    from transformers.image_utils import load_image

    input_ids = torch.tensor([ids])
    kwargs = {"mm_token_type_ids": (input_ids == IMAGE).int()}
    if image_paths:
        processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
        pixels = processor([load_image(p) for p in image_paths], return_tensors="pt")
        kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            **kwargs,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def run_args(folder, *extra):
    return (
        f"model.path={folder}",
        "model.max_context=512",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        *extra,
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_prompt_images_generate_as_transformers(tmp_path, vlm, photo_path):
    folder, reference = vlm
    result = run_cli(tmp_path, *run_args(folder, "prompt.text=Describe it.", f"prompt.images=[{photo_path}]"))
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    ids = row["prompt_token_ids"]
    assert ids.count(IMAGE) == 16 * 14 // 4 and ids.index(IMAGE) == ids.index(VISION_START) + 1  # expanded in place
    assert row["token_ids"] == reference_generate(folder, reference, ids, [str(photo_path)])
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 56 and stats["prompt_tokens"] == len(ids)
    assert stats["image_preprocess_ms"] > 0 and stats["vision_encode_ms"] > 0
    assert "images: 56 of the prompt tokens | preprocess" in result.stderr


def test_mixed_batch_rows_equal_their_runs_alone(tmp_path, vlm, photo_path, odd_images):
    folder, reference = vlm
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
                        {"type": "image", "path": str(odd_images["rgba"])},
                        {"type": "text", "text": " with "},
                        {"type": "image", "path": str(photo_path)},
                    ],
                }
            ],
        },
        {"id": "missing", "prompt": "Describe it.", "images": [str(tmp_path / "nope.jpg")]},
    ]
    got = assert_batch_rows_equal_their_runs_alone(
        tmp_path, run_args(folder), rows, {"missing": "nope.jpg: no such file"}
    )
    two = got[("two", 0)]
    assert two["token_ids"] == reference_generate(
        folder, reference, two["prompt_token_ids"], [str(odd_images["rgba"]), str(photo_path)]
    )
    stats = json.loads((tmp_path / "batch" / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 56 + 56 + 15 and stats["finish_reasons"] == {"error": 1, "length": 3}
    assert stats["occupancy"] > 0  # M-RoPE image rows ran through the scheduler


def test_vision_weights_stay_unread_until_an_image_needs_them(vlm):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel.checkpoints.loader import load_model

    folder, _ = vlm
    mx.synchronize()
    before = mx.get_active_memory()
    model = load_model(str(folder), dtype="float32").model
    loaded = mx.get_active_memory() - before
    tower_bytes = sum(v.nbytes for _, v in tree_flatten(model.visual.parameters()))
    language_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - tower_bytes
    assert language_bytes <= loaded < language_bytes + tower_bytes // 2  # the tower is not in memory yet
    mx.eval(model.visual.parameters())
    assert mx.get_active_memory() - before >= language_bytes + tower_bytes


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_quantize_at_load_keeps_the_vision_stage_dense_and_images_work(tmp_path, vlm, photo_path):
    folder, _ = vlm
    result = run_cli(
        tmp_path,
        *run_args(
            folder, "prompt.text=Describe it.", f"prompt.images=[{photo_path}]", "model.quantize={bits:8,group_size:32}"
        ),
    )
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    assert row["prompt_token_ids"].count(IMAGE) == 56 and len(row["token_ids"]) == MAX_TOKENS
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["model"]["quantization"]["bits"] == 8


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_prompt_ids_equal_transformers_processor(tmp_path, vlm, photo_path, odd_images):
    """Rendering, tokenizing and expanding as transformers' Qwen2VLProcessor does. The processor
    class insists on a (torchvision) video processor, so its image step is reproduced by hand
    (as transformers does): each <|image_pad|> of the rendered text becomes grid.prod() // merge^2 copies,
    with the grids from transformers' own Pillow image processor, then the tokenizer encodes."""
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder, _ = vlm
    paths = [str(odd_images["rgba"]), str(photo_path)]
    content = [
        {"type": "image", "path": paths[0]},
        {"type": "text", "text": "and"},
        {"type": "image", "path": paths[1]},
    ]
    rows = [
        {"id": "two", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]}
    ]
    result = run_cli(
        tmp_path, *run_args(folder, "prompt=jsonl", f"prompt.file={write_rows(tmp_path / 'rows.jsonl', rows)}")
    )
    assert result.returncode == 0, result.stderr
    ours = read_rows(tmp_path / "run")[0]["prompt_token_ids"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    grids = Qwen2VLImageProcessorPil.from_pretrained(folder)([load_image(p) for p in paths], return_tensors="np")[
        "image_grid_thw"
    ]
    text = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False, add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == 3
    expanded = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // 4) + rest for g, rest in zip(grids, pieces[1:]))
    assert ours == tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert ours.count(IMAGE) == 15 + 56


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_images_without_placeholders_fail_that_row(tmp_path, vlm, photo_path):
    """template=none renders no placeholder for the image part: one clear error row."""
    folder, _ = vlm
    rows = [
        {"id": "raw", "prompt": "Describe it.", "images": [str(photo_path)]},
        {"id": "text", "prompt": "Hello there"},
    ]
    result = run_cli(
        tmp_path,
        *run_args(folder, "prompt=jsonl", f"prompt.file={write_rows(tmp_path / 'rows.jsonl', rows)}", "template=none"),
    )
    assert result.returncode == 0, result.stderr
    got = by_key(read_rows(tmp_path / "run"))
    assert got[("raw", 0)]["finish_reason"] == "error"
    assert f"the prompt has 0 image placeholder(s) for 1 image(s) ({photo_path})" in got[("raw", 0)]["error"]
    assert got[("text", 0)]["finish_reason"] == "length"


@pytest.mark.slow  # runs mlxcel-run in a subprocess and a server
def test_the_server_takes_images_as_data_urls_and_allowed_paths(tmp_path, vlm, photo_path):
    """A chat request with the photo as a data: URL, and as a path under serve.image_dirs, answers
    what mlxcel-run answers for prompt.images (whose tokens equal transformers': above)."""
    import base64

    from tests.serve_fixtures import request_json, running_server

    folder, _ = vlm
    result = run_cli(tmp_path, *run_args(folder, "prompt.text=Describe it.", f"prompt.images=[{photo_path}]"))
    assert result.returncode == 0, result.stderr
    expected = read_rows(tmp_path / "run")[0]
    assert len(expected["token_ids"]) == MAX_TOKENS and expected["text"].strip()
    data_url = "data:image/jpeg;base64," + base64.b64encode(photo_path.read_bytes()).decode()
    overrides = (*run_args(folder), f"serve.image_dirs=[{photo_path.parent}]", "serve.model_name=vlm")
    with running_server(tmp_path / "serve", *overrides) as server:
        for url in (data_url, str(photo_path)):
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
            body = {"model": "vlm", "messages": [{"role": "user", "content": content}]}
            status, reply, _ = request_json(f"{server.url}/chat/completions", body)
            assert status == 200, reply
            assert reply["choices"][0]["message"]["content"] == expected["text"]
            assert reply["usage"]["prompt_tokens"] == len(expected["prompt_token_ids"])
