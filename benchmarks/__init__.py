"""Benchmarks and evaluations of newsvec: figures, not timed asserts. Run from the repository root:
``python -m benchmarks.<name>`` (or the Makefile targets). Not installed into the worker image."""
