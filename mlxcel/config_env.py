"""Which environment variables a config may read: those the user names on the command line.

`${oc.env:NAME}` in a recipe or a config folder someone else wrote would copy a secret into the
prompt and from there into prompts.jsonl, config.resolved.json and the answers. So OmegaConf's
`oc.env` resolver is replaced by one that reads only the variables named in a `${oc.env:NAME}`
the user typed (an override such as `model.path='${oc.env:MODELS}/llama'`); any other read is
an error naming the key and the variable. The free-text keys (prompt.text, ...) are literal
text on the command line and name nothing.
"""

from __future__ import annotations

import re
from typing import Any


class EnvironmentReadRefused(ValueError):
    """A config's `${oc.env:NAME}` for a variable the command line did not name."""


def find_refusal(ex: BaseException | None) -> EnvironmentReadRefused | None:
    """The refusal inside OmegaConf's wrapping of a resolver's error, if that is what `ex` is."""
    seen = 0
    while ex is not None and seen < 20:
        if isinstance(ex, EnvironmentReadRefused):
            return ex
        ex, seen = ex.__cause__ or ex.__context__, seen + 1
    return None


_NAMED = re.compile(r"\$\{\s*oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")
_allowed: set[str] = set()


def names_given(args: list[str]) -> set[str]:
    """The variables a command line's `${oc.env:NAME}` values name (free text aside)."""
    from mlxcel.cli import _FREE_TEXT

    return {name for arg in args if not _FREE_TEXT.match(arg) for name in _NAMED.findall(arg)}


def allow_environment_reads(names: set[str]) -> None:
    _allowed.clear()
    _allowed.update(names)


def register_environment_resolver() -> None:
    from omegaconf import OmegaConf
    from omegaconf.resolvers import oc

    _unset = object()

    def read_environment(key: str, default: Any = _unset) -> Any:
        if key not in _allowed:
            raise EnvironmentReadRefused(
                f"reads the environment variable {key}, which the command line did not name; a config may read "
                f"only the variables you pass yourself, e.g. key='${{oc.env:{key}}}'"
            )
        return oc.env(key) if default is _unset else oc.env(key, default)

    OmegaConf.register_new_resolver("oc.env", read_environment, replace=True, use_cache=False)
