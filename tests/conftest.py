"""Shared fixtures: tiny random checkpoints written by HF transformers' save_pretrained, so the
real loaders read real file formats and transformers is the oracle. Nothing downloads."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import pytest

# pytest rewrites the asserts of test modules only: these helpers' asserts should show values on
# failure too, and registering works only before a module's first import (for helpers: just below).
pytest.register_assert_rewrite("tests.helpers", "tests.family_fixtures", "tests.vision_fixtures")
from tests.helpers import make_tiny_checkpoint  # noqa: E402 -- after register_assert_rewrite

# The parity tests compare float32 logits within 1e-3. MLX runs float32 matmuls as TF32 on CUDA
# GPUs and M5-class Macs unless MLX_ENABLE_TF32=0 (~1e-3 relative per product: Qwen3 tiny
# checkpoint 0.0125 off on the H200 with it on). Set before MLX reads it; CPU runs are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# Under pytest-xdist (`pytest -m cuda -n 8` on a GPU) each worker gets its own CUDA kernel cache:
# MLX writes its compiled kernels to the folder in place, with no rename, so a worker could load a
# file another is still writing. Set before MLX's first compile reads it.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    os.environ.setdefault("MLX_PTX_CACHE_DIR", os.path.join(tempfile.gettempdir(), "mlx-ptx", worker))
    if mx.default_device() == mx.gpu:
        # one GPU, several processes that each take it for theirs: MLX's allocator keeps freed
        # buffers cached up to its memory limit, so the workers' caches together ran the H100 out of
        # memory (cudaMallocAsync, then illegal accesses in every later test of that worker)
        from mlxcel.engine.scheduler import device_memory_bytes

        share = device_memory_bytes() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        mx.set_memory_limit(share)
        mx.set_cache_limit(share // 4)


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


@pytest.fixture(scope="module")
def on_the_cpu():
    """The module's tests run on the CPU: exactness is promised in fp32 there; on a GPU kernels
    differ with the batch (test_paged_attention checks the CUDA path)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)
