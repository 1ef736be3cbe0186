from mlxcel.sampling.chain import (
    BatchSampler,
    Draw,
    RowKey,
    Sampler,
    SamplerChain,
    make_sampler_chain,
)
from mlxcel.sampling.rng import derive_row_seed

__all__ = ["BatchSampler", "Draw", "RowKey", "Sampler", "SamplerChain", "derive_row_seed", "make_sampler_chain"]
