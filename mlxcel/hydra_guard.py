"""What Hydra may do on a config's say: only the `hydra.*` settings on an allow-list, checked on
the values Hydra will use, before Hydra acts on any of them.

Hydra instantiates `hydra.callbacks`, `hydra.launcher` and `hydra.sweeper` from their `_target_`
(any importable callable, called with the config's arguments), configures logging from
`hydra.job_logging` / `hydra.hydra_logging` through `logging.config.dictConfig` (whose `class`,
`()` and `ext://` values import anything), sets `hydra.job.env_set` in the environment of the
job and every process it starts, composes each sweep job with `hydra.overrides.hydra`, and
creates folders from `hydra.run.dir`, `hydra.sweep.dir`/`subdir` and `hydra.output_subdir`. All
of that comes from data: the command line, a recipe, a `--config-dir` or `--config-path` folder.

So mlxcel-run composes the config exactly as `hydra.main` is about to (the same search path,
primary config and overrides), resolves the `hydra` node with the job-time values stubbed (an
interpolation can carry a payload from anywhere in the config), and compares it with what
mlxcel's own conf composes to: every `hydra.*` value that differs must be on the allow-list
(run and sweep folders, job name, mode, logging levels and files in the run folder, the
launchers' plain single-line options, sweep parameters of non-hydra keys), and is checked on its
resolved value. A sweep job's settings that depend on swept values are checked for each job.
Anything else is a config error before Hydra creates a folder or imports a name.
"""

from __future__ import annotations

import copy
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxcel.config_expansion import select
from mlxcel.errors import ConfigError, ConfigIssue, first_line

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
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JOB_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=,+-]*$")
# The hydra.* settings a config may change (dotted prefixes of the resolved node), and what each is.
ALLOWED_SETTINGS = {
    "run.dir": "the run folder",
    "sweep.dir": "the sweep folder",
    "sweep.subdir": "a sweep job's folder in it",
    "output_subdir": "where Hydra keeps its copy of the config, in the run folder",
    "job.name": "the job's name",
    "job.chdir": "whether the job runs in its folder",
    "job.env_set": "variables for the job (not ones that load code)",
    "job.env_copy": "variables copied to remote jobs (named on the command line)",
    "job.config.override_dirname": "how override_dirname is spelled",
    "mode": "RUN or MULTIRUN",
    "verbose": "debug logging",
    "searchpath": "more config folders (checked like the rest)",
    "job_logging": "logging: standard handlers, log files in the run folder",
    "hydra_logging": "logging: standard handlers, log files in the run folder",
    "launcher": "the launchers' plain options",
    "sweeper.params": "sweep parameters (not of hydra.* keys)",
    "sweeper.max_batch_size": "jobs launched at once",
    "help": "the --help text",
    "hydra_help": "the --hydra-help text",
    # Hydra fills these in itself
    "runtime.choices": "",
    "runtime.config_sources": "",
    "overrides": "",
    "job.override_dirname": "",
    "job.config_name": "",
}
# hydra.* nodes a sweep job resolves for itself (the launcher, sweeper, callbacks and sweep folder
# come from the first composition, which is checked as a whole).
PER_JOB_SETTINGS = ("sweep.subdir", "output_subdir", "job", "job_logging", "hydra_logging")
MAX_CHECKED_JOBS = 256
# Where a job's folder is when its settings are resolved before it exists.
STUB_OUTPUT_DIR = "/mlxcel-job-folder"


def check_hydra_settings(args: list[str], conf_dir: Path):
    """Compose what `hydra.main` is about to run for command line `args` and refuse unsafe
    `hydra.*` settings (a ConfigError naming the key). Returns the composed config where it is
    the one job's config (not a sweep, not help), so it can be validated before Hydra makes a
    run folder; None otherwise. A composition error is left for Hydra to report as it would."""
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mlxcel.config_expansion import check_config_folder, check_interpolation_sizes
    from mlxcel.resolvers import allow_environment_reads, names_given, register_resolvers

    register_resolvers()
    allow_environment_reads(names_given(args))
    parsed = parse_hydra_args(args)
    if parsed.experimental_rerun is not None:
        refuse(
            "--experimental-rerun",
            "unpickles the file, which runs code of the file's choosing; run the job again from its "
            "config instead: mlxcel-run --config-dir RUN/.hydra --config-name config",
            parsed.experimental_rerun,
        )
    if parsed.help or parsed.hydra_help:
        return None  # prints help; instantiates nothing
    check_sweep_overrides(parsed.overrides)
    for key, folder in (("--config-dir", parsed.config_dir), ("--config-path", parsed.config_path)):
        if folder is not None and "://" not in folder:
            check_config_folder(key, Path(folder))
    shipped = compose_baseline(conf_dir, parsed.overrides)  # (before: it builds a global Hydra of its own)
    with composer(parsed, conf_dir) as compose:
        try:
            cfg = compose(parsed.config_name or "config", list(parsed.overrides), RunMode.MULTIRUN)
        except KeyError as ex:  # Hydra reads hydra.job.env_copy's variables from os.environ
            refuse("hydra.job.env_copy", f"{ex.args[0]} is not set in the environment; unset names run nothing")
        except (HydraException, OmegaConfBaseException, ValueError):
            return None  # Hydra reports it itself, before it instantiates anything
        check_interpolation_sizes(cfg)
        check_recorded_overrides(cfg, parsed.overrides)
        check_targets(OmegaConf.to_container(cfg.hydra, resolve=False))  # as written, then as resolved
        node = resolve_hydra_node(cfg)
        check_changed_settings(node, resolve_hydra_node(shipped))
        check_node(node, parsed.overrides)
        check_output_dirs(node)
        mode = node.get("mode")
        one_job = not parsed.multirun and str(mode) != "MULTIRUN"
        if not one_job:
            check_sweep_jobs(cfg, compose, node, parsed.overrides)
    runs = not (parsed.cfg or parsed.info or parsed.shell_completion)
    return cfg if one_job and runs else None


def parse_hydra_args(args: list[str]):
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(args)


@contextmanager
def composer(parsed, conf_dir: Path):
    """Hydra's composition as hydra.main sets it up for these arguments: the primary config
    folder (--config-path, else mlxcel's conf), --config-dir before the schema. Yields the compose
    function, which lives while the global Hydra it builds does."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import _get_module_name_override, create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    config_path = parsed.config_path if parsed.config_path is not None else str(conf_dir)
    # hydra.main reads a relative --config-path from the module that declares the task (mlxcel.cli)
    search_path = create_automatic_config_search_path(None, _get_module_name_override() or "mlxcel.cli", config_path)
    if parsed.config_dir is not None:
        extra = os.path.abspath(parsed.config_dir)
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="mlxcel", config_search_path=search_path)

    def compose(config_name: str, overrides: list[str], run_mode):
        return hydra.compose_config(
            config_name=config_name,
            overrides=overrides,
            run_mode=run_mode,
            with_log_configuration=False,
            validate_sweep_overrides=False,
        )

    try:
        yield compose
    finally:
        GlobalHydra.instance().clear()


def compose_baseline(conf_dir: Path, overrides: list[str]):
    """What mlxcel's own conf composes to with the same hydra/* group picks (a shipped launcher's
    settings are mlxcel's); without them where a pick is not one mlxcel ships."""
    from hydra._internal.utils import get_args_parser
    from hydra.errors import HydraException
    from hydra.types import RunMode

    picks = [o for o in overrides if re.match(r"^[+~]{0,2}hydra/[\w/]+=[\w.-]+$", o)]
    plain = get_args_parser().parse_args([])
    for attempt in (picks, []):
        with composer(plain, conf_dir) as compose:
            try:
                return compose("config", attempt, RunMode.MULTIRUN)
            except HydraException:
                continue
    raise AssertionError("mlxcel's own conf does not compose")


def refuse(key: str, problem: str, value: Any = None) -> None:
    raise ConfigError(ConfigIssue(key, problem, value, has_value=value is not None))


def resolve_hydra_node(cfg, parts: tuple[str, ...] | None = None) -> dict:
    """The `hydra` node (or its `parts`) as plain data, every interpolation resolved as it will be
    in a job (the job's folder, number and id stubbed). A value that cannot be resolved is
    refused here: Hydra would resolve it later, per job, after this check."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    stubbed = copy.deepcopy(cfg)
    with read_write(stubbed.hydra), open_dict(stubbed.hydra):
        stubbed.hydra.runtime.output_dir = STUB_OUTPUT_DIR
        for key, value in (("num", 0), ("id", "0")):
            if OmegaConf.is_missing(stubbed.hydra.job, key):
                stubbed.hydra.job[key] = value
        # the command line as text (checked by check_recorded_overrides): Hydra never resolves it
        stubbed.hydra.overrides.hydra, stubbed.hydra.overrides.task = [], []
        try:
            OmegaConf.select(stubbed.hydra, "job.override_dirname", throw_on_missing=False)
        except OmegaConfBaseException:  # an override's `${...}`: a job that names it fails there
            stubbed.hydra.job.override_dirname = "(unresolvable)"
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(stubbed)  # for ${hydra:...}
    try:
        if parts is None:
            return OmegaConf.to_container(stubbed.hydra, resolve=True, throw_on_missing=False)
        resolved = {}
        for part in parts:
            value = OmegaConf.select(stubbed.hydra, part, throw_on_missing=False)
            resolved[part] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        return resolved
    except OmegaConfBaseException as ex:
        from mlxcel.resolvers import find_refusal

        key = getattr(ex, "full_key", None) or "hydra"
        if find_refusal(ex):
            refuse(key, str(find_refusal(ex)))
        refuse(key, f"cannot be resolved before the job runs ({first_line(str(ex))})")
    finally:
        HydraConfig.instance().cfg = previous


def iter_leaves(node: Any, path: tuple = ()):
    """(path, value) of every leaf; an empty dict or list is a leaf."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from iter_leaves(value, (*path, str(key)))
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            yield from iter_leaves(value, (*path, str(i)))
    else:
        yield path, node


def dotted(path: tuple) -> str:
    return "hydra." + ".".join(path)


def check_changed_settings(node: dict, baseline: dict) -> None:
    """Every resolved hydra.* value that differs from mlxcel's own is a setting a config may change."""
    for path, value in iter_leaves(node):
        if select(baseline, path) == value:
            continue
        name = ".".join(path)
        if not any(name == key or name.startswith(key + ".") for key in ALLOWED_SETTINGS):
            settings = ", ".join(key for key, what in ALLOWED_SETTINGS.items() if what)
            if path[0] == "callbacks":
                refuse(dotted(path), "a config may not add or change Hydra callbacks (Hydra calls them)", value)
            refuse(dotted(path), f"not a setting a config may change; allowed under hydra.: {settings}", value)


def check_node(node: dict, overrides: list[str]) -> None:
    """The resolved node's values: targets, launcher, logging, environment, sweep parameters."""
    check_targets(node)
    check_launcher(node.get("launcher") or {})
    for key in ("job_logging", "hydra_logging"):
        check_logging(node.get(key) or {}, f"hydra.{key}")
    check_job(node.get("job") or {}, overrides)
    check_sweeper_params((node.get("sweeper") or {}).get("params") or {}, overrides)


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


def is_one_line(value: Any) -> bool:
    """A plain value that cannot start a new line in a script or a file Hydra writes."""
    if isinstance(value, str):
        return not any(ch in value for ch in "\n\r\x00\x0b\x0c\x85\u2028\u2029")
    return value is None or isinstance(value, (bool, int, float))


def check_launcher(launcher: dict) -> None:
    """The joblib, submitit and Ray launchers' settings that are data, not code: single-line
    plain values (a newline in a SLURM value would be a line of the sbatch script)."""
    for path, value in iter_leaves(launcher, ("launcher",)):
        if not is_one_line(value) and value not in ({}, []):
            refuse(
                dotted(path), "must be a single-line plain value (no newlines: it is written into a job script)", value
            )
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
    ray = launcher.get("ray") or {}
    for part, allowed in (("init", ALLOWED_RAY_INIT), ("remote", ALLOWED_RAY_REMOTE)):
        for key in ray.get(part) or {}:
            if key not in allowed:
                why = "not allowed"
                if key == "runtime_env":
                    why = "installs packages, runs setup hooks and sets variables (a config may not run code)"
                refuse(f"hydra.launcher.ray.{part}.{key}", f"{why}; allowed here: {', '.join(sorted(allowed))}")


def check_logging(node: Any, path: str) -> None:
    """A dictConfig that only builds the standard handlers and formatters, files in the job's folder."""
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
        if key == "filename" and not is_in_job_folder(value):
            refuse(here, "a log file goes in the run folder: ${hydra.runtime.output_dir}/NAME.log", value)
        check_logging(value, here)


def is_in_job_folder(filename: Any) -> bool:
    """A resolved log file name: under the job's (stubbed) folder, after `..` is folded."""
    path = os.path.normpath(str(filename))
    return path.startswith(STUB_OUTPUT_DIR + os.sep)


def check_job(job: dict, overrides: list[str]) -> None:
    name = job.get("name")
    if name is not None and not (isinstance(name, str) and JOB_NAME.match(name) and ".." not in name):
        refuse("hydra.job.name", "names log files in the run folder: letters, digits and _ . = , + - only", name)
    if job.get("chdir") not in (None, True, False):
        refuse("hydra.job.chdir", "must be true, false or null", job.get("chdir"))
    for name, value in (job.get("env_set") or {}).items():
        if not ENV_NAME.match(str(name)) or str(name).upper().startswith(UNSAFE_ENV_PREFIXES):
            refuse(
                f"hydra.job.env_set.{name}",
                "this variable makes processes load code of the config's choosing; set it in your shell if you mean it",
            )
        if not is_one_line(value):
            refuse(f"hydra.job.env_set.{name}", "must be a single-line plain value", value)
    copied = list(job.get("env_copy") or [])
    given = [o for o in overrides if o.lstrip("+~").startswith("hydra.job.env_copy")]
    if copied and not given:
        refuse(
            "hydra.job.env_copy",
            "copies environment variables into the job's recorded config; name them on the command line if you mean it",
            copied,
        )
    for name in copied:
        if str(name).upper().startswith(UNSAFE_ENV_PREFIXES):
            refuse("hydra.job.env_copy", "this variable makes processes load code; set it in your shell", name)


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


def check_sweeper_params(params: dict, overrides: list[str]) -> None:
    """hydra.sweeper.params becomes each job's overrides, which a job process reads as its command
    line: the same rules, and no environment read the real command line did not name."""
    from mlxcel.resolvers import _NAMED, names_given

    given = names_given(overrides)
    for key, value in params.items():
        for name in set(_NAMED.findall(str(value))) - given:
            refuse(
                f"hydra.sweeper.params.{key}",
                f"reads the environment variable {name}, which the command line did not name",
            )
        name = str(key).lstrip("+~")
        if name.split(".")[0].split("/")[0] == "hydra":
            refuse(f"hydra.sweeper.params.{key}", "Hydra's own settings cannot be swept; set them once")
        if not is_one_line(value):
            refuse(f"hydra.sweeper.params.{key}", "must be a single-line value (a, b, c)", value)


def check_recorded_overrides(cfg, overrides: list[str]) -> None:
    """Hydra appends the command line to hydra.overrides and composes each sweep job again from
    hydra.overrides.hydra: a config that prefills them would slip settings past this check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(overrides)
    expected = {
        "hydra": [o.input_line for o in parsed if o.is_hydra_override()],
        "task": [o.input_line for o in parsed if not o.is_hydra_override()],
    }
    recorded = OmegaConf.to_container(cfg.hydra.overrides, resolve=False)
    for key, lines in expected.items():
        if recorded.get(key) != lines:
            refuse(f"hydra.overrides.{key}", "is Hydra's record of the command line; a config may not set it")


def check_output_dirs(node: dict) -> None:
    """Run and sweep folders: a new folder of their own, never the current one or a file; a
    job's folder, Hydra's config copy and log files stay inside them (resolved values)."""
    folders = {}
    for key in ("run.dir", "sweep.dir"):
        value = select(node, tuple(key.split(".")))
        if value is not KeyError:
            folders[key] = check_run_folder(f"hydra.{key}", value)
    check_inside("hydra.sweep.subdir", select(node, ("sweep", "subdir")), "the sweep folder")
    check_inside("hydra.output_subdir", node.get("output_subdir"), "the run folder")
    submitit = (node.get("launcher") or {}).get("submitit_folder")
    if submitit is not None:
        path = Path(os.path.normpath(Path(str(submitit)).expanduser().absolute()))
        if "sweep.dir" not in folders or folders["sweep.dir"] not in path.parents:
            refuse(
                "hydra.launcher.submitit_folder", "goes in the sweep folder: ${hydra.sweep.dir}/.submitit/%j", submitit
            )


def check_run_folder(key: str, value: Any) -> Path:
    """A run (or sweep) folder as mlxcel-run, mlxcel-chat and mlxcel-serve take it: named, a
    folder of its own (not the current one or one above it), not a file. Returns it absolute."""
    if value is None or not str(value).strip():
        refuse(key, "empty: the run would write into the current folder; name a folder", value if value else "")
    if not is_one_line(value):
        refuse(key, "must be a single-line path", value)
    path = Path(os.path.normpath(Path(str(value)).expanduser().absolute()))
    if path.exists() and not path.is_dir():
        refuse(key, f"{path} exists and is not a folder", str(value))
    if path.resolve() in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        refuse(key, "is the current folder or one above it; name a folder of its own", str(value))
    return path


def check_inside(key: str, value: Any, where: str) -> None:
    """A relative folder that stays inside its parent (resolved: an interpolation may carry `..`)."""
    if value is None or value is KeyError:
        return
    parts = Path(str(value)).parts
    if not is_one_line(value) or Path(str(value)).is_absolute() or ".." in parts or not str(value).strip():
        refuse(key, f"must stay inside {where} (a relative name, no '..', not absolute)", str(value))


def check_sweep_jobs(cfg, compose, node: dict, overrides: list[str]) -> None:
    """A sweep composes each job again: the settings a job resolves for itself are checked for
    every job whose values can differ (they interpolate a swept key or the job's overrides)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not depends_on_job(cfg):
        return
    params = (node.get("sweeper") or {}).get("params") or {}
    lines = [*(f"{key}={value}" for key, value in params.items()), *overrides]
    parsed = [o for o in OverridesParser.create().parse_overrides(lines) if not o.is_hydra_override()]
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    if len(jobs) > MAX_CHECKED_JOBS:
        refuse(
            "hydra",
            f"this sweep's {len(jobs)} jobs each resolve hydra.* settings from swept values; at most "
            f"{MAX_CHECKED_JOBS} such jobs are checked: sweep fewer values or drop the interpolation",
        )
    hydra_lines = OmegaConf.to_container(cfg.hydra.overrides.hydra)
    for job in jobs:
        job_cfg = compose(cfg.hydra.job.config_name, [*hydra_lines, *job], RunMode.RUN)
        job_node = resolve_hydra_node(job_cfg)
        for key in ("job_logging", "hydra_logging"):
            check_logging(job_node.get(key) or {}, f"hydra.{key}")
        check_job(job_node.get("job") or {}, overrides)
        check_inside("hydra.sweep.subdir", select(job_node, ("sweep", "subdir")), "the sweep folder")
        check_inside("hydra.output_subdir", job_node.get("output_subdir"), "the run folder")


def depends_on_job(cfg) -> bool:
    """Whether a per-job setting resolves from the job's own config or overrides: resolved again
    with the non-hydra config emptied and the override names replaced, it changes or fails."""
    from omegaconf import OmegaConf, open_dict, read_write

    tripped = copy.deepcopy(cfg)
    OmegaConf.set_struct(tripped, False)
    for key in list(tripped.keys()):
        if key != "hydra":
            tripped[key] = "???"
    with read_write(tripped.hydra), open_dict(tripped.hydra):
        tripped.hydra.job.override_dirname = "???"
    try:
        return resolve_hydra_node(cfg, PER_JOB_SETTINGS) != resolve_hydra_node(tripped, PER_JOB_SETTINGS)
    except ConfigError:
        return True
