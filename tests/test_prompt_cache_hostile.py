"""The prompt cache folder (`runner.prompt_cache_dir`) is untrusted input (issue 38, item 15): a
file with the right name but other arrays (inner shape, rank, dtype), damaged values (zeroed,
NaN) or no checksum is skipped with one line and the job's tokens are the cache-off run's; a
folder that cannot be used (a file, read-only, a full disk) is said once and the job completes.
Whole jobs run in-process on the tiny Llama in fp32 on the CPU."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine import prompt_cache_files
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.prompt_cache_files import checksum_arrays, load_entries, save_entries

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)

SYSTEM = "You answer questions about capitals, briefly and without any preamble at all, please. " * 2
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a city."]
PREFIX = "mlxcel: prompt cache: "


def write_rows(folder: Path) -> Path:
    rows = folder / "rows.jsonl"
    if not rows.exists():
        system = {"role": "system", "content": SYSTEM}
        lines = [{"id": i, "messages": [system, {"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
        rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return rows


def run_job(tiny_llama, tmp_path: Path, name: str, cache_dir: Path | None) -> tuple[str, list[dict]]:
    """(stats.json's status, the rows in id order)."""
    from mlxcel.api import load_config
    from mlxcel.runner import run

    overrides = [
        f"prompt.file={write_rows(tmp_path)}",
        "decode.max_tokens=6",
        "decode.ignore_eos=true",
        "model.dtype=float32",
        "runner.device=cpu",
        "runner.progress=off",
    ]
    if cache_dir is not None:
        overrides.append(f"runner.prompt_cache_dir={cache_dir}")
    cfg = load_config({"model": {"path": str(tiny_llama)}}, overrides)
    try:
        run(cfg, tmp_path / name, stream=None, log=None)
    except Exception as exc:  # the status says it (and the test's output shows what it was)
        print(f"the job raised {exc!r}")
    stats = json.loads((tmp_path / name / "stats.json").read_text())
    written = tmp_path / name / "generations.jsonl"
    lines = written.read_text().splitlines() if written.exists() else []
    return stats["status"], sorted((json.loads(line) for line in lines), key=lambda r: r["id"])


def tokens(rows: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in rows]


def cache_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(PREFIX)]


@pytest.fixture(scope="module")
def cache_off(tiny_llama, tmp_path_factory) -> list[dict]:
    status, rows = run_job(tiny_llama, tmp_path_factory.mktemp("off"), "off", None)
    assert status == "completed"
    return rows


def entry_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("*.safetensors") if not p.name.startswith("."))


def rewrite(path: Path, change, keep_checksum: bool = False) -> None:
    """Write `path` again under its own name with change(name, array) for each array; its checksum
    is computed anew (a consistent file) unless `keep_checksum` (a damaged one)."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    arrays = {name: change(name, a) for name, a in arrays.items()}
    if not keep_checksum:
        metadata = {**metadata, "sha256": checksum_arrays(arrays)}
    mx.save_safetensors(str(path), arrays, metadata=metadata)


CHANGES = {
    "inner shape": lambda name, a: a[..., : a.shape[-1] // 2],
    "rank": lambda name, a: a.reshape(a.shape[0], -1),
    "one more axis": lambda name, a: a[..., None],
    "dtype": lambda name, a: a.astype(mx.float16),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_an_entry_with_other_arrays_is_skipped_with_a_line(tiny_llama, tmp_path, capsys, cache_off, change):
    cache_dir = tmp_path / "cache"
    status, first = run_job(tiny_llama, tmp_path, "first", cache_dir)
    assert status == "completed" and tokens(first) == tokens(cache_off)
    files = entry_files(cache_dir)
    assert files
    for path in files:
        rewrite(path, CHANGES[change])
    capsys.readouterr()
    status, second = run_job(tiny_llama, tmp_path, "second", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(second) == tokens(cache_off)
    assert all(r["cached_tokens"] == 0 for r in second[:1])  # nothing adopted from the disk
    assert len(lines) == len(files) and all("do not match" in line for line in lines), lines


@pytest.mark.parametrize("damage", ["zeroed", "nan"])
def test_damaged_values_fail_the_checksum(tiny_llama, tmp_path, capsys, cache_off, damage):
    cache_dir = tmp_path / "cache"
    run_job(tiny_llama, tmp_path, "first", cache_dir)
    files = entry_files(cache_dir)
    value = 0.0 if damage == "zeroed" else float("nan")
    for path in files:
        rewrite(path, lambda name, a: mx.full(a.shape, value, a.dtype), keep_checksum=True)
    capsys.readouterr()
    status, second = run_job(tiny_llama, tmp_path, "second", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(second) == tokens(cache_off)
    assert second[0]["cached_tokens"] == 0  # the first row found nothing to adopt
    assert len(lines) == len(files) and all("checksum" in line for line in lines), lines


def test_non_finite_values_are_refused_even_with_a_matching_checksum(tiny_llama, tmp_path, capsys, cache_off):
    cache_dir = tmp_path / "cache"
    run_job(tiny_llama, tmp_path, "first", cache_dir)
    files = entry_files(cache_dir)
    for path in files:
        rewrite(path, lambda name, a: mx.full(a.shape, float("inf"), a.dtype))
    capsys.readouterr()
    status, second = run_job(tiny_llama, tmp_path, "second", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(second) == tokens(cache_off)
    assert len(lines) == len(files) and all("NaN or infinite" in line for line in lines), lines


def test_an_entry_without_a_checksum_is_a_miss(tiny_llama, tmp_path, capsys, cache_off):
    cache_dir = tmp_path / "cache"
    run_job(tiny_llama, tmp_path, "first", cache_dir)
    files = entry_files(cache_dir)
    for path in files:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        mx.save_safetensors(str(path), arrays, metadata={k: v for k, v in metadata.items() if k != "sha256"})
    capsys.readouterr()
    status, second = run_job(tiny_llama, tmp_path, "second", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(second) == tokens(cache_off) and second[0]["cached_tokens"] == 0
    assert len(lines) == len(files) and all("no checksum" in line for line in lines), lines
    # the job wrote its own entries again, under the same names: the next job adopts them
    status, third = run_job(tiny_llama, tmp_path, "third", cache_dir)
    assert tokens(third) == tokens(cache_off) and third[0]["cached_tokens"] > 0


def test_a_cache_dir_that_is_a_file_is_said_at_start_and_the_job_completes(tiny_llama, tmp_path, capsys, cache_off):
    cache_dir = tmp_path / "not-a-folder"
    cache_dir.write_text("mine")
    status, rows = run_job(tiny_llama, tmp_path, "run", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(rows) == tokens(cache_off)
    assert len(lines) == 1 and str(cache_dir) in lines[0], lines
    assert cache_dir.read_text() == "mine"


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_a_folder_that_refuses_writes_is_said_once_and_the_job_completes(
    tiny_llama, tmp_path, capsys, monkeypatch, cache_off, code
):
    """(Running as root, chmod does not stop writes: the file's writes fail as the system's would.)"""

    class Refusing:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115 (closed in __exit__)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            if code == errno.ENOSPC:
                self.file.write(bytes(data)[:10])  # a part made it to the disk
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(prompt_cache_files, "open_entry", Refusing)
    cache_dir = tmp_path / "cache"
    status, rows = run_job(tiny_llama, tmp_path, "run", cache_dir)
    lines = cache_lines(capsys.readouterr().err)
    assert status == "completed" and tokens(rows) == tokens(cache_off)
    assert len(lines) == 1 and os.strerror(code) in lines[0], lines
    assert not [p for p in cache_dir.rglob("*") if p.is_file()]  # no partial file left behind


def test_a_refused_folder_is_said_once_per_cache_not_per_save(tmp_path, capsys, monkeypatch):
    def refuse(path, mode):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(prompt_cache_files, "open_entry", refuse)
    cache = PromptCache(1 << 20)
    layer = [mx.ones((4, 2, 8)), mx.ones((4, 2, 8))]
    cache.insert(np.arange(4), 0, [layer])
    assert save_entries(cache, tmp_path, "key") == 0
    cache.insert(np.arange(8), 4, [layer])
    assert save_entries(cache, tmp_path, "key") == 0  # a chat's next turn
    lines = cache_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "read-only" in lines[0].lower(), lines


def test_files_that_are_not_regular_files_are_skipped(tmp_path, capsys):
    """A FIFO named like an entry would block the job's start forever."""
    target = tmp_path / "key"
    target.mkdir()
    os.mkfifo(target / ("a" * 32 + "-0.safetensors"))
    (target / ("b" * 32 + "-0.safetensors")).mkdir()
    layout = [[((2, 8), mx.float32)] * 2]
    assert load_entries(PromptCache(1 << 20), tmp_path, "key", layout) == 0
    lines = cache_lines(capsys.readouterr().err)
    assert len(lines) == 2 and all("not a regular file" in line for line in lines), lines


@pytest.mark.parametrize(
    "token_ids",
    ['{"a": 1}', "[1.5, 2]", "[99999999999999999999]", "[-1, 2]", '"12"', "[[1], [2, 3]]", "not json"],
)
def test_token_ids_that_are_not_token_ids_are_skipped(tmp_path, capsys, token_ids):
    arrays = {"0.0": mx.ones((2, 2, 8)), "0.1": mx.ones((2, 2, 8))}
    metadata = {"format": str(prompt_cache_files.FORMAT_VERSION), "model_key": "key", "start": "0"}
    metadata.update(token_ids=token_ids, sha256=checksum_arrays(arrays))
    (tmp_path / "key").mkdir()
    mx.save_safetensors(str(tmp_path / "key" / ("c" * 32 + "-0.safetensors")), arrays, metadata=metadata)
    layout = [[((2, 8), mx.float32)] * 2]
    assert load_entries(PromptCache(1 << 20), tmp_path, "key", layout) == 0
    lines = cache_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "ignoring" in lines[0], lines
