"""Pieces of the benchmark scripts: bench_train.py's shape, workers and report; bench_data.py's workers and report."""
