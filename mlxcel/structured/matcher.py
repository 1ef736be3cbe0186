"""Constraints bound to a model's tokenizer, and the token masks of a batch.

`Constraints(tokenizer, n_vocab, eos_ids)` compiles specs (spec.py) into `Constraint`s, one per
distinct spec (kept, as a job's rows and a server's requests repeat them); each row takes its own
matcher from one (`new_matcher`). `fill_masks` computes a batch's masks with llguidance's
executor (Rust threads, the GIL released) while the device runs the forward pass; the sampler
chain applies them (sampling/processors.apply_token_bitmask). The scheduler reports whether a
row's matcher ended in an accepting state; `judge_returned_text` then judges the text the row
returns (a stop string may cut it short of the tokens the matcher read; a JSON answer must also
validate), once, outside the decode loop's step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from mlxcel.structured.spec import (
    ConstraintError,
    compile_grammar,
    describe_spec,
    first_line,
    is_valid_json_answer,
    make_answer_check,
)

CACHED_CONSTRAINTS = 64  # distinct specs kept compiled (a server sees schemas without end)


class Constraint:
    """One compiled spec: a fresh matcher for each row, and the judge of its answers."""

    def __init__(self, spec: dict, matcher, end_ids: frozenset[int], owner: Constraints):
        self.spec = spec
        self.kind = describe_spec(spec)
        self.end_ids = end_ids  # the EOS ids the grammar allows once the answer is whole: they end the row
        self._matcher = matcher  # at the start state, copied for each row (compiling is the costly part)
        self._owner = owner  # the tokenizer it was compiled for (judge_text tokenizes with it)
        self._answer_check = None  # a JSON schema's jsonschema validator, made on first use

    def new_matcher(self):
        return self._matcher.deep_copy()

    def judge_text(self, text: str) -> bool:
        """Whether `text`, the answer a row returns, is whole and valid: a new matcher reads it (as
        llguidance tokenizes it; the grammar reads bytes, whatever the tokens), and a JSON schema's
        answer validates (jsonschema: llguidance accepts keys written with \\u escapes, unchecked).
        Judged on the returned text, so a stop string that cut it short counts."""
        matcher = self.new_matcher()
        tokens = self._owner.ll_tokenizer.tokenize_str(text)
        if matcher.try_consume_tokens(tokens) != len(tokens) or not is_satisfied(matcher):
            return False
        if self.kind != "json_schema":
            return True
        if self._answer_check is None:
            self._answer_check = make_answer_check(self.spec["json_schema"])
        return is_valid_json_answer(self._answer_check, text)


class Constraints:
    """A model's constraints: its tokenizer as llguidance sees it, built on first use."""

    def __init__(self, tokenizer, n_vocab: int, eos_token_ids: list[int]):
        self.tokenizer, self.n_vocab, self.eos_token_ids = tokenizer, n_vocab, list(eos_token_ids)
        self.compiled: OrderedDict[str, Constraint] = OrderedDict()
        self._ll_tokenizer = None
        self._executor = None
        # a server compiles on its request threads (serve/app.py), side by side; the cache and the
        # tokenizer's first build are shared
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            from mlxcel.structured.tokenizer import make_ll_tokenizer

            with self._lock:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = make_ll_tokenizer(self.tokenizer, self.n_vocab, self.eos_token_ids)
        return self._ll_tokenizer

    def compile(self, spec: dict) -> Constraint:
        """The spec's Constraint; a spec that does not compile raises ConstraintError (one line)."""
        try:
            # as given: the order of a schema's properties is the order of the answer's keys
            key = json.dumps(spec)
            with self._lock:
                constraint = self.compiled.get(key)
            if constraint is None:  # (compiled outside the lock: other specs need not wait)
                constraint = self.bind(spec, compile_grammar(spec))
        except RecursionError:  # (a hostile schema hundreds of levels deep)
            raise ConstraintError("nested too deeply to compile", describe_spec(spec)) from None
        with self._lock:
            self.compiled[key] = constraint
            self.compiled.move_to_end(key)  # (the most recently used last)
            if len(self.compiled) > CACHED_CONSTRAINTS:
                self.compiled.popitem(last=False)
        return constraint

    def bind(self, spec: dict, grammar: str) -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(first_line(matcher.get_error()), describe_spec(spec))
        return Constraint(spec, matcher, frozenset(self.eos_token_ids), self)

    def fill_masks(self, matchers: list, out: np.ndarray | None = None) -> np.ndarray:
        """[B, ceil(V / 32)] int32 bitmasks in batch order: a row's allowed tokens, every bit set
        for rows without a matcher (or whose matcher is done: their draw is not read). `out`: the
        array to write them in (a MaskBuffer's host view)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        # (as wide as llguidance's vocabulary: the tokenizer's when it is wider than the logits,
        # which apply_token_bitmask then cuts to the logits' width)
        if out is None:
            masks = np.full((len(matchers), self.mask_words), -1, dtype=np.int32)
        else:
            masks = out
            masks.fill(-1)
        work = [(m, i) for i, m in enumerate(matchers) if m is not None and not m.is_error()]
        if work:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, work, masks)
        return masks

    @property
    def mask_words(self) -> int:
        return (self.ll_tokenizer.vocab_size + 31) // 32


class MaskBuffer:
    """A loop's masks in one device array the host writes in place, through a numpy view of its
    memory (unified memory on Apple silicon and the CPU, CUDA's managed memory), so a step makes
    no new device array. The caller writes it only when no queued draw still reads it (the
    scheduler reads every queued draw before it computes the next masks). Where the device does
    not see the view's writes (checked on this array once) each step gets a new array instead."""

    def __init__(self, constraints: Constraints, rows: int):
        import mlx.core as mx

        self.constraints, self.rows = constraints, rows
        self.array = mx.array(np.full((rows, constraints.mask_words), -1, dtype=np.int32))
        view = np.asarray(memoryview(self.array))
        shared = view.flags.writeable and view.shape == tuple(self.array.shape)
        self.host = view if shared and device_sees_host_writes(self.array, view) else None

    def fill(self, matchers: list):
        """fill_masks for `matchers` (at most `rows`) as a device array: the buffer, its first rows
        written (apply_token_bitmask reads as many rows as the logits have, so no op is built here
        and any thread may call this), or a new array where the view is not the array's memory."""
        import mlx.core as mx

        if self.host is None or len(matchers) > self.rows:
            return mx.array(self.constraints.fill_masks(matchers))
        self.constraints.fill_masks(matchers, self.host[: len(matchers)])
        return self.array


def device_sees_host_writes(array, view: np.ndarray) -> bool:
    """Whether the device reads what the host writes through `view` (of `array`'s memory). Read on
    a stream of its own, so the check waits for no queued work."""
    import mlx.core as mx

    view.flat[0] = 12345
    with mx.stream(side_stream()):
        seen = array.reshape(-1)[0] + 0
    return seen.item() == 12345


def side_stream():
    """This thread's stream for checks that must not wait for its queued work (MLX's streams
    belong to the thread that made them: a server's engine thread makes its own)."""
    import mlx.core as mx

    stream = getattr(_thread_streams, "side", None)
    if stream is None:
        stream = _thread_streams.side = mx.new_stream(mx.default_device())
    return stream


_thread_streams = threading.local()


def consume_token(matcher, token: int) -> str | None:
    """Advance a row's matcher by its drawn token; the reason when the token breaks it (the mask
    makes that impossible unless a stop rule outside the grammar drew it)."""
    if matcher.is_stopped() or matcher.consume_token(token):
        return None
    return f"the constraint refused token {token}: {first_line(matcher.get_error())}"


def is_satisfied(matcher) -> bool:
    """Whether the matcher has read a whole match (an EOS now would be allowed; also after the
    grammar's end or an EOS). Not in its error state, where llguidance's is_stopped() is true too."""
    return not matcher.is_error() and matcher.is_accepting()


def judge_returned_text(constraint: Constraint | None, result, text: str) -> bool | None:
    """A finished row's constraint_satisfied, set on `result` (a RowResult) and returned: the
    scheduler's verdict from the matcher's state is replaced by the verdict on the text the row
    returns (None: the row had no constraint). Judged once, where the text is known."""
    if constraint is not None and result.constraint_satisfied is not None:
        result.constraint_satisfied = constraint.judge_text(text)
    return result.constraint_satisfied


__all__ = [
    "Constraint",
    "ConstraintError",
    "Constraints",
    "MaskBuffer",
    "consume_token",
    "is_satisfied",
    "judge_returned_text",
]
