"""Slowloris by the body: a request answered before its body is read (401 without the key, 413
by its ``Content-Length``, 415, 408) leaves its connection open, and uvicorn's keep-alive timer is
reset by every byte that arrives, while the header deadline (``main.HeaderDeadline``) was
disarmed when the headers completed. A client without the key declares a body of a gigabyte,
takes its 401 and sends one byte every second: its connection is held for good, which is what
the header deadline was made to stop ("a client that never finishes its headers (slowloris)
would hold its connection for good"; docs/serving.md: "a connection that never finishes its
headers is closed after 10 s"). The connection must be closed once its answer is written and
its body does not end within the deadline."""
from __future__ import annotations

import socket
import threading
import time

from tests.common import make_config
from tests.serve.conftest import API_KEY, loopback_socket, need

need("fastapi")
uvicorn = need("uvicorn")

from pipeline.serve import main as serve_main  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
from tests.serve.test_serve_hostile import Gated  # noqa: E402

DEADLINE_S = 1.5


def _held_for(port: int, request: bytes, seconds: float) -> tuple[bytes, bool]:
    """(the answer's status line, whether the connection is still open after ``seconds`` of one
    body byte a second)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(request)
        conn.settimeout(5)
        status = conn.recv(4096).split(b"\r\n")[0]
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            try:
                conn.sendall(b"x")
                conn.settimeout(0.01)
                try:
                    if conn.recv(4096) == b"":
                        return status, False
                except socket.timeout:
                    pass
            except OSError:
                return status, False
            time.sleep(0.5)
        return status, True


def test_a_body_trickled_after_an_early_answer_does_not_hold_the_connection(monkeypatch,
                                                                              tmp_path):
    protocol = serve_main._http_protocol()  # pylint: disable=protected-access
    if protocol == "auto":
        need("httptools")
    monkeypatch.setattr(serve_main, "HEADER_TIMEOUT_S", DEADLINE_S)
    app = create_app(make_config(output=str(tmp_path / "no-output")), Gated(), api_key=API_KEY)
    sock = loopback_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="on", http=protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.01)
    port = sock.getsockname()[1]
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: 1000000000\r\n")
    try:
        anonymous = _held_for(port, head + b"\r\n", 4 * DEADLINE_S + 6)  # past keep-alive's 5 s
        too_large = _held_for(port, head + b"Authorization: Bearer " + API_KEY.encode()
                              + b"\r\n\r\n", 4 * DEADLINE_S + 6)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert anonymous[0].startswith(b"HTTP/1.1 401") and too_large[0].startswith(b"HTTP/1.1 413")
    assert not anonymous[1], (
        "a client without the key held its connection past the header deadline and keep-alive "
        "by trickling the body of its answered request")
    assert not too_large[1], "a 413's connection held by its trickled body"
