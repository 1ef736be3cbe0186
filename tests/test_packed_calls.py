"""One forward call an iteration (models/paged_packed.py): the decode rows and the prefill pieces in
one line of tokens give the logits and leave the pools that separate calls do (a decode step, then
the pieces as a ragged call), fp32 on the CPU; which families take it; and the scheduler with it
draws each row's tokens alone (tests/test_scheduler.py runs its randomized schedules packed too)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine.scheduler import supports_packed_calls
from mlxcel.models.paged_cache import PageTable
from mlxcel.models.paged_layers import make_paged_caches
from mlxcel.models.paged_packed import PACKED_ALIGN, begin_packed

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model(request, on_the_cpu):
    return load_model(str(request.getfixturevalue(request.param)), dtype="float32").model


def make_prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, length).tolist() for _ in range(count)]


def fresh(model, slots: int = 3):
    table = PageTable(64, slots, 256)
    for slot in range(slots):
        table.reserve(slot, 200)
    return table, make_paged_caches(len(model.make_cache(1)), table)


def prefill(model, table, caches, slot: int, prompt: list[int]) -> mx.array:
    table.begin(np.array([slot]), len(prompt))
    logits = model(mx.array([prompt]), caches, logits_at=len(prompt) - 1)[:, -1, :]
    table.end()
    return logits


def decode(model, table, caches, slots: list[int], tokens: list[int]) -> mx.array:
    table.begin(np.array(slots), 1, decoding=True)
    logits = model(mx.array(tokens)[:, None], caches)[:, -1, :]
    table.end()
    return logits


def test_a_packed_call_gives_the_separate_calls_logits_and_pools(model):
    """Slot 0 decodes (its prompt prefilled before), slot 1 prefills its first 23 tokens and slot 2
    its whole 9-token prompt, in one packed call against a decode step and a ragged call; then every
    row decodes again from the pools each way left."""
    a, b, c = make_prompts(7, 3, 40)
    c = c[:9]
    separate, packed = fresh(model), fresh(model)
    for table, caches in (separate, packed):
        prefill(model, table, caches, 0, a)
    token = 17

    table, caches = separate
    decoded = decode(model, table, caches, [0], [token])
    width = 32
    leads = np.array([width - 23, width - 9])
    table.begin(np.array([1, 2]), width, leads)
    lines = mx.array([[0] * int(leads[0]) + b[:23], [0] * int(leads[1]) + c])
    pieces = model(lines, caches, logits_at=width - 1)[:, -1, :]
    table.end()
    want = mx.concatenate([decoded, pieces[1:]])

    table, caches = packed
    step = begin_packed(table, np.array([0]), np.array([1, 2]), [(0, 23), (0, 9)], 32, PACKED_ALIGN)
    assert step.tokens == 1 + 23 + 9 and step.length == PACKED_ALIGN  # padded at its end (as on CUDA)
    line = mx.array([token] + b[:23] + c + [0] * (step.length - step.tokens))
    got = model(line[None], caches, logits_at=step.last_positions([1]))[0]
    table.end()
    assert got.shape == want.shape and np.abs(np.array(got) - np.array(want)).max() <= 1e-5
    assert separate[0].lengths.tolist() == packed[0].lengths.tolist() == [41, 23, 9]

    follow = [[5, 9, 11]]  # the next step of all three rows reads what each call wrote
    after = [decode(model, t, c, [0, 1, 2], follow[0]) for t, c in (separate, packed)]
    assert np.abs(np.array(after[0]) - np.array(after[1])).max() <= 1e-5


def test_a_packed_call_of_pieces_alone_matches_one_call_per_row(model):
    """No decode rows (an iteration that only admits): two rows' pieces, one of them a later piece of
    its prompt, against each piece in a call of its own."""
    a, b = make_prompts(8, 2, 50)
    separate, packed = fresh(model), fresh(model)
    for table, caches in (separate, packed):
        prefill(model, table, caches, 0, a[:16])  # slot 0's first piece, before
    table, caches = separate
    want = mx.concatenate([prefill(model, table, caches, 0, a[16:50]), prefill(model, table, caches, 1, b[:20])])
    table, caches = packed
    step = begin_packed(table, np.array([], dtype=np.int32), np.array([0, 1]), [(16, 50), (0, 20)], 34)
    line = mx.array(a[16:50] + b[:20] + [0] * (step.length - step.tokens))
    got = model(line[None], caches, logits_at=step.last_positions([0, 1]))[0]
    table.end()
    assert np.abs(np.array(got) - np.array(want)).max() <= 1e-5
    assert packed[0].lengths.tolist()[:2] == [50, 20]


def test_which_families_take_packed_calls(tiny_llama, tmp_path):
    """Llama-like layers do; a hybrid's recurrent layers (their scan needs a row's tokens in a row)
    and a family with its own RoPE step (Llama 4's NoPE and chunked layers) do not: they keep a call
    per part."""
    pytest.importorskip("torch")
    from tests.test_families_llama4 import write_llama4
    from tests.test_families_qwen3_5 import make_checkpoint

    assert supports_packed_calls(load_model(str(tiny_llama), dtype="float32").model)
    for folder in (make_checkpoint(tmp_path / "q35", "qwen3_5_text"), write_llama4(tmp_path / "llama4")):
        assert not supports_packed_calls(load_model(str(folder), dtype="float32").model), folder.name
