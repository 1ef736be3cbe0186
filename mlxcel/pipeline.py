"""The staged pipeline a run (or a script) drives: model → tokenizer → template → prompts →
PrefillPlan → engine. `Pipeline.load(cfg)` builds it; `prepare` renders and tokenizes samples
(a bad one becomes an error row, not a failed job); `generate` runs one batch."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from mlxcel.checkpoints.fingerprint import ModelHeader, read_model_header
from mlxcel.checkpoints.loader import LoadedModel, load_model, resolve_model_path
from mlxcel.config import RunConfig
from mlxcel.engine import BatchState, DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.auto_rows import OPEN_PROMPT_TOKENS, choose_batch_engine_rows, choose_max_rows
from mlxcel.engine.draft_model import check_draft_vocabulary
from mlxcel.engine.engine import OnRowDone, OnToken
from mlxcel.engine.prompt_cache import PROMPT_CACHE_SHARE, PromptCache
from mlxcel.engine.prompt_cache_files import (
    describe_layout,
    describe_model_key,
    describe_states,
    load_entries,
    save_entries,
)
from mlxcel.engine.scheduler import (
    BatchScheduler,
    ScheduleState,
    default_kv_budget_bytes,
    device_memory_bytes,
    supports_scheduling,
)
from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError
from mlxcel.jobs import Sample
from mlxcel.models.paged_cache import BLOCK_SIZE, count_blocks
from mlxcel.prefill_plan import PrefillPlan, plan_prefill
from mlxcel.sampling import SamplerChain, make_sampler_chain
from mlxcel.sampling.config import SamplerConfig
from mlxcel.sampling.history import make_piece_encoder
from mlxcel.structured.matcher import Constraint, Constraints
from mlxcel.structured.spec import ConstraintError, check_grammar, describe_spec
from mlxcel.template import NO_TEMPLATE_HINT, PromptTokens, build_prompt, load_template_source
from mlxcel.tokenizer import DeferredTextStream, TextStream, load_tokenizer
from mlxcel.tokenizer.base import MlxcelTokenizer
from mlxcel.tokenizer.literal import encode_text, escape_spans
from mlxcel.tools.grammar import make_call_grammar
from mlxcel.tools.parsers import choose_tool_parser, reasoning_format
from mlxcel.vision.stage import (
    ImageInputs,
    check_images_allowed,
    collect_image_paths,
    flatten_text_parts,
    is_vision_model,
    prepare_images,
)


@dataclass
class PreparedSample:
    sample: Sample
    prompt: PromptTokens | None = None
    error: str | None = None  # why this sample cannot run (it is written as an error row)
    images: ImageInputs | None = None  # the prompt's preprocessed images (VLMs); token ids already expanded
    constraint: Constraint | None = None  # structured output: the row's (or the job's) compiled constraint
    # how the answer is read (mlxcel/tools/parsers.py): (tool syntax or None, <think>, opened in the prompt)
    reader: tuple | None = None


def find_template(cfg: RunConfig, tokenizer: MlxcelTokenizer, required: bool = True, tools=None):
    """The chat template the config picks (None: no template). `required` False (a server, whose
    completions need none): template=auto without one is None here, and an error per chat request.
    `tools`: the one for prompts with tools (a tokenizer's "tool_use" template, where it has one)."""
    template = cfg.template
    tools = template.kwargs.get("tools") if tools is None else tools
    source = load_template_source(tokenizer, template.text, template.file, template.kind, template.name, tools=tools)
    if template.kind == "auto" and source is None and required:  # one error for the run, not one per row
        where = cfg.tokenizer.path or cfg.model.path
        raise MlxcelError(f"template=auto: the tokenizer of {where} has no chat template; {NO_TEMPLATE_HINT}")
    return source


# The last job's weights (one entry: a sweep over models holds one at a time), with what identifies them.
_KEPT_WEIGHTS: dict[tuple, LoadedModel] = {}


def describe_weights(path: Path, settings: tuple) -> tuple:
    """What makes two jobs' weights the same: the files (their paths and modification times,
    sub-folders such as an adapter's included), the load settings, and the device."""
    import mlx.core as mx

    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stamps = tuple((str(f.relative_to(path.parent)), f.stat().st_mtime_ns) for f in files if f.is_file())
    return (str(path.resolve()), stamps, json.dumps(settings), str(mx.default_device()))


def describe_load_settings(cfg: RunConfig) -> dict:
    """The config's settings that change the loaded weights (the weights cache and the prompt cache's key)."""
    model = cfg.model
    settings = {
        "dtype": model.dtype,
        "gguf_weights": model.gguf_weights,
        "quantize": model.quantize.model_dump() if model.quantize else None,
        "fuse": model.resolved_fuse(),
    }
    if model.adapter is not None or model.adapters is not None:  # (their files too: retrained, they differ)
        folders = {"": model.adapter} if model.adapter is not None else dict(model.adapters)
        settings["adapters"] = {name: describe_weights(Path(folder), ()) for name, folder in folders.items()}
        settings["merge_adapter"] = model.merge_adapter
    return settings


def load_weights_for(cfg: RunConfig, path: Path, log: TextIO | None, keep: bool) -> LoadedModel:
    model = cfg.model
    settings = describe_load_settings(cfg)
    quantize, fuse = settings["quantize"], settings["fuse"]
    key = describe_weights(path, tuple(settings.values())) if keep else None
    if key is not None and key in _KEPT_WEIGHTS:
        say(log, f"model {model.path}: the previous job's weights, still loaded")
        kept = _KEPT_WEIGHTS[key]
        return replace(kept, info={**kept.info, "load_ms": 0.0, "kept_from_previous_job": True})
    _KEPT_WEIGHTS.clear()  # the previous model goes before this one loads
    say(log, f"loading model {model.path} ...")
    loaded = load_model(
        model.path,
        model.dtype,
        model.gguf_weights,
        quantize,
        fuse=fuse,
        adapter=model.adapter,
        adapters=model.adapters,
        merge_adapter=model.merge_adapter,
    )
    info = loaded.info
    params, seconds = info["params"] / 1e6, info["load_ms"] / 1000
    say(log, f"loaded {info['arch']} ({params:.0f}M params, {info['dtype']}) in {seconds:.1f} s")
    if "note" in info:
        say(log, info["note"])
    if key is not None:
        _KEPT_WEIGHTS[key] = loaded
    return loaded


def load_draft_model(cfg: RunConfig, loaded: LoadedModel, log: TextIO | None):
    """decode.draft.model_path's model, in the model's dtype (its vocabulary checked before: Pipeline.load)."""
    from mlxcel.engine.draft_model import DraftModel
    from mlxcel.engine.scheduler import recurrent_layers

    path = cfg.decode.draft.model_path
    say(log, f"loading draft model {path} ...")
    draft = load_model(path, loaded.info["dtype"], cfg.model.gguf_weights)
    if any(recurrent_layers(draft.model)):
        raise MlxcelError(
            f"decode.draft.model_path={path}: a {draft.info['arch']} draft model keeps recurrent state, which a "
            "rejected draft cannot take back yet; pick an attention-only draft model"
        )
    say(log, f"loaded draft {draft.info['arch']} ({draft.info['params'] / 1e6:.0f}M params)")
    return DraftModel(draft.model, loaded.model.args.vocab_size)


def check_model_config(cfg: RunConfig, require_template: bool = True) -> tuple:
    """The config's demands on this model that its header and tokenizer can answer (tile size,
    KV groups, the chat template): config errors, before minutes of loading. Returns the
    model's path, header and tokenizer."""
    path = resolve_model_path(cfg.model.path)
    header = read_model_header(path)
    check_before_loading(cfg, header)
    tokenizer = load_tokenizer(cfg.tokenizer.path or path, cfg.tokenizer.kind)
    find_template(cfg, tokenizer, require_template)
    return path, header, tokenizer


def check_job_constraint(cfg: RunConfig) -> list[ConfigIssue]:
    """decode.constraint compiles, as llguidance checks it without the tokenizer: a config error
    before the weights load (Pipeline.compile_job_constraint binds it to the tokenizer after)."""
    config = cfg.decode.constraint
    if config is None:
        return []
    spec = config.to_spec()  # (a file that cannot be read: its own ConfigError)
    try:
        check_grammar(spec)
    except ConstraintError as exc:
        return [describe_compile_error(spec, exc)]
    return []


def describe_compile_error(spec: dict, exc: ConstraintError) -> ConfigIssue:
    return ConfigIssue(f"decode.constraint.{describe_spec(spec)}", f"does not compile: {exc.reason}", has_value=False)


def check_before_loading(cfg: RunConfig, header: ModelHeader) -> None:
    """What the config asks of this model, checked from its header: config errors (exit 2)
    before minutes of loading."""
    issues = []
    context = cfg.model.max_context or header.max_context
    tile = cfg.prefill.resolved_tile_size()
    if tile and tile >= context:
        issues.append(ConfigIssue("prefill.tile_size", f"must be below the model's context ({context} tokens)", tile))
    if cfg.decode.kv_bits and header.head_dim and header.head_dim % cfg.decode.kv_group_size:
        issues.append(
            ConfigIssue(
                "decode.kv_group_size",
                f"must divide the model's head size ({header.head_dim}); use one of 32, 64, 128 that does",
                cfg.decode.kv_group_size,
            )
        )
    issues += check_job_constraint(cfg)
    families = cfg.model.families
    if families and header.arch not in families:
        issues.append(
            ConfigIssue(
                "model",
                f"{cfg.model.path} is a {header.arch!r} checkpoint, and this model preset is for "
                f"{', '.join(families)}; pick the preset of its family, or model=hf for any",
                has_value=False,
            )
        )
    if issues:
        raise ConfigError(issues)


class Pipeline:
    def __init__(
        self,
        cfg: RunConfig,
        header: ModelHeader,
        tokenizer: MlxcelTokenizer,
        loaded: LoadedModel | None,
        require_template: bool = True,
    ):
        self.cfg = cfg
        self.header = header
        self.tokenizer = tokenizer
        self.loaded = loaded
        self.template_source = find_template(cfg, tokenizer, require_template)
        self.max_context = cfg.model.max_context or (
            loaded.model.args.max_position_embeddings if loaded else header.max_context
        )
        self.stop_ids = self._merge_stop_ids() if loaded else set()
        self.sampler = self.make_sampler() if loaded else None
        self.prompt_cache = make_prompt_cache(cfg) if loaded and cfg.runner.prompt_cache else None
        self.prompt_cache_key = ""  # names this model's folder under runner.prompt_cache_dir (load_prompt_cache)
        self.keep_answers = False  # snapshot answers into the prompt cache too (a chat's next turn starts with them)
        self.row_chains: dict[str, SamplerChain] = {}  # rows' own chains by their settings, LRU (chain_for)
        self.max_rows: int | None = None  # runner.max_rows as the last engine got it (auto resolved: choose_rows)
        # (a dry run compiles constraints too, against the tokenizer alone: a bad schema fails it)
        self.constraints = (
            Constraints(tokenizer, loaded.model.args.vocab_size, self.eos_ids())
            if loaded
            else Constraints(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
        )
        self.constraint = self.compile_job_constraint()  # decode.constraint, for rows without their own
        self.draft_model = None  # decode.draft.method=model: engine/draft_model.py (Pipeline.load)
        # rows with tools render with the tokenizer's "tool_use" template where it has one (as
        # transformers picks it), and answers are read for tool calls and <think> reasoning
        self.tool_template_source = find_template(cfg, tokenizer, require_template, tools=[]) or self.template_source
        self.tool_parser = choose_tool_parser(cfg.template.tool_parser, self.tool_template_source)
        self.reasoning = reasoning_format(self.template_source)  # think, harmony or None

    @classmethod
    def load(
        cls,
        cfg: RunConfig,
        load_weights: bool = True,
        log: TextIO | None = None,
        keep_weights: bool = False,
        require_template: bool = True,
    ) -> Pipeline:
        """`keep_weights`: the jobs of a sweep run in this process (Hydra's basic launcher) one
        after another; the weights stay loaded for the next job that asks for the same ones.
        `require_template` False: see find_template."""
        # (a GGUF file's tokenizer reads its metadata itself)
        path, header, tokenizer = check_model_config(cfg, require_template)
        drafting = load_weights and cfg.decode.draft.method == "model"
        if drafting:  # (before minutes of loading)
            draft_path = cfg.decode.draft.model_path
            draft_tokenizer = load_tokenizer(resolve_model_path(draft_path), "auto")
            check_draft_vocabulary(tokenizer, draft_tokenizer, f"decode.draft.model_path={draft_path}")
        loaded = None
        if load_weights:
            loaded = load_weights_for(cfg, path, log, keep_weights)
        pipeline = cls(cfg, header, tokenizer, loaded, require_template)
        if drafting:
            pipeline.draft_model = load_draft_model(cfg, loaded, log)
        pipeline.load_prompt_cache(path, log)
        return pipeline

    def load_prompt_cache(self, path: Path, log: TextIO | None) -> None:
        """With runner.prompt_cache_dir: what earlier jobs of this model saved there."""
        folder = self.cfg.runner.prompt_cache_dir
        if self.prompt_cache is None or folder is None:
            return
        cfg = self.cfg
        settings = {
            **describe_load_settings(cfg),
            "dtype": self.loaded.info["dtype"],  # resolved: "auto" differs by device
            "kv_bits": cfg.decode.kv_bits,
            "kv_group_size": cfg.decode.kv_group_size if cfg.decode.kv_bits else None,
        }
        self.prompt_cache_key = describe_model_key(path, self.header.fingerprint, settings)
        model = self.loaded.model
        layout = describe_layout(model, settings["dtype"], cfg.decode.kv_bits, cfg.decode.kv_group_size)
        states = describe_states(model)
        used = load_entries(self.prompt_cache, Path(folder), self.prompt_cache_key, layout, log or sys.stderr, states)
        if used:
            say(log, f"prompt cache: {used} entries ({self.prompt_cache.cached_tokens} tokens) from {folder}")

    def save_prompt_cache(self) -> None:
        folder = self.cfg.runner.prompt_cache_dir
        if self.prompt_cache is not None and folder is not None and self.prompt_cache_key:
            save_entries(self.prompt_cache, Path(folder), self.prompt_cache_key)

    def _merge_stop_ids(self) -> set[int]:
        """EOS from the model, generation_config.json and the tokenizer, plus decode.stop_token_ids;
        decode.ignore_eos keeps only the explicit stop ids."""
        cfg = self.cfg
        vocab = self.loaded.model.args.vocab_size
        bad = [i for i in cfg.decode.stop_token_ids if not 0 <= i < vocab]
        if bad:
            raise ConfigError(ConfigIssue("decode.stop_token_ids", f"ids must be in [0, {vocab}) for this model", bad))
        stop = set(cfg.decode.stop_token_ids)
        if not cfg.decode.ignore_eos:
            stop.update(self.eos_ids())
        return stop

    def eos_ids(self) -> list[int]:
        """The model's EOS ids (its config, generation_config.json and the tokenizer's), sorted."""
        loaded = self.loaded
        eos = loaded.generation_config.get("eos_token_id")
        ids = set([eos] if isinstance(eos, int) else eos or []) | set(loaded.model.eos_token_ids())
        return sorted(ids | set(self.tokenizer.eos_token_ids))

    def make_sampler(self, config: SamplerConfig | None = None) -> SamplerChain:
        """The sampler chain (the config's, or `config`: a server request's) bound to this model:
        its vocabulary, EOS ids, DRY breakers tokenized."""
        encode = make_piece_encoder(self.tokenizer)  # DRY's breaker strings
        return make_sampler_chain(
            config or self.cfg.sampler,
            self.loaded.model.args.vocab_size,
            encode=encode,
            eos_token_ids=self.eos_ids(),
            max_context=self.max_context,
        )

    def compile_job_constraint(self) -> Constraint | None:
        """decode.constraint compiled for this model's tokenizer: one that does not compile is a
        config error before anything runs."""
        config = self.cfg.decode.constraint
        if config is None:
            return None
        spec = config.to_spec()
        try:
            return self.constraints.compile(spec)
        except ConstraintError as exc:
            raise ConfigError(describe_compile_error(spec, exc)) from None

    def read_tools(self, row) -> tuple[str | None, dict | None]:
        """A row's tools (its own, or template.kwargs.tools) and tool_choice: (the syntax its answer's
        calls are read in, None without tools or with tool_choice none; its structured-output spec:
        a forced call's grammar for required or a named function, else its own constraint)."""
        from mlxcel.openai_protocol import ApiError, read_tool_settings

        tools = row.tools if row.tools is not None else self.cfg.template.kwargs.get("tools")
        if tools is None and row.tool_choice is None:
            return None, row.constraint
        if tools is not None and "tools" not in (self.tool_template_source or ""):
            raise MlxcelError(
                "tools: the chat template does not render tools (set template.file or template.text to one that "
                "does, or leave tools out)"
            )
        try:
            tools, choice = read_tool_settings(tools, row.tool_choice)
            if choice in ("none", "auto"):
                return (self.tool_parser if choice == "auto" else None), row.constraint
            if row.constraint is not None:
                raise ApiError(400, "a constraint cannot be used with tool_choice required or a named function")
            grammar = make_call_grammar(
                self.tool_parser, tools, choice, row.parallel_tool_calls, self.tokenizer.special_tokens
            )
            return self.tool_parser, grammar
        except ApiError as exc:
            raise MlxcelError(f"{exc.param}: {exc.message}" if exc.param else exc.message) from None

    def constraint_for(self, spec: dict | None) -> Constraint | None:
        """A row's constraint: its own spec compiled (ConstraintError if it does not), else the job's."""
        if spec is None:
            return self.constraint
        return self.constraints.compile(spec)

    def prepare(self, samples: list[Sample]) -> list[PreparedSample]:
        """Render and tokenize every sample; one that fails gets its error, the rest go on."""
        prepared = []
        for sample in samples:
            try:
                prepared.append(self.prepare_one(sample))
            except MlxcelError as exc:
                prepared.append(PreparedSample(sample, None, str(exc)))
        return prepared

    def prepare_one(self, sample: Sample) -> PreparedSample:
        """Render, tokenize and (with images) load, preprocess and expand the placeholders. A dry
        run (no weights) stops before the images: their token counts need the model's processor."""
        template, model = self.cfg.template, self.loaded.model if self.loaded else None
        row = sample.row
        if row.batch is not None and row.batch.get("error"):
            raise MlxcelError(row.batch["error"])  # a batch file's line that cannot run
        if row.constraint_error is not None:
            raise MlxcelError(row.constraint_error)  # (its constraint cannot be read: this row's error)
        if self.loaded is not None:
            self.chain_for(row.sampler)  # (a bad logit_bias id is this row's error)
        tool_parser, spec = self.read_tools(row)
        constraint = self.constraint_for(spec)  # (one that does not compile: this row's error)
        if row.raw:  # a completion (a server's, a batch file's): the text as it is
            prompt = build_prompt(self.tokenizer, row.messages, None, enabled=False)
            self.check_length(prompt)
            return PreparedSample(sample, prompt, constraint=constraint)
        paths = collect_image_paths(sample.row.messages)
        if model is not None:
            check_images_allowed(model, self.header.arch, paths)
        kwargs = template.kwargs if sample.row.tools is None else {**template.kwargs, "tools": sample.row.tools}
        if template.enable_thinking is not None:
            kwargs = {**kwargs, "enable_thinking": template.enable_thinking}
        messages = flatten_text_parts(sample.row.messages)
        templated = template.kind != "none"
        literal = template.special_tokens_in_content == "text"  # (the user's special-token text stays text)
        source = self.tool_template_source if kwargs.get("tools") is not None else self.template_source
        prompt = build_prompt(self.tokenizer, messages, source, templated, kwargs, literal)
        reader = None
        if templated and (tool_parser is not None or self.reasoning):
            reader = (tool_parser, self.reasoning, prompt.text.rstrip().endswith("<think>"))
        if model is None or not is_vision_model(model):
            self.check_length(prompt)
            return PreparedSample(sample, prompt, constraint=constraint, reader=reader)
        # a family that expands its placeholders in the text gets it with the user's special-token
        # texts escaped, so they stay text when it is encoded again
        escaped, escapes = escape_spans(prompt.text, prompt.literal_spans)

        def encode_expanded(text: str) -> list[int]:
            return encode_text(self.tokenizer, *escapes.unescape(text), add_special_tokens=not templated)

        token_ids, images = prepare_images(model, escaped, prompt.token_ids, paths, encode_expanded)
        if images is not None:  # the history boundary moved with the expansion: no history piece
            prompt = PromptTokens(prompt.text, token_ids, history_tokens=0, literal_spans=prompt.literal_spans)
        self.check_length(prompt)
        return PreparedSample(sample, prompt, images=images, constraint=constraint)

    def make_text_stream(
        self, streaming: bool = True, stop_strings: list[str] | None = None
    ) -> TextStream | DeferredTextStream:
        """Per-row detokenizer that also applies the stop strings (the row's own, else
        decode.stop_strings); decoded once at the row's end where nothing reads its text as it
        grows (`streaming` False) and no stop string is set."""
        stops = self.cfg.decode.stop_strings if stop_strings is None else stop_strings
        if not streaming and not stops:
            return DeferredTextStream(self.tokenizer)
        return TextStream(self.tokenizer, stops)

    def chain_for(self, config: SamplerConfig | dict | None) -> SamplerChain | None:
        """A row's own sampler chain (a server request's, a batch file line's), built once per
        distinct settings; the last ROW_CHAINS used are kept (a chain holds compiled functions and
        a bias vector, and a server sees settings without end)."""
        if config is None:
            return None
        data = config.model_dump(mode="json") if isinstance(config, SamplerConfig) else config
        key = json.dumps(data, sort_keys=True)
        chain = self.row_chains.pop(key, None)
        if chain is None:
            try:
                chain = self.make_sampler(SamplerConfig.model_validate(data))
            except ConfigError as err:
                raise MlxcelError("; ".join(f"{i.path}: {i.message} (got {i.value!r})" for i in err.issues)) from None
        self.row_chains[key] = chain  # (the most recently used last)
        if len(self.row_chains) > ROW_CHAINS:
            del self.row_chains[next(iter(self.row_chains))]
        return chain

    def check_length(self, prompt: PromptTokens) -> None:
        if not prompt.token_ids:
            raise MlxcelError("the prompt encodes to no tokens")
        if len(prompt.token_ids) >= self.max_context:
            raise MlxcelError(
                f"prompt of {len(prompt.token_ids)} tokens does not fit the model's context of {self.max_context} "
                "(shorten it, or raise model.max_context if the model supports more)"
            )

    def plan(self, prompt: PromptTokens) -> PrefillPlan:
        """The PrefillPlan this prompt gets when it runs alone."""
        return plan_prefill(
            len(prompt.token_ids),
            chunk_size=self.cfg.prefill.resolved_chunk_size(),
            history_boundary=prompt.history_tokens,
            tile_size=self.cfg.prefill.resolved_tile_size(),
        )

    def generate(
        self, batch: list[PreparedSample], on_token: OnToken | None = None, on_row_done: OnRowDone | None = None
    ) -> BatchState | ScheduleState:
        """Run these rows to the end (see group_rows for how many at once)."""
        request = self.make_request(batch)
        state = self.make_engine(request).generate(request, on_token or (lambda row, token: True), on_row_done)
        self.save_prompt_cache()
        return state

    def steps(
        self, batch: list[PreparedSample], on_token: OnToken, on_row_done: OnRowDone | None = None
    ) -> Iterator[BatchState | ScheduleState]:
        """Run these rows, yielding after every decode step (for streaming APIs)."""
        request = self.make_request(batch)
        yield from self.make_engine(request).steps(request, on_token, on_row_done)
        self.save_prompt_cache()

    def group_rows(self, rows: list) -> list[list]:
        """How a job's rows go to generate(): all at once to the scheduler (runner.max_rows of them
        decode together), or runner.max_rows at a time to the batch engine, which still runs what
        the scheduler does not cover yet (scheduler.supports_scheduling)."""
        if not rows:
            return []
        if self.can_schedule(rows):
            return [rows]
        size = self.max_rows = choose_batch_engine_rows(self.cfg.runner.max_rows)
        return [rows[start : start + size] for start in range(0, len(rows), size)]

    def can_schedule(self, rows: list) -> bool:
        prepared = [row[1] if isinstance(row, tuple) else row for row in rows]
        return self.loaded is not None and supports_scheduling(self.loaded.model, self.make_request(prepared))

    def make_engine(self, request: GenerationRequest) -> DirectEngine | BatchScheduler:
        if self.loaded is None:
            raise MlxcelError("this pipeline was loaded without weights (dry run): it cannot generate")
        pipelined = self.cfg.decode.use_pipeline()
        if supports_scheduling(self.loaded.model, request):
            runner = self.cfg.runner
            budget = int(runner.kv_budget_gb * 1e9) if runner.kv_budget_gb else None
            self.max_rows = self.choose_rows(request, budget or default_kv_budget_bytes())
            return BatchScheduler(
                self.loaded.model,
                self.max_context,
                self.max_rows,
                budget,
                pipelined,
                self.cfg.prefill.chunk_size,
                decode_step=self.cfg.decode.step,
                prompt_cache=self.prompt_cache,
                keep_answers=self.keep_answers,
                snapshot_all=self.cfg.runner.prompt_cache_dir is not None,
                batch_invariant=runner.batch_invariant,
                # a prompt-cache folder's files hold every position of a layer, not a window's ring
                window_rings=self.cfg.runner.prompt_cache_dir is None,
                draft_model=self.draft_model,
            )
        if self.cfg.runner.batch_invariant:
            raise MlxcelError(
                f"runner.batch_invariant=true needs the continuous-batching scheduler, which does not run "
                f"{self.header.arch} with these rows yet: set runner.batch_invariant=false"
            )
        self.max_rows = choose_batch_engine_rows(self.cfg.runner.max_rows)
        return DirectEngine(self.loaded.model, self.max_context, pipeline=pipelined, decode_step=self.cfg.decode.step)

    def choose_rows(self, request: GenerationRequest, kv_budget_bytes: int) -> int:
        """runner.max_rows for the scheduler that runs `request` (engine/auto_rows.py). A job's rows
        are known: their mean positions (prompt, tile and tokens, in whole blocks, as the scheduler
        reserves them), not a high percentile, since admission already holds the longer rows to the
        budget and slots short of what it holds would leave it idle. An open loop's (no rows yet: a
        server, a Ray worker) are not: decode.max_tokens after OPEN_PROMPT_TOKENS, within the context."""
        tile = request.tile_size or 0
        if request.rows:
            lengths = [
                count_blocks(min(len(r.prompt_ids) + (r.max_tokens or request.max_tokens), self.max_context) + tile)
                for r in request.rows
            ]
            positions = BLOCK_SIZE * sum(lengths) / len(lengths)
        else:
            positions = count_blocks(min(OPEN_PROMPT_TOKENS + request.max_tokens, self.max_context) + tile) * BLOCK_SIZE
        return choose_max_rows(
            self.cfg.runner.max_rows,
            self.loaded.model,
            positions,
            kv_budget_bytes,
            rows=len(request.rows) or None,
            kv_bits=request.kv_bits,
            kv_group_size=request.kv_group_size,
        )

    def adapter_index(self, name: str | None) -> int:
        """A row's adapter (one of model.adapters' names, checked when the rows were read) as the
        model's index of it; -1: none."""
        if name is None:
            return -1
        control = getattr(self.loaded.model, "adapter_control", None) if self.loaded is not None else None
        if control is None or name not in control.names:
            raise MlxcelError(f"adapter {name!r}: not one of model.adapters ({', '.join(self.adapter_names())})")
        return control.names.index(name)

    def adapter_names(self) -> list[str]:
        """model.adapters' names, as the loaded model keeps them (empty: none)."""
        control = getattr(self.loaded.model, "adapter_control", None) if self.loaded is not None else None
        return list(control.names) if control is not None and control.default < 0 else []

    def describe_max_rows(self) -> dict:
        """What stats.json records: the rows at once the engine got, and whether auto chose them."""
        setting = self.cfg.runner.max_rows
        return {"max_rows": self.max_rows or choose_batch_engine_rows(setting), "max_rows_auto": setting == "auto"}

    def make_request(self, batch: list[PreparedSample]) -> GenerationRequest:
        cfg = self.cfg
        rows = [
            RowRequest(
                p.prompt.token_ids,
                row_id=p.sample.row.id,
                sample_index=p.sample.index,
                history_tokens=p.prompt.history_tokens,
                max_tokens=p.sample.row.max_tokens,
                seed=p.sample.row.seed,
                images=p.images,
                sampler=self.chain_for(p.sample.row.sampler),
                logprobs=p.sample.row.logprobs,
                constraint=p.constraint,
                adapter=self.adapter_index(p.sample.row.adapter),
            )
            for p in batch
        ]
        return GenerationRequest(
            rows=rows,
            sampler=self.sampler,
            max_tokens=cfg.decode.max_tokens,
            stop_token_ids=frozenset(self.stop_ids),
            chunk_size=cfg.prefill.resolved_chunk_size(),
            tile_size=cfg.prefill.resolved_tile_size(),
            pad_token_id=self.tokenizer.eos_token_ids[0] if self.tokenizer.eos_token_ids else 0,
            logprobs=cfg.decode.logprobs,
            kv_bits=cfg.decode.kv_bits,
            kv_group_size=cfg.decode.kv_group_size,
            constraints=self.constraints,
            draft=cfg.decode.draft if cfg.decode.draft.method != "none" else None,
        )


ROW_CHAINS = 64  # rows' own sampler chains kept built (Pipeline.chain_for)


def make_prompt_cache(cfg: RunConfig) -> PromptCache:
    gb = cfg.runner.prompt_cache_gb
    return PromptCache(int(gb * 1e9) if gb else int(device_memory_bytes() * PROMPT_CACHE_SHARE))


def say(log: TextIO | None, message: str) -> None:
    if log is not None:
        print(f"mlxcel: {message}", file=log, flush=True)
