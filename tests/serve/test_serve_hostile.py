"""``newsvec serve`` against a hostile or careless client (a stand-in engine, no model):

- a client that sends a large request and goes away has its inputs dropped, not embedded (the
  batcher's promise: "an input whose request gave up (timed out, or its client went away) is
  dropped if no call has taken it yet");
- ``/readyz``, which needs no key, does not open a store connection (a thread of the event loop's
  default pool, up to ``connect_timeout``) per probe: a flood of probes must not stall the
  authenticated routes that share that pool;
- a connection that never finishes its request headers is closed in the end (slowloris).
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from tests.common import make_config
from tests.serve.conftest import API_KEY, headers, need, serving, slow_service

need("fastapi")
httpx = need("httpx")

from pipeline.serve.app import create_app  # noqa: E402


class Gated:
    """384-dimensional constant vectors; every call held while ``gate`` is clear."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[int] = []

    def label(self) -> str:
        return "gated@test"

    def embed(self, prompts):
        self.gate.wait(30)
        self.calls.append(len(prompts))
        return [np.full(384, 384 ** -0.5, np.float32) for _ in prompts]


def _app(tmp_path, engine):
    return create_app(make_config(output=str(tmp_path / "no-output")), engine, api_key=API_KEY)


def test_the_inputs_of_a_client_that_went_away_are_not_embedded(tmp_path):
    engine = Gated()
    with serving(_app(tmp_path, engine)) as url:
        engine.gate.clear()
        answers: list = []
        first = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/embeddings", json={"input": "first"}, headers=headers(), timeout=30)))
        first.start()
        time.sleep(0.3)  # the first call is in the engine
        body = ('{"input": [' + ", ".join(['"gone soon"'] * 500) + "]}").encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as gone:
            gone.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nAuthorization: Bearer " + API_KEY.encode()
                         + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                         + body)
            time.sleep(0.5)  # read, tokenized, waiting for the engine: then the client goes
        time.sleep(0.3)
        engine.gate.set()
        first.join(30)
        time.sleep(0.5)
        assert answers and answers[0].status_code == 200
    assert engine.calls == [1], f"a gone client's 500 inputs were embedded: {engine.calls}"


class UnreachableStore:
    """A store corpus whose every connection attempt hangs for ``hang_s`` (a blackholed host:
    libpq's connect_timeout is 10 s)."""

    kind = "store"

    def __init__(self, hang_s: float):
        self.hang_s, self.attempts = hang_s, 0
        self._lock = threading.Lock()

    def ready(self):
        with self._lock:
            self.attempts += 1
        time.sleep(self.hang_s)
        return "the store cannot be reached: timeout"

    def nearest(self, vector, k, all_copies, filters):
        raise AssertionError("not searched here")


def test_a_flood_of_unauthenticated_readyz_probes_does_not_stall_the_service(tmp_path):
    app = _app(tmp_path, Gated())
    store = UnreachableStore(hang_s=3.0)
    app.state.service.corpus = store
    with serving(app) as url:
        probes = [threading.Thread(target=lambda: httpx.get(f"{url}/readyz", timeout=30))
                  for _ in range(24)]
        for probe in probes:
            probe.start()
        time.sleep(0.5)
        started = time.perf_counter()
        info = httpx.get(f"{url}/info", headers=headers(), timeout=30)
        took = time.perf_counter() - started
        for probe in probes:
            probe.join(30)
    assert info.status_code == 200
    assert store.attempts <= 2 and took < 2.5, (  # stalled: >= 3 s
        f"24 unauthenticated probes made {store.attempts} store connection attempts, and an "
        f"authenticated GET /info waited {took:.1f} s behind them")


def test_a_connection_that_never_finishes_its_headers_is_closed(tmp_path):
    with slow_service(tmp_path) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # and no more
            slow.settimeout(20)
            started = time.monotonic()
            try:
                closed = slow.recv(1024) is not None  # b"" (closed) or a 408
            except socket.timeout:
                closed = False
            waited = time.monotonic() - started
        assert closed, f"a connection that never sent its headers was held for {waited:.0f} s"


def test_readyz_tells_a_client_without_the_key_nothing_of_the_deployment(tmp_path):
    with serving(_app(tmp_path, Gated())) as url:
        anonymous = httpx.get(f"{url}/readyz", timeout=30)
    assert anonymous.status_code in (200, 503)
    assert str(tmp_path) not in anonymous.text, (
        f"an unauthenticated /readyz names the output: {anonymous.text}")


def test_a_keyless_loopback_service_refuses_a_page_rebound_to_it(tmp_path):
    """Without a key the service listens on loopback only, trusting whoever reaches it there; a
    web page the user opens can reach it too, by DNS rebinding (its own name resolving to
    127.0.0.1, so the browser lets it read the answers: the corpus, through /v1/search) or by a
    cross-site ``text/plain`` POST (no preflight). The Host it was called by must be a loopback
    one, and a body must be declared JSON."""
    app = create_app(make_config(output=str(tmp_path / "no-output")), Gated(), api_key=None)
    with serving(app) as url:
        rebound = httpx.get(f"{url}/info", headers={"Host": "attacker.example:8080"},
                            timeout=30)
        cross_site = httpx.post(f"{url}/v1/embeddings", content=b'{"input": "x"}',
                                headers={"Content-Type": "text/plain"}, timeout=30)
        local = httpx.get(f"{url}/info", timeout=30)
    assert local.status_code == 200
    assert rebound.status_code >= 400, "a page rebound to 127.0.0.1 reads GET /info"
    assert cross_site.status_code >= 400, "a cross-site text/plain POST is embedded"


def test_a_body_that_never_arrives_is_answered_408_in_request_timeout_s(tmp_path):
    config = make_config(output=str(tmp_path / "no-output"))
    config = config.model_copy(update={"serve": config.serve.model_copy(
        update={"request_timeout_s": 2.0})})
    with serving(create_app(config, Gated(), api_key=API_KEY)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nAuthorization: Bearer " + API_KEY.encode()
                         + b"\r\nContent-Length: 100\r\n\r\n{\"input\": ")  # and no more
            slow.settimeout(20)
            started = time.monotonic()
            answer = slow.recv(4096)
            waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer, answer[:300]
    assert waited < 10, f"answered after {waited:.0f} s"
