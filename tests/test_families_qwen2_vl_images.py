"""Qwen2-VL and Qwen2.5-VL with images against transformers' Qwen2VLForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration: our whole vision stage (preprocess -> placeholder expansion ->
tower -> EmbedMerger -> M-RoPE prefill -> shifted decode) on a real photo plus a second image,
against transformers' image processor and full model on the same expanded ids."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from mlxcel.vision.images import load_image
from mlxcel.vision.stage import expand_placeholders, is_vision_model, merge_embeddings
from tests.family_fixtures import LOGIT_TOLERANCE, PROMPT, mlxcel_logits, reference_logits
from tests.helpers import write_tiny_tokenizer
from tests.qwen2_vl_fixtures import PREPROCESSOR, TEXT, VISION

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# In-vocab ids the text of PROMPT never uses (its ids are 8..281).
VISION_START, VISION_END, IMAGE = 3, 4, 5
GREEDY = 24
CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
}


@pytest.fixture(scope="module", params=list(CLASSES))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model) of one variant, saved with save_pretrained."""
    variant = request.param
    folder = tmp_path_factory.mktemp(variant)
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[variant])
    config = config_class(
        text_config={**TEXT, "vocab_size": write_tiny_tokenizer(folder)},
        vision_config=VISION[variant],
        image_token_id=IMAGE,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # wider than the init's 0.02, tower included: logits far apart, features not ~0
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder, model


@pytest.fixture(scope="module")
def images(photo_path, odd_images):
    """The photo and a small RGBA image (alpha composited onto white), with their sources."""
    sources = [str(photo_path), str(odd_images["rgba"])]
    return [load_image(path) for path in sources], sources


def make_prompt(n_images: int) -> list[int]:
    """Text, then each image as <|vision_start|><|image_pad|><|vision_end|> followed by more text."""
    ids = PROMPT[:6]
    for i in range(n_images):
        ids = ids + [VISION_START, IMAGE, VISION_END] + PROMPT[6 + 7 * i : 13 + 7 * i]
    return ids


def run_ours(model, prompt: list[int], images, sources) -> tuple[list[int], np.ndarray, list[int], object]:
    """Expanded ids, prefill logits [L, V] and GREEDY tokens, the way the pipeline runs a prompt."""
    inputs = model.preprocess_images(images, sources)
    ids = expand_placeholders(prompt, model.image_token_id, inputs.token_counts)
    positions, shift = model.make_positions(ids, inputs)
    embeddings = merge_embeddings(
        model.embed_tokens(mx.array([ids])), ids, model.image_token_id, model.encode_images(inputs)
    )
    cache = model.make_cache()
    logits = model.forward_with_embeddings(embeddings, cache, positions=positions[:, None])
    for layer_cache in cache:
        layer_cache.position_shift = mx.array([shift])
    tokens = [int(mx.argmax(logits[0, -1]))]
    while len(tokens) < GREEDY:
        tokens.append(int(mx.argmax(model(mx.array([tokens[-1:]]), cache)[0, -1])))
    return ids, np.array(logits[0].astype(mx.float32)), tokens, inputs


def run_theirs(folder, reference, ids: list[int], images) -> tuple[dict, np.ndarray, list[int]]:
    """transformers' own image processor and full model on the same expanded ids."""
    processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    pixels = processor(images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    # transformers needs mm_token_type_ids (1 at image tokens) to compute M-RoPE positions
    kwargs = {
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (input_ids == IMAGE).int(),
    }
    with torch.no_grad():
        logits = reference(input_ids=input_ids, **kwargs).logits[0].numpy()
        out = reference.generate(
            input_ids,
            **kwargs,
            max_new_tokens=GREEDY,
            min_new_tokens=GREEDY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return pixels, logits, out[0, len(ids) :].tolist()


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_prompts_match_transformers(checkpoint, images, n_images):
    folder, reference = checkpoint
    model = load_model(str(folder), dtype="float32").model
    assert is_vision_model(model)
    chosen, sources = images[0][:n_images], images[1][:n_images]
    prompt = make_prompt(n_images)
    ids, logits, tokens, inputs = run_ours(model, prompt, chosen, sources)
    pixels, want_logits, want_tokens = run_theirs(folder, reference, ids, chosen)

    grids = pixels["image_grid_thw"].numpy()
    np.testing.assert_array_equal(inputs.extras["grid_thw"], grids)
    assert ids == expand_placeholders(prompt, IMAGE, (grids.prod(-1) // 4).tolist())
    assert inputs.token_counts[0] == 16 * 14 // 4  # the photo at max_pixels 50k: a few dozen tokens
    diff = float(np.abs(logits - want_logits).max())
    print(f"{reference.config.model_type} {n_images} image(s), {len(ids)} tokens: max abs logit diff {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert tokens == want_tokens
    assert len(set(tokens)) >= 3  # a varied continuation, not one repeated token


def test_images_change_the_logits(checkpoint, images):
    """The features reach the logits: the photo mirrored (same size, same token count) changes them."""
    from PIL import ImageOps

    folder, _ = checkpoint
    model = load_model(str(folder), dtype="float32").model
    (photo, _), (source, _) = images
    _, logits, _, _ = run_ours(model, make_prompt(1), [photo], [source])
    _, mirrored, _, _ = run_ours(model, make_prompt(1), [ImageOps.mirror(photo)], [source])
    assert np.abs(logits[-1] - mirrored[-1]).max() > 1e-2


def test_text_prompts_still_match_transformers(checkpoint):
    folder, reference = checkpoint
    got, loaded = mlxcel_logits(folder, PROMPT)
    assert np.abs(got - reference_logits(reference, PROMPT)).max() <= LOGIT_TOLERANCE
    positions, shift = loaded.model.make_positions(PROMPT, None)  # no images: plain positions
    assert positions.dtype == mx.int32 and shift == 0
    np.testing.assert_array_equal(np.array(positions), np.broadcast_to(np.arange(len(PROMPT)), (3, len(PROMPT))))


def test_missing_preprocessor_config_fails_at_the_first_image(checkpoint, images, tmp_path):
    folder, _ = checkpoint
    copy = tmp_path / "no_preprocessor"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("preprocessor_config.json"))
    model = load_model(str(copy), dtype="float32").model  # loads, and text works without it
    model(mx.array([PROMPT[:5]]), model.make_cache())
    with pytest.raises(MlxcelError, match=f"{copy}: no preprocessor_config.json"):
        model.preprocess_images(images[0][:1], images[1][:1])


def test_processor_that_disagrees_with_the_tower_is_refused(checkpoint, images, tmp_path):
    folder, _ = checkpoint
    copy = tmp_path / "merge_1"
    shutil.copytree(folder, copy)
    (copy / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "merge_size": 1}))
    model = load_model(str(copy), dtype="float32").model
    with pytest.raises(MlxcelError, match="merge_size 1 \\(vision_config: 2\\)"):
        model.preprocess_images(images[0][:1], images[1][:1])


def test_every_weight_layout_sanitizes_alike(checkpoint):
    """Hub / save_pretrained (`model.*`, `visual.*`), transformers 5 in memory (`model.language_model.*`,
    `model.visual.*`) and mlx-vlm (`language_model.*`, `vision_tower.*`) give the same weights."""
    folder, _ = checkpoint
    model = load_model(str(folder), dtype="float32").model
    saved = {}
    for file in folder.glob("*.safetensors"):
        saved.update(mx.load(str(file)))
    assert any(k.startswith("visual.") for k in saved)
    renames = {
        "memory": {"visual.": "model.visual.", "model.": "model.language_model.", "lm_head.": "lm_head."},
        "mlx-vlm": {
            "visual.": "vision_tower.",
            "model.": "language_model.model.",
            "lm_head.": "language_model.lm_head.",
        },
    }
    want = model.sanitize(saved)
    assert any(k.startswith("visual.") for k in want)
    for name, rename in renames.items():
        moved = {}
        for key, value in saved.items():
            prefix = next(p for p in rename if key.startswith(p))
            moved[rename[prefix] + key[len(prefix) :]] = value
        assert sorted(model.sanitize(moved)) == sorted(want), name
