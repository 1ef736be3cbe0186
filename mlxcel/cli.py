"""`mlxcel-run` / `python -m mlxcel`: Hydra composes conf/, pydantic validates, the runner runs.

This is the only module (with hydra_callbacks.py and hydra_guard.py, which refuses `hydra.*`
settings that would run code) that imports Hydra.

Passing text exactly
--------------------
The values of `prompt.text`, `prompt.system` and `template.text` (also with `+`/`++`) are always
taken as one literal string: commas, colons, quotes, `${...}`, non-ASCII letters and trailing
spaces survive, so after the shell has done its quoting

    mlxcel-run prompt.text='Hello, world: ça va?  '

sends exactly `Hello, world: ça va?  `. Two exceptions: a value that is entirely one
Hydra-quoted string (`"prompt.text='a, b'"`) is unquoted once, as Hydra does, and a bare `null`
means null (use `~prompt.system` to drop a key). So to send text that itself starts and ends with
a quote, wrap it in one more pair. These keys never sweep: `-m prompt.text=a,b` is one prompt
`a,b`; sweep prompts from a YAML file (hydra.sweeper.params) instead.

Typed as for other tools
------------------------
`mlxcel-run 'What is 2+2?'` (one bare argument) is the prompt; `--model PATH` / `-m PATH` (a path,
not an override: Hydra's multirun flag otherwise), `--prompt`/`-p`, `--max-tokens`/`-n`,
`--system-prompt`, `--seed` are their overrides; flags whose override needs a choice (`--temp`:
which sampler) get one line naming it (translate_familiar_args). `--version` is mlxcel's and MLX's.

Errors: config problems (Hydra's or ours) exit 2, run failures exit 1, Ctrl-C 130, each as
one line on stderr; MLXCEL_DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxcel.errors import first_line
from mlxcel.resolvers import _FREE_TEXT, FREE_TEXT_KEYS, find_recipes_dir, register_resolvers  # noqa: F401 (re-exported)

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
_STOP_STRINGS = re.compile(r"^\+{0,2}decode\.stop_strings=", re.DOTALL)
# One complete Hydra quoted string (a backslash escapes the next character).
_QUOTED = re.compile(r"""^(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")$""", re.DOTALL)


def find_conf_dir() -> Path:
    """conf/ of a source checkout (plain or editable), else the conf shipped as mlxcel.conf."""
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "conf" / "config.yaml").is_file():
        return checkout / "conf"
    from importlib.resources import files

    return Path(str(files("mlxcel") / "conf"))  # the wheel maps conf/ to mlxcel/conf


# ---- recipes: `mlxcel-run recipe=NAME [overrides]` runs recipes/NAME.yaml ----
def list_recipes() -> list[str]:
    return sorted(path.stem for path in find_recipes_dir().glob("*.yaml"))


def find_recipe(value: str) -> Path:
    """recipe=NAME names recipes/NAME.yaml; a value with a slash or a .yaml suffix is a path to
    the user's own job file."""
    from mlxcel.errors import ConfigError, ConfigIssue

    if "/" in value or os.sep in value or value.endswith((".yaml", ".yml")):
        path = Path(value).expanduser().resolve()
        if path.suffix not in (".yaml", ".yml"):  # recipe=/etc/passwd would print its lines as keys
            raise ConfigError(ConfigIssue("recipe", "a job file is a .yaml or .yml file", value))
        if not path.is_file():
            raise ConfigError(ConfigIssue("recipe", f"no such file: {path}", value))
        return path
    path = find_recipes_dir() / f"{value}.yaml"
    if not value or not path.is_file():
        raise ConfigError(
            ConfigIssue("recipe", f"unknown recipe; available: {', '.join(list_recipes()) or 'none'}", value)
        )
    return path


def use_recipe(args: list[str]) -> list[str]:
    """Replace `recipe=X` in argv by `--config-name` of the recipe, stored in Hydra's ConfigStore.

    The ConfigStore rather than --config-dir: the recipe becomes the primary config without
    adding its folder to the search path, so a user's --config-dir and hydra.searchpath keep
    working as usual and a stray config.yaml beside a user's job file cannot hide the base
    config (a recipe's defaults list names it: `- config`).
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from mlxcel.config_expansion import check_yaml_file
    from mlxcel.errors import ConfigError, ConfigIssue

    picks = [arg for arg in args if arg.startswith("recipe=")]
    if not picks:
        return args
    if len(picks) > 1:
        raise ConfigError(ConfigIssue("recipe", "give one recipe", [p.partition("=")[2] for p in picks]))
    if any(arg in ("--config-name", "-cn") or arg.startswith("--config-name=") for arg in args):
        raise ConfigError(
            ConfigIssue("recipe", "recipe= picks the primary config; drop --config-name", has_value=False)
        )
    path = find_recipe(picks[0].partition("=")[2])
    check_yaml_file("recipe", path)
    try:
        import yaml

        is_mapping = isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict)
        node = OmegaConf.load(path)
    except Exception as ex:  # YAML syntax: one line naming the file
        raise ConfigError(ConfigIssue("recipe", f"cannot read {path}: {first_line(str(ex))}", has_value=False)) from ex
    if not is_mapping:
        raise ConfigError(
            ConfigIssue(
                "recipe", f"{path} is not a job file: it must be a YAML mapping of config keys", has_value=False
            )
        )
    name = "recipe_" + re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)  # its name in the ConfigStore
    ConfigStore.instance().store(name=name, node=node)
    return ["--config-name", name, *(arg for arg in args if arg != picks[0])]


# ---- what people type coming from mlx_lm.generate and llama-cli (README: "Coming from ...") ----
# Hydra's options that take the next argument as their value (-p, --package, only with --cfg/--info)
HYDRA_VALUE_OPTIONS = (
    *("--cfg", "-c", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"),
)
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
# Flags that set one key, meaning what they mean there: taken as that override.
FAMILIAR_FLAGS = {
    "--model": "model.path",
    "--prompt": "prompt.text",
    "-p": "prompt.text",
    "--system-prompt": "prompt.system",
    "-sys": "prompt.system",
    "--max-tokens": "decode.max_tokens",
    "-n": "decode.max_tokens",
    "--seed": "sampler.seed",
    "-s": "sampler.seed",
}
# Flags whose override depends on a choice: a sampler picks its stages (mlx_lm's --temp samples
# from the whole distribution, llama-cli's keeps its top-k/top-p/min-p chain), or a key means
# something else here (mlx_lm's --max-kv-size is a rotating cache). Named, not guessed.
NAMED_FLAGS = {
    "--temp": "sampler=temperature sampler.processors.temperature.value={} (as mlx_lm; llama-cli's chain: "
    "sampler=default sampler.processors.temperature.value={})",
    "--top-p": "sampler=default sampler.processors.top_p.p={}",
    "--top-k": "sampler=default sampler.processors.top_k.k={}",
    "--min-p": "sampler=min_p sampler.processors.min_p.p={}",
    "--repeat-penalty": "sampler=penalties sampler.processors.penalties.repeat={}",
    "--xtc-probability": "sampler=xtc sampler.processors.xtc.probability={}",
    "--max-kv-size": "model.max_context={} (the context's cap; nothing rotates)",
    "--ctx-size": "model.max_context={}",
    "--kv-bits": "decode.kv_bits={}",
    "--prefill-step-size": "prefill.chunk_size={}",
    "--chat-template-file": "template.file={}",
    "--ignore-chat-template": "template=none",
    "-no-cnv": "template=none",
}
HYDRA_OPTIONS = (
    *HYDRA_VALUE_OPTIONS,
    *("--help", "-h", "--hydra-help", "--version", "--resolve", "--package", "-p", "--run", "-r", "--multirun", "-m"),
    *("--shell-completion", "-sc", "--info", "-i"),
)
TOP_LEVEL_KEYS = (
    *("model", "tokenizer", "template", "sampler", "prefill", "decode", "prompt", "runner", "hydra", "recipe"),
)
_OVERRIDE_KEY = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.@/-]*$")


def describe_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import mlxcel

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = "not installed"
    return f"mlxcel {mlxcel.__version__} (MLX {mlx})"


def is_model_path(value: str) -> bool:
    """What follows -m is a model (llama-cli's -m FILE.gguf), not Hydra's multirun flag before an
    override or a prompt: an existing path, or one word with a slash or a .gguf suffix and no `=`
    (hydra/launcher=joblib is an override, `What is 1/2?` a prompt)."""
    if "=" in value or value.startswith(("-", "+")) or (value.startswith("~") and not value.startswith("~/")):
        return False  # (~KEY deletes a key)
    if os.path.exists(value):
        return True
    one_word = not any(c.isspace() for c in value)
    return one_word and ("/" in value or value.endswith(".gguf") or value.startswith("embedded:"))


def is_override(arg: str) -> bool:
    """KEY=VALUE (or ~KEY) as Hydra takes it, its key a dotted name: anything else that is not an
    option is a prompt (`What is 2+2?`, `x=2 and y=3?`)."""
    key, equals, _ = arg.partition("=")
    return bool(_OVERRIDE_KEY.match(key)) and (bool(equals) or key.startswith("~"))


def translate_familiar_args(args: list[str]) -> list[str]:
    """The command line as people type it coming from other tools, as mlxcel's overrides: a bare
    prompt (one argument) is prompt.text, --model PATH (or -m PATH) model.path, --prompt/-p
    prompt.text, --max-tokens/-n decode.max_tokens, --system-prompt/-sys, --seed/-s; a flag whose
    override needs a choice (--temp: which sampler) or that is no option here is a config error
    naming the override to type (argparse would print its usage and stop)."""
    from mlxcel.errors import ConfigError, ConfigIssue

    shows_config = any(arg.split("=")[0] in ("--cfg", "-c", "--info", "-i") for arg in args)
    out: list[str] = []
    prompts: list[str] = []  # the prompt given as a bare argument or by --prompt
    i = 0
    while i < len(args):
        arg, has_next = args[i], i + 1 < len(args)
        takes_value = arg in HYDRA_VALUE_OPTIONS or (arg in ("-p", "--package") and shows_config)
        if takes_value or (arg in ("--info", "-i") and has_next and args[i + 1] in INFO_CHOICES):
            out += args[i : i + 2]  # Hydra's option and its value
            i += 2
            continue
        flag, _, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg == "-m" and has_next and is_model_path(args[i + 1]):
            flag, value = "--model", args[i + 1]  # llama-cli's -m FILE.gguf, not Hydra's multirun
            i += 1
        elif flag in FAMILIAR_FLAGS or flag in NAMED_FLAGS:
            if flag == arg and flag not in ("--ignore-chat-template", "-no-cnv"):
                if not has_next:
                    raise ConfigError(ConfigIssue(flag, f"needs a value: {flag} VALUE", has_value=False))
                value = args[i + 1]
                i += 1
        elif arg.startswith("-") and flag not in HYDRA_OPTIONS:
            raise ConfigError(
                ConfigIssue(
                    flag,
                    "not an option of mlxcel-run: settings are KEY=VALUE overrides (mlxcel-run --help; "
                    "the README's 'Coming from mlx-lm or llama.cpp' table)",
                    has_value=False,
                )
            )
        i += 1
        if flag in NAMED_FLAGS:
            override = NAMED_FLAGS[flag].format(value, value)
            raise ConfigError(ConfigIssue(flag, f"mlxcel-run takes overrides: type {override}", has_value=False))
        if flag in FAMILIAR_FLAGS:
            key = FAMILIAR_FLAGS[flag]
            if key == "prompt.text":
                prompts.append(value)
            else:  # (a path is one string, whatever it holds; free text is quoted later; numbers as typed)
                out.append(f"{key}={quote_override_value(value) if key == 'model.path' else value}")
        elif arg.startswith("-") or is_override(arg):
            out.append(arg)
        else:
            head = arg.lstrip("+~").split(".")[0].split("/")[0]
            if "=" not in arg and head in TOP_LEVEL_KEYS:  # `decode.max_tokens 5`: not a prompt
                raise ConfigError(ConfigIssue(arg, f"an override needs a value: {arg}=VALUE", has_value=False))
            prompts.append(arg)
    if not prompts:
        return out
    given = [arg.partition("=")[2] for arg in out if arg.lstrip("+").startswith("prompt.text=")]
    if len(prompts) + len(given) > 1:
        raise ConfigError(
            ConfigIssue(
                "prompt.text",
                "give one prompt, as one argument: quote it, e.g. mlxcel-run 'What is 2+2?' (settings are KEY=VALUE)",
                [*prompts, *given],
            )
        )
    # quote_free_text takes the value as literal text, but for these two (unquoted once; null)
    text = prompts[0]
    return [*out, f"prompt.text={quote_override_value(text) if text == 'null' or _QUOTED.match(text) else text}"]


PROMPT_INPUTS = ("prompt.file", "prompt.messages", "prompt.rows")


def prefer_given_prompt(args: list[str], extra: dict | None = None) -> list[str]:
    """A prompt input the user gives (prompt.file, prompt.messages or prompt.rows, on the command
    line or in `extra`) wins over the prompt group's default text: `mlxcel-run prompt.file=x.jsonl`
    alone runs the batch job. A text the user gives too stays, and validation names the clash."""
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in args if "=" in arg and not arg.startswith("-")}
    given |= {f"prompt.{key}" for key, value in ((extra or {}).get("prompt") or {}).items() if value is not None}
    if given & set(PROMPT_INPUTS) and "prompt.text" not in given:
        return [*args, "prompt.text=null"]
    return args


def quote_override_value(text: str) -> str:
    """Quote `text` so Hydra's override parser and OmegaConf's resolver give back exactly `text`."""
    text = re.sub(r"(\\*)\$\{", r"\1\1\\${", text)  # OmegaConf: \${ is a literal ${
    text = re.sub(r"(\\*)'", r"\1\1\\'", text)  # Hydra: only backslashes before a quote are escapes
    text = re.sub(r"(\\+)$", r"\1\1", text)  # ...and before the closing quote
    return f"'{text}'"


def quote_free_text(args: list[str]) -> list[str]:
    """Quote the values of the free-text keys so they stay literal: a value that is one quoted
    string is unquoted once (as Hydra would) and quoted again our way, so `${...}` in it stays
    text too; null stays null. Stop strings keep their list, each string quoted."""
    quoted = []
    for arg in args:
        match = _FREE_TEXT.match(arg)
        if match and match.group(3) != "null":
            value = match.group(3)
            text = parse_override_value(match.group(2), value) if _QUOTED.match(value) else value
            arg = f"{match.group(1)}{match.group(2)}={quote_override_value(text)}"
        elif match is None and _STOP_STRINGS.match(arg):
            arg = quote_stop_strings(arg)
        quoted.append(arg)
    return quoted


def parse_override_value(key: str, value: str):
    """A value as Hydra's override parser reads it (a quoted string: unquoted once)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(f"{key}={value}").value()


def quote_stop_strings(arg: str) -> str:
    """`decode.stop_strings=[...]` (or one string) with every string quoted literally; other
    shapes (a sweep) are left to Hydra, and their `${...}` to validation."""
    from hydra.errors import HydraException

    prefix, _, value = arg.partition("=")
    try:
        parsed = parse_override_value(prefix.lstrip("+~"), value)
    except HydraException:
        return arg  # Hydra reports the syntax
    if isinstance(parsed, str):
        return f"{prefix}=[{quote_override_value(parsed)}]"
    if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
        return f"{prefix}=[{', '.join(quote_override_value(item) for item in parsed)}]"
    return arg


def run_job(cfg: Any) -> Any:
    """The Hydra task: composed config -> RunConfig -> runner."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from mlxcel.outputs import write_failure_stats
    from mlxcel.resolvers import allow_environment_reads, names_given

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    register_resolvers()  # again: a launcher may run this job in a process of its own
    allow_environment_reads(names_given(list(hydra_cfg.overrides.task)))
    try:
        data = read_job_config(cfg)
        run_cfg = validate_config(data)
    except ConfigError as ex:
        # a sweep's job (one run is validated before Hydra makes its folder): say in it why nothing ran
        write_failure_stats(out_dir, ex)
        raise
    from mlxcel import runner  # lazy: loads MLX and the model code only for a valid config

    # a sweep's jobs keep the weights loaded for the next job of this process that uses the same ones
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    # a launcher that runs the jobs side by side: each claims a GPU of its own
    side_by_side = sweep and hydra_cfg.launcher.get("_target_") not in (None, BASIC_LAUNCHER)
    sweep_job = (Path(hydra_cfg.runtime.cwd, hydra_cfg.sweep.dir), int(hydra_cfg.job.num)) if side_by_side else None
    return runner.run(
        run_cfg, out_dir=out_dir, overrides=list(hydra_cfg.overrides.task), keep_weights=sweep, sweep_job=sweep_job
    )


def read_job_config(cfg: Any) -> dict:
    """The composed config as plain data (without Hydra's own node); a `???` left unset by a
    preset is reported as a config error naming the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from mlxcel.config_expansion import check_interpolation_sizes
    from mlxcel.errors import ConfigError, ConfigIssue

    check_interpolation_sizes(cfg)  # before anything resolves a doubling chain
    try:
        return {
            key: OmegaConf.to_container(cfg[key], resolve=True, throw_on_missing=True)
            if OmegaConf.is_config(cfg[key])
            else cfg[key]
            for key in cfg
            if key != "hydra"
        }
    except MissingMandatoryValue as ex:
        raise ConfigError(
            ConfigIssue(ex.full_key, f"required: this preset has no default; set {ex.full_key}=...", has_value=False)
        ) from ex


def compose_config(overrides: list[str], extra: dict | None = None) -> dict:
    """Compose conf/ as mlxcel-run does, for the Python API: the defaults, CLI-style overrides,
    then `extra` (a partial config dict) merged on top. Hydra's errors become a ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mlxcel.errors import ConfigError, ConfigIssue
    from mlxcel.resolvers import allow_environment_reads, names_given

    register_resolvers()
    allow_environment_reads(names_given(list(overrides)))
    try:
        with initialize_config_dir(config_dir=str(find_conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=quote_free_text(prefer_given_prompt(list(overrides), extra)))
        OmegaConf.set_struct(cfg, False)  # unknown keys in `extra` are reported by validation, by name
        cfg = OmegaConf.merge(cfg, extra or {})
    except (HydraException, OmegaConfBaseException) as ex:
        raise ConfigError(ConfigIssue("overrides", describe_hydra_error(ex), has_value=False)) from ex
    return read_job_config(cfg)


def claim_run_folder_early(composed: Any, claimed: list[Path]) -> str:
    """One job's checks before hydra.main: its config and input rows (a config error makes no
    folder), then its run folder (locked; a refused start leaves an existing folder untouched:
    Hydra would write .hydra/ into it first). Returns the override that pins the folder for Hydra (so a folder
    named by the clock is the one locked here); the folder joins `claimed` as it is claimed."""
    from omegaconf import OmegaConf

    from mlxcel.config import validate_config
    from mlxcel.jobs import expand_samples, hash_samples, input_files, load_job_rows
    from mlxcel.outputs import claim_run_folder
    from mlxcel.pipeline import check_model_config

    run_cfg = validate_config(read_job_config(composed))
    # a bad input file is a config error too
    samples = expand_samples(load_job_rows(run_cfg.prompt, run_cfg.sampler, list(run_cfg.model.adapters or {})))
    if not run_cfg.runner.resume:  # (a resume's model was checked when the run began)
        check_model_config(run_cfg)
    run_dir = Path(str(OmegaConf.select(composed, "hydra.run.dir"))).expanduser().absolute()
    if not run_dir.exists():
        claimed.append(
            run_dir
        )  # ours from here: an ending before the run's own leaves its status (a folder that existed is left as it was)
    claim_run_folder(
        run_dir, run_cfg.resolved_dict(), run_cfg.runner.resume, input_files(run_cfg.prompt), hash_samples(samples)
    )
    return f"hydra.run.dir={quote_override_value(str(run_dir))}"


def check_utf8(args: list[str]) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no file can take."""
    from mlxcel.errors import ConfigError, ConfigIssue

    for number, arg in enumerate(args, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise ConfigError(
                ConfigIssue(
                    f"argument {number}",
                    "is not valid UTF-8 text; check the terminal's or the script's encoding",
                    shown,
                )
            ) from None


def describe_hydra_error(ex: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line composition errors as one line."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from mlxcel.config import RENAMED_KEYS, describe_renamed
    from mlxcel.resolvers import find_refusal

    if isinstance(ex, MissingConfigException) and ex.missing_cfg_file:
        missing = describe_missing_option(ex.missing_cfg_file, ex.options)
        if missing is not None:
            return missing
    if isinstance(ex, MissingConfigException) and ex.options is not None and ex.missing_cfg_file:
        group = ex.missing_cfg_file.rpartition("/")[0]
        options = ", ".join(ex.options) or "none"
        return f"could not find config '{ex.missing_cfg_file}'; available options in '{group}': {options}"
    if isinstance(ex, OverrideParseException):
        reason = first_line(ex.message)
        return (
            f"cannot parse override {ex.override!r}: {reason}; quote values with special characters, "
            "e.g. \"key='a, b: c'\""
        )
    if isinstance(ex, OmegaConfBaseException):
        key = getattr(ex, "full_key", None)
        refusal = find_refusal(ex)
        text = str(refusal) if refusal else first_line(str(ex))
        return f"{key}: {text}" if key else text
    lines = [line.strip() for line in str(ex).split("Config search path:")[0].splitlines()]
    lines = [line for line in lines if line and not line.startswith("See https://")]
    cause = ex.__cause__
    if isinstance(cause, OmegaConfBaseException) and "not in struct" in str(cause) and cause.full_key in RENAMED_KEYS:
        return f"{cause.full_key}: {describe_renamed(cause.full_key)}"
    stage = re.fullmatch(r"sampler\.processors\.(\w+)", str(getattr(cause, "full_key", None)))
    if isinstance(cause, OmegaConfBaseException) and "not in struct" in str(cause) and stage:
        given = re.search(r"use \+(\S+=.*)$", str(ex), re.MULTILINE)
        return describe_missing_stage(stage.group(1), given.group(1) if given else None)
    if isinstance(cause, OmegaConfBaseException) and "not in struct" in str(cause):
        # An override of a key that no config defines: name the valid keys, as validation does.
        # (Hydra's own hint, "+key=" to append it, would only meet validation's unknown-key error.)
        from mlxcel.config import suggest_key

        keys = [str(k) for k in (cause.parent_node or {}) if k != "hydra"]
        return f"{cause.full_key}: unknown key{suggest_key(str(cause.full_key), keys)}; valid keys: " + (
            ", ".join(keys) or "none"
        )
    if isinstance(cause, OmegaConfBaseException):
        lines.append(f"({first_line(str(cause))})")
    return join_sentences(lines)


# Hydra's launchers that mlxcel's `ray` extra installs (conf/hydra/launcher/ builds on them)
LAUNCHER_PLUGINS = {
    "joblib": "hydra-joblib-launcher",
    "submitit_local": "hydra-submitit-launcher",
    "submitit_slurm": "hydra-submitit-launcher",
    "ray": "hydra-ray-launcher",
    "ray_aws": "hydra-ray-launcher",
}


def describe_missing_option(missing: str, options: list[str] | None) -> str | None:
    """A group option that is not there, where the fix is not another option: a path given to
    the model group (model=/tmp/x.gguf), a launcher whose Hydra plugin is not installed."""
    group, _, value = missing.partition("/")
    if group == "model" and (is_model_path(value) or value.endswith((".gguf", ".safetensors"))):
        presets = f" (presets: {', '.join(options)})" if options else ""
        return f"model: {value!r} is a path, not a model preset: give it as model.path={value}{presets}"
    name = missing.removeprefix("hydra/launcher/")
    if name != missing and name in LAUNCHER_PLUGINS:
        return (
            f"hydra/launcher: Hydra's {name} launcher ({LAUNCHER_PLUGINS[name]}) is not installed; it comes with "
            "mlxcel's ray extra: pip install 'mlxcel[ray]'"
        )
    return None


def describe_missing_stage(stage: str, given: str | None) -> str:
    """sampler.processors.STAGE set where the sampler picked has no such stage: the samplers that
    have it (conf/sampler/), the one named after it first."""
    import yaml

    from mlxcel.config import suggest_key
    from mlxcel.sampling.config import CHAIN_ORDER

    key = f"sampler.processors.{stage}"
    if stage not in CHAIN_ORDER:
        return f"{key}: unknown sampler stage{suggest_key(key, list(CHAIN_ORDER))}; known: {', '.join(CHAIN_ORDER)}"
    having = []
    for path in sorted((find_conf_dir() / "sampler").glob("*.yaml")):
        preset = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if stage in (preset.get("processors") or {}):
            having.append(path.stem)
    having.sort(key=lambda name: name != stage)
    setting = given or f"{key}.KEY=VALUE"
    if not having:
        return f"{key}: this sampler has no {stage} stage; add it: ++{setting}"
    others = f" (samplers with a {stage} stage: {', '.join(having)})" if len(having) > 1 else ""
    return (
        f"{key}: this sampler has no {stage} stage; pick one that has it: sampler={having[0]} {setting}{others}, "
        f"or add it to this one: ++{setting}"
    )


def join_sentences(lines: list[str]) -> str:
    text = ""
    for line in lines:
        text += ("" if not text else " " if text[-1] in ".:;!?" or line.startswith("(") else "; ") + line
    return text


def run_command(command: Callable[[list[str]], int]) -> None:
    """A command that composes its own config (mlxcel-chat, mlxcel-serve) run on argv: its errors
    one line each (the traceback with MLXCEL_DEBUG=1), and its exit code."""
    debug = os.environ.get("MLXCEL_DEBUG", "") not in ("", "0")
    try:
        code = command(sys.argv[1:])
    except (Exception, KeyboardInterrupt) as exc:
        code = report_error(exc, debug)
    sys.exit(code)


def report_error(ex: BaseException, debug: bool) -> int:
    """Print `ex` for the user (one line each; the traceback with debug) and return the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mlxcel.errors import ConfigError, MlxcelError, Terminated

    if debug:
        traceback.print_exception(ex)
    if isinstance(ex, Terminated):
        print("mlxcel: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as the shell reports a process it ended
    if isinstance(ex, KeyboardInterrupt):
        print("mlxcel: interrupted", file=sys.stderr)
        return 130
    if isinstance(ex, ConfigError):
        for line in ex.format().splitlines():
            print(f"mlxcel: config error: {line}", file=sys.stderr)
        return 2
    if isinstance(ex, MlxcelError):
        print(f"mlxcel: error: {ex}", file=sys.stderr)
        return ex.exit_code
    if isinstance(ex, (HydraException, OmegaConfBaseException)):
        print(f"mlxcel: config error: {describe_hydra_error(ex)}", file=sys.stderr)
        return 2
    suffix = "" if debug else " (set MLXCEL_DEBUG=1 for the traceback)"
    print(f"mlxcel: error: {type(ex).__name__}: {first_line(str(ex))}{suffix}", file=sys.stderr)
    return 1


class SweepFailures:
    """The failed jobs of a multirun. Each is reported as it fails and the sweep goes on: Hydra's
    basic sweeper raises the first failure only after every job (of its batch) has run. The
    process then exits 1 with one line naming the count and the summary."""

    def __init__(self) -> None:
        self.jobs = 0
        self.failed: list[BaseException] = []
        self.sweep_dir: Path | None = None

    def count_job(self) -> None:
        self.jobs += 1

    def record(self, ex: BaseException, debug: bool) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        self.failed.append(ex)
        self.sweep_dir = Path(hydra_cfg.runtime.cwd, hydra_cfg.sweep.dir).absolute()  # relative to the launch dir
        # (a launcher that runs jobs in other processes hands the error back pickled, this with it)
        ex.mlxcel_sweep_dir = str(self.sweep_dir)
        print(f"mlxcel: job {hydra_cfg.job.num} failed ({' '.join(hydra_cfg.overrides.task)}):", file=sys.stderr)
        report_error(ex, debug)

    def is_job_failure(self, ex: BaseException) -> bool:
        return any(ex is failed for failed in self.failed) or hasattr(ex, "mlxcel_sweep_dir")

    def report(self, ex: BaseException) -> int:
        failed, jobs = len(self.failed), self.jobs
        if not self.failed:  # the jobs ran in other processes (joblib, submitit, Ray): their summary counts
            from mlxcel.sweep_summary import read_summary_rows

            self.sweep_dir = Path(ex.mlxcel_sweep_dir)
            rows = read_summary_rows(self.sweep_dir)
            failed, jobs = sum(row.get("status") == "failed" for row in rows), len(rows)
        summary = self.sweep_dir / "summary.csv" if self.sweep_dir else None
        where = f"summary: {summary}" if summary and summary.is_file() else f"sweep folder: {self.sweep_dir}"
        print(f"mlxcel: {failed} of {jobs} jobs failed; {where}", file=sys.stderr)
        return 1


def entry() -> None:
    """`mlxcel-run` and `python -m mlxcel`: first, on a Linux CPU, re-execute once with OpenBLAS
    preloaded instead of MLX's reference BLAS (mlxcel/blas.py); then `main`. In-process callers
    (tests, embedding) call `main` and keep their process."""
    from mlxcel.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv[1:])
    main()


def main() -> None:
    """Console entry point: parse argv with Hydra, run, exit with 0, 1, 2 or 130."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mlxcel.hydra_guard import check_hydra_settings
    from mlxcel.outputs import STATS_FILE, terminate_on_sigterm, write_failure_stats
    from mlxcel.resolvers import allow_environment_reads, names_given

    debug = os.environ.get("MLXCEL_DEBUG", "") not in ("", "0") or os.environ.get("HYDRA_FULL_ERROR") == "1"
    failures: list[BaseException] = []
    sweep = SweepFailures()

    def task(cfg: Any) -> Any:
        sweep.count_job()
        try:
            return run_job(cfg)
        except Exception as ex:
            # A sweep lets Hydra record the failed job (on_job_end) and go on; a single run keeps
            # it here so Hydra does not print its own "Error executing job" line before ours.
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                sweep.record(ex, debug)
                raise
            failures.append(ex)
            return None

    # hydra.main reports errors through run_and_report: a message plus a stripped traceback and
    # "Set the environment variable HYDRA_FULL_ERROR=1". HYDRA_FULL_ERROR=1 is its documented
    # switch to re-raise instead, so every error (composition, override syntax, interpolation,
    # the job's own) reaches one handler here, which prints one line and picks the exit code.
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    claimed: list[Path] = []  # the one job's run folder, once claimed
    try:
        terminate_on_sigterm()
        check_utf8(sys.argv[1:])
        register_resolvers()
        allow_environment_reads(names_given(sys.argv[1:]))
        if "--version" in sys.argv[1:]:  # (Hydra's would print Hydra's)
            from mlxcel.outputs import AnswerStream

            AnswerStream(sys.stdout).write(describe_version() + "\n")  # (`| head -0` too: quietly)
            sys.exit(0)
        args = translate_familiar_args(sys.argv[1:])
        sys.argv = [sys.argv[0], *use_recipe(quote_free_text(prefer_given_prompt(args)))]
        composed = check_hydra_settings(sys.argv[1:], find_conf_dir())  # before Hydra instantiates or creates anything
        if composed is not None:  # one job: refuse what can be refused before Hydra writes into a folder
            sys.argv.append(claim_run_folder_early(composed, claimed))
        hydra.main(version_base="1.3", config_path=str(find_conf_dir()), config_name="config")(task)()
        if failures:
            raise failures[0]
    except (Exception, KeyboardInterrupt) as ex:
        if sweep.is_job_failure(ex):
            sys.exit(sweep.report(ex))
        for folder in claimed:  # ended before the run could say so (Ctrl-C in start-up): its status
            if folder.is_dir() and not (folder / STATS_FILE).exists():
                write_failure_stats(folder, ex)
        sys.exit(report_error(ex, debug))
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    sys.exit(0)
