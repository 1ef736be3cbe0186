"""Tiny random checkpoints of each dense family, written by transformers' save_pretrained, and
the checks every family runs against transformers (the oracle). Nothing downloads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.sampling import Sampler
from tests.helpers import load_reference, write_tiny_tokenizer

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]
LOGIT_TOLERANCE = 1e-3
GREEDY_TOKENS = 32

BASE_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}

# family -> (transformers config class, model class, shape defaults)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16, "tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 24, "num_key_value_heads": 1}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "tie_word_embeddings": False},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
}


def make_family_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Random-weight fp32 checkpoint + tokenizer + generation_config in `folder`."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    config_class, model_class, defaults = FAMILIES[family]
    shape = {**BASE_SHAPE, **defaults, "vocab_size": vocab, **overrides}
    config = getattr(transformers, config_class)(**shape, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    save_widened(model, folder)
    return folder


def save_widened(model, folder: Path) -> None:
    """Save `model` with its random init widened: tiny init gives logits all ~0 and an unstable argmax."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:  # norms: off their init (ones, or zeros for Gemma's 1 + w) so a wrong offset shows
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))


def mlxcel_logits(folder: Path, ids: list[int]) -> tuple[np.ndarray, object]:
    loaded = load_model(str(folder), dtype="float32")
    return np.array(loaded.model(mx.array([ids]), loaded.model.make_cache())[0]), loaded


def reference_logits(reference, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].numpy()


def reference_greedy(reference, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def mlxcel_generate(model, prompts: list[list[int]], n: int, **request) -> list[list[int]]:
    engine = DirectEngine(model, max_context=512)
    rows = [RowRequest(ids, row_id=i) for i, ids in enumerate(prompts)]
    state = engine.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=n, **request))
    return [r.token_ids for r in state.results]


def measure_parity(folder: Path, prompt: list[int] = PROMPT, n: int = GREEDY_TOKENS) -> dict:
    """Build both sides of a parity check and compare nothing: fp32 logits over the prompt and n
    greedy tokens, from mlxcel and from transformers (check_parity compares them). A module-scoped
    fixture builds this once, so a mismatch fails the test that checks it, not the fixture."""
    reference = load_reference(folder)
    expected = reference_logits(reference, prompt)
    got, loaded = mlxcel_logits(folder, prompt)
    return {
        "folder": folder,
        "logits": got,
        "reference_logits": expected,
        "greedy": mlxcel_generate(loaded.model, [prompt], n)[0],
        "reference_greedy": reference_greedy(reference, prompt, n),
        "model": loaded.model,
        "reference": reference,
    }


def check_parity(result: dict) -> dict:
    """measure_parity's two sides agree: logits within LOGIT_TOLERANCE, greedy tokens identical."""
    got, expected = result["logits"], result["reference_logits"]
    assert got.shape == expected.shape
    max_abs_diff = float(np.abs(got - expected).max())
    assert max_abs_diff <= LOGIT_TOLERANCE, max_abs_diff
    assert result["greedy"] == result["reference_greedy"]
    return result


def assert_parity(folder: Path, prompt: list[int] = PROMPT) -> dict:
    """Build and check at once: for a test's own checkpoint (never inside a fixture)."""
    return check_parity(measure_parity(folder, prompt))


def longrope(pairs: int, original: int) -> dict:
    """Phi-3's longrope config keys: short factors below `original` positions, long ones past it."""
    return {
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [2.0 + 1.5 * i for i in range(pairs)],
        },
        "original_max_position_embeddings": original,
        "max_position_embeddings": 256,
    }


def prefill_last_logits(model, prompts: list[list[int]], pad_id: int = 0) -> np.ndarray:
    """The last position's logits for each row, the rows left-padded into one batch."""
    length = max(len(p) for p in prompts)
    left_pad = [length - len(p) for p in prompts]
    tokens = mx.array([[pad_id] * pad + p for pad, p in zip(left_pad, prompts)])
    cache = model.make_cache(len(prompts), left_pad)
    return np.array(model(tokens, cache, logits_at=length - 1)[:, 0, :])


def prefill_in_pieces(model, prompt: list[int], piece: int, tile: int | None = None) -> tuple[np.ndarray, list]:
    """As the engine's PrefillPlan: pieces of `piece` tokens, each right-padded to a multiple of
    `tile` and the padding trimmed from the cache. Returns the last logits and the cache."""
    cache = model.make_cache(1)
    for start in range(0, len(prompt), piece):
        chunk = prompt[start : start + piece]
        pad = (-len(chunk)) % tile if tile else 0
        logits = model(mx.array([chunk + [0] * pad]), cache, logits_at=len(chunk) - 1)
        for layer_cache in cache:
            layer_cache.trim(pad)
    return np.array(logits[0, 0]), cache


def decode_logits(model, cache, tokens: list[int]) -> np.ndarray:
    """Feed tokens one at a time; the logits after each."""
    out = []
    for token in tokens:
        out.append(np.array(model(mx.array([[token]]), cache)[0, -1]))
    return np.stack(out)


def assert_batch_rows_match_alone(model, prompts: list[list[int]], n: int = 12) -> None:
    """Left-padded batch prefill gives each row its own logits, and each row its own tokens."""
    batch = prefill_last_logits(model, prompts)
    for row, prompt in enumerate(prompts):
        alone = prefill_last_logits(model, [prompt])[0]
        assert np.abs(batch[row] - alone).max() <= 1e-4, (row, np.abs(batch[row] - alone).max())
    together = mlxcel_generate(model, prompts, n)
    for row, prompt in enumerate(prompts):
        assert together[row] == mlxcel_generate(model, [prompt], n)[0], row


def assert_pieces_match_one_shot(model, prompt: list[int], piece: int, tile: int | None) -> None:
    """Multi-piece (and tile-padded) prefill leaves the cache one-shot prefill leaves: same
    last logits, same logits for the decode steps after."""
    one_shot, cache_a = prefill_in_pieces(model, prompt, len(prompt))
    pieces, cache_b = prefill_in_pieces(model, prompt, piece, tile)
    assert np.abs(one_shot - pieces).max() <= 1e-4
    follow = [11, 42, 7, 99, 5, 18, 23, 64, 3, 77]
    assert np.abs(decode_logits(model, cache_a, follow) - decode_logits(model, cache_b, follow)).max() <= 1e-4


def schedule(model, prompts, max_tokens=GREEDY_TOKENS, ragged=None, request=None, **options):
    """The rows through BatchScheduler, greedy; `request`: GenerationRequest options (kv_bits), the
    rest BatchScheduler's; `ragged`: the GPU's ragged prefill (rows' pieces in one call, padding
    before each). Returns the run's state."""
    from mlxcel.engine.scheduler import BatchScheduler

    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 8), **options)
    if ragged is not None:
        scheduler.ragged_prefill = ragged
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    return scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=max_tokens, **(request or {})))


def check_prefix_adoption(model) -> None:
    """Rows sharing an 80-token prefix, the prompt cache on: the later rows adopt it and every row
    draws what it draws alone."""
    from mlxcel.engine.prompt_cache import PromptCache

    shared = PROMPT * 2
    prompts = [shared + tail for tail in (PROMPT[3:20], PROMPT[11:19], PROMPT[:30])]
    state = schedule(model, prompts, 12, chunk_size=32, prompt_cache=PromptCache(10**8))
    alone = [schedule(model, [p], 12).results[0].token_ids for p in prompts]
    assert [r.token_ids for r in state.results] == alone
    assert state.results[0].cached_tokens == 0 and all(r.cached_tokens >= 64 for r in state.results[1:])


def check_scheduler_rows(result: dict, long_prompt: list[int], ragged: bool) -> None:
    """measure_parity's model in the scheduler: rows of `long_prompt`, 23 and 9 tokens prefilled
    in pieces of 16 beside one another (`ragged`: in one padded call, the GPU's way), then decoded
    together: the long row draws transformers' 32 greedy tokens, each short one its tokens alone."""
    model, prompts = result["model"], [long_prompt, PROMPT[5:28], PROMPT[:9]]
    state = schedule(model, prompts, GREEDY_TOKENS, ragged=ragged, max_rows=4, chunk_size=16)
    got = [r.token_ids for r in state.results]
    assert got[0] == result["reference_greedy"]
    assert got[1:] == [mlxcel_generate(model, [p], GREEDY_TOKENS)[0] for p in prompts[1:]]
