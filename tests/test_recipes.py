"""Recipes: every recipe composes, validates and dry-runs; recipe= finds them in a checkout and
after a non-editable install, from any directory; unknown names and user job files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlxcel.cli import (
    find_conf_dir,
    find_recipe,
    find_recipes_dir,
    list_recipes,
    read_job_config,
    register_resolvers,
    use_recipe,
)
from mlxcel.config import PromptRow, validate_config
from mlxcel.errors import ConfigError
from tests.helpers import find_smollm2_gguf, requires_smollm2

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted(path.stem for path in (REPO / "recipes").glob("*.yaml"))


def run_cli(args: list[str], cwd: Path, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLXCEL_DEBUG", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def compose_recipe(name: str, overrides: list[str] = ()) -> OmegaConf:
    """The recipe as mlxcel-run composes it (through use_recipe and the ConfigStore)."""
    register_resolvers()
    args = use_recipe([f"recipe={name}"])
    assert args[0] == "--config-name"
    with initialize_config_dir(config_dir=str(find_conf_dir()), version_base="1.3"):
        return compose(config_name=args[1], overrides=list(overrides), return_hydra_config=True)


def sweep_points(cfg) -> list[list[str]]:
    """The overrides of every job of the recipe's own sweep (one key per recipe here)."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    points = [[]]
    for key, values in params.items():
        points = [p + [f"{key}={v.strip()}"] for p in points for v in str(values).split(",")]
    return points


def test_the_shipped_recipes_are_found_in_the_checkout():
    assert find_recipes_dir() == REPO / "recipes"
    assert {"chunk_sweep", "batch_jsonl", "sampler_sweep"} <= set(list_recipes())
    assert list_recipes() == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_starts_with_a_comment_saying_what_it_does_and_how_to_run_it(name):
    text = (REPO / "recipes" / f"{name}.yaml").read_text()
    head = text.split("\ndefaults:")[0].splitlines()
    assert head[0].startswith(f"# {name}: ") and all(line.startswith("#") or not line for line in head)
    assert f"mlxcel-run recipe={name}" in text


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates_at_every_sweep_point(name):
    cfg = compose_recipe(name)
    for point in sweep_points(cfg):
        job = compose_recipe(name, point)
        run_cfg = validate_config(read_job_config(job))
        assert run_cfg.runner.name == name  # each recipe writes under outputs/<its name>/


def test_chunk_sweep_is_greedy_over_three_chunk_sizes():
    cfg = compose_recipe("chunk_sweep")
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert sweep_points(cfg) == [[f"prefill.chunk_size={c}"] for c in (16, 64, 2048)]
    run_cfg = validate_config(read_job_config(cfg))
    assert run_cfg.sampler.effective_chain() == [{"stage": "draw", "kind": "greedy"}]
    assert run_cfg.decode.max_tokens <= 32 and len(run_cfg.prompt.text) > 1000  # a few hundred tokens


def test_sampler_sweep_samples_at_three_temperatures_with_a_fixed_seed():
    cfg = compose_recipe("sampler_sweep")
    assert sweep_points(cfg) == [[f"sampler.processors.temperature.value={t}"] for t in ("0.2", "0.7", "1.0")]
    run_cfg = validate_config(read_job_config(compose_recipe("sampler_sweep", sweep_points(cfg)[0])))
    chain = run_cfg.sampler.effective_chain()
    assert chain[0]["stage"] == "temperature" and chain[0]["value"] == 0.2 and chain[-1]["kind"] == "categorical"
    assert run_cfg.sampler.seed == 1234


def test_batch_jsonl_reads_the_example_prompts_shipped_with_the_recipes():
    run_cfg = validate_config(read_job_config(compose_recipe("batch_jsonl")))
    path = Path(run_cfg.prompt.file)
    assert path == find_recipes_dir() / "data" / "prompts.jsonl" and path.is_absolute()
    rows = [PromptRow.model_validate(json.loads(line)) for line in path.read_text().splitlines()]
    assert len(rows) == 6
    assert any(r.prompt for r in rows) and any(r.messages for r in rows) and any(r.id is None for r in rows)
    assert any(r.max_tokens for r in rows) and any(r.n > 1 for r in rows) and any(r.seed is not None for r in rows)


def test_unknown_recipe_is_a_config_error_listing_the_recipes():
    with pytest.raises(ConfigError) as info:
        find_recipe("nope")
    assert info.value.format() == f"recipe: unknown recipe; available: {', '.join(RECIPES)} (got 'nope')"


def test_two_recipes_or_a_config_name_are_refused():
    with pytest.raises(ConfigError, match="give one recipe"):
        use_recipe(["recipe=chunk_sweep", "recipe=batch_jsonl"])
    with pytest.raises(ConfigError, match="drop --config-name"):
        use_recipe(["recipe=chunk_sweep", "--config-name", "config"])
    assert use_recipe(["a=1"]) == ["a=1"]


# ---- through the CLI ----
@pytest.mark.slow
def test_unknown_recipe_exits_2_with_one_line(tmp_path):
    result = run_cli(["recipe=nope"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"mlxcel: config error: recipe: unknown recipe; available: {', '.join(RECIPES)} (got 'nope')"
    ]


@pytest.mark.slow
@requires_smollm2
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_dry_runs_through_the_cli(name, tmp_path):
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    result = run_cli(
        [f"recipe={name}", "runner.dry_run=true", f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={sweep_dir}"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    cfg = compose_recipe(name)
    job_dirs = (
        [sweep_dir / str(i) for i in range(len(sweep_points(cfg)))]
        if OmegaConf.select(cfg, "hydra.sweeper.params")
        else [run_dir]
    )
    prompts = []
    for job_dir in job_dirs:
        assert json.loads((job_dir / "stats.json").read_text())["status"] == "dry_run"
        prompts.append([json.loads(line) for line in (job_dir / "prompts.jsonl").read_text().splitlines()])
        assert prompts[-1] and all(row["prompt_token_ids"] for row in prompts[-1])
    assert not (tmp_path / "outputs").exists()  # the folders went where hydra.*.dir said
    if len(job_dirs) > 1:
        summary = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
        assert [row["status"] for row in summary] == ["dry_run"] * len(job_dirs)
    if name == "chunk_sweep":
        ids = [p[0]["prompt_token_ids"] for p in prompts]
        assert len(ids[0]) >= 200 and all(i == ids[0] for i in ids)
        # every prompt token is chunked (no chat template, so no one-piece history span)
        pieces = [len(p[0]["prefill_pieces"]) for p in prompts]
        assert pieces == [-(-len(ids[0]) // 16), -(-len(ids[0]) // 64), 1]
    if name == "batch_jsonl":
        assert {row["id"] for row in prompts[0]} == {"capital", "haiku", "colors", "follow-up", 5, "french"}


@pytest.mark.slow
@requires_smollm2
def test_command_line_sweep_replaces_the_recipes_sweep_of_that_key(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        ["recipe=chunk_sweep", "prefill.chunk_size=32,128", "runner.dry_run=true", f"hydra.sweep.dir={sweep_dir}"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    assert [row["params"]["prefill.chunk_size"] for row in summary] == [32, 128]


@pytest.mark.slow
def test_a_users_own_job_file_extends_the_base_config(tmp_path):
    (tmp_path / "my_job.yaml").write_text(
        "defaults:\n  - config\n  - override /sampler: temperature\n  - _self_\ndecode:\n  max_tokens: 3\n"
    )
    (tmp_path / "config.yaml").write_text("decode:\n  max_tokens: 999\n")  # a stray file beside it changes nothing
    result = run_cli(["recipe=./my_job.yaml", "--cfg", "job", "sampler.seed=5"], tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["decode"]["max_tokens"] == 3 and shown["sampler"]["seed"] == 5
    assert shown["sampler"]["selector"]["kind"] == "categorical" and shown["model"]["path"] == "embedded:smollm2"
    missing = run_cli(["recipe=./nope.yaml"], tmp_path)
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        f"mlxcel: config error: recipe: no such file: {tmp_path / 'nope.yaml'} (got './nope.yaml')"
    ]


@pytest.mark.slow
def test_recipe_works_with_a_users_config_dir(tmp_path):
    mine = tmp_path / "myconf" / "sampler"
    mine.mkdir(parents=True)
    (mine / "hot.yaml").write_text("processors:\n  temperature: {value: 1.5}\nselector: {kind: categorical}\n")
    result = run_cli(["recipe=chunk_sweep", "--config-dir", "myconf", "sampler=hot", "--cfg", "job"], tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["sampler"]["processors"]["temperature"]["value"] == 1.5 and shown["runner"]["name"] == "chunk_sweep"


@pytest.mark.slow
def test_installed_package_finds_its_recipes_from_any_directory(tmp_path, installed_mlxcel):
    target = installed_mlxcel
    shipped = target / "mlxcel" / "recipes"
    assert sorted(p.stem for p in shipped.glob("*.yaml")) == RECIPES and (shipped / "data" / "prompts.jsonl").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_cli(["recipe=batch_jsonl", "--cfg", "job", "--resolve"], elsewhere, pythonpath=target)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["prompt"]["file"] == str(shipped / "data" / "prompts.jsonl")
    unknown = run_cli(["recipe=nope"], elsewhere, pythonpath=target)
    assert unknown.returncode == 2 and f"available: {', '.join(RECIPES)}" in unknown.stderr
    if find_smollm2_gguf() is not None:
        run_dir = elsewhere / "run"
        dry = run_cli(
            ["recipe=batch_jsonl", "runner.dry_run=true", f"hydra.run.dir={run_dir}"], elsewhere, pythonpath=target
        )
        assert dry.returncode == 0, dry.stderr
        assert len((run_dir / "prompts.jsonl").read_text().splitlines()) >= 6
        sweep_dir = elsewhere / "sweep"  # the summary callback and the plot, from the installed package
        sweep = run_cli(
            ["recipe=chunk_sweep", "runner.dry_run=true", f"hydra.sweep.dir={sweep_dir}"], elsewhere, pythonpath=target
        )
        assert sweep.returncode == 0, sweep.stderr
        assert (
            len((sweep_dir / "summary.jsonl").read_text().splitlines()) == 3 and (sweep_dir / "summary.png").is_file()
        )
