"""The run folder: config.resolved.json, generations.jsonl (one line per finished row,
flushed as it lands), stats.json (written atomically, also when a run fails), and `.lock`, which
the run holds (an OS file lock) from before Hydra writes into the folder to the run's end, so two
runs never write one folder."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError, Terminated, refuse_repeated_keys

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
    # resolved: `dry/../dry/prompts.jsonl` or a symlinked folder names the same file
    written = {(Path(folder) / name).resolve() for name in (CONFIG_FILE, GENERATIONS_FILE, STATS_FILE, PROMPTS_FILE)}
    for path in inputs:
        if Path(path).expanduser().resolve() in written:
            raise ConfigError(
                ConfigIssue(
                    "prompt.file",
                    f"is a file this run writes ({Path(path).name} in its run folder); move the input or pick another "
                    "hydra.run.dir",
                    str(path),
                )
            )


def write_json_atomic(path: Path, data: Any) -> None:
    replace_file(path, (json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n").encode("utf-8"))


def replace_file(path: Path, data: bytes) -> None:
    """Write path.tmp and rename it over `path`: a reader sees the old file or the new one. A
    failed write (a full disk) removes path.tmp and leaves `path` as it was."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def describe_disk_full(exc: BaseException) -> MlxcelError | None:
    """A full disk or quota, as the one line that says what to do (the rows written are whole and
    kept: append_generation cuts a half-written one), or None for another error."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return MlxcelError(
        f"{exc.strerror or 'no space left on device'}{where}: free some space, then run again with "
        "runner.resume=true (the rows already written are kept)"
    )


class RunOutputs:
    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, resolved: dict) -> None:
        write_json_atomic(self.dir / CONFIG_FILE, resolved)

    def append_generation(self, row: dict) -> None:
        data = memoryview((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        # unbuffered: nothing is left to flush after a failed write (a close would append it later)
        with defer_interrupt(), open(self.dir / GENERATIONS_FILE, "ab", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                while data:
                    data = data[f.write(data) :]
                os.fsync(f.fileno())
            except OSError:  # a full disk mid-line: cut what was written, the file keeps whole rows only
                with suppress(OSError):
                    f.truncate(end)
                raise

    def write_stats(self, stats: dict) -> None:
        write_json_atomic(self.dir / STATS_FILE, stats)

    def write_prompts(self, rows: list[dict]) -> None:
        with open(self.dir / PROMPTS_FILE, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def read_rows(self) -> list[dict]:
        path = self.dir / GENERATIONS_FILE
        # split at "\n" only: str.splitlines also splits at U+2028, U+0085..., which rows' text holds as they are
        return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]] if path.exists() else []

    def read_sessions(self) -> list[dict]:
        """The earlier sessions of a job being resumed, from the stats.json the last one left (none
        if it was killed before writing one); a damaged stats.json is a config error."""
        from mlxcel.stats import SESSION_FIELDS, summarize_session

        path = self.dir / STATS_FILE
        if not path.exists() and not path.is_symlink():
            return []
        fix = "delete it to resume (the earlier sessions' times are then left out of the job's stats)"
        previous = read_run_json(path, fix)
        sessions = previous.get("sessions") or [summarize_session(previous)]
        numbers = [key for key in SESSION_FIELDS if key != "status"]
        if not isinstance(sessions, list) or not all(
            isinstance(s, dict) and all(is_number(s.get(key)) or s.get(key) is None for key in numbers)
            for s in sessions
        ):
            raise ConfigError(
                ConfigIssue(
                    str(path),
                    f"its sessions (or {', '.join(numbers)}) are not the numbers a run writes; the file was edited "
                    f"or damaged: {fix}",
                    has_value=False,
                )
            )
        return sessions

    def read_done_keys(self) -> dict[tuple[str, int], str | None]:
        """(id, sample) of every row already written, with the hash of the input row it answered
        (None in folders written before rows kept one). Every line is checked before the file is
        changed (a damaged or repeated row is a config error, and a refused resume changes
        nothing); then a torn last line (a crash mid-write) is cut off, so appended rows start on a
        line of their own and that row runs again."""
        path = self.dir / GENERATIONS_FILE
        if not path.exists() and not path.is_symlink():
            return {}
        data = read_run_file(path, ROW_FIX)
        whole = data[: data.rfind(b"\n") + 1]
        keys, kept, lines = {}, [], {}
        # split at "\n" only: str.splitlines also splits at U+2028, U+0085..., which rows' text holds as they are
        for number, line in enumerate(whole.split(b"\n")[:-1], start=1):
            row = read_row(path, number, line)
            if row["finish_reason"] == "interrupted":
                continue  # a single prompt's partial row: it runs again, in its place
            key = (str(row["id"]), row.get("sample", 0))
            if key in lines:  # counted once, its tokens twice in the job's stats
                raise ConfigError(
                    ConfigIssue(
                        f"{path} line {number}",
                        f"repeats the row of line {lines[key]} (id {key[0]}, sample {key[1]}); the file was edited or "
                        f"damaged: {ROW_FIX}",
                        has_value=False,
                    )
                )
            lines[key] = number
            keys[key] = row.get("input_sha256")
            kept.append(line)
        if len(kept) < whole.count(b"\n"):
            replace_file(path, b"".join(line + b"\n" for line in kept))
        elif len(whole) < len(data):
            with open(path, "r+b") as f:
                f.truncate(len(whole))
        return keys


ROW_FIX = "delete that line (the resume runs its row again) or start a new run (a new hydra.run.dir)"
# what a resume reads back from a written row, and the types a run writes them as
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str, int),
    "sample": (int,),
    "finish_reason": (str,),
    "input_sha256": (str, type(None)),
    "text": (str,),
    "error": (str, type(None)),
    "token_ids": (list,),
    "logprobs": (list, type(None)),
    "prompt_tokens": (int, type(None)),
    "generated_tokens": (int,),
    "cached_tokens": (int, type(None)),
}
NEWLINE = b"\n"
TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", type(None): "null"}


def read_row(path: Path, number: int, line: bytes) -> dict:
    """Line `number` of generations.jsonl as a row; a damaged one is a config error naming it."""

    row, problem = parse_json(line)
    parsed = problem is None
    if parsed:
        problem = describe_row_problem(row)
    if problem is None:
        return row
    raise ConfigError(
        ConfigIssue(
            f"{path} line {number}",
            f"{problem}; the file was edited or damaged: {ROW_FIX}",
            line[:60].decode("utf-8", "replace"),
            has_value=not parsed,  # (the line's start says where it broke; a field's problem names the field)
        )
    )


def parse_json(data: bytes, lines: bool = False) -> tuple[Any, str | None]:
    """A JSON text a user may have edited: (its value, None) or (None, why it cannot be read);
    `lines`: a file of several lines, whose problems name the line."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=refuse_repeated_keys), None
    except UnicodeDecodeError as exc:
        where = f"line {data.count(NEWLINE, 0, exc.start) + 1}: " if lines else ""
        return None, f"{where}is not UTF-8 text (byte {exc.start + 1})"
    except RecursionError:
        return None, "is not valid JSON (nested too deeply to read)"
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}: " if lines else ""
        return None, f"{where}is not valid JSON ({exc.msg} at column {exc.colno})"
    except ValueError as exc:  # errors.RepeatedKeyError
        return None, f"is not valid JSON (the key {exc.args[0]!r} appears twice)"


def describe_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"is not a JSON object (it is {type(row).__name__}: each line of {GENERATIONS_FILE} is one row)"
    for key in ("id", "finish_reason"):
        if row.get(key) is None:
            return f"has no {key}"
    for key, types in ROW_FIELDS.items():
        if key in row and (isinstance(row[key], bool) or not isinstance(row[key], types)):
            return f"has {key} {repr(row[key])[:40]}, not {' or '.join(TYPE_NAMES[t] for t in types)}"
    if row.get("sample", 0) < 0:
        return f"has sample {row['sample']}, below 0"
    return None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_run_file(path: Path, fix: str) -> bytes:
    """A run file's bytes; a folder, device or unreadable file in its place is a config error."""
    if not path.is_file():  # (a FIFO or /dev/zero would never end)
        raise ConfigError(
            ConfigIssue(str(path), f"is not a regular file (a folder or a device); {fix}", has_value=False)
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(ConfigIssue(str(path), f"cannot be read ({exc.strerror}); {fix}", has_value=False)) from None


def read_run_json(path: Path, fix: str) -> dict:
    """config.resolved.json or stats.json as the JSON object a run wrote; a damaged one is a config
    error naming the file (and line)."""

    data = read_run_file(path, fix)
    value, problem = parse_json(data, lines=True)
    if problem is None and not isinstance(value, dict):
        problem = f"is not a JSON object (it is {type(value).__name__})"
    if problem is None:
        return value
    raise ConfigError(ConfigIssue(f"{path}", f"{problem}; the file was edited or damaged: {fix}", has_value=False))


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
    fix = "start a new run (a new hydra.run.dir), or restore the file"
    previous = flatten(read_run_json(outputs.dir / CONFIG_FILE, fix))
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
    outputs.read_sessions()  # (read again when the run starts) a damaged stats.json refuses the resume here, unchanged
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
    # best effort: `exc` is what the user hears of (a full disk fails this write too; its .tmp is removed)
    with suppress(OSError):
        RunOutputs(out_dir).write_stats(report)


class AnswerStream:
    """stdout for a single prompt's answer as it streams (and --version). A reader that goes away
    (`mlxcel-run ... | head`) ends the streaming, not the run: `write` says False from then on
    (the runner ends the row there, "cancelled", and the job completes) and the stream's
    descriptor is pointed at /dev/null, so the interpreter's last flush raises nothing either."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.open = True

    def write(self, text: str) -> bool:
        if self.open:
            try:
                self.stream.write(text)
                self.stream.flush()
            except BrokenPipeError:
                self.open = False
                silence_stream(self.stream)
        return self.open


def silence_stream(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null (what it still buffers goes there)."""
    with suppress(AttributeError, OSError, ValueError):  # no descriptor (a StringIO): nothing flushes it at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


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
    from mlxcel.hydra_guard import check_run_folder

    given = [a for a in args if a.startswith("hydra.run.dir=")]
    rest = [a for a in args if not a.startswith("hydra.run.dir=")]
    return (check_run_folder("hydra.run.dir", given[-1].partition("=")[2]) if given else None), rest


def default_run_dir(name: str, kind: str) -> Path:
    """outputs/<runner.name>/<kind>/<time>_<pid>: a chat's or a server's folder."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return Path("outputs", name, kind, f"{stamp}_{os.getpid()}").absolute()
