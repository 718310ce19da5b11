"""Tools for local runs, demos and tests: the emulator starters, the Pub/Sub publisher, the
streaming demo. Run from the repository root: ``python -m tools.<name>``. Not installed into the
worker image."""
