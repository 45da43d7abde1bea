"""Pieces of scripts/bench_train.py: the benchmark shape, the workers, the report."""
