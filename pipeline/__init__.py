"""newsvec's pipelines: options and config, the graph, and the entry points
(``python -m pipeline``)."""
import os


def logs_to_stderr() -> None:
    """Standard output carries a command's result alone (``newsvec search --json ... | jq``):
    vLLM logs to standard output unless ``VLLM_LOGGING_STREAM`` says otherwise, here and in the
    engine processes it starts, which read it from the environment. Called by every entry point
    before vLLM is imported; a value the user set is kept."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
