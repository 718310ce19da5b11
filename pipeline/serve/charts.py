"""Small SVG line charts for the status page (``pipeline.serve.pages``), drawn by the service: no
script, no remote asset, nothing a Content-Security-Policy of ``default-src 'none'`` refuses.

``line_chart(title, series, ...)`` draws one line per named series of (x, y) points, with the
y axis from 0 to the largest value, a few x labels and a legend. Every text drawn (the title,
the series' names: dead-letter reasons read from the output) is XML-escaped.
"""
from __future__ import annotations

import html
import math
from typing import Callable, Mapping, Sequence

WIDTH, HEIGHT = 720, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 170, 28, 30  # the plot's margins: the legend on the right
# Colours a reader tells apart (Okabe and Ito's palette), then grey for the rest.
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000",
           "#f0e442")
MAX_SERIES = len(PALETTE)

Point = tuple[float, float]


def _text(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ticks(top: float) -> list[float]:
    """Up to five round values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    step = 10 ** math.floor(math.log10(top / 4)) if top >= 4 else 1.0
    for factor in (1, 2, 5, 10):
        if top / (step * factor) <= 4:
            step *= factor
            break
    return [i * step for i in range(int(math.ceil(top / step)) + 1)]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


MARKED_POINTS = 40  # a series of at most this many points has a dot at each


def _polyline(points: Sequence[Point], x: Callable[[float], float], y: Callable[[float], float],
              colour: str) -> str:
    dots = "".join(f'<circle cx="{x(px):.1f}" cy="{y(py):.1f}" r="2.5" fill="{colour}"/>'
                   for px, py in points) if len(points) <= MARKED_POINTS else ""
    if len(points) == 1:
        return dots
    joined = " ".join(f"{x(px):.1f},{y(py):.1f}" for px, py in points)
    return (f'<polyline points="{joined}" fill="none" stroke="{colour}" '
            f'stroke-width="1.5"/>{dots}')


def line_chart(title: str, series: Mapping[str, Sequence[Point]], *, chart_id: str,
               x_label: Callable[[float], str]) -> str:
    """An SVG element: each series a line (a dot where it has one point), in ``PALETTE``'s
    colours in the order given (at most ``MAX_SERIES``: merge the rest before), the x axis
    labelled by ``x_label`` at its ends and middle, the y axis from 0."""
    drawn = {name: sorted(points) for name, points in list(series.items())[:MAX_SERIES]
             if points}
    xs = [px for points in drawn.values() for px, _ in points]
    ys = [py for points in drawn.values() for _, py in points]
    ticks = _ticks(max(ys, default=0.0))
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    span = (x1 - x0) or 1.0
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def x(value: float) -> float:
        return _LEFT + (value - x0) / span * plot_w if x1 > x0 else _LEFT + plot_w / 2

    def y(value: float) -> float:
        return _TOP + plot_h - value / ticks[-1] * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="{_text(chart_id)}" class="chart" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="{_text(title)}">',
             f'<title>{_text(title)}</title>',
             f'<text x="{_LEFT}" y="16" font-size="13" font-weight="bold">{_text(title)}</text>']
    parts += _axes(ticks, y, plot_w, plot_h)
    if xs:
        for at in sorted({x0, (x0 + x1) / 2, x1}):
            parts.append(f'<text x="{x(at):.1f}" y="{HEIGHT - 10}" font-size="11" '
                         f'text-anchor="middle">{_text(x_label(at))}</text>')
    else:
        parts.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_TOP + plot_h / 2:.0f}" '
                     'font-size="12" text-anchor="middle">nothing to show</text>')
    for i, (name, points) in enumerate(drawn.items()):
        colour = PALETTE[i]
        parts.append(_polyline(points, x, y, colour))
        ly = _TOP + 14 * i + 6
        parts.append(f'<rect x="{WIDTH - _RIGHT + 12}" y="{ly - 8}" width="10" height="10" '
                     f'fill="{colour}"/><text x="{WIDTH - _RIGHT + 26}" y="{ly + 1}" '
                     f'font-size="11">{_text(name[:24])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _axes(ticks: list[float], y: Callable[[float], float], plot_w: float, plot_h: float
          ) -> list[str]:
    parts = [f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" '
             'stroke="#888"/>']
    for tick in ticks:
        parts.append(f'<line x1="{_LEFT}" y1="{y(tick):.1f}" x2="{_LEFT + plot_w}" '
                     f'y2="{y(tick):.1f}" stroke="#ddd"/><text x="{_LEFT - 6}" '
                     f'y="{y(tick) + 4:.1f}" font-size="11" text-anchor="end">'
                     f'{_number(tick)}</text>')
    return parts


def top_series(series: Mapping[str, Sequence[Point]], keep: int = MAX_SERIES,
               rest: str = "(others)") -> dict[str, list[Point]]:
    """``series`` with the ``keep`` - 1 largest (by their sum) kept and the others summed into
    ``rest`` at each x, so that every one has a colour of its own."""
    ranked = sorted(series, key=lambda name: (-sum(v for _, v in series[name]), name))
    if len(ranked) <= keep:
        return {name: list(series[name]) for name in ranked}
    kept = {name: list(series[name]) for name in ranked[:keep - 1]}
    summed: dict[float, float] = {}
    for name in ranked[keep - 1:]:
        for px, py in series[name]:
            summed[px] = summed.get(px, 0.0) + py
    kept[rest] = sorted(summed.items())
    return kept
