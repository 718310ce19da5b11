"""0.2's name of newsvec's data types, which live in ``transforms.types`` (their Parquet schemas in
``transforms.output.parquet``). Kept for one reason: a streaming job updated from 0.2 holds
elements in flight that 0.2 pickled under this module's name (Beam pickles a dataclass element by
its module and name; tests/streaming/test_state_coders.py reads them). Nothing in newsvec
imports it."""
from transforms.types import *  # noqa: F401,F403
