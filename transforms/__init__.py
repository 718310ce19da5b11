"""newsvec's pipeline stages: one module per box of the pipeline diagram (README.md).

Batch:      read -> parse -> text -> incremental -> embed -> dedup -> sinks -> commit
Streaming:  parse -> windowing -> text -> microbatch -> dedup -> embed -> sinks

Batch embeds before it drops duplicates (a grouping before the engine would be a barrier that keeps
the GPU idle); streaming drops them first, per micro-batch. Every stage speaks the types in
``schema``; ``layout`` names the output's folders and files, ``manifest`` publishes a batch run,
``engine`` holds the model.
"""
