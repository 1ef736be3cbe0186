"""Errors a user can act on. The CLI prints them as one line each, without a traceback.

ConfigError exits with code 2 (fix the config or an override); MlxcelError with code 1
(the run itself failed: a bad file, a prompt too long for the model, ...).
"""

from __future__ import annotations

from dataclasses import dataclass


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, SLURM, `docker stop`): ends a run as Ctrl-C does, stats written."""


class MlxcelError(Exception):
    """A runtime failure with a message meant for the user (exit code 1)."""

    exit_code = 1


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # dotted config path, e.g. "decode.max_tokens"
    message: str
    value: object = None
    has_value: bool = True

    def format(self) -> str:
        if not self.has_value:
            return f"{self.path}: {self.message}"
        return f"{self.path}: {self.message} (got {self.value!r})"


class ConfigError(MlxcelError):
    """One or more invalid config values (exit code 2). Carries every problem at once."""

    exit_code = 2

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue, hint: str | None = None):
        self.issues = [issues] if isinstance(issues, ConfigIssue) else list(issues)
        self.hint = hint
        super().__init__(self.format())

    def format(self) -> str:
        lines = [issue.format() for issue in self.issues]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class RepeatedKeyError(ValueError):
    """A JSON object that names a key twice (json.loads would keep the last silently)."""


def refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook for input a user wrote (rows, run files, answers)."""
    keys = [key for key, _ in pairs]
    repeated = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if repeated is not None:
        raise RepeatedKeyError(repeated)
    return dict(pairs)


def first_line(text: str) -> str:
    """A multi-line message's first non-empty line (Hydra's, OmegaConf's, a library's)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
