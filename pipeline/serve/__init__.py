"""``newsvec serve``: the query side over HTTP, from the same config as the pipeline
(docs/serving.md).

One file per part: ``main`` (the command, uvicorn, draining on SIGTERM), ``app`` (the Starlette app
and its routes: ``create_app``), ``batcher`` (dynamic batching into engine calls by a token budget
and a short wait), ``limits`` (what a request may be, and the error bodies), ``auth`` (the API
key, the loopback rule), ``corpus`` (what ``/v1/search`` searches, checked against the config),
``metrics`` (Prometheus), ``search_page`` (the search page at ``/``, its files in ``static/``).
"""
