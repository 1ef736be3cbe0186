"""Gemma 3 with images (model_type gemma3) against transformers' Gemma3ForConditionalGeneration
(fp32, tiny random checkpoint by save_pretrained: tiny SigLIP pooled to mm_tokens_per_image = 4,
sliding windows shorter than the prompt, one of them shorter than an image block): prompt ids
equal Gemma3Processor's, logits and greedy tokens with the image-block bidirectional masks, and
the whole pipeline through mlxcel-run with prompt.images."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.models import gemma3_vl
from mlxcel.sampling import Sampler
from mlxcel.vision.images import load_image
from mlxcel.vision.processors import gemma3 as gemma3_processor
from mlxcel.vision.stage import is_vision_model, merge_embeddings
from tests.family_fixtures import (
    BASE_SHAPE,
    FAMILIES,
    LOGIT_TOLERANCE,
    PROMPT,
    mlxcel_generate,
    reference_greedy,
    save_widened,
)
from tests.vision_fixtures import build_once

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402 -- after importorskip

GREEDY = 24
SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    gemma3_processor.BOI_TOKEN,
    gemma3_processor.EOI_TOKEN,
    gemma3_processor.IMAGE_TOKEN,
]
# tiny SigLIP: 28 / 14 = 2 x 2 patches, pooled to mm_tokens_per_image = 4
VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
PREPROCESSOR = {  # google/gemma-3-4b-it's, at the tiny tower's size
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 4,
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 28, "width": 28},
}
# Gemma 3's template, cut down: an image part writes <start_of_image>, a text part its text
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TRAINING = ["user\n\n\nDescribe this image.\n\nCompare the two pictures. What is shown here?\nmodel\n"] * 8 + [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
]
WINDOWS = {"window6": 6, "window3": 3}  # both shorter than the prompts; 3 is shorter than an image block


def write_gemma3_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAINING, trainer)
    special = {
        "boi_token": gemma3_processor.BOI_TOKEN,
        "eoi_token": gemma3_processor.EOI_TOKEN,
        "image_token": gemma3_processor.IMAGE_TOKEN,
    }
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        extra_special_tokens=special,
        chat_template=TEMPLATE,
    )
    wrapped.save_pretrained(folder)
    return wrapped


def make_checkpoint(folder: Path, window: int):
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_gemma3_tokenizer(folder)
    text = {**BASE_SHAPE, **FAMILIES["gemma3_text"][2], "sliding_window": window, "vocab_size": len(tokenizer)}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        eos_token_id=2,
        pad_token_id=0,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config)
    save_widened(model, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model, tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """window name -> (folder, transformers model, tokenizer), each built once."""
    return build_once(tmp_path_factory, lambda folder, name: make_checkpoint(folder, WINDOWS[name]))


@pytest.fixture(scope="module")
def images(photo_path, odd_images):
    return {"one": [str(photo_path)], "two": [str(photo_path), str(odd_images["gray"])]}


def render(tokenizer, n_images: int) -> str:
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe this image."}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )


def make_processor(tokenizer, preprocessor: dict = PREPROCESSOR):
    return transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_dict(preprocessor), tokenizer=tokenizer, image_seq_length=4
    )


def ours_inputs(model, tokenizer, text: str, paths: list[str]):
    inputs = model.preprocess_images([load_image(p) for p in paths], paths)
    ids = tokenizer(model.expand_image_text(text, inputs, paths), add_special_tokens=False)["input_ids"]
    return ids, inputs


def theirs_inputs(tokenizer, text: str, paths: list[str], preprocessor: dict = PREPROCESSOR) -> dict:
    from transformers.image_utils import load_image as hf_load_image

    processor = make_processor(tokenizer, preprocessor)
    # Gemma3Processor's own defaults (do_pan_and_scan False) override the image processor's config:
    # a checkpoint's pan-and-scan settings reach it only as call arguments
    pan_and_scan = {
        k: v for k, v in preprocessor.items() if k.startswith(("do_pan_and_scan", "pan_and_scan_")) and v is not None
    }
    return dict(processor(text=[text], images=[[hf_load_image(p) for p in paths]], return_tensors="pt", **pan_and_scan))


def reference_generate(reference, ids: list[int], pixel_values, image_token: int, n: int = GREEDY) -> list[int]:
    token_types = (torch.tensor([ids]) == image_token).long()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]),
            pixel_values=pixel_values,
            token_type_ids=token_types,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def prefill_logits(model, ids: list[int], inputs) -> np.ndarray:
    embedded = merge_embeddings(
        model.embed_tokens(mx.array([ids])), ids, model.image_token_id, model.encode_images(inputs)
    )
    blocks = mx.array([model.image_blocks(ids)], dtype=mx.int32)
    return np.array(model.forward_with_embeddings(embedded, model.make_cache(), image_blocks=blocks)[0])


@pytest.mark.parametrize("count", ["one", "two"])
@pytest.mark.parametrize("name", list(WINDOWS))
def test_image_prompt_matches_transformers(checkpoint, images, name, count):
    folder, reference, tokenizer = checkpoint(name)
    model = load_model(str(folder), dtype="float32").model
    assert is_vision_model(model) and model.image_token_id == tokenizer.image_token_id
    paths = images[count]
    text = render(tokenizer, len(paths))
    ids, inputs = ours_inputs(model, tokenizer, text, paths)
    theirs = theirs_inputs(tokenizer, text, paths)
    assert ids == theirs["input_ids"][0].tolist()
    assert model.image_blocks(ids) == gemma3_vl.find_image_blocks(ids, tokenizer.image_token_id)
    assert [int(t) for t in theirs["token_type_ids"][0]] == [int(b >= 0) for b in model.image_blocks(ids)]
    assert np.abs(inputs.pixel_values - theirs["pixel_values"].numpy()).max() <= 1e-4
    assert sum(inputs.token_counts) == 4 * len(paths) and len(ids) > WINDOWS[name]

    with torch.no_grad():
        expected = reference(**theirs).logits[0].numpy()
    got = prefill_logits(model, ids, inputs)
    diff = float(np.abs(got - expected).max())
    assert diff <= LOGIT_TOLERANCE, diff
    # the bidirectional blocks matter: plain causal masks give other logits
    embedded = merge_embeddings(
        model.embed_tokens(mx.array([ids])), ids, model.image_token_id, model.encode_images(inputs)
    )
    causal = np.array(model.forward_with_embeddings(embedded, model.make_cache())[0])
    assert np.abs(causal - expected).max() > 10 * LOGIT_TOLERANCE

    engine = DirectEngine(model, max_context=512)
    state = engine.generate(
        GenerationRequest([RowRequest(ids, images=inputs)], Sampler("greedy"), max_tokens=GREEDY, chunk_size=8)
    )
    assert [p["end"] - p["start"] for p in state.timings.prefill_pieces] == [len(ids)]  # one piece, not chunks of 8
    assert state.results[0].token_ids == reference_generate(
        reference, ids, theirs["pixel_values"], tokenizer.image_token_id
    )
    assert len(set(state.results[0].token_ids)) >= 2
    # the scheduler (paged cache: the blocks in its own masks), beside a text row, gives the same tokens
    text = RowRequest(PROMPT[:20], row_id="text")
    scheduled = BatchScheduler(model, 512, 2, chunk_size=8).generate(
        GenerationRequest([text, RowRequest(ids, row_id=0, images=inputs)], Sampler("greedy"), max_tokens=GREEDY)
    )
    assert scheduled.results[1].token_ids == state.results[0].token_ids
    assert [p["end"] - p["start"] for p in scheduled.timings.prefill_pieces if p["row"] == 1] == [len(ids)]


def test_image_row_in_a_batch_equals_its_run_alone(checkpoint, images):
    folder, _, tokenizer = checkpoint("window6")
    model = load_model(str(folder), dtype="float32").model
    rows = []
    for count in ("one", "two"):
        ids, inputs = ours_inputs(model, tokenizer, render(tokenizer, len(images[count])), images[count])
        rows.append(RowRequest(ids, row_id=count, images=inputs))
    rows.append(RowRequest(PROMPT[:20], row_id="text"))
    engine = DirectEngine(model, max_context=512)
    batch = engine.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=12)).results
    for row, result in zip(rows, batch):
        alone = engine.generate(GenerationRequest([row], Sampler("greedy"), max_tokens=12)).results[0]
        assert result.token_ids == alone.token_ids, row.row_id


def test_text_prompts_are_the_text_model(checkpoint):
    """A text prompt runs as on the language model alone, and the tower stays unread."""
    folder, reference, _ = checkpoint("window6")
    loaded = load_model(str(folder), dtype="float32")
    model = loaded.model
    assert loaded.info["arch"] == "gemma3" and "note" not in loaded.info
    assert model.layer_windows == [6, 6, None, 6]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    got = np.array(model(mx.array([PROMPT]), model.make_cache())[0])
    assert np.abs(got - expected).max() <= LOGIT_TOLERANCE
    assert mlxcel_generate(model, [PROMPT], GREEDY)[0] == reference_greedy(reference, PROMPT, GREEDY)


def test_image_blocks():
    assert gemma3_vl.find_image_blocks([1, 9, 9, 2, 9, 3, 9, 9], 9) == [-1, 0, 0, -1, 1, -1, 2, 2]
    assert gemma3_vl.find_image_blocks([], 9) == []


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_prompt_images_through_mlxcel_run(tmp_path, checkpoint, photo_path):
    from tests.helpers import read_rows, run_cli

    folder, reference, tokenizer = checkpoint("window6")
    args = (
        "model=gemma3",
        f"model.path={folder}",
        "model.max_context=512",
        f"decode.max_tokens={GREEDY}",
        "decode.ignore_eos=true",
        "prompt.text=Describe this image.",
        f"prompt.images=[{photo_path}]",
    )
    result = run_cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    theirs = theirs_inputs(tokenizer, row["prompt"], [str(photo_path)])
    assert row["prompt_token_ids"] == theirs["input_ids"][0].tolist()
    assert row["prompt_token_ids"].count(tokenizer.image_token_id) == 4
    assert row["token_ids"] == reference_generate(
        reference, row["prompt_token_ids"], theirs["pixel_values"], tokenizer.image_token_id
    )
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 4 and stats["prompt_tokens"] == len(row["prompt_token_ids"])


def test_pan_and_scan_prompt_matches_transformers(checkpoint, photo_path, tmp_path):
    """A wide image with pan-and-scan on: the original view plus its crops, each its own image block,
    and the processor's "Here is the original image ... and here are some crops" text."""
    import shutil

    source, reference, tokenizer = checkpoint("window6")
    folder = tmp_path / "pan_and_scan"
    shutil.copytree(source, folder)
    preprocessor = {
        **PREPROCESSOR,
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 14,
        "pan_and_scan_max_num_crops": 3,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    wide = tmp_path / "wide.png"
    load_image(photo_path).crop((0, 200, 512, 330)).save(wide)  # 512 x 130: ratio 3.9, three crops
    model = load_model(str(folder), dtype="float32").model
    text = render(tokenizer, 1)
    ids, inputs = ours_inputs(model, tokenizer, text, [str(wide)])
    theirs = theirs_inputs(tokenizer, text, [str(wide)], preprocessor)
    assert ids == theirs["input_ids"][0].tolist()
    assert inputs.token_counts == [4 * 4]  # the original view + 3 crops, 4 tokens each
    assert np.abs(inputs.pixel_values - theirs["pixel_values"].numpy()).max() <= 1e-4
    with torch.no_grad():
        expected = reference(**theirs).logits[0].numpy()
    assert np.abs(prefill_logits(model, ids, inputs) - expected).max() <= LOGIT_TOLERANCE
    engine = DirectEngine(model, max_context=512)
    state = engine.generate(GenerationRequest([RowRequest(ids, images=inputs)], Sampler("greedy"), max_tokens=GREEDY))
    assert state.results[0].token_ids == reference_generate(
        reference, ids, theirs["pixel_values"], tokenizer.image_token_id
    )


def test_the_prompt_cache_never_hands_one_images_state_to_another(checkpoint, images, odd_images):
    """Two rows with the same text and placeholders but different images: the second, run after
    the first left its KV in the cache, adopts only what precedes its image, and its tokens are
    the cache-off run's."""
    folder, _, tokenizer = checkpoint("window6")
    model = load_model(str(folder), dtype="float32").model
    text = render(tokenizer, 1)
    rows = []
    for name, path in (("photo", images["one"][0]), ("gray", str(odd_images["gray"]))):
        ids, inputs = ours_inputs(model, tokenizer, text, [path])
        rows.append(RowRequest(ids, row_id=name, images=inputs))
    assert rows[0].prompt_ids == rows[1].prompt_ids  # the placeholders look alike

    def run(row, cache):
        scheduler = BatchScheduler(model, 512, 2, prompt_cache=cache, snapshot_all=True)  # as a chat keeps all
        return scheduler.generate(GenerationRequest([row], Sampler("greedy"), max_tokens=12)).results[0]

    cache = PromptCache(1 << 30)
    run(rows[0], cache)
    adopted = run(rows[1], cache)
    assert adopted.token_ids == run(rows[1], None).token_ids
    assert 0 < adopted.cached_tokens <= rows[1].prompt_ids.index(model.image_token_id)
