"""What the docs show stays true where it can be generated here: the config groups the README
lists are the ones conf/ has, every config error shown after a `$ mlxcel-run` line is what that
command prints today (input files come from `$ cat FILE` lines in the same block), and the sweep
summary's header shown in docs/jobs.md is the one a sweep writes."""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ERROR_PREFIX = "mlxcel: config error:"


def text_blocks(path: Path) -> list[list[str]]:
    """The lines of each ```text block (indented blocks in lists too)."""
    blocks, current, indent = [], None, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if current is None and stripped == "```text":
            current, indent = [], line[: len(line) - len(line.lstrip())]
        elif current is not None and stripped == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(line[len(indent) :] if line.startswith(indent) else line)
    return blocks


def shown_config_errors() -> list[tuple[str, dict[str, str], str, list[str]]]:
    """(where, input files, command, the config-error lines shown) for every `$ mlxcel-run` whose
    shown output is config errors only."""
    cases = []
    for path in DOCS:
        for block in text_blocks(path):
            files: dict[str, str] = {}
            commands = [i for i, line in enumerate(block) if line.startswith("$ ")]
            for n, start in enumerate(commands):
                end = commands[n + 1] if n + 1 < len(commands) else len(block)
                command, output = block[start][2:], block[start + 1 : end]
                if command.startswith("cat "):
                    files[command[4:].strip()] = "\n".join(output) + "\n"
                elif command.startswith("mlxcel-run ") and output and all(o.startswith(ERROR_PREFIX) for o in output):
                    cases.append((f"{path.name}: {command}", dict(files), command, output))
    return cases


CASES = shown_config_errors()


def test_the_docs_show_config_errors_to_check():
    assert len(CASES) >= 3, [c[0] for c in CASES]  # the check cannot pass by finding nothing


@pytest.mark.parametrize("where, files, command, shown", CASES, ids=[c[0] for c in CASES])
def test_a_config_error_shown_in_the_docs_is_what_the_command_prints(
    where, files, command, shown, tmp_path, monkeypatch, capsys
):
    from mlxcel.cli import main

    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    never = types.ModuleType("mlxcel.runner")
    never.run = lambda *a, **k: pytest.fail(f"{where}: ran instead of a config error")
    monkeypatch.setitem(sys.modules, "mlxcel.runner", never)
    monkeypatch.setattr(sys, "argv", shlex.split(command))
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == shown


def readme_group_options() -> dict[str, list[str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Config groups", 1)[1].split("\n## ", 1)[0]
    groups = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`\w+`", cells[0]):
            groups[cells[0].strip("`")] = re.findall(r"`([\w-]+)`", cells[1])
    return groups


def test_the_readme_lists_every_config_group_and_option():
    listed = readme_group_options()
    conf = REPO / "conf"
    for group in sorted(p.name for p in conf.iterdir() if p.is_dir()):
        options = sorted(p.stem for p in (conf / group).glob("*.yaml") if p.stem != "base")
        assert sorted(listed.get(group, [])) == options, group


def test_the_sweep_summary_header_shown_is_the_one_written(tmp_path):
    from mlxcel.sweep_summary import write_summary_csv

    shown = next(
        block[i + 1]
        for block in text_blocks(REPO / "docs" / "jobs.md")
        for i, line in enumerate(block)
        if line.startswith("$ cut -d, -f1-11 ") and "summary.csv" in line
    )
    write_summary_csv([], ["prefill.chunk_size"], tmp_path / "summary.csv")
    written = (tmp_path / "summary.csv").read_text().splitlines()[0].split(",")
    assert shown == ",".join(written[:11])
