"""Hybrid models in the scheduler: recurrent layers' states in row slots beside the paged KV pool.

A tiny Qwen 3.5 (three Gated DeltaNet layers to one attention layer) written by transformers is the
model; each row run among others (any piece size, ragged pieces whose padding comes before the
row's tokens, few slots) must draw the tokens it draws alone, which are transformers' greedy tokens.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import (
    BatchScheduler,
    kv_bytes_per_position,
    recurrent_layers,
    supports_scheduling,
)
from mlxcel.errors import MlxcelError
from mlxcel.models import invariant
from mlxcel.models.gated_delta import CHUNK
from mlxcel.models.paged_cache import QuantizedPagedKVCache
from mlxcel.models.paged_state import PagedRecurrentCache
from mlxcel.sampling import Sampler
from tests.family_fixtures import PROMPT, reference_greedy, save_widened
from tests.helpers import load_reference, write_tiny_tokenizer

pytest.importorskip("torch")

TOKENS = 24
# longer than a chunk of the gated delta rule (64), and shorter ones
PROMPTS = [PROMPT * 3, PROMPT[5:28], PROMPT[:9], PROMPT * 2 + PROMPT[:13], PROMPT[3:34]]


def write_qwen3_5(folder, seed: int = 0):
    import torch
    import transformers

    vocab = write_tiny_tokenizer(folder)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    save_widened(transformers.Qwen3_5ForCausalLM(config), folder)
    return folder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from mlxcel.checkpoints.loader import load_model

    folder = write_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))
    model = load_model(str(folder), dtype="float32").model
    reference = load_reference(folder)
    expected = [reference_greedy(reference, p, TOKENS) for p in PROMPTS]
    return model, expected


def schedule(model, prompts, max_tokens=TOKENS, ragged=None, **options):
    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 8), **options)
    if ragged is not None:
        scheduler.ragged_prefill = ragged
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=max_tokens))
    return [r.token_ids for r in state.results], state


def test_the_scheduler_takes_hybrids_and_keeps_a_state_per_recurrent_layer(hybrid):
    model, _ = hybrid
    assert recurrent_layers(model) == [True, True, True, False]
    request = GenerationRequest([RowRequest(PROMPT)], Sampler("greedy"))
    assert supports_scheduling(model, request)
    # keys and values of one position: the one attention layer's (2 kv heads x 32, fp32), not the recurrent ones'
    assert kv_bytes_per_position(model) == 2 * 2 * 32 * 4
    # a row's state, per linear layer: the conv window (3 x 128 fp32: q and k of 2 heads x 16, v of
    # 4 x 16) and the delta rule's matrices (4 heads x 16 x 16 fp32)
    assert model.state_bytes_per_row() == 3 * (3 * 128 * 4 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"chunk_size": 16},  # pieces carry the state from one to the next
        {"chunk_size": 7},  # pieces that end mid-chunk of the gated delta rule
        {"max_rows": 2, "chunk_size": 16},  # rows join and leave the decode batch
    ],
    ids=["whole", "pieces16", "pieces7", "two-slots"],
)
def test_each_row_among_others_draws_transformers_tokens(hybrid, options):
    model, expected = hybrid
    got, state = schedule(model, PROMPTS, **options)
    assert got == expected
    assert state.state_bytes == state_slots(options) * model.state_bytes_per_row()


def state_slots(options: dict) -> int:
    return options.get("max_rows", 8)


def test_ragged_pieces_keep_each_rows_state_across_their_leading_padding(hybrid, monkeypatch):
    """Ragged prefill (the GPU's): several rows' pieces in one call, each row's tokens after padding
    it neither caches nor lets into its state; later pieces too, whose convolution must see the
    row's earlier tokens, not the padding. (With the GPU's pieces an iteration: the CPU's fewer
    rarely put a row's later piece beside another row's.)"""
    from mlxcel.engine import scheduler

    monkeypatch.setattr(scheduler, "CPU_PIECES_PER_STEP", scheduler.PIECES_PER_STEP)
    monkeypatch.setattr(scheduler, "CPU_IDLE_PIECES_PER_STEP", scheduler.IDLE_PIECES_PER_STEP)
    model, expected = hybrid
    got, state = schedule(model, PROMPTS, ragged=True, chunk_size=16)
    assert got == expected
    later_padded = [p for p in state.timings.prefill_pieces if p["start"] > 0 and p["pad"] > 0 and p["rows"] > 1]
    assert later_padded, "no ragged call carried a row's later piece behind padding"


def test_a_recurrent_state_costs_the_same_at_any_position(hybrid):
    """What the recurrent caches hold after a row of 9 positions and one of 160: arrays of the
    same shapes (the conv window and the delta rule's matrices), whatever the row's length."""
    model, _ = hybrid
    held = {}
    for prompt in (PROMPT[:9], PROMPT * 4):
        scheduler = BatchScheduler(model, 512, 8)
        caches = []
        original = scheduler.run_rows

        def record(state, waiting, table, layer_caches, *rest, caches=caches, original=original):
            caches.extend(layer_caches)
            return original(state, waiting, table, layer_caches, *rest)

        scheduler.run_rows = record
        scheduler.generate(GenerationRequest([RowRequest(prompt)], Sampler("greedy"), max_tokens=4))
        recurrent = [c for c in caches if isinstance(c, PagedRecurrentCache)]
        held[len(prompt)] = [tuple(x.shape) for c in recurrent for x in c.dense]
    assert held[9] == held[160] and len(held[9]) == 3 * 2
    assert sum(np.prod(shape) * 4 for shape in held[9]) == model.state_bytes_per_row()


def test_state_and_blocks_share_the_kv_budget(hybrid):
    model, expected = hybrid
    per_row = model.state_bytes_per_row()
    # room for two rows' states and their two blocks each: two slots (a third would need a state
    # and a block more), every row still right
    budget = 2 * per_row + 4 * kv_bytes_per_position(model) * 32
    got, state = schedule(model, PROMPTS[1:3] * 2, kv_budget_bytes=budget)
    assert got == expected[1:3] * 2
    assert state.state_bytes == 2 * per_row
    # a budget below one row's state and blocks: the row ends with an error that names both
    _, state = schedule(model, [PROMPT], kv_budget_bytes=per_row)
    error = state.results[0].error
    assert state.results[0].finish_reason == "error" and "per-row state" in error and "kv_budget_gb" in error


# ---- the prompt cache: a prefix is adoptable where its recurrent states were recorded ----
SHARED = PROMPT * 2  # 80 tokens every row starts with
TAILS = [PROMPT[3:20], PROMPT[11:19], PROMPT[:30], PROMPT[25:31]]


def test_rows_sharing_a_prefix_adopt_it_with_its_states(hybrid):
    """The first row's piece ends where the shared prefix does (its states are recorded there);
    the others adopt the prefix's keys, values and states, and draw the tokens they draw alone."""
    model, _ = hybrid
    prompts = [SHARED + tail for tail in TAILS]
    alone = [schedule(model, [p])[0][0] for p in prompts]
    got, state = schedule(model, prompts, prompt_cache=PromptCache(10**8), chunk_size=32)
    assert got == alone
    adopted = [r.cached_tokens for r in state.results]
    assert adopted[0] == 0 and all(n == len(SHARED) for n in adopted[1:]), adopted


def test_a_second_job_and_a_follow_up_turn_adopt_with_states(hybrid):
    model, _ = hybrid
    cache = PromptCache(10**8)
    first = SHARED + TAILS[0]
    schedule(model, [first], prompt_cache=cache, snapshot_all=True)
    # the whole prompt but its last token is adoptable only at a piece's end: 64 of 97 (pieces of 32)
    again, state = schedule(model, [first + TAILS[1]], prompt_cache=cache, chunk_size=32)
    assert state.results[0].cached_tokens == len(first) and again == [schedule(model, [first + TAILS[1]])[0][0]]


def test_a_cut_node_keeps_no_states_and_matches_cut_back_to_one_that_does():
    cache = PromptCache(10**6)
    kv = [[mx.zeros((6, 1))], []]
    states = [[], [mx.ones((1, 2))]]
    cache.insert([1, 2, 3, 4, 5, 6], 0, kv, states)
    assert cache.match([1, 2, 3, 4, 5, 6, 7], with_states=True).length == 6
    cache.insert([1, 2, 3, 9], 3, [[mx.zeros((1, 1))], []])  # splits the node after 3 tokens
    assert cache.match([1, 2, 3, 9], with_states=True).length == 0  # no states at 3 nor at 4
    assert cache.match([1, 2, 3, 4, 5, 6], with_states=True).length == 6
    assert cache.match([1, 2, 3, 4, 5], with_states=True).length == 0
    assert cache.nbytes == 7 * 4 + 2 * 4


def test_saved_states_are_loaded_and_checked_against_the_model(hybrid, tmp_path):
    from mlxcel.engine.prompt_cache_files import describe_layout, describe_states, load_entries, save_entries

    model, _ = hybrid
    first = PromptCache(10**8)
    schedule(model, [SHARED + TAILS[0]], prompt_cache=first, snapshot_all=True, chunk_size=32)
    assert save_entries(first, tmp_path, "key") == first.entries > 0
    layout, states = describe_layout(model, "float32", None, 64), describe_states(model)
    assert [len(kinds) for kinds in layout] == [0, 0, 0, 2] and [len(k) for k in states] == [2, 2, 2, 0]
    second = PromptCache(10**8)
    assert load_entries(second, tmp_path, "key", layout, states=states) == first.entries
    prompt = SHARED + TAILS[2]
    got, state = schedule(model, [prompt], prompt_cache=second, chunk_size=32)
    assert state.results[0].cached_tokens == 64 and got == [schedule(model, [prompt])[0][0]]
    # states of another shape (another model's) are refused, with the file named
    wrong = [[((5, *shape[1:]), kind) for shape, kind in kinds] for kinds in states]
    log = io.StringIO()
    assert load_entries(PromptCache(10**8), tmp_path, "key", layout, log, states=wrong) == 0
    assert "ignoring" in log.getvalue() and "0.s0 is [1, 3, 128]" in log.getvalue()


def test_kv_bits_quantizes_the_attention_layers_only(hybrid):
    model, _ = hybrid
    scheduler = BatchScheduler(model, 512, 4)
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(PROMPTS[:3])]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=8, kv_bits=8, kv_group_size=32, chunk_size=16)
    caches = []
    original = scheduler.run_rows

    def record(state, waiting, table, layer_caches, *rest):
        caches.extend(layer_caches)
        return original(state, waiting, table, layer_caches, *rest)

    scheduler.run_rows = record
    state = scheduler.generate(request)
    assert [type(c) for c in caches] == [PagedRecurrentCache] * 3 + [QuantizedPagedKVCache]
    alone = [schedule_quantized(model, p) for p in PROMPTS[:3]]
    assert [r.token_ids for r in state.results] == alone
    assert all(len(t) == 8 for t in alone)


def schedule_quantized(model, prompt):
    rows = [RowRequest(prompt)]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=8, kv_bits=8, kv_group_size=32, chunk_size=16)
    return BatchScheduler(model, 512, 4).generate(request).results[0].token_ids


def test_batch_invariant_rows_equal_alone_on_the_cpu_and_refused_on_a_gpu(hybrid, monkeypatch):
    model, expected = hybrid
    got, _ = schedule(model, PROMPTS, batch_invariant=True)
    assert got == expected
    monkeypatch.setattr(invariant, "pads_matmuls", lambda: True)
    with pytest.raises(MlxcelError, match="recurrent layers"):
        BatchScheduler(model, 512, 8, batch_invariant=True)


def test_pieces_leave_the_state_one_shot_leaves(hybrid):
    """The states themselves, not only the tokens: a prompt prefilled in pieces that end mid-chunk
    leaves each recurrent layer the delta-rule matrices one call leaves (fp32, 1e-5)."""
    model, _ = hybrid
    from mlxcel.models.recurrent import RecurrentCache

    prompt = PROMPTS[3]
    cache = model.make_cache(1)
    model(mx.array([prompt]), cache)
    alone = [c.states[1] for c in cache if isinstance(c, RecurrentCache)]
    split = model.make_cache(1)
    for start in range(0, len(prompt), CHUNK - 5):
        model(mx.array([prompt[start : start + CHUNK - 5]]), split)
    pieces = [c.states[1] for c in split if isinstance(c, RecurrentCache)]
    for a, b in zip(alone, pieces):
        assert np.abs(np.array(a) - np.array(b)).max() <= 1e-5


def test_a_one_token_piece_is_not_taken_for_a_decode_step(hybrid):
    """A one-token prompt (or last piece) prefilled while other rows decode: its call has one token
    a row, like a decode step, but the decode batch's states must stay the decode batch's."""
    model, _ = hybrid
    prompts = [list(range(10, 20)), list(range(30, 40)), [7], PROMPT[:17], PROMPT[:33]]
    limits = [2, 8, 4, 6, 6]
    alone = [schedule(model, [p], max_tokens=n)[0][0] for p, n in zip(prompts, limits)]
    for options in ({"max_rows": 2}, {"max_rows": 3, "chunk_size": 16}):
        scheduler = BatchScheduler(model, 512, options.pop("max_rows"), **options)
        rows = [RowRequest(p, row_id=i, max_tokens=n) for i, (p, n) in enumerate(zip(prompts, limits))]
        state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=8))
        assert [r.token_ids for r in state.results] == alone


def test_fused_projections_compute_what_separate_ones_do(tmp_path):
    """model.fuse (the default): each Gated DeltaNet layer's four input projections, attention's
    query-gate/k/v and the MLP's gate/up are one matmul each, with the same logits."""
    from mlxcel.checkpoints.loader import load_model

    folder = write_qwen3_5(tmp_path / "qwen3_5", seed=3)
    fused = load_model(str(folder), dtype="float32").model
    separate = load_model(str(folder), dtype="float32", fuse=False).model
    layers = fused.model.layers
    assert "in_proj" in layers[0].linear_attn and "in_proj_qkv" not in layers[0].linear_attn
    assert "qkv_proj" in layers[3].self_attn and "gate_up_proj" in layers[0].mlp
    ids = mx.array([PROMPT[:20]])
    got = np.array(fused(ids, fused.make_cache()))
    assert np.abs(got - np.array(separate(ids, separate.make_cache()))).max() <= 1e-5
