"""SIGTERM drains ``newsvec serve``: a request in flight is answered, a new connection is refused,
and the process exits 0 (``tests.serve.slow_server``: the real command's ``run`` in a process of
its own, with a stand-in engine whose calls take 2 s)."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.serve.conftest import need, slow_service


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(tmp_path):
    httpx = need("httpx")
    with slow_service(tmp_path) as (process, url):
        answers: list = []
        in_flight = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/embeddings", json={"input": "still answered"}, timeout=30)))
        in_flight.start()
        time.sleep(0.5)  # the request waits for the engine's 2 s call
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/healthz", timeout=5)
        in_flight.join(30)
        assert answers and answers[0].status_code == 200, answers
        assert len(answers[0].json()["data"][0]["embedding"]) == 384
        assert process.wait(30) == 0, process.stdout.read().decode() if process.stdout else ""
