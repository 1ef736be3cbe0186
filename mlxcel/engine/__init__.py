from mlxcel.engine.direct import DirectEngine
from mlxcel.engine.engine import BatchState, Engine, PromptTooLongError
from mlxcel.engine.request import GenerationRequest, GenerationTimings, RowRequest, RowResult

__all__ = [
    "BatchState",
    "DirectEngine",
    "Engine",
    "GenerationRequest",
    "GenerationTimings",
    "PromptTooLongError",
    "RowRequest",
    "RowResult",
]
