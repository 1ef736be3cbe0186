"""Phi-4-multimodal (phi4_multimodal) against transformers' Phi4MultimodalForCausalLM with its vision
LoRA loaded through PEFT, as the model card does (fp32, a tiny random checkpoint written by
save_pretrained, longrope with partial rotary as the released model, a random adapter saved by PEFT
in vision-lora/). transformers' Phi-4 image processor needs torchvision, whose PyPI wheel does not
run on the CPU torch here: the processor is checked against a transcription of it
(tests/test_vision_phi4_multimodal.py) and transformers gets our pixel values, crop masks and HD sizes.

Covered: a two-image prompt (ids, logits, 24 greedy tokens with the adapter on in decode), a text
prompt (the adapter off, as the base model), the LoRA layers (fused = unfused = W + s BA, quantized
unfused), after_prefill switching to the unfused form, mixed batches through mlxcel-run, and bad
adapter folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from mlxcel.models.lora import LoRAControl, LoRAWeights, make_lora_linear
from mlxcel.vision.images import load_image
from mlxcel.vision.stage import expand_placeholders, is_vision_model, merge_embeddings
from tests.family_fixtures import LOGIT_TOLERANCE, mlxcel_generate, save_widened
from tests.helpers import SPECIALS, read_rows, run_cli, write_tiny_tokenizer
from tests.vision_fixtures import assert_batch_rows_equal_their_runs_alone, mlxcel_greedy_after

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

GREEDY = 24
MAX_TOKENS = 8
LAYOUT = ["<|image|>", "<|user|>", "<|assistant|>", "<|end|>"]
IMAGE = 3  # after the three ChatML specials
ROTARY = 12  # head_dim 16 * partial_rotary_factor 0.75
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(ROTARY // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(ROTARY // 2)],
    },
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": 448,
    "patch_size": 14,
    "crop_size": 448,
    "image_token_id": IMAGE,
}
AUDIO = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_blocks": 1,
    "num_attention_heads": 2,
    "ext_pw_out_channel": 32,
    "depthwise_separable_out_channel": 32,
    "nemo_conv_channels": 32,
    "audio_token_id": 300,
}
PREPROCESSOR = {
    "dynamic_hd": 36,
    "image_processor_type": "Phi4MultimodalImageProcessor",
    "patch_size": 14,
    "size": {"height": 448, "width": 448},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LORA_TARGETS = (
    r"model\.layers\.\d+\.((self_attn\.(qkv|o)_proj)|(mlp\.(gate_up|down)_proj))"  # transformers' conversion's
)


def write_tokenizer(folder: Path) -> int:
    size = write_tiny_tokenizer(folder, [*SPECIALS, *LAYOUT], TEMPLATE, vocab_size=330, eos_token="<|end|>")
    assert transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|image|>") == IMAGE
    return size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, transformers model with the vision adapter active) written once: base weights,
    vision-lora/ by PEFT, preprocessor_config.json."""
    folder = tmp_path_factory.mktemp("phi4mm")
    vocab = write_tokenizer(folder)
    config = transformers.Phi4MultimodalConfig(**TEXT, vocab_size=vocab + 2, vision_config=VISION, audio_config=AUDIO)
    torch.manual_seed(0)
    model = transformers.Phi4MultimodalForCausalLM(config)
    save_widened(model, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter): make it count
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    wrapped.eval()
    wrapped.save_pretrained(folder / "vision-lora")
    return folder, wrapped


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(str(checkpoint[0]), dtype="float32").model


@pytest.fixture(scope="module")
def images(photo_path):
    """The photo (a 2x2 crop grid with padding) and a small strip of it (one crop)."""
    photo = load_image(photo_path)
    return [photo, photo.crop((0, 100, 300, 250))]


def reference_image_inputs(inputs) -> dict:
    """Our crops as transformers' processor batches them: [images, max crops, ...], padding crops
    zero with an all-ones mask; image_sizes are the padded HD sizes."""
    prepared = inputs.extras["images"]
    most = max(p.pixel_values.shape[0] for p in prepared)
    pixels = np.zeros((len(prepared), most, *prepared[0].pixel_values.shape[1:]), np.float32)
    masks = np.ones((len(prepared), most, *prepared[0].patch_mask.shape[1:]), np.float32)
    for i, p in enumerate(prepared):
        pixels[i, : len(p.pixel_values)], masks[i, : len(p.patch_mask)] = p.pixel_values, p.patch_mask
    return {
        "image_pixel_values": torch.from_numpy(pixels),
        "image_attention_mask": torch.from_numpy(masks),
        "image_sizes": torch.tensor([[p.hd_height, p.hd_width] for p in prepared]),
    }


def tokenize(folder: Path, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]


def mlxcel_image_prefill(model, ids: list[int], images):
    inputs = model.preprocess_images(images, [f"image{i}" for i in range(len(images))])
    expanded = expand_placeholders(ids, IMAGE, inputs.token_counts)
    embeddings = merge_embeddings(
        model.embed_tokens(mx.array([expanded])), expanded, IMAGE, model.encode_images(inputs)
    )
    cache = model.make_cache()
    vision_rows = mx.ones((1, len(expanded)), dtype=mx.bool_)
    logits = model.forward_with_embeddings(embeddings, cache, vision_rows=vision_rows)
    mx.eval(logits)
    model.after_prefill()
    return expanded, inputs, np.array(logits[0]), cache


TWO_IMAGES = "<|user|>Compare <|image|> with <|image|> today, how are you?<|end|><|assistant|>"


def test_two_image_prompt_matches_transformers_with_the_vision_adapter(checkpoint, loaded, images):
    folder, reference = checkpoint
    ids = tokenize(folder, TWO_IMAGES)
    expanded, inputs, logits, cache = mlxcel_image_prefill(loaded, ids, images)
    counts = inputs.token_counts
    assert expanded == tokenize(
        folder, TWO_IMAGES.replace("<|image|>", "{}").format(*("<|image|>" * n for n in counts))
    )
    assert len(counts) == 2 and all(n > 273 for n in counts)  # 16x16 global + 16 separators + 1, plus the crops
    ours = mlxcel_greedy_after(loaded, logits, cache, GREEDY)
    pixels = reference_image_inputs(inputs)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([expanded]), **pixels).logits[0].numpy()
        out = reference.generate(
            input_ids=torch.tensor([expanded]),
            **pixels,
            max_new_tokens=GREEDY,
            min_new_tokens=GREEDY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        with reference.disable_adapter():  # the adapter must matter, or this test proves nothing about it
            without = reference(input_ids=torch.tensor([expanded]), **pixels).logits[0].numpy()
    assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE
    assert np.abs(without - expected).max() > 0.05
    assert ours == out[0, len(expanded) :].tolist()
    assert len(set(ours)) >= 3


def test_text_prompt_runs_the_base_model(checkpoint, loaded):
    folder, reference = checkpoint
    ids = tokenize(folder, "<|user|>Hello, world! How are you today?<|end|><|assistant|>")
    with torch.no_grad(), reference.disable_adapter():
        expected = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
        out = reference.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=GREEDY,
            min_new_tokens=GREEDY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    got = np.array(loaded(mx.array([ids]), loaded.make_cache())[0])
    assert np.abs(got - expected).max() <= LOGIT_TOLERANCE
    assert mlxcel_generate(loaded, [ids], GREEDY)[0] == out[0, len(ids) :].tolist()


def test_vision_stage_is_not_read_for_text(checkpoint):
    model = load_model(str(checkpoint[0]), dtype="float32").model
    assert is_vision_model(model) and model.vision_modules == ("image_embed",)
    assert not model._lora_loaded  # the adapter is read at the first image
    assert all(layer.self_attn.qkv_proj.lora is None for layer in model.model.layers)


# ---- the LoRA layers ------------------------------------------------------------------------------


def make_adapted_layer(control: LoRAControl, in_dims: int = 64, out_dims: int = 96) -> nn.Module:
    layer = make_lora_linear(in_dims, out_dims, True, control)
    layer.lora = LoRAWeights(
        mx.random.normal((8, in_dims), key=mx.random.key(1)) * 0.1,
        mx.random.normal((out_dims, 8), key=mx.random.key(2)) * 0.1,
        2.0,
    )
    return layer


def test_lora_forms_agree_with_the_merged_weight():
    control = LoRAControl()
    layer = make_adapted_layer(control)
    x = mx.random.normal((2, 20, 64), key=mx.random.key(3))  # 40 tokens: merging (64 x 96) is the cheaper form
    merged = np.array(x @ (layer.weight + 2.0 * layer.lora.b @ layer.lora.a).T + layer.bias)
    plain = np.array(x @ layer.weight.T + layer.bias)
    assert np.allclose(np.array(layer(x)), plain, atol=1e-5)  # rows None: the base layer
    control.rows, control.fused = mx.ones((2, 1, 1)), True
    fused = np.array(layer(x))
    control.fused = False
    unfused = np.array(layer(x))
    assert np.abs(fused - merged).max() < 1e-4 and np.abs(unfused - merged).max() < 1e-4
    assert np.abs(merged - plain).max() > 0.1
    control.rows = mx.array([1.0, 0.0]).reshape(2, 1, 1)  # per row: the second row is plain
    mixed = np.array(layer(x))
    assert np.abs(mixed[0] - merged[0]).max() < 1e-4 and np.abs(mixed[1] - plain[1]).max() < 1e-5


def test_merge_only_where_it_is_cheaper():
    from mlxcel.models.lora import is_merge_cheaper

    assert is_merge_cheaper(40, 96, 64) and not is_merge_cheaper(38, 96, 64)  # 96 * 64 / 160 = 38.4
    assert not is_merge_cheaper(1, 5120, 3072) and is_merge_cheaper(
        2048, 5120, 3072
    )  # Phi-4's qkv: decode vs a 2k piece


def test_quantized_lora_layer_keeps_its_adapter_and_runs_unfused():
    control = LoRAControl(rows=mx.ones((1, 1, 1)), fused=True)
    layer = make_adapted_layer(control)
    x = mx.random.normal((1, 3, 64), key=mx.random.key(4))
    dense = np.array(layer(x))
    quantized = layer.to_quantized(group_size=32, bits=8)
    assert isinstance(quantized, nn.QuantizedLinear) and quantized.lora is layer.lora
    assert "lora" not in dict(quantized.parameters())  # the adapter is not a checkpoint parameter
    assert np.abs(np.array(quantized(x)) - dense).max() < 0.05


def test_after_prefill_unfuses_for_decoding(checkpoint, loaded, images):
    folder, _ = checkpoint
    ids = tokenize(folder, "<|user|><|image|>Describe it.<|end|><|assistant|>")
    seen = []
    original = type(loaded).after_prefill

    def spy(self):
        seen.append(self.lora_control.fused)
        original(self)

    type(loaded).after_prefill = spy
    try:
        mlxcel_image_prefill(loaded, ids, images[1:])
    finally:
        type(loaded).after_prefill = original
    assert seen == [True] and loaded.lora_control.fused is False


# ---- files ----------------------------------------------------------------------------------------


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_images_need_the_adapter_and_the_processor_config(checkpoint, images, tmp_path):
    folder = copy_checkpoint(checkpoint[0], tmp_path / "no_lora")
    shutil.rmtree(folder / "vision-lora")
    model = load_model(str(folder), dtype="float32").model
    with pytest.raises(MlxcelError, match=r"vision-lora/adapter_config.json: missing"):
        model.preprocess_images(images[:1], ["photo.jpg"])
    folder = copy_checkpoint(checkpoint[0], tmp_path / "no_preprocessor")
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(MlxcelError, match="no preprocessor_config.json"):
        load_model(str(folder), dtype="float32").model.preprocess_images(images[:1], ["photo.jpg"])


def test_adapter_for_another_model_is_refused(checkpoint, images, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copy_checkpoint(checkpoint[0], tmp_path / "wrong")
    path = folder / "vision-lora" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("qkv_proj.lora_A.weight"))
    tensors[key] = np.zeros((8, 32), np.float32)
    save_file(tensors, path)
    with pytest.raises(MlxcelError, match=r"qkv_proj has lora_A \(8, 32\).*layer is 64 -> "):
        load_model(str(folder), dtype="float32").model.preprocess_images(images[:1], ["photo.jpg"])
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = np.zeros((8, 64), np.float32)
    tensors[key] = load_file(checkpoint[0] / "vision-lora" / "adapter_model.safetensors")[key]
    save_file(tensors, path)
    with pytest.raises(MlxcelError, match="targets model.embed_tokens, which is not an adapted layer"):
        load_model(str(folder), dtype="float32").model.preprocess_images(images[:1], ["photo.jpg"])
    config = json.loads((checkpoint[0] / "vision-lora" / "adapter_config.json").read_text())
    (folder / "vision-lora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(MlxcelError, match="use_dora are not supported"):
        load_model(str(folder), dtype="float32").model.preprocess_images(images[:1], ["photo.jpg"])


# ---- end to end through mlxcel-run ----------------------------------------------------------------


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_prompt_images_generate_as_transformers(tmp_path, checkpoint, photo_path):
    folder, reference = checkpoint
    result = run_cli(
        tmp_path,
        "model=phi4_multimodal",
        f"model.path={folder}",
        "model.max_context=4096",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        "prompt.text=Describe it.",
        f"prompt.images=[{photo_path}]",
    )
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    assert row["prompt"] == "<|user|><|image|>Describe it.<|end|><|assistant|>"
    ids = row["prompt_token_ids"]
    model = load_model(str(folder), dtype="float32").model
    inputs = model.preprocess_images([load_image(photo_path)], [str(photo_path)])
    assert ids == expand_placeholders(tokenize(folder, row["prompt"]), IMAGE, inputs.token_counts)
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.tensor([ids]),
            **reference_image_inputs(inputs),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert row["token_ids"] == out[0, len(ids) :].tolist()
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == inputs.token_counts[0] and stats["prompt_tokens"] == len(ids)
    assert stats["image_preprocess_ms"] > 0 and stats["vision_encode_ms"] > 0


def test_mixed_batch_rows_equal_their_runs_alone(tmp_path, checkpoint, photo_path, odd_images):
    """An image row, a text row (no adapter even beside image rows), a two-image conversation and
    a missing image in one batch: the bad row fails alone, every good row gives its tokens alone."""
    folder, _ = checkpoint
    rows = [
        {"id": "photo", "prompt": "Describe it.", "images": [str(photo_path)]},
        {"id": "text", "prompt": "Hello there"},
        {
            "id": "two",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": str(odd_images["gray"])},
                        {"type": "text", "text": "and"},
                        {"type": "image", "path": str(photo_path)},
                    ],
                }
            ],
        },
        {"id": "missing", "prompt": "Describe it.", "images": [str(tmp_path / "nope.png")]},
    ]
    args = (
        "model=phi4_multimodal",
        f"model.path={folder}",
        "model.max_context=4096",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
    )
    assert_batch_rows_equal_their_runs_alone(tmp_path, args, rows, {"missing": "nope.png: no such file"})
    stats = json.loads((tmp_path / "batch" / "run" / "stats.json").read_text())
    assert stats["occupancy"] > 0  # the scheduler ran them, the adapter set per call


def test_quantized_model_keeps_the_vision_adapter(checkpoint, loaded, images):
    from mlxcel.checkpoints.quantize import quantize_at_load
    from mlxcel.models.lora import QuantizedLoRALinear

    folder, _ = checkpoint
    model = load_model(str(folder), dtype="float32").model
    quantize_at_load(model, 8, 32)
    assert all(isinstance(layer.mlp.gate_up_proj, QuantizedLoRALinear) for layer in model.model.layers)
    ids = tokenize(folder, "<|user|><|image|>Describe it.<|end|><|assistant|>")
    _, _, dense, _ = mlxcel_image_prefill(loaded, ids, images[1:])
    _, _, quantized, _ = mlxcel_image_prefill(model, ids, images[1:])
    assert model.model.layers[0].self_attn.qkv_proj.lora is not None  # read after quantizing, onto the quantized layers
    assert np.abs(quantized - dense).max() < 0.1 * np.abs(dense).max()
    assert int(quantized[-1].argmax()) == int(dense[-1].argmax())


def test_original_remote_code_layout_names_the_transformers_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi4mm", "architectures": ["Phi4MMForCausalLM"]}))
    with pytest.raises(MlxcelError, match=r"'phi4mm' is the original remote-code layout.*--revision refs/pr/70"):
        load_model(str(tmp_path))


def test_image_prompt_in_pieces_equals_one_piece(checkpoint, loaded, images):
    """Prefilled in 256-token pieces (the adapter merged per piece) or whole: the same tokens."""
    from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
    from mlxcel.sampling import Sampler

    folder, _ = checkpoint
    ids = tokenize(folder, "<|user|><|image|>Describe it.<|end|><|assistant|>")
    inputs = loaded.preprocess_images(images[:1], ["photo"])
    expanded = expand_placeholders(ids, IMAGE, inputs.token_counts)
    engine = DirectEngine(loaded, max_context=4096)
    results = {}
    for chunk in (256, 4096):
        state = engine.generate(
            GenerationRequest([RowRequest(expanded, images=inputs)], Sampler("greedy"), max_tokens=12, chunk_size=chunk)
        )
        results[chunk] = state.results[0].token_ids
        assert len(state.timings.prefill_pieces) == (-(-len(expanded) // chunk))
    assert results[256] == results[4096] and len(set(results[256])) >= 2


def test_image_row_across_the_longrope_switch_in_the_scheduler(checkpoint, loaded, images, monkeypatch):
    """With the switch moved to just past an image prompt, the image row passes it mid-decode: the
    scheduler runs its sequence again from the kept embeddings (image features included) and,
    beside a text row, gives the batch engine's tokens."""
    from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler

    folder, _ = checkpoint
    ids = tokenize(folder, "<|user|><|image|>Describe it.<|end|><|assistant|>")
    inputs = loaded.preprocess_images(images[:1], ["photo"])
    expanded = expand_placeholders(ids, IMAGE, inputs.token_counts)
    rows = [
        RowRequest(expanded, row_id=0, images=inputs, max_tokens=12),
        RowRequest(tokenize(folder, "<|user|>Hello there<|end|><|assistant|>"), row_id=1, max_tokens=12),
    ]
    greedy = Sampler("greedy")

    def alone() -> list[list[int]]:
        return [
            DirectEngine(loaded, 4096).generate(GenerationRequest([row], greedy)).results[0].token_ids for row in rows
        ]

    limit = len(expanded) + 4  # the image row's 6th generated token passes it
    monkeypatch.setattr(loaded, "longrope_limit", limit)
    for layer in loaded.model.layers:
        monkeypatch.setattr(layer.self_attn.rope, "original_max", limit)
    expected = alone()
    crossed = []
    find = BatchScheduler.find_longrope_crossings
    monkeypatch.setattr(
        BatchScheduler, "find_longrope_crossings", lambda self, batch: crossed.append(find(self, batch)) or crossed[-1]
    )
    scheduled = BatchScheduler(loaded, 4096, 2).generate(GenerationRequest(rows, greedy))
    assert [r.token_ids for r in scheduled.results] == expected
    assert sum(int(c.sum()) for c in crossed) == 1  # the image row passed the switch once, mid-decode
