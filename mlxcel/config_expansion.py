"""Bounds on how large a config may grow as it is loaded and resolved.

A few lines of YAML can stand for gigabytes: aliases of aliases (`b: [*a, *a, ...]`, the
"billion laughs") are copied out when OmegaConf builds its nodes, and 30 interpolations that each
repeat the one before (`a1: ${a0}${a0}`) resolve to a string of 2**30 characters. Both are
refused, naming the file or the key, before anything loads or resolves them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mlxcel.errors import ConfigError, ConfigIssue

MAX_YAML_NODES = 200_000  # nodes of one YAML file with its aliases copied out
MAX_CONFIG_FILES = 5_000  # YAML files looked at in one config folder
MAX_RESOLVED_CHARS = 1_000_000  # characters one config value may resolve to
# An interpolation's innermost `${...}`: a key, or a resolver with its arguments.
_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")


def check_yaml_file(key: str, path: Path) -> None:
    """A YAML file whose aliases expand past MAX_YAML_NODES nodes is refused (PyYAML shares an
    alias's node; OmegaConf copies it once per use)."""
    import yaml

    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # the loader reports a file it cannot read, as it would
    sizes: dict[int, int] = {}

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once; the loader refuses it
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        sizes[id(node)] = total = min(total, MAX_YAML_NODES + 1)
        return total

    if root is not None and size(root) > MAX_YAML_NODES:
        raise ConfigError(
            ConfigIssue(
                key,
                f"{path}: its aliases expand to more than {MAX_YAML_NODES:,} values; write the values out",
                has_value=False,
            )
        )


def check_config_folder(key: str, folder: Path) -> None:
    """Every YAML file of a config folder (--config-dir, --config-path) Hydra may load from."""
    if not folder.is_dir():
        return  # Hydra names a missing folder
    for count, path in enumerate(sorted(folder.rglob("*.y*ml"))):
        if count >= MAX_CONFIG_FILES:
            break
        if path.is_file():
            check_yaml_file(key, path)


def check_interpolation_sizes(cfg: Any) -> None:
    """No value of the composed config may resolve past MAX_RESOLVED_CHARS characters: an upper
    bound from the unresolved text (each `${key}` counts as the size of what it names),
    computed once per key, so a doubling chain is refused without being resolved."""
    from omegaconf import OmegaConf

    root = OmegaConf.to_container(cfg, resolve=False)
    sizes: dict[tuple, int] = {}

    def size_of(path: tuple) -> int:
        if path in sizes:
            return sizes[path]
        sizes[path] = 0  # a cycle: OmegaConf reports it
        node = select(root, path)
        if isinstance(node, dict):
            total = sum(size_of((*path, str(k))) for k in node)
        elif isinstance(node, list):
            total = sum(size_of((*path, str(i))) for i in range(len(node)))
        elif isinstance(node, str):
            total = len(node) + sum(size_of(ref) for ref in references(node, path[:-1]))
        else:
            total = 0 if node is KeyError else len(str(node))  # (a name that is no key: a resolver's text)
        sizes[path] = total = min(total, MAX_RESOLVED_CHARS + 1)
        return total

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
        elif isinstance(node, str) and "${" in node and size_of(path) > MAX_RESOLVED_CHARS:
            raise ConfigError(
                ConfigIssue(
                    ".".join(path),
                    f"its interpolations would resolve to more than {MAX_RESOLVED_CHARS:,} characters",
                    has_value=False,
                )
            )

    walk(root, ())


def select(node: Any, path: tuple) -> Any:
    """The value at `path` (keys, list indices as digits) in plain data; KeyError where there is none."""
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return KeyError
    return node


def references(text: str, parent: tuple) -> list[tuple]:
    """The keys a value's interpolations name (nested ones too; a resolver's arguments that look
    like keys count, which only over-estimates), as paths from the root."""
    found = []
    while True:
        matches = list(_INTERPOLATION.finditer(text))
        if not matches:
            return found
        for match in matches:
            body = match.group(1).strip()
            args = body.partition(":")[2].split(",") if ":" in body else [body]
            for arg in args:
                path = as_path(arg.strip().strip("'\""), parent)
                if path:
                    found.append(path)
        text = _INTERPOLATION.sub("", text)


def as_path(text: str, parent: tuple) -> tuple | None:
    """`a.b[0]` or a relative `..x` as a path from the root; None for what cannot be a key."""
    if not text or not re.fullmatch(r"[.\w\[\]-]+", text):
        return None
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    if text.startswith("."):
        dots = len(text) - len(text.lstrip("."))
        base = parent[: max(0, len(parent) - (dots - 1))]
        return (*base, *[p for p in text[dots:].split(".") if p])
    return tuple(p for p in text.split(".") if p)
