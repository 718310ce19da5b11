"""SIGTERM drains ``newsvec serve``: a request in flight is answered, a new connection is refused,
and the process exits 0 (``tests.serve.slow_server``: the real command's ``run`` in a process of
its own, with a stand-in engine whose calls take 2 s)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.common import REPO
from tests.serve.conftest import need


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(tmp_path):
    httpx = need("httpx")
    need("uvicorn")
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.serve.slow_server", str(tmp_path / "no-output"),
         str(port_file)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "NEWSVEC_API_KEY": ""})
    try:
        url = _started(process, port_file, httpx)
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
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _started(process: subprocess.Popen, port_file, httpx) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        if port_file.is_file() and port_file.read_text():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise AssertionError("the service did not start in 120 s")
