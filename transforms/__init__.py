"""newsvec's pipeline stages: one module per box of the pipeline diagram.

parse -> text -> dedup -> embed -> sinks, all speaking the types in ``schema``.
"""
