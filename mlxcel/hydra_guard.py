"""What Hydra may do on a config's say: refuse `hydra.*` settings that would run code or write
outside the run folder, before Hydra acts on any of them.

Hydra instantiates `hydra.callbacks`, `hydra.launcher` and `hydra.sweeper` from their `_target_`
(any importable callable, called with the config's arguments), configures logging from
`hydra.job_logging` / `hydra.hydra_logging` through `logging.config.dictConfig` (whose `class`,
`()` and `ext://` values import anything), and sets `hydra.job.env_set` in the environment of the
job and every process it starts. All of that comes from data: the command line, a recipe file, a
`--config-dir`. So mlxcel-run composes the config as Hydra is about to (the same search path,
primary config and overrides) and allows only what mlxcel ships and documents: its own callback,
Hydra's basic launcher and sweeper, the standard logging handlers and formatters writing to the
terminal or into the run folder (a log file's name must start with ${hydra.runtime.output_dir}/),
and the joblib, submitit and Ray launchers (docs/scaleout.md) without the settings of theirs that
run shell lines, pass raw scheduler options or set up a Ray runtime environment.
Anything else is a config error before Hydra creates a folder or imports a name. Hydra's own
blocklist (a few builtins) misses `pathlib.Path.write_text` and the like, and does not look at
logging configs at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlxcel.errors import ConfigError, ConfigIssue

ALLOWED_TARGETS = {
    "callbacks": {"mlxcel.hydra_callbacks.SweepSummary"},
    "launcher": {
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
    },
    "sweeper": {"hydra._internal.core_plugins.basic_sweeper.BasicSweeper"},
}
# logging.config.dictConfig's `class` values that may appear in hydra/job_logging, hydra/hydra_logging
ALLOWED_LOGGING_CLASSES = {
    "logging.StreamHandler",
    "logging.FileHandler",
    "logging.NullHandler",
    "logging.Formatter",
    "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler",
}
ALLOWED_STREAMS = {"ext://sys.stdout", "ext://sys.stderr"}
# The launchers' settings that are data only. submitit's `setup` (shell lines in the job script) and
# `srun_args` run code; Ray's `runtime_env` installs packages, runs setup hooks and sets variables.
REFUSED_LAUNCHER_KEYS = {
    "setup": "runs these shell lines before each job",
    "srun_args": "passes raw srun options (--export can set variables that load code)",
}
ALLOWED_SBATCH_PARAMETERS = {"mail-user", "mail-type", "reservation", "nodelist", "time", "gpus", "requeue", "licenses"}
ALLOWED_RAY_INIT = {"address", "num_cpus", "num_gpus", "object_store_memory", "namespace", "include_dashboard"}
ALLOWED_RAY_INIT |= {"logging_level", "log_to_driver"}
ALLOWED_RAY_REMOTE = {"num_cpus", "num_gpus", "memory", "resources", "max_retries", "max_calls"}
# Variables that make a process (or the interpreter) load code of someone's choosing.
UNSAFE_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "BASH_ENV", "ENV", "PERL5", "NODE_OPTIONS", "RUBYOPT", "PATH")


def check_hydra_settings(args: list[str], conf_dir: Path):
    """Compose what `hydra.main` is about to run for command line `args` and refuse unsafe
    `hydra.*` settings (a ConfigError naming the key). Returns the composed config where it is
    the one job's config (not a sweep, not help), so it can be validated before Hydra makes a
    run folder; None otherwise. A composition error is left for Hydra to report as it would."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parsed = parse_hydra_args(args)
    if parsed.help or parsed.hydra_help:
        return None  # prints help; instantiates nothing
    check_sweep_overrides(parsed.overrides)
    try:
        cfg = compose_hydra_node(parsed, conf_dir)
    except (HydraException, OmegaConfBaseException, ValueError):
        return None  # Hydra reports it itself, before it instantiates anything
    node = OmegaConf.to_container(cfg.hydra, resolve=False)
    check_targets(node)
    check_launcher(node.get("launcher") or {})
    for key in ("job_logging", "hydra_logging"):
        check_logging(node.get(key) or {}, f"hydra.{key}")
    check_environment(node.get("job") or {})
    check_sweeper_params((node.get("sweeper") or {}).get("params") or {})
    check_output_dirs(cfg, node)
    mode = node.get("mode")
    one_job = not parsed.multirun and str(getattr(mode, "name", mode)) != "MULTIRUN"
    runs = not (parsed.cfg or parsed.info or parsed.shell_completion)
    return cfg if one_job and runs else None


def parse_hydra_args(args: list[str]):
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(args)


def compose_hydra_node(parsed, conf_dir: Path):
    """The config as hydra.main composes it (sweep values aside: each job gets one)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    search_path = create_config_search_path(str(conf_dir))
    if parsed.config_dir is not None:  # as hydra.main adds --config-dir
        extra = os.path.abspath(parsed.config_dir)
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    try:
        hydra = Hydra.create_main_hydra2(task_name="mlxcel", config_search_path=search_path)
        return hydra.compose_config(
            config_name=parsed.config_name or "config",
            overrides=list(parsed.overrides),
            run_mode=RunMode.MULTIRUN,
            with_log_configuration=False,
            validate_sweep_overrides=False,
        )
    finally:
        GlobalHydra.instance().clear()


def refuse(key: str, problem: str, value: Any = None) -> None:
    raise ConfigError(ConfigIssue(key, problem, value, has_value=value is not None))


def check_targets(node: dict, path: str = "hydra") -> None:
    """Every `_target_` under hydra.* is one mlxcel ships, at the place it belongs."""
    for key, value in node.items():
        here = f"{path}.{key}"
        if key == "_target_":
            place = path.split(".")[1] if path.count(".") >= 1 else ""
            allowed = ALLOWED_TARGETS.get(place, set())
            top_level = path.count(".") == (2 if place == "callbacks" else 1)
            if value not in allowed or not top_level:
                names = ", ".join(sorted(allowed)) or "none"
                refuse(
                    here, f"Hydra would import and call this; allowed here: {names} (a config may not run code)", value
                )
        elif isinstance(value, dict):
            check_targets(value, here)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    check_targets(item, f"{here}[{i}]")


def check_launcher(launcher: dict) -> None:
    """The joblib, submitit and Ray launchers' settings that are data, not code."""
    for key, why in REFUSED_LAUNCHER_KEYS.items():
        if launcher.get(key):
            refuse(f"hydra.launcher.{key}", f"{why} (a config may not run code); set it in your cluster's profile")
    for name in launcher.get("additional_parameters") or {}:
        if name not in ALLOWED_SBATCH_PARAMETERS:
            allowed = ", ".join(sorted(ALLOWED_SBATCH_PARAMETERS))
            refuse(
                f"hydra.launcher.additional_parameters.{name}",
                f"a raw sbatch option; allowed: {allowed}, or the launcher's own keys (partition, account, gres, ...)",
            )
    folder = launcher.get("submitit_folder")
    if folder is not None and not (str(folder).startswith("${hydra.sweep.dir}/") and ".." not in str(folder)):
        refuse("hydra.launcher.submitit_folder", "goes in the sweep folder: ${hydra.sweep.dir}/.submitit/%j", folder)
    ray = launcher.get("ray") or {}
    for part, allowed in (("init", ALLOWED_RAY_INIT), ("remote", ALLOWED_RAY_REMOTE)):
        for key in ray.get(part) or {}:
            if key not in allowed:
                why = "not allowed"
                if key == "runtime_env":
                    why = "installs packages, runs setup hooks and sets variables (a config may not run code)"
                refuse(f"hydra.launcher.ray.{part}.{key}", f"{why}; allowed here: {', '.join(sorted(allowed))}")


def check_logging(node: Any, path: str) -> None:
    """A dictConfig that only builds the standard handlers and formatters."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            check_logging(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        if isinstance(node, str) and node.startswith("ext://") and node not in ALLOWED_STREAMS:
            refuse(path, f"logging would import this; allowed: {', '.join(sorted(ALLOWED_STREAMS))}", node)
        return
    for key, value in node.items():
        here = f"{path}.{key}"
        if key == "()":
            refuse(here, "logging would import and call this factory (a config may not run code)", value)
        if key == "class" and value not in ALLOWED_LOGGING_CLASSES:
            refuse(here, f"logging would import this; allowed: {', '.join(sorted(ALLOWED_LOGGING_CLASSES))}", value)
        if key == "filename" and not is_in_run_folder(value):
            refuse(here, "a log file goes in the run folder: ${hydra.runtime.output_dir}/NAME.log", value)
        check_logging(value, here)


def is_in_run_folder(filename: Any) -> bool:
    """A log file's name as written: under the job's output folder, no `..`."""
    text = str(filename)
    return text.startswith(("${hydra.runtime.output_dir}/", "${hydra:runtime.output_dir}/")) and ".." not in text


def check_environment(job: dict) -> None:
    for name in job.get("env_set") or {}:
        if str(name).upper().startswith(UNSAFE_ENV_PREFIXES):
            refuse(
                f"hydra.job.env_set.{name}",
                "this variable makes processes load code of the config's choosing; set it in your shell if you mean it",
            )
    for name in job.get("env_copy") or []:
        if str(name).upper().startswith(UNSAFE_ENV_PREFIXES):
            refuse(
                "hydra.job.env_copy",
                "this variable makes processes load code; set it in your shell if you mean it",
                name,
            )


def check_sweep_overrides(overrides: list[str]) -> None:
    """Sweeping a hydra.* key would change Hydra's own settings per job, after the check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # Hydra reports the syntax error
    for override in parsed:
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" and override.is_sweep_override():
            refuse(key, "Hydra's own settings cannot be swept; give one value", override.input_line)


def check_sweeper_params(params: dict) -> None:
    """hydra.sweeper.params becomes each job's overrides: the same rule as the command line."""
    for key in params:
        name = str(key).lstrip("+~")
        if name.split(".")[0].split("/")[0] == "hydra":
            refuse(f"hydra.sweeper.params.{key}", "Hydra's own settings cannot be swept; set them once")


def check_output_dirs(cfg, node: dict) -> None:
    """Run and sweep folders: a new folder of their own, never the current one or a file."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key in ("run.dir", "sweep.dir"):
        try:
            value = OmegaConf.select(cfg.hydra, key, throw_on_missing=True)
        except OmegaConfBaseException:
            continue  # an interpolation only a job can resolve; Hydra reports a broken one
        if value is None or not str(value).strip():
            refuse(
                f"hydra.{key}",
                "empty: the run would write into the current folder; name a folder",
                value if value is not None else "",
            )
        path = Path(str(value)).expanduser().absolute()
        if path.exists() and not path.is_dir():
            refuse(f"hydra.{key}", f"{path} exists and is not a folder", str(value))
        if path.resolve() in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
            refuse(f"hydra.{key}", "is the current folder or one above it; name a folder of its own", str(value))
    subdir = (node.get("sweep") or {}).get("subdir")  # as written: it names the job (${hydra.job.num})
    if subdir is not None:
        parts = Path(str(subdir)).parts
        if Path(str(subdir)).is_absolute() or ".." in parts:
            refuse("hydra.sweep.subdir", "must stay inside the sweep folder (no '..', not absolute)", str(subdir))
