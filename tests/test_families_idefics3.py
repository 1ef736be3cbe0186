"""Idefics3 (idefics3) and SmolVLM (smolvlm) against transformers' Idefics3ForConditionalGeneration /
SmolVLMForConditionalGeneration (fp32, tiny random checkpoints written by save_pretrained, a tokenizer
with the image tokens and a chat template rendering an image part as `<image>`): the bucketized
position ids and masked embeddings, prompt ids equal to Idefics3Processor's / SmolVLMProcessor's on a
two-image prompt of a real photo (split into tiles), logits and greedy tokens, then mlxcel-run end to
end and the presets."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import FAMILIES, load_model
from mlxcel.models import idefics3
from mlxcel.vision import siglip
from mlxcel.vision.images import load_image
from mlxcel.vision.stage import is_vision_model, merge_embeddings
from tests.family_fixtures import LOGIT_TOLERANCE, save_widened
from tests.helpers import SPECIALS, TRAINING_TEXT, read_rows, run_cli, write_tiny_tokenizer
from tests.vision_fixtures import build_once

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.idefics3.image_processing_pil_idefics3 import (  # noqa: E402 -- after importorskip
    Idefics3ImageProcessorPil,
)
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings  # noqa: E402 -- after importorskip
from transformers.models.smolvlm import processing_smolvlm  # noqa: E402 -- after importorskip
from transformers.models.smolvlm.image_processing_pil_smolvlm import (  # noqa: E402 -- after importorskip
    SmolVLMImageProcessorPil,
)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
IMAGE = 3  # `<image>`: the first token after the ChatML specials
IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)
]
GREEDY = 24
MAX_TOKENS = 8
# 56 px tiles of 7 px patches: an 8x8 grid, pixel-shuffled by 2 to 16 tokens a tile
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 56,
    "patch_size": 7,
}
SEQ_LEN = 16
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "bos_token_id": None,
    "pad_token_id": 0,
}
PREPROCESSOR = {  # the keys of Idefics3-8B's preprocessor_config.json, sizes shrunk: the photo splits into 2x2 tiles
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 56},
    "resample": 1,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 112},
}
# Idefics3's template, cut down: an image part renders as <image>, a text part as its text
TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
KINDS = {  # model_type -> (config class, model class, image processor class)
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", Idefics3ImageProcessorPil),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", SmolVLMImageProcessorPil),
}


def write_tokenizer(folder: Path, kind: str) -> int:
    extra = {}
    if kind == "smolvlm":  # SmolVLM's tokenizer_config.json names its image tokens
        extra = {
            "extra_special_tokens": {
                "fake_image_token": "<fake_token_around_image>",
                "image_token": "<image>",
                "global_image_token": "<global-img>",
            }
        }
    training = TRAINING_TEXT + ["User: Describe this image.\nAssistant: A photo of a woman.\n\n"]
    size = write_tiny_tokenizer(
        folder, [*SPECIALS, *IMAGE_TOKENS], TEMPLATE, vocab_size=360, training=training, **extra
    )
    assert transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<image>") == IMAGE
    return size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """kind -> (folder, transformers model), each built once."""
    return build_once(tmp_path_factory, make_checkpoint)


def make_checkpoint(folder: Path, kind: str):
    config_class, model_class, _ = KINDS[kind]
    text_config = {**TEXT, "model_type": "llama", "vocab_size": write_tokenizer(folder, kind)}
    config = getattr(transformers, config_class)(
        vision_config=VISION, text_config=text_config, image_token_id=IMAGE, scale_factor=2, pad_token_id=0
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    save_widened(model, folder)  # std 0.2 matrices, perturbed norms/biases; eval mode
    (folder / "preprocessor_config.json").write_text(
        json.dumps({**PREPROCESSOR, "image_processor_type": f"{KINDS[kind][2].__name__[:-3]}"})
    )
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ_LEN}))
    return model


class NoVideoSmolVLMProcessor(transformers.SmolVLMProcessor):
    """SmolVLMProcessor without its video processor (which needs torchvision): images only."""

    def check_argument_for_proper_class(self, name, arg):
        return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)


def make_processor(kind: str, folder: Path, monkeypatch):
    image_processor = KINDS[kind][2].from_dict(PREPROCESSOR)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if kind == "idefics3":
        return transformers.Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=SEQ_LEN
        )
    monkeypatch.setattr(processing_smolvlm, "num2words", str)  # video prompts only; not installed here
    return NoVideoSmolVLMProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, image_seq_len=SEQ_LEN
    )


def transformers_inputs(kind: str, folder: Path, text: str, images, monkeypatch) -> dict:
    return dict(make_processor(kind, folder, monkeypatch)(text=[text], images=[images], return_tensors="pt"))


def reference_generate(model, inputs: dict, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def images(photo_path):
    """The photo (512x600: 2x2 tiles + the global view) and a wide strip of it (1x2 tiles + global)."""
    photo = load_image(photo_path)
    return [photo, photo.crop((0, 100, 512, 250))]


# --- the tower's embeddings ---------------------------------------------------------------------


@pytest.mark.parametrize("side", [8, 26, 32])
def test_bucketized_position_ids_match_transformers(side):
    """Frames of different real sizes in one padded batch (top-left rectangles of real patches)."""
    config = transformers.Idefics3VisionConfig(hidden_size=8, image_size=side * 4, patch_size=4)
    rows, cols = side, side
    mask = np.zeros((5, rows, cols), dtype=bool)
    for i, (h, w) in enumerate([(rows, cols), (rows // 2, cols), (3, cols // 3), (1, 1), (rows - 1, 2)]):
        mask[i, :h, :w] = True
    embeddings = Idefics3VisionEmbeddings(config)
    captured = {}

    class Captured(Exception):
        pass

    def capture(module, args):
        captured["ids"] = args[0]
        raise Captured

    embeddings.position_embedding.register_forward_pre_hook(capture)
    with torch.no_grad(), pytest.raises(Captured):
        embeddings(torch.zeros(5, 3, rows * 4, cols * 4), torch.from_numpy(mask))
    np.testing.assert_array_equal(siglip.bucketize_position_ids(mask, side), captured["ids"].numpy())


def test_masked_embeddings_and_tower_match_transformers():
    """The whole tower on padded frames (real patches a top-left rectangle): real patches' outputs."""
    config = transformers.Idefics3VisionConfig(**VISION)
    torch.manual_seed(0)
    tower = transformers.models.idefics3.modeling_idefics3.Idefics3VisionTransformer(config).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.2)
    ours = idefics3.make_vision_model(siglip.SiglipVisionArgs.from_config(VISION))
    weights = {k: mx.array(v.detach().numpy()) for k, v in tower.state_dict().items()}
    ours.load_weights(list(ours.sanitize(weights).items()))
    pixels = np.random.default_rng(0).standard_normal((3, 3, 56, 56)).astype(np.float32)
    pixel_mask = np.zeros((3, 56, 56), dtype=bool)
    pixel_mask[0], pixel_mask[1, :30, :], pixel_mask[2, :56, :17] = (
        True,
        True,
        True,
    )  # 30 px: 5 rows (the 5th partly real)
    patch_mask = idefics3.make_patch_mask(pixel_mask, 7)
    assert patch_mask[1].sum() == 5 * 8 and patch_mask[2].sum() == 8 * 3
    got = np.array(ours.encode(ours.embeddings(mx.array(pixels), patch_mask), mx.array(patch_mask.reshape(3, -1))))
    with torch.no_grad():
        want = tower(
            torch.from_numpy(pixels), patch_attention_mask=torch.from_numpy(patch_mask)
        ).last_hidden_state.numpy()
    real = patch_mask.reshape(3, -1)
    assert np.abs(got[real] - want[real]).max() <= 1e-4


# --- the family against transformers -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_two_image_prompt_matches_transformers(checkpoint, images, monkeypatch, kind):
    folder, reference = checkpoint(kind)
    model = load_model(str(folder), dtype="float32").model
    assert is_vision_model(model) and model.image_token_id == IMAGE and model.model_type == kind
    assert FAMILIES[kind] == "idefics3"
    text = "<|im_start|>User:<image>Describe<image>this image.<end_of_utterance>\nAssistant:"
    inputs = model.preprocess_images(images, ["photo", "strip"])
    assert inputs.extras["rows"] == [2, 1] and inputs.extras["cols"] == [2, 2]
    assert inputs.token_counts == [SEQ_LEN * 5, SEQ_LEN * 3]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(model.expand_image_text(text, inputs, ["photo", "strip"]), add_special_tokens=False)["input_ids"]

    theirs = transformers_inputs(kind, folder, text, images, monkeypatch)
    assert ids == theirs["input_ids"][0].tolist()
    assert ids.count(IMAGE) == sum(inputs.token_counts)
    np.testing.assert_allclose(inputs.pixel_values, theirs["pixel_values"].numpy(), atol=1e-5)

    features = model.encode_images(inputs)
    embeddings = merge_embeddings(model.embed_tokens(mx.array([ids])), ids, IMAGE, features)
    cache = model.make_cache()
    got = np.array(model.forward_with_embeddings(embeddings, cache)[0])
    with torch.no_grad():
        want = reference(**theirs).logits[0].numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= LOGIT_TOLERANCE, np.abs(got - want).max()

    greedy = [int(got[-1].argmax())]
    while len(greedy) < GREEDY:
        greedy.append(int(mx.argmax(model(mx.array([[greedy[-1]]]), cache)[0, -1]).item()))
    assert greedy == reference_generate(reference, theirs, GREEDY)
    assert len(set(greedy)) >= 3  # a varied continuation, not one repeated token


def test_layouts_load_alike_and_text_prompts_need_no_vision(checkpoint, images, tmp_path):
    """transformers' in-memory names and an MLX conversion's (language_model.*, vision_model.*,
    connector.*) give the same logits."""
    from safetensors.numpy import load_file, save_file

    folder, reference = checkpoint("idefics3")
    saved = load_file(folder / "model.safetensors")
    renamed = {}
    for key, value in saved.items():
        for old, new in (
            ("model.text_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
            ("model.vision_model.", "vision_model."),
            ("model.connector.", "connector."),
        ):
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    renamed["vision_model.embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]  # older saves' buffer
    for file in ("config.json", "preprocessor_config.json"):
        (tmp_path / file).write_text((folder / file).read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    a, b = load_model(str(folder), dtype="float32").model, load_model(str(tmp_path), dtype="float32").model
    inputs = a.preprocess_images(images[:1], ["photo"])
    np.testing.assert_array_equal(np.array(a.encode_images(inputs)), np.array(b.encode_images(inputs)))
    prompt = [5, 9, 30, 41, 7]
    got = np.array(b(mx.array([prompt]), b.make_cache())[0])
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() <= LOGIT_TOLERANCE


def test_smolvlm_reads_its_image_token_names_from_the_tokenizer_config(checkpoint, images, tmp_path):
    folder, _ = checkpoint("smolvlm")
    model = load_model(str(folder), dtype="float32").model
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "extra_special_tokens": {
                    "fake_image_token": "<fake>",
                    "image_token": "<img>",
                    "global_image_token": "<g>",
                }
            }
        )
    )
    (tmp_path / "preprocessor_config.json").write_text((folder / "preprocessor_config.json").read_text())
    model.attach_preprocessor(tmp_path)
    inputs = model.preprocess_images(images[1:], ["strip"])
    text = model.expand_image_text("a<img>b", inputs, ["strip"])
    tile = "<img>" * SEQ_LEN
    assert text == f"a<fake><row_1_col_1>{tile}<fake><row_1_col_2>{tile}\n\n<fake><g>{tile}<fake>b"
    with pytest.raises(Exception, match="placeholder"):
        model.expand_image_text("a<image>b", inputs, ["strip"])


def test_tile_size_must_match_the_tower(checkpoint, images, tmp_path):
    folder, _ = checkpoint("idefics3")
    model = load_model(str(folder), dtype="float32").model
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**PREPROCESSOR, "max_image_size": {"longest_edge": 42}})
    )
    model.attach_preprocessor(tmp_path)
    with pytest.raises(Exception, match="image_size 56"):
        model.preprocess_images(images[:1], ["photo"])


# --- mlxcel-run end to end -----------------------------------------------------------------------


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_images_generate_as_transformers(tmp_path, checkpoint, photo_path, monkeypatch, kind):
    folder, reference = checkpoint(kind)
    result = run_cli(
        tmp_path,
        f"model={kind}",
        f"model.path={folder}",
        "model.max_context=1024",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        "prompt.text=Describe it.",
        f"prompt.images=[{photo_path}]",
    )
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    assert row["prompt"] == "<|im_start|>User:<image>Describe it.<end_of_utterance>\nAssistant:"
    theirs = transformers_inputs(kind, folder, row["prompt"], [load_image(photo_path)], monkeypatch)
    assert row["prompt_token_ids"] == theirs["input_ids"][0].tolist()
    count = SEQ_LEN * 5  # 2x2 tiles + the global view
    assert row["prompt_token_ids"].count(IMAGE) == count
    assert row["token_ids"] == reference_generate(reference, theirs, MAX_TOKENS)
    assert len(set(row["token_ids"])) >= 2
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == count and stats["prompt_tokens"] == len(row["prompt_token_ids"])
    assert stats["image_preprocess_ms"] > 0 and stats["vision_encode_ms"] > 0


@pytest.mark.parametrize("preset", ["idefics3", "smolvlm"])
def test_presets_compose_and_name_their_model_type(preset, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={preset}", f"model.path={tmp_path}"])
    model = validate_config(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)).model
    assert model.path == str(tmp_path) and preset in model.families
    assert preset in list_supported_families() and FAMILIES[preset] == "idefics3"


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_mixed_batch_of_image_and_text_rows_generates_as_transformers(
    tmp_path, checkpoint, photo_path, odd_images, monkeypatch
):
    from tests.helpers import by_key, write_rows

    kind = "smolvlm"
    folder, reference = checkpoint(kind)
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
    ]
    result = run_cli(
        tmp_path,
        f"model={kind}",
        f"model.path={folder}",
        "model.max_context=1024",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        "prompt=jsonl",
        f"prompt.file={write_rows(tmp_path / 'rows.jsonl', rows)}",
        "runner.max_rows=3",
    )
    assert result.returncode == 0, result.stderr
    got = by_key(read_rows(tmp_path / "run"))
    for row in rows:
        out = got[(row["id"], 0)]
        paths = [p["path"] for m in row.get("messages", []) for p in m["content"] if p["type"] == "image"] or row.get(
            "images", []
        )
        if paths:
            theirs = transformers_inputs(kind, folder, out["prompt"], [load_image(p) for p in paths], monkeypatch)
        else:
            theirs = {"input_ids": torch.tensor([out["prompt_token_ids"]])}
            assert out["prompt_token_ids"].count(IMAGE) == 0
        assert out["prompt_token_ids"] == theirs["input_ids"][0].tolist(), row["id"]
        assert out["token_ids"] == reference_generate(reference, theirs, MAX_TOKENS), row["id"]
    two = got[("two", 0)]
    assert two["prompt"] == "<|im_start|>User:Compare <image> with <image><end_of_utterance>\nAssistant:"
    assert two["prompt_token_ids"].count(IMAGE) > SEQ_LEN * 5  # the grayscale's frames and the photo's 5
