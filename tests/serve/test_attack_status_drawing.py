"""``/status`` keeps the status it collected (``StatusCache``: a reload loop or many tabs read the
output at most every few seconds), but draws the page anew for every request, on the event loop
that every embedding and search shares: for 48 hours of one-minute windows (``?hours=48``, 2,880
rows, 1.2 MB of HTML) a drawing took 80-185 ms on the 2-core machine here, so a page reloaded in
a loop, or open in a few tabs that refresh, stalls the service's requests by that much for each
of its own (docs/serving.md promises such a page costs the output a read every few seconds; the
status cache "holding no thread that the service's searches need" is to spare them). One status
is drawn once, however often it is asked for while it is kept, and not on the event loop."""
from __future__ import annotations

import datetime as dt
import threading

from tests.common import make_config
from tests.serve.conftest import headers, need
from transforms.settings import ServeSettings

need("fastapi")

from pipeline.serve import pages  # noqa: E402
from pipeline.serve import status as status_lib  # noqa: E402
from tests.serve.test_status import client_of  # noqa: E402


def _big_status(config, hours):
    now = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    windows = []
    for i in range(hours * 60):
        start = now - dt.timedelta(minutes=i + 1)
        windows.append(status_lib.WindowStatus(
            window_start=status_lib._iso(start),  # pylint: disable=protected-access
            window_end=status_lib._iso(  # pylint: disable=protected-access
                start + dt.timedelta(minutes=1)),
            micro_batches=4, messages_in=1000, rows_written=990, rows_per_minute=990.0,
            messages_per_minute=1000.0, dead_lettered=10,
            dead_lettered_by_reason={f"reason-{i % 12}": 5, "invalid_json": 5}, settled=True))
    return status_lib.Status(
        output=config.output, kind="streaming", generated_at="2026-12-01T00:00:00Z",
        hours=hours, streaming=status_lib.StreamingStatus(
            start="a", end="b", window_s=60, totals={}, windows=windows[::-1], flagged=[],
            compaction=[])).to_dict()


def test_one_status_is_drawn_once_and_not_on_the_event_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(status_lib, "collect", _big_status)
    drawn: list[str] = []
    render = pages.render

    def counted(status):
        drawn.append(threading.current_thread().name)
        return render(status)

    monkeypatch.setattr(pages, "render", counted)
    with client_of(make_config(output=str(tmp_path), serve=ServeSettings(search="off"))) as client:
        loop_thread = client.portal.call(lambda: threading.current_thread().name)
        answers = [client.get("/status?hours=48", headers=headers()) for _ in range(8)]
    assert all(a.status_code == 200 for a in answers)
    assert len(drawn) == 1, (
        f"one status (kept by the cache) was drawn {len(drawn)} times for 8 requests: each "
        "drawing holds the event loop for 0.1 s")
    assert loop_thread not in drawn, "the page is drawn on the event loop"
