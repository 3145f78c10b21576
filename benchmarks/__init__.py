"""Reproducible measurements; results are recorded in docs/benchmarks.md."""
