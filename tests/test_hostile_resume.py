"""Resuming from a run folder that was damaged, and a disk that fills mid-job (issue 38, items 13
and 14). A damaged file is a config error naming the file and line, and a refused resume leaves
the folder byte for byte as it was; a full disk ends the job with one line, leaves no half-written
file, and a resume then writes every row exactly once. In-process, on a tiny random Llama."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from mlxcel.api import load_config
from mlxcel.cli import report_error
from mlxcel.errors import ConfigError, MlxcelError
from mlxcel.runner import run
from tests.helpers import by_key

PROMPTS = [{"prompt": "one"}, {"id": "two", "prompt": "two", "n": 2}, {"prompt": "three"}, {"prompt": "four"}]
TORN = b'{"id": 9, "sample": 0, "te'  # a line a crash cut short (a resume that goes ahead cuts it off)


def job_config(tiny_llama: Path, prompts: Path, *extra: str):
    return load_config(
        {"model": {"path": str(tiny_llama)}},
        [
            "prompt=jsonl",
            f"prompt.file={prompts}",
            "decode.max_tokens=3",
            "decode.ignore_eos=true",
            "runner.max_rows=2",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def finished(tiny_llama, tmp_path_factory) -> Path:
    """A completed job's folder (`run`) beside its prompts (`prompts.jsonl`): 5 rows, one id with 2 samples."""
    base = tmp_path_factory.mktemp("finished")
    (base / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    run(job_config(tiny_llama, base / "prompts.jsonl"), base / "run", stream=None, log=None)
    return base


def copy_run(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished / "run", tmp_path / "run"))


def resume(tiny_llama: Path, finished: Path, folder: Path):
    return run(job_config(tiny_llama, finished / "prompts.jsonl", "runner.resume=true"), folder, stream=None, log=None)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder`: a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def read_lines(folder: Path) -> list[bytes]:
    return (folder / "generations.jsonl").read_bytes().split(b"\n")[:-1]


def assert_one_line(exc: BaseException, code: int, capsys) -> str:
    capsys.readouterr()
    assert report_error(exc, debug=False) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def set_field(number: int, **changes):
    """Line `number` of generations.jsonl with `changes` (a value of ... drops the key)."""

    def damage(lines: list[bytes]) -> list[bytes]:
        row = json.loads(lines[number - 1])
        row.update(changes)
        lines[number - 1] = json.dumps({k: v for k, v in row.items() if v is not ...}).encode()
        return lines

    return damage


def put_line(number: int, data: bytes):
    def damage(lines: list[bytes]) -> list[bytes]:
        lines[number - 1] = data
        return lines

    return damage


def repeat_line(number: int):
    def damage(lines: list[bytes]) -> list[bytes]:
        return [*lines, lines[number - 1]]

    return damage


def bad_utf8(number: int):
    def damage(lines: list[bytes]) -> list[bytes]:
        lines[number - 1] = lines[number - 1].replace(b'"text": "', b'"text": "\xff\xfe', 1)
        return lines

    return damage


@pytest.mark.parametrize(
    "damage, line, words",
    [
        (set_field(2, id=...), 2, "has no id"),
        (set_field(2, id=True), 2, "id"),
        (set_field(2, id=None), 2, "has no id"),
        (put_line(2, b"[1, 2]"), 2, "not a JSON object"),
        (put_line(2, b'"text"'), 2, "not a JSON object"),
        (set_field(3, sample="zero"), 3, "sample"),
        (set_field(3, sample=-1), 3, "sample"),
        (set_field(3, sample=1.5), 3, "sample"),
        (set_field(1, finish_reason=...), 1, "finish_reason"),
        (set_field(1, token_ids=5), 1, "token_ids"),
        (set_field(1, prompt_tokens="12"), 1, "prompt_tokens"),
        (set_field(1, input_sha256=7), 1, "input_sha256"),
        (set_field(1, text=["a"]), 1, "text"),
        (bad_utf8(2), 2, "not UTF-8"),
        (put_line(4, b""), 4, "not valid JSON"),
        (put_line(4, b"[" * 100_000), 4, "not valid JSON"),
        (repeat_line(1), 6, "line 1"),
        (repeat_line(3), 6, "line 3"),
    ],
    ids=[
        "no-id",
        "bool-id",
        "null-id",
        "array",
        "string",
        "sample-zero",
        "sample-negative",
        "sample-float",
        "no-finish-reason",
        "token-ids-int",
        "prompt-tokens-str",
        "hash-int",
        "text-list",
        "non-utf8",
        "blank",
        "nested",
        "repeated-first",
        "repeated-sample",
    ],
)
def test_a_damaged_generations_file_refuses_the_resume_and_changes_nothing(
    tiny_llama, finished, tmp_path, capsys, damage, line, words
):
    """Each damage with a torn last line after it: the resume used to cut the torn line off
    before it read the rest (and refused only then, the file already changed)."""
    folder = copy_run(finished, tmp_path)
    lines = damage(read_lines(folder))
    (folder / "generations.jsonl").write_bytes(b"\n".join(lines) + b"\n" + TORN)
    before = snapshot(folder)
    with pytest.raises(ConfigError) as raised:
        resume(tiny_llama, finished, folder)
    err = assert_one_line(raised.value, 2, capsys)
    assert f"generations.jsonl line {line}" in err and words in err, err
    assert snapshot(folder) == before


def test_a_repeated_row_is_not_counted_twice(tiny_llama, finished, tmp_path):
    """The same (id, sample) twice: refused, where it used to count as one written row (and the
    job's stats counted its tokens twice)."""
    folder = copy_run(finished, tmp_path)
    lines = read_lines(folder)
    (folder / "generations.jsonl").write_bytes(b"\n".join([*lines[:2], *lines]) + b"\n")
    with pytest.raises(ConfigError, match=r"generations\.jsonl line 3: repeats the row of line 1"):
        resume(tiny_llama, finished, folder)


def test_generations_jsonl_as_a_folder_refuses_the_resume(tiny_llama, finished, tmp_path, capsys):
    folder = copy_run(finished, tmp_path)
    (folder / "generations.jsonl").unlink()
    (folder / "generations.jsonl").mkdir()
    before = snapshot(folder)
    with pytest.raises(ConfigError) as raised:
        resume(tiny_llama, finished, folder)
    assert "generations.jsonl" in assert_one_line(raised.value, 2, capsys)
    assert snapshot(folder) == before


@pytest.mark.parametrize(
    "name, data, words",
    [
        ("config.resolved.json", b'{"model": {"path": ', "line 1"),
        ("config.resolved.json", b"[1, 2]\n", "not a JSON object"),
        ("config.resolved.json", b'{"model": "\xff"}\n', "not UTF-8"),
        ("config.resolved.json", b'{\n"model": 1,\n"model": 2\n}\n', "'model' appears twice"),
        ("config.resolved.json", None, "config.resolved.json"),
        ("stats.json", b'{"status": "compl', "line 1"),
        ("stats.json", b"[1, 2]\n", "not a JSON object"),
        ("stats.json", b'{"status": "completed", "sessions": 5}\n', "sessions"),
        ("stats.json", b'{"status": "completed", "sessions": [{"prefill_time_ms": "x"}]}\n', "sessions"),
        ("stats.json", b'{"status": "completed", "decode_time_ms": [1]}\n', "decode_time_ms"),
        ("stats.json", None, "stats.json"),
    ],
    ids=[
        "config-torn",
        "config-array",
        "config-non-utf8",
        "config-repeated-key",
        "config-folder",
        "stats-torn",
        "stats-array",
        "stats-sessions-int",
        "stats-session-time",
        "stats-time-list",
        "stats-folder",
    ],
)
def test_a_damaged_run_file_refuses_the_resume_and_changes_nothing(
    tiny_llama, finished, tmp_path, capsys, name, data, words
):
    """config.resolved.json (what the resume compares) and stats.json (whose earlier sessions a
    resume keeps): `data` None makes the file a folder. A torn last row must stay too."""
    folder = copy_run(finished, tmp_path)
    (folder / name).unlink()
    if data is None:
        (folder / name).mkdir()
    else:
        (folder / name).write_bytes(data)
    (folder / "generations.jsonl").write_bytes(b"\n".join(read_lines(folder)[:2]) + b"\n" + TORN)
    before = snapshot(folder)
    with pytest.raises(ConfigError) as raised:
        resume(tiny_llama, finished, folder)
    err = assert_one_line(raised.value, 2, capsys)
    assert name in err and words in err, err
    assert snapshot(folder) == before


def test_a_resume_reads_rows_whose_text_holds_line_separators(tiny_llama, finished, tmp_path):
    """U+2028, U+0085 and friends are written as they are (ensure_ascii=False): str.splitlines
    split such a row in two, and the resume called the file damaged."""
    folder = copy_run(finished, tmp_path)
    lines = read_lines(folder)
    row = json.loads(lines[0])
    row["text"] = "a\u2028b\x85c\u2029d\x1ce"
    (folder / "generations.jsonl").write_bytes(json.dumps(row, ensure_ascii=False).encode() + b"\n" + lines[1] + b"\n")
    resume(tiny_llama, finished, folder)
    rows = [json.loads(line) for line in read_lines(folder)]
    assert rows[0]["text"] == row["text"]
    assert sorted(by_key(rows)) == sorted(by_key(json.loads(line) for line in read_lines(finished / "run")))
    assert len(rows) == 5 and json.loads((folder / "stats.json").read_text())["rows"] == 5


# ---- a full disk ----
class FullDisk:
    """open() for a disk that fills: after `rows` writes to generations.jsonl every write into the
    run folder writes half its data and raises ENOSPC, as write(2) does past the last free block
    (`stats=False`: stats.json's writes still fit)."""

    def __init__(self, folder: Path, rows: int, stats: bool = True):
        self.folder, self.rows_left, self.stats = folder.absolute(), rows, stats
        self.real_open = builtins.open

    def open(self, file, mode="r", *args, **kwargs):
        f = self.real_open(file, mode, *args, **kwargs)
        if isinstance(file, int) or not any(c in mode for c in "wax"):
            return f
        path = Path(file).absolute()
        if path.parent != self.folder:
            return f
        return FillingFile(f, self, path.name.startswith("generations.jsonl"), path)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(builtins, "open", self.open)
        monkeypatch.setattr(io, "open", self.open)  # (pathlib's)


class FillingFile:
    def __init__(self, f, disk: FullDisk, rows: bool, path: Path):
        self.f, self.disk, self.rows, self.path = f, disk, rows, path

    def write(self, data):
        full = self.disk.rows_left <= 0 and (self.rows or self.disk.stats)
        if not full:
            if self.rows:
                self.disk.rows_left -= 1
            return self.f.write(data)
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def run_out_of_space(tiny_llama, finished, tmp_path, monkeypatch, rows: int, stats: bool) -> tuple[Path, BaseException]:
    folder = tmp_path / "run"
    FullDisk(folder, rows, stats).install(monkeypatch)
    with pytest.raises(MlxcelError) as raised:
        run(job_config(tiny_llama, finished / "prompts.jsonl"), folder, stream=None, log=None)
    monkeypatch.undo()
    return folder, raised.value


def assert_resume_writes_every_row_once(tiny_llama, finished, folder: Path) -> None:
    resume(tiny_llama, finished, folder)
    rows = [json.loads(line) for line in read_lines(folder)]
    full = by_key(json.loads(line) for line in read_lines(finished / "run"))
    assert len(rows) == len(full) and sorted(by_key(rows)) == sorted(full)  # none lost, none twice
    assert {k: r["token_ids"] for k, r in by_key(rows).items()} == {k: r["token_ids"] for k, r in full.items()}
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["rows"] == len(full)


@pytest.mark.parametrize("rows", [0, 2, 4])
def test_a_disk_full_mid_job_ends_in_one_line_with_stats_and_a_resume_writes_each_row_once(
    tiny_llama, finished, tmp_path, monkeypatch, capsys, rows
):
    folder, exc = run_out_of_space(tiny_llama, finished, tmp_path, monkeypatch, rows, stats=False)
    err = assert_one_line(exc, 1, capsys)
    assert "no space left" in err.lower() and "runner.resume=true" in err, err
    assert len(read_lines(folder)) == rows
    assert not (folder / "generations.jsonl").read_bytes() or (folder / "generations.jsonl").read_bytes()[-1:] == b"\n"
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["status"] == "failed" and "No space left" in stats["error"]["message"]
    assert_resume_writes_every_row_once(tiny_llama, finished, folder)


@pytest.mark.parametrize("rows", [2, 5])
def test_a_disk_too_full_for_stats_leaves_no_tmp_file_and_a_resume_writes_each_row_once(
    tiny_llama, finished, tmp_path, monkeypatch, capsys, rows
):
    """rows=5: every row fits and the final stats.json does not."""
    folder, exc = run_out_of_space(tiny_llama, finished, tmp_path, monkeypatch, rows, stats=True)
    err = assert_one_line(exc, 1, capsys)
    assert "no space left" in err.lower(), err
    assert len(read_lines(folder)) == rows
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "config.resolved.json", "generations.jsonl"]
    assert_resume_writes_every_row_once(tiny_llama, finished, folder)


def test_failure_stats_on_a_full_disk_are_given_up_quietly(tmp_path, monkeypatch):
    """cli.main writes a claimed folder's failure stats after the run's own attempt: a second
    ENOSPC there escaped its handler as a traceback."""
    from mlxcel.outputs import write_failure_stats

    FullDisk(tmp_path, 0).install(monkeypatch)
    write_failure_stats(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a subprocess: the exit code and the one line, and Hydra's .hydra/ left alone too
def test_the_cli_refuses_a_damaged_resume_with_exit_2_and_changes_nothing(tiny_llama, finished, tmp_path):
    import subprocess
    import sys

    from tests.helpers import assert_one_line_error

    prompts = finished / "prompts.jsonl"
    args = [
        f"model.path={tiny_llama}",
        "prompt=jsonl",
        f"prompt.file={prompts}",
        "decode.max_tokens=3",
        "decode.ignore_eos=true",
        "runner.max_rows=2",
        "hydra.run.dir=run",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("MLXCEL_DEBUG", None)

    def mlxcel(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "mlxcel", *args, *extra]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert mlxcel().returncode == 0
    folder = tmp_path / "run"
    lines = set_field(2, sample="zero")(read_lines(folder))
    (folder / "generations.jsonl").write_bytes(b"\n".join(lines) + b"\n" + TORN)
    before = snapshot(folder)
    result = mlxcel("runner.resume=true")
    assert_one_line_error(result, 2, "generations.jsonl line 2: has sample 'zero', not an integer")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert snapshot(folder) == before


def test_a_batch_file_job_on_a_full_disk_leaves_no_tmp_file_and_resumes(tiny_llama, tmp_path, monkeypatch, capsys):
    """An OpenAI batch file's job rebuilds batch_output.jsonl as it ends, also when it fails: on a
    full disk that write failed too and left batch_output.jsonl.tmp behind."""
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "t", "prompt": p}}
        for i, p in enumerate(["one", "two", "three"])
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    folder = tmp_path / "run"
    FullDisk(folder, 1).install(monkeypatch)
    with pytest.raises(MlxcelError) as raised:
        run(job_config(tiny_llama, tmp_path / "batch.jsonl"), folder, stream=None, log=None)
    monkeypatch.undo()
    assert "no space left" in assert_one_line(raised.value, 1, capsys).lower()
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "config.resolved.json", "generations.jsonl"]
    assert len(read_lines(folder)) == 1
    run(job_config(tiny_llama, tmp_path / "batch.jsonl", "runner.resume=true"), folder, stream=None, log=None)
    assert sorted(json.loads(line)["id"] for line in read_lines(folder)) == ["req-0", "req-1", "req-2"]
    out = [json.loads(line) for line in (folder / "batch_output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
