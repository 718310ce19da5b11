"""newsvec's pipelines: options and config, the graph, and the entry points
(``python -m pipeline``)."""
import logging
import os

# Libraries whose INFO lines a command shows only with --verbose (WARNING and above always, on
# standard error). vLLM sets its own logger's level from VLLM_LOGGING_LEVEL when it is imported,
# in this process and in the engine processes it starts: that variable is set too.
QUIETED_LOGGERS = ("apache_beam", "vllm", "torch", "transformers")
_USERS_VLLM_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")  # a level the user set: kept
VERBOSE_HELP = "also show the INFO logs of vLLM, torch and Beam (on standard error)"


def logs_to_stderr() -> None:
    """Standard output carries a command's result alone (``newsvec search --json ... | jq``):
    vLLM logs to standard output unless ``VLLM_LOGGING_STREAM`` says otherwise, here and in the
    engine processes it starts, which read it from the environment. Called by every entry point
    before vLLM is imported; a value the user set is kept."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def command_logging(verbose: bool = False) -> None:
    """A command's logging, set before it imports vLLM: every log line on standard error
    (``logs_to_stderr``); the INFO lines of vLLM, torch and Beam only when ``verbose``
    (``--verbose``), their warnings and errors always. newsvec's own lines are left as the
    command sets them."""
    logs_to_stderr()
    level = logging.INFO if verbose else logging.WARNING
    if _USERS_VLLM_LEVEL is None:
        os.environ["VLLM_LOGGING_LEVEL"] = logging.getLevelName(level)
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(level)


def parse_command(parser, argv, known_only: bool = False):
    """A sub-command's arguments, parsed with the ``--verbose`` every sub-command takes, and its
    logging set by it (``command_logging``) before anything imports vLLM. ``known_only``: the
    arguments it does not know are returned beside them (Beam's, for a command that runs jobs)."""
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    if known_only:
        args, rest = parser.parse_known_args(argv)
        command_logging(args.verbose)
        return args, rest
    args = parser.parse_args(argv)
    command_logging(args.verbose)
    return args

