"""The resolvers a config's interpolations may call, and which environment variables a config
may read: those the user names on the command line.

`${mlxcel.recipes_dir:}` and `${mlxcel.pid:}` are mlxcel's own (register_resolvers).

`${oc.env:NAME}` in a recipe or a config folder someone else wrote would copy a secret into the
prompt and from there into prompts.jsonl, config.resolved.json and the answers. So OmegaConf's
`oc.env` resolver is replaced by one that reads only the variables named in a `${oc.env:NAME}`
the user typed (an override such as `model.path='${oc.env:MODELS}/llama'`); any other read is
an error naming the key and the variable. The free-text keys (prompt.text, ...) are literal
text on the command line and name nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

FREE_TEXT_KEYS = ("prompt.text", "prompt.system", "template.text")
_FREE_TEXT = re.compile(r"^(\+{0,2})(" + "|".join(re.escape(k) for k in FREE_TEXT_KEYS) + r")=(.*)$", re.DOTALL)


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


def find_recipes_dir() -> Path:
    """recipes/ of a source checkout (plain or editable), else the recipes shipped as mlxcel.recipes."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "recipes").is_dir():
        return checkout / "recipes"
    from importlib.resources import files

    return Path(str(files("mlxcel") / "recipes"))  # the wheel maps recipes/ to mlxcel/recipes


def register_resolvers() -> None:
    """${mlxcel.recipes_dir:}: the folder of the shipped recipes, so a recipe can name its data
    files (recipes/data/...) wherever mlxcel is installed and wherever it is run from;
    ${mlxcel.pid:}: this process's id, in default run folder names (cached in the config, as
    Hydra's ${now:} is: a launcher that runs jobs in other processes hands them the sweep folder
    the first process named); `oc.env` reads only what the command line names (below)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("mlxcel.recipes_dir", lambda: str(find_recipes_dir()), replace=True)
    OmegaConf.register_new_resolver("mlxcel.pid", lambda: str(os.getpid()), replace=True, use_cache=True)
    register_environment_resolver()
