"""SIGTERM while a burst is queued behind the engine, more than ``serve.drain_s`` (8 s) of it
(``tests.serve.slow_server``: every engine call takes 2 s; each request here fills one call): the
requests that cannot be embedded in time must still get an answer a client can act on, a 503
with ``Retry-After`` in the service's JSON error body, never a bare connection reset or
uvicorn's plain-text 500."""
from __future__ import annotations

import signal
import threading
import time

from tests.serve.conftest import need, slow_service


def test_sigterm_answers_every_queued_request_it_cannot_finish_with_a_503(tmp_path):
    httpx = need("httpx")
    with slow_service(tmp_path) as (process, url):
        answers: dict[int, object] = {}

        def send(i: int, inputs: list[str]) -> None:
            try:
                answers[i] = httpx.post(f"{url}/v1/embeddings", json={"input": inputs},
                                        timeout=60)
            except httpx.HTTPError as exc:
                answers[i] = exc

        long = " ".join(["word"] * 400)  # 256 tokens, truncated: 32 of them fill one call
        senders = [threading.Thread(target=send, args=(0, ["first"]))]
        senders += [threading.Thread(target=send, args=(i, [long] * 32)) for i in range(1, 8)]
        senders[0].start()
        time.sleep(0.3)
        for sender in senders[1:]:
            sender.start()
        deadline = time.monotonic() + 60
        while _queued(httpx, url) < 160:  # 5 calls' worth (10 s) or more waiting
            assert time.monotonic() < deadline, "the burst was not queued in 60 s"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        for sender in senders:
            sender.join(60)
        assert process.wait(30) == 0

    def shown(answer) -> str:
        if isinstance(answer, Exception):
            return f"{type(answer).__name__}"
        return f"{answer.status_code} {answer.headers.get('content-type')}"

    bad = {i: shown(a) for i, a in sorted(answers.items())
           if not (not isinstance(a, Exception) and (
               a.status_code == 200 or (a.status_code == 503 and "retry-after" in a.headers
                                        and a.headers["content-type"] == "application/json")))}
    assert len(answers) == 8 and not bad, f"answers after SIGTERM: {bad}"


def _queued(httpx, url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("newsvec_serve_queue_depth "):
            return float(line.split()[1])
    return 0.0
