"""The package's layers: no module imports one that imports it back (function-level imports
count: they are circles too, only deferred), and the job side does not reach into the server."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "mlxcel"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the mlxcel modules it imports anywhere in its body (a package's own modules and
    the bare `mlxcel` package aside)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        found = {owner(t) for t in targets if t.startswith("mlxcel")}
        graph[name] = {m for m in found if m and m != name and m != "mlxcel" and not name.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 50 and graph["mlxcel.runner"]  # the walk found the package and its imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_job_side_does_not_reach_into_the_server():
    """OpenAI's request mapping (openai_protocol, openai_messages) is shared: jobs and batch files
    read rows through it without importing mlxcel.serve, and it imports neither side."""
    graph = import_graph()
    for module in (
        "mlxcel.jobs",
        "mlxcel.batch_files",
        "mlxcel.runner",
        "mlxcel.openai_protocol",
        "mlxcel.openai_messages",
    ):
        assert not [m for m in graph[module] if m.startswith("mlxcel.serve")], module
    assert not {"mlxcel.jobs", "mlxcel.batch_files", "mlxcel.runner"} & graph["mlxcel.openai_protocol"]
