"""The operator's status page: ``GET /status`` (HTML) and ``GET /status.json`` (the same
status, as ``pipeline.serve.status.collect`` returns it). The page is a drawing of that dict and
nothing more: every number it shows is in the JSON.

Both go through the service's routes' wrapper (``app._answered``): behind the API key like
``/info``, counted in the metrics. A browser sends no ``Authorization`` header by itself: with a
key configured, the page is opened through a proxy that adds it (docs/serving.md); the key is
never taken from the URL or a cookie, where it would land in logs and browser history.

Every text that comes from the output (reasons, ids, paths, problems) is HTML-escaped, and the
page runs no script and loads nothing: ``HEADERS`` holds a Content-Security-Policy that forbids
scripts and every remote asset, and allows only the page's own style sheet (by its hash) and
its inline SVG charts (``pipeline.serve.charts``).

Stable hooks for a browser test: each window is a ``<tr class="window" data-window="START">``,
with class ``unbalanced`` (drawn red) when ``newsvec ledger`` finds a problem in it, its
problems in its ``td.reason``; each batch run a ``<tr class="run" data-run="RUN_ID">``, alike;
the problems of no one window in ``#problems``.
"""
from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import html
import json
import math
from typing import Any, Awaitable, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response

from pipeline.serve.charts import line_chart, top_series
from pipeline.serve.limits import bad
from pipeline.serve.status import DEFAULT_HOURS, MAX_HOURS, StatusCache

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; vertical-align: top; }
th { background: #f3f3f3; }
td.text, td.reason { text-align: left; overflow-wrap: anywhere; min-width: 12em; }
.scroll { overflow-x: auto; max-width: 100%; }
td.when { white-space: nowrap; }
tr.unbalanced td, li.problem, .problem { background: #fdd; color: #a00; }
tr.open td:first-child::after { content: " (open)"; color: #888; }
tr.waiting td { background: #fff4d6; }
p.ok { color: #060; }
code { font-size: 13px; }
svg.chart { display: block; margin: 0.5em 0; }
"""
_CSS_HASH = base64.b64encode(hashlib.sha256(CSS.encode("utf-8")).digest()).decode("ascii")
HEADERS = {
    # No script at all (default-src 'none'), nothing remote; the one style sheet by its hash.
    "Content-Security-Policy": (f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; "
                                "img-src 'self'; form-action 'self'; base-uri 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
Handler = Callable[[Request], Awaitable[Response]]


def _e(value: Any) -> str:
    """``value`` as text escaped for HTML (an element's text or a quoted attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def hours_asked(request: Request) -> int:
    """``?hours=N``: 1 to ``MAX_HOURS`` (default ``DEFAULT_HOURS``); else a 400."""
    raw = request.query_params.get("hours")
    if raw is None:
        return DEFAULT_HOURS
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_HOURS:
        raise bad(f"hours: a whole number of hours from 1 to {MAX_HOURS}", "invalid_value",
                  "hours")
    return int(raw)


def status_routes(service: Any) -> dict[str, tuple[str, Handler]]:
    """``{path: (method, handler)}`` of ``/status`` and ``/status.json`` over ``service.config``,
    for ``create_app`` to add behind its wrapper."""
    cache = StatusCache(service.config)
    drawn: dict[str, tuple[dict, bytes]] = {}  # per route: the status last drawn, its bytes
    drawing = asyncio.Lock()

    async def draw(route: str, status: dict, make: Callable[[dict], str]) -> bytes:
        """``make(status)``, once per status the cache holds (a page reloaded in a loop is not
        drawn again), in a thread: 48 hours of minute windows take 0.1 s, which the event loop
        every request shares would be held for."""
        async with drawing:
            held = drawn.get(route)
            if held is None or held[0] is not status:
                drawn[route] = (status, (await asyncio.to_thread(make, status)).encode("utf-8"))
            return drawn[route][1]

    async def status_page(request: Request) -> Response:
        status = await cache.get(hours_asked(request))
        return Response(await draw("page", status, render),
                        media_type="text/html; charset=utf-8", headers=HEADERS)

    async def status_json(request: Request) -> Response:
        status = await cache.get(hours_asked(request))
        return Response(await draw("json", status, as_json),
                        media_type="application/json", headers=HEADERS)

    return {"/status": ("GET", status_page), "/status.json": ("GET", status_json)}


def as_json(status: dict) -> str:
    """``/status.json``'s body."""
    return json.dumps(status, ensure_ascii=False)


def render(status: dict) -> str:
    """The page of a status (``collect``'s dict)."""
    parts = [f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
             f'<title>newsvec status: {_e(status["output"])}</title><style>{CSS}</style>'
             f'</head><body>\n<h1>newsvec status</h1>\n{_overview(status)}\n'
             f'{_problems(status["problems"])}']
    if status["streaming"] is not None:
        parts.append(_streaming(status["streaming"], status["hours"]))
    else:
        parts.append(_runs(status["runs"]))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _overview(status: dict) -> str:
    verdict = ('<p id="verdict" class="ok">nothing wrong found</p>' if status["ok"] else
               '<p id="verdict" class="problem">problems found: see the red rows</p>')
    return (f'<p id="overview">output <code id="output">{_e(status["output"])}</code> '
            f'({_e(status["kind"])}), read at {_e(status["generated_at"])} '
            f'(<a id="json-link" href="/status.json?hours={int(status["hours"])}">JSON</a>)</p>'
            f'\n{verdict}')


def _problems(problems: list) -> str:
    if not problems:
        return '<ul id="problems"></ul>'
    items = "".join(f'<li class="problem">{_e(p)}</li>' for p in problems)
    return f'<h2>Problems</h2>\n<ul id="problems">{items}</ul>'


def _by_reason(by_reason: Optional[dict]) -> str:
    return ", ".join(f"{_e(reason)}: {_e(n)}" for reason, n in sorted((by_reason or {}).items()))


def _reasons(problems: list) -> str:
    if not problems:
        return "balanced"
    return "<ul>" + "".join(f"<li>{_e(p)}</li>" for p in problems) + "</ul>"


def _row(cells: list, attributes: str) -> str:
    """A table row: text cells (escaped here) and ``(class, html)`` cells (escaped already)."""
    out = []
    for cell in cells:
        if isinstance(cell, tuple):
            out.append(f'<td class="{cell[0]}">{cell[1]}</td>')
        else:
            out.append(f"<td>{_e(cell)}</td>")
    return f"<tr {attributes}>{''.join(out)}</tr>"


def _table(table_id: str, headings: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headings)
    return (f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>'
            f'{"".join(rows)}</tbody></table></div>')


def _epoch(text: Optional[str]) -> Optional[float]:
    """An RFC 3339 time, or a day (its midnight UTC), as Unix seconds; None for neither."""
    try:
        at = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)).timestamp()


def _clock(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%H:%M")


def _date(epoch: float) -> str:
    at = dt.datetime.fromtimestamp(epoch, dt.timezone.utc)
    return at.strftime("%Y-%m-%d" if at.time() == dt.time() else "%Y-%m-%d %H:%M")


def _y(value: Any) -> float:
    """A count or rate as a chart draws it: 0 for what is no finite number of a float's range
    (the output's absurd values are named among the problems, never drawn)."""
    try:
        y = float(value or 0)
    except (OverflowError, TypeError, ValueError):
        return 0.0
    return y if math.isfinite(y) else 0.0


def _charts(points: list[tuple[Optional[float], dict]], rates: dict[str, str], rate_title: str,
            x_label: Callable[[float], str], per: str) -> str:
    """Two charts over ``points`` ((x, item) pairs): the ``rates`` (item key -> series name),
    and the dead letters by reason, each ``per`` x."""
    placed = [(x, item) for x, item in points if x is not None]
    rate = {name: [(x, _y(item.get(key))) for x, item in placed]
            for key, name in rates.items()}
    reasons: dict[str, list[tuple[float, float]]] = {}
    for _, item in placed:
        for reason in item.get("dead_lettered_by_reason") or {}:
            reasons.setdefault(str(reason), [])
    for x, item in placed:
        by_reason = item.get("dead_lettered_by_reason") or {}
        for reason, series in reasons.items():
            series.append((x, _y(by_reason.get(reason))))
    return (line_chart(f"{rate_title}, {per}", rate, chart_id="rate-chart", x_label=x_label)
            + line_chart(f"Dead letters by reason, {per}", top_series(reasons),
                         chart_id="dead-letters-chart", x_label=x_label))


def _streaming(streaming: dict, hours: int) -> str:
    windows = streaming["windows"]
    form = (f'<form id="hours-form" method="get" action="/status"><label>hours '
            f'<input type="number" name="hours" min="1" max="{MAX_HOURS}" value="{int(hours)}">'
            f'</label> <button type="submit">show</button></form>')
    charts = _charts([(_epoch(w["window_start"]), w) for w in windows],
                     {"rows_per_minute": "rows", "messages_per_minute": "messages in"},
                     "Rows and messages a minute", _clock, "per window (UTC)")
    rows = [_window_row(w) for w in reversed(windows)]
    table = _table("windows", [
        "window (UTC)", "micro-batches", "in", "rows", "rows / min", "dead letters",
        "by reason", "duplicates", "near duplicates", "late", "written after end (s)",
        "in the store", "ledger"], rows)
    return (f'{_flagged(windows)}\n<h2>Windows from {_e(streaming["start"])} to '
            f'{_e(streaming["end"])}</h2>\n{form}\n{charts}\n{table}\n'
            f'{_compaction(streaming["compaction"])}\n{_store(streaming["store"])}')


def _flagged(windows: list) -> str:
    """The flagged windows, each a link to its row with its first problem."""
    items = []
    for w in windows:
        if w["balanced"]:
            continue
        more = len(w["problems"]) - 1
        items.append(f'<li class="problem"><a href="#window-{_e(w["window_start"])}">'
                     f'{_e(w["window_start"])}</a>: {_e(w["problems"][0])}'
                     f'{f" (and {more} more)" if more else ""}</li>')
    if not items:
        return '<ul id="flagged"></ul>'
    return f'<h2>Flagged windows</h2>\n<ul id="flagged">{"".join(items)}</ul>'



def _window_row(w: dict) -> str:
    classes = "window" + ("" if w["balanced"] else " unbalanced") + \
        ("" if w["settled"] else " open")
    stored = {None: "", True: "yes", False: "no"}[w["store_loaded"]]
    return _row([("when", _e(w["window_start"])), w["micro_batches"], w["messages_in"],
                 w["rows_written"], w["rows_per_minute"], w["dead_lettered"],
                 ("text", _by_reason(w["dead_lettered_by_reason"])), w["duplicates"],
                 w["near_duplicates"], w["late_reassigned"],
                 "" if w["written_after_end_s"] is None else w["written_after_end_s"], stored,
                 ("reason", _reasons(w["problems"]))],
                f'class="{classes}" id="window-{_e(w["window_start"])}" '
                f'data-window="{_e(w["window_start"])}"')


def _compaction(hours: list) -> str:
    rows = []
    for h in hours:
        waiting = h["closed"] and h["compacted"] < h["micro_batches"]
        rows.append(_row([("text", _e(h["partition"])), "yes" if h["closed"] else "no",
                          h["micro_batches"], h["compacted"], h["compacted_at"] or ""],
                         f'class="hour{" waiting" if waiting else ""}" '
                         f'data-partition="{_e(h["partition"])}"'))
    return "<h2>Compaction</h2>\n" + _table(
        "compaction", ["hour", "closed", "micro-batches", "compacted", "compacted at"], rows)


def _store(lag: Optional[dict]) -> str:
    if lag is None:
        return ""
    behind = lag["error"] is not None or (lag["loaded"] or 0) < lag["micro_batches"]
    items = "".join(f"<dt>{_e(name)}</dt><dd>{_e(lag[key])}</dd>" for key, name in (
        ("table", "table"), ("micro_batches", "micro-batches that loaded rows"),
        ("loaded", "of them in the store"), ("last_written_at", "newest written"),
        ("last_loaded_at", "newest loaded"), ("lag_s", "lag (s)"), ("error", "error"))
        if lag[key] is not None)
    return (f'<h2>Store</h2>\n<dl id="store" class="{"problem" if behind else "ok"}">{items}'
            "</dl>")


def _runs(runs: list) -> str:
    charts = _charts([(_epoch(r["day"] or r["launched_at"]), r["counts"] or {}) for r in runs],
                     {"written": "written", "in": "in"}, "Articles", _date,
                     "per run (by its day, else its launch)")
    rows = []
    for r in runs:
        counts = r["counts"] or {}
        classes = "run" + (" unbalanced" if r["problems"] else "")
        stored = {None: "", True: "yes", False: "no"}[r["store_loaded"]]
        rows.append(_row([
            r["day"] or "", ("text", _e(r["run_id"] or "")), r["state"], r["launched_at"] or "",
            "" if r["duration_s"] is None else r["duration_s"], counts.get("in", ""),
            counts.get("written", ""), counts.get("dead_lettered", ""),
            ("text", _by_reason(counts.get("dead_lettered_by_reason"))),
            counts.get("duplicates", ""), counts.get("unchanged", ""),
            counts.get("near_duplicates", ""),
            {None: "", True: "yes", False: "superseded"}[r["published"]], stored,
            ("reason", _reasons(r["problems"]))],
            f'class="{classes}" data-run="{_e(r["run_id"] or "")}" '
            f'data-output="{_e(r["output"])}"'))
    table = _table("runs", [
        "day", "run", "state", "launched (UTC)", "launch to commit (s)", "in", "written",
        "dead letters", "by reason", "duplicates", "unchanged", "near duplicates", "published",
        "in the store", "accounting"], rows)
    return f"<h2>Batch runs</h2>\n{charts}\n{table}"
