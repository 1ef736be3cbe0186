"""Hydra callbacks (registered in conf/hydra/default.yaml, the only `_target_` in our YAML).

SweepSummary writes <sweep dir>/summary.jsonl, summary.csv and summary.png during a multirun,
one row per job. It works per job in on_job_end, which Hydra calls for failed jobs too;
on_multirun_end is not called once a job has failed, so it cannot be where the summary is made.
A summary problem must never fail a job: it is one warning line on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from mlxcel import sweep_summary


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.swept: list[str] | None = None  # the sweep's parameters, read once at multirun start

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self.swept = read_swept_keys(config)
            sweep_summary.clear_summary(find_sweep_dir(config))
        except Exception as ex:  # noqa: BLE001 - the sweep must run whatever happens here
            warn(ex)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = find_sweep_dir(config)
            rows = sweep_summary.read_summary_rows(sweep_dir)
            note = sweep_summary.describe_unchanged(rows, sweep_summary.find_swept_keys(rows))
            if note:
                print(note, file=sys.stderr)
        except Exception as ex:  # noqa: BLE001 - a summary problem must not fail the sweep
            warn(ex)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        try:
            mode = config.hydra.mode  # a RunMode in Hydra's own config; compare by name
            if getattr(mode, "name", mode) != RunMode.MULTIRUN.name:
                return
            add_job_row(config, job_return, self.swept if self.swept is not None else read_swept_keys(config))
        except Exception as ex:  # noqa: BLE001 - a summary problem must not fail the job
            warn(ex)


def add_job_row(config: DictConfig, job_return: Any, swept: list[str]) -> None:
    """Append this job's row to summary.jsonl, then rewrite the CSV and the plot."""
    job_dir = Path(config.hydra.runtime.output_dir)
    sweep_dir = find_sweep_dir(config)
    overrides = [str(o) for o in OmegaConf.to_container(config.hydra.overrides.task, resolve=False)]
    status = getattr(job_return, "status", None)
    job_error = job_return._return_value if status is not None and status.name == "FAILED" else None
    row = sweep_summary.make_summary_row(
        job=int(config.hydra.job.num),
        overrides=overrides,
        params=parse_overrides(overrides),
        swept=swept,
        job_dir=job_dir,
        stats=sweep_summary.read_job_stats(job_dir),
        job_error=job_error,
        job_status=status.name.lower() if status is not None else None,
    )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with sweep_summary.lock_summary(sweep_dir):
        sweep_summary.append_summary_row(sweep_dir, row)
        sweep_summary.write_summary(sweep_dir)


def find_sweep_dir(config: DictConfig) -> Path:
    """hydra.sweep.dir is relative to the launch directory, which is not the working directory
    inside a job when hydra.job.chdir is true."""
    launch_dir = OmegaConf.select(config, "hydra.runtime.cwd") or os.getcwd()
    return Path(launch_dir, str(config.hydra.sweep.dir)).absolute()


def read_swept_keys(config: DictConfig) -> list[str]:
    """Keys with more than one value, in the order the basic sweeper expands them: the
    config's hydra.sweeper.params first, then the command line's sweep overrides (a, b, c)."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task") or []]
    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override() and key not in keys:
            keys.append(key)
    return keys


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """A job's overrides as {key: value}, values typed as Hydra reads them (16 is an int)."""
    params: dict[str, Any] = {}
    for text in overrides:
        try:
            override = OverridesParser.create().parse_override(text)
            value = override.value()
            params[override.get_key_element().lstrip("+~")] = (
                value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
            )
        except Exception:  # noqa: BLE001 - an odd override still gets its text as the value
            key, _, value = text.partition("=")
            params[key.lstrip("+~")] = value
    return params


def warn(ex: BaseException) -> None:
    print(f"mlxcel: warning: sweep summary not updated: {type(ex).__name__}: {ex}".splitlines()[0], file=sys.stderr)
