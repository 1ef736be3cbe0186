"""DirectEngine: one request (one or more rows) from prefill to the last token."""

from __future__ import annotations

from collections.abc import Iterator

from mlxcel.config import read_env_flag
from mlxcel.engine.engine import BatchState, Engine, OnRowDone, OnToken
from mlxcel.engine.request import GenerationRequest
from mlxcel.errors import MlxcelError


class DirectEngine:
    def __init__(self, model, max_context: int, pipeline: bool = True, decode_step: str = "auto"):
        self.engine = Engine(model, max_context, decode_step)
        self.pipeline = pipeline and not read_env_flag("MLXCEL_FORCE_SYNC")

    def generate(
        self,
        request: GenerationRequest,
        on_token: OnToken = lambda row, token: True,
        on_row_done: OnRowDone | None = None,
    ) -> BatchState:
        """Generate every row; `on_token(row, token)` streams each token as it reaches the host,
        `on_row_done(row, result)` reports each row the moment it finishes."""
        state = None
        for state in self.steps(request, on_token, on_row_done):  # noqa: B007 (the last state is the result)
            pass
        return state

    def steps(
        self, request: GenerationRequest, on_token: OnToken, on_row_done: OnRowDone | None = None
    ) -> Iterator[BatchState]:
        """The decode loop as a generator: yields after each step's tokens reached the host
        (stopping the iteration early abandons the request).

        Pipelined: step t+1's forward pass is queued before step t's token is read, so the
        host's bookkeeping and the callback overlap the device's work."""
        if any(r.sampler is not None or r.logprobs for r in request.rows):
            raise MlxcelError(
                "rows with sampler settings of their own (a server request's, a batch file line's) run on the "
                "scheduler only, and this model or request runs on the batch engine (scheduler.supports_scheduling)"
            )
        if any(r.constraint is not None for r in request.rows):
            raise MlxcelError(
                "structured output (decode.constraint, response_format) runs on the scheduler only, and this "
                "model or request runs on the batch engine (scheduler.supports_scheduling)"
            )
        engine = self.engine
        state = engine.start(request)
        while True:
            if self.pipeline:
                if engine.can_submit(state):
                    engine.submit(state)
                alive = engine.finish_rows(state, on_token, on_row_done)
            else:
                alive = engine.step(state, on_token, on_row_done)
            yield state
            if not alive:
                return
