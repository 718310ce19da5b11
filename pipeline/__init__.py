"""newsvec's pipelines: options and config, the graph, and the entry points
(``python -m pipeline``)."""
