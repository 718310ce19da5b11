"""Tools for local runs, demos, tests and benchmarks: the emulator starters, the Pub/Sub publisher,
the streaming demo, and what tests and benchmarks both use (a streaming output written with FAKE
vectors, the reference text preparation, generated Japanese text, the modeled dedup state store,
the engine-call recorder). Run from the repository root: ``python -m tools.<name>``. Not installed
into the worker image. Imports go one way: tests/ and benchmarks/ import tools/, never each
other."""
