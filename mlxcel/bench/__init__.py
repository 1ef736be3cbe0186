"""The side-by-side benchmark against mlx-lm: `python -m mlxcel.bench` (see __main__.py).

checkpoints.py builds the HF folders both engines read, peers.py times one generation by each
engine, harness.py alternates them over repetitions and reports medians and ratios.
mlx-lm is imported only when a run needs it, so the rest imports without the `bench` extra.
"""
