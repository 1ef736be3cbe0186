from mlxcel.sampling.chain import RowKey, Sampler, derive_row_seed, make_sampler

__all__ = ["RowKey", "Sampler", "derive_row_seed", "make_sampler"]
