"""``newsvec serve --config C [--host H] [--port P]`` (and ``python -m pipeline.serve``): the
service of ``pipeline.serve.app`` under uvicorn, until SIGTERM or SIGINT.

Before it listens: the output is checked against the config (a config whose prefixes, embedding
signature or model differ from the output's committed run refuses to start, exit status 2, naming
the difference), the model is loaded, and a host other than a loopback one without an API key
refuses to start (exit status 1). On SIGTERM it stops accepting connections (``/readyz`` answers
503 on those still open), finishes the requests in flight for up to ``serve.drain_s``, then exits
0."""
from __future__ import annotations

import argparse
import logging
import math
import socket
import sys
import time
from typing import Optional, Sequence

import uvicorn

from pipeline import config as config_lib
from pipeline import parse_command
from pipeline.serve.auth import ServeRefused, check_binding

_LOG = logging.getLogger("newsvec.serve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="newsvec serve", description="Serve the config's model over HTTP: OpenAI's "
        "embeddings API (queries as newsvec search embeds them, documents as the pipeline "
        "embeds an article), a search of the output or the store, and what a client checks "
        "itself against (GET /info); batched, bounded, with probes and Prometheus metrics "
        "(docs/serving.md).")
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG),
                        help="the config whose model, output and serve: section to use")
    parser.add_argument("--host", help="the address to listen on (default serve.host: "
                        "127.0.0.1); any other than a loopback one needs an API key")
    parser.add_argument("--port", type=int, help="the TCP port (default serve.port: 8080)")
    parser.add_argument("--output", help="search this output prefix instead of the config's")
    parser.add_argument("--input_date", help="fills {date} in the config's output, as the run "
                        "(default yesterday)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_command(_parser(), list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_lib.load_for_command(args.config, output=args.output,
                                         input_date=args.input_date)
    serve = config.serve.model_copy(update={
        key: value for key, value in (("host", args.host), ("port", args.port))
        if value is not None})
    try:
        return run(config.model_copy(update={"serve": serve}))
    except ServeRefused as exc:
        print(f"newsvec serve: {exc}", file=sys.stderr)
        return 1


def run(config: config_lib.Config, engine=None, sock: Optional[socket.socket] = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; 0. ``engine``: a stand-in (tests); ``sock``: a
    socket already bound (default: ``serve.host`` and ``serve.port``)."""
    from pipeline.serve import auth
    from pipeline.serve.app import create_app

    key = auth.api_key(config.serve)
    check_binding(config.serve.host, key)  # before the model loads
    sock = sock or _bound(config.serve.host, config.serve.port)  # a port taken: said at once
    app = create_app(config, engine, api_key=key)  # refused until uvicorn listens
    service = app.state.service
    server = DrainingServer(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=math.ceil(config.serve.drain_s), backlog=4096,
        http=_http_protocol()), service)
    host, port = sock.getsockname()[:2]
    _LOG.info("serving %s on http://%s:%d (search: %s)", service.label,
              f"[{host}]" if ":" in host else host, port,
              service.corpus.kind if service.corpus is not None else "off")
    server.run(sockets=[sock])
    return 0


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (``ServeRefused`` naming them when it cannot
    be)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeRefused(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


HEADER_TIMEOUT_S = 10.0
"""How long a connection may take to send a request's headers, from its opening or the start of
the request, and to end the body of a request answered before its body was read (401, 413,
408): uvicorn has no such limit, and a client that never finishes its headers, or trickles such
a body a byte at a time (slowloris), would hold its connection for good."""


def _http_protocol():
    """uvicorn's httptools protocol, closing a connection whose request headers, or the body of
    a request answered before it ended, do not end within ``HEADER_TIMEOUT_S`` (a body that does
    not arrive is ``serve.request_timeout_s``'s: ``limits.read_json``)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools (it comes with vLLM): uvicorn's h11, with no such limit
        _LOG.warning("httptools is not installed: connections that never finish their request "
                     "headers are not closed")
        return "auto"

    class HeaderDeadline(HttpToolsProtocol):
        _deadline = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:  # answered before its body ended: each byte
            super().on_response_complete()  # of it would reset uvicorn's keep-alive timer
            if self.cycle.response_complete and self.cycle.more_body:  # not a pipelined one's
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline


_WRITE_S = 0.5
"""Of ``serve.drain_s``, what is kept for the last answers to be written."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which marks the service draining (``/readyz`` fails) as soon as a
    SIGTERM or SIGINT arrives, and has the batcher begin no engine call that would end after
    ``serve.drain_s`` (the inputs still waiting then are answered 503, ``Batcher.drain_by``);
    uvicorn closes its sockets, lets the requests in flight finish for
    ``timeout_graceful_shutdown`` and runs the lifespan's end, and the process exits 0."""

    def __init__(self, config: uvicorn.Config, service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        if not self.service.draining:  # the answers written before uvicorn's limit
            self.service.batcher.drain_by(
                time.perf_counter() + max(0.0, self.service.settings.drain_s - _WRITE_S))
        self.service.draining = True
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has shut down, so that the process ends by it
        # (status 143); drained, it exits 0 instead (``run`` returns).
        self._captured_signals.clear()
