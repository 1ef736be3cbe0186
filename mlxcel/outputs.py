"""The run folder: config.resolved.json, generations.jsonl (one line per finished row,
flushed as it lands), stats.json (written atomically, also when a run fails), and `.lock`, which
the run holds (an OS file lock) from before Hydra writes into the folder to the run's end, so two
runs never write one folder."""

from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from mlxcel.errors import ConfigError, ConfigIssue, Terminated

CONFIG_FILE = "config.resolved.json"
GENERATIONS_FILE = "generations.jsonl"
STATS_FILE = "stats.json"
PROMPTS_FILE = "prompts.jsonl"
LOCK_FILE = ".lock"
# stats.json's headline figures, first in the file and the sweep summary's columns
HEADLINE_FIELDS = (
    "prompt_tokens",
    "generated_tokens",
    "prefill_time_ms",
    "decode_time_ms",
    "prefill_tok_per_sec",
    "decode_tok_per_sec",
    "ttft_ms",
    "peak_memory_gb",
)
# Keys that may change between a run and its resumption: they do not change what a row contains.
# runner.batch_size is runner.max_rows's old name, still in folders written before it was renamed;
# model.families only checks the checkpoint, model.hub_ids only words an error (folders written before them have none);
# every decode step (eager, segmented, compiled) gives the same tokens (tests/test_segmented_decode.py).
RESUMABLE_KEYS = (
    "runner.resume",
    "runner.progress",
    "runner.max_rows",
    "runner.batch_size",
    "runner.dry_run",
    "model.families",
    "model.hub_ids",
    "decode.step",
    "decode.resolved_step",
    # the prompt cache changes no row's tokens (tests/test_prompt_cache.py)
    "runner.prompt_cache",
    "runner.prompt_cache_gb",
    "runner.prompt_cache_dir",
)


_HELD_LOCKS: dict[Path, int] = {}  # run folder -> the open file this process locks it through


def lock_run_folder(folder: Path) -> None:
    """Lock `folder` for this process until release_run_folder (creating the folder); a folder
    another process holds is a config error. Locking a folder this process holds is a no-op."""
    folder = Path(folder).absolute()
    if folder in _HELD_LOCKS:
        return
    try:
        import fcntl
    except ImportError:  # not a POSIX system: MLX runs on macOS and Linux
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            ConfigIssue(
                "hydra.run.dir",
                "another mlxcel run is writing to this folder; wait for it to end or pick another folder",
                str(folder),
            )
        ) from None
    _HELD_LOCKS[folder] = fd


def release_run_folder(folder: Path) -> None:
    """The run is over: other runs may take the folder (its .lock file stays: removing it would
    let two runs lock two different files)."""
    fd = _HELD_LOCKS.pop(Path(folder).absolute(), None)
    if fd is not None:
        os.close(fd)


def check_not_input(folder: Path, inputs: list[Path]) -> None:
    """No file a run writes may be one it reads (a dry run into the input's folder once wrote
    prompts.jsonl over its own prompts.jsonl)."""
    written = {(Path(folder) / name).absolute() for name in (CONFIG_FILE, GENERATIONS_FILE, STATS_FILE, PROMPTS_FILE)}
    for path in inputs:
        if Path(path).expanduser().absolute() in written:
            raise ConfigError(
                ConfigIssue(
                    "prompt.file",
                    f"is a file this run writes ({Path(path).name} in its run folder); move the input or pick another "
                    "hydra.run.dir",
                    str(path),
                )
            )


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class RunOutputs:
    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, resolved: dict) -> None:
        write_json_atomic(self.dir / CONFIG_FILE, resolved)

    def append_generation(self, row: dict) -> None:
        with defer_interrupt(), open(self.dir / GENERATIONS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_stats(self, stats: dict) -> None:
        write_json_atomic(self.dir / STATS_FILE, stats)

    def write_prompts(self, rows: list[dict]) -> None:
        with open(self.dir / PROMPTS_FILE, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def read_rows(self) -> list[dict]:
        path = self.dir / GENERATIONS_FILE
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []

    def read_sessions(self) -> list[dict]:
        """The earlier sessions of a job being resumed, from the stats.json the last one left."""
        from mlxcel.stats import summarize_session

        try:
            previous = json.loads((self.dir / STATS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return previous.get("sessions") or [summarize_session(previous)]

    def read_done_keys(self) -> dict[tuple[str, int], str | None]:
        """(id, sample) of every row already written, with the hash of the input row it answered
        (None in folders written before rows kept one). A torn last line (a crash mid-write) is
        cut off the file, so appended rows start on a line of their own and that row runs again."""
        path = self.dir / GENERATIONS_FILE
        if not path.exists():
            return {}
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            with open(path, "r+b") as f:
                f.truncate(len(data))
        keys, kept = {}, []
        for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(
                    ConfigIssue(f"{path} line {number}", "is not valid JSON; the file was edited or damaged", line[:60])
                ) from None
            if row.get("finish_reason") == "interrupted":
                continue  # a single prompt's partial row: it runs again, in its place
            keys[(str(row["id"]), int(row.get("sample", 0)))] = row.get("input_sha256")
            kept.append(line)
        if len(kept) < data.count(b"\n"):
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, path)
        return keys


def claim_run_folder(
    out_dir: Path, resolved: dict, resume: bool, inputs: list[Path], rows: dict[tuple[str, int], str]
) -> set[tuple[str, int]]:
    """Everything that may refuse a start, before the run writes a byte: the folder's lock, the
    input files, and a fresh folder (or, resuming, one holding a run of the same config whose
    written rows answer the input's rows as they are now). `rows`: the job's (id, sample) ->
    hash_row. Returns the rows already written (resuming)."""
    check_not_input(out_dir, inputs)
    check_run_folder(out_dir) if resume else check_fresh(
        out_dir
    )  # before the lock file: a refused folder stays as it was
    lock_run_folder(out_dir)
    if not resume:
        check_fresh(out_dir)  # again, now that no other run can start writing it
        return set()
    done = check_resume(RunOutputs(out_dir), resolved)
    check_same_rows(done, rows)
    return set(done)


def check_same_rows(done: dict[tuple[str, int], str | None], rows: dict[tuple[str, int], str]) -> None:
    """A written row must answer the input row of its id as it is now (an edited file, say a line
    inserted above id-less rows, would mix answers and prompts); rows written before hashes were
    kept are taken as they are."""
    changed = sorted(
        key[0] for key, digest in done.items() if key in rows and digest is not None and digest != rows[key]
    )
    gone = sorted(key[0] for key in done if key not in rows)
    issues = []
    if changed:
        issues.append(
            ConfigIssue(
                "runner.resume",
                f"the input's rows changed since they were answered: ids {', '.join(dict.fromkeys(changed))}",
                has_value=False,
            )
        )
    if gone:
        issues.append(
            ConfigIssue(
                "runner.resume",
                f"written rows are not in the input any more: ids {', '.join(dict.fromkeys(gone))}",
                has_value=False,
            )
        )
    if issues:
        raise ConfigError(issues, hint="fix: resume with the input as it was, or start a new run (a new hydra.run.dir)")


def check_fresh(folder: Path) -> None:
    """A new run never appends to another run's generations."""
    path = Path(folder) / GENERATIONS_FILE
    if path.exists() and path.stat().st_size:
        raise ConfigError(
            ConfigIssue(
                "hydra.run.dir",
                "already holds a run's generations.jsonl; set runner.resume=true to continue it, or pick a new folder",
                str(folder),
            )
        )


def check_run_folder(folder: Path) -> None:
    """A folder to resume holds a run (its config)."""
    if not (Path(folder) / CONFIG_FILE).exists():
        raise ConfigError(
            ConfigIssue(
                "runner.resume",
                f"{folder} has no {CONFIG_FILE}: not a run folder to resume (set hydra.run.dir to one)",
                True,
            )
        )


def check_resume(outputs: RunOutputs, resolved: dict) -> dict[tuple[str, int], str | None]:
    """runner.resume=true: the folder must hold a run of the same config; returns the rows done."""
    check_run_folder(outputs.dir)
    path = outputs.dir / CONFIG_FILE
    previous = flatten(json.loads(path.read_text(encoding="utf-8")))
    current = flatten(json.loads(json.dumps(resolved, default=str)))
    changed = [
        ConfigIssue(
            key,
            f"differs from the run being resumed (was {previous.get(key, '<unset>')!r})",
            current.get(key, "<unset>"),
        )
        for key in sorted(previous.keys() | current.keys())
        if key not in RESUMABLE_KEYS
        and resolve_setting(key, previous.get(key)) != resolve_setting(key, current.get(key))
    ]
    if changed:
        raise ConfigError(
            changed, hint="fix: resume with the run's own config (its .hydra/overrides.yaml), or start a new run"
        )
    return outputs.read_done_keys()


def resolve_setting(key: str, value: Any) -> Any:
    """What a setting means on this machine, where its default changed its spelling:
    prefill.tile_size was null before `auto` (which is null here unless the GPU has Neural
    Accelerators), and model.fuse, prompt.format and runner.batch_invariant were not keys, so a folder written before
    still resumes."""
    if key == "prefill.tile_size":
        from mlxcel.prefill_plan import choose_tile_size

        return choose_tile_size(value)
    if key in ("model.fuse", "model.resolved_fuse") and value is None:
        return True  # folders written before model.fuse was a key fused (unless $MLXCEL_FUSE=0 said otherwise)
    if key == "prompt.format" and value is None:
        return "auto"  # folders written before prompt.format was a key read rows, as auto does for them
    if key == "runner.batch_invariant" and value is None:
        return False  # folders written before it was a key ran the default mode
    return value


def flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def describe_error(exc: BaseException) -> dict:
    import traceback

    return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(traceback.format_exception(exc))}


def write_failure_stats(out_dir: Path, exc: BaseException, report: dict | None = None) -> None:
    """stats.json for a run that did not complete: `status` says how it ended, `error` why."""
    report = dict(report or {})
    report["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    report["error"] = describe_error(exc)
    RunOutputs(out_dir).write_stats(report)


def raise_terminated(signum, frame) -> None:
    raise Terminated()


def terminate_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does: stats.json says `interrupted` (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)


@contextmanager
def defer_interrupt():
    """Hold Ctrl-C and SIGTERM until the block ends, so a row is either fully on disk and counted
    or not at all (an interrupt mid-write would leave a torn line or a row missing from stats.json)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig in signals:
            signal.signal(sig, previous[sig])
        for sig in dict.fromkeys(caught):
            if callable(previous[sig]):
                previous[sig](sig, None)
            elif previous[sig] == signal.SIG_DFL:
                signal.raise_signal(sig)


def split_run_dir(args: list[str]) -> tuple[Path | None, list[str]]:
    """hydra.run.dir=PATH (as for mlxcel-run) out of the overrides of a command that composes the
    config itself (mlxcel-chat, mlxcel-serve)."""
    given = [a for a in args if a.startswith("hydra.run.dir=")]
    rest = [a for a in args if not a.startswith("hydra.run.dir=")]
    return (Path(given[-1].partition("=")[2]).expanduser().absolute() if given else None), rest


def default_run_dir(name: str, kind: str) -> Path:
    """outputs/<runner.name>/<kind>/<time>_<pid>: a chat's or a server's folder."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return Path("outputs", name, kind, f"{stamp}_{os.getpid()}").absolute()
