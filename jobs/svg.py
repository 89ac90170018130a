"""What fusegen's HTML reports are drawn with (a job's `_report.html`, `fusegen bench
--report`): the page, tables and inline SVG plots. No script, no stylesheet or font
fetched, no plotting package; every string from the run is escaped here."""
from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

W, H, PAD = 640, 240, 48  # a plot's size and its margin for the axes' labels
_BAR_H, _BAR_GAP, _LABEL_W = 22, 6, 240  # a bar chart's rows and its label column
COLOURS = ("#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#57606a")
_STYLE = ("body{font-family:sans-serif;max-width:760px;margin:2em auto}th{text-align:left;\n"
          "padding-right:1em}td.num{text-align:right}svg text{font-size:11px}")


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a line chart: its points (x, y) in data units, left to right."""
    css_class: str  # the polyline's class: what a reader (or a test) finds it by
    points: Sequence[tuple[float, float]]
    label: str = ""  # its legend entry, where the chart has several lines


def e(value) -> str:
    """`value` as HTML text (None as empty)."""
    return html.escape("" if value is None else str(value))


def number(value, text: str) -> str:
    """A table cell showing `text`, with the exact number (as the JSON file writes it)
    in its data-value, so a figure read off the page is the figure the run measured."""
    return f'<td class="num" data-value="{e(json.dumps(value))}">{e(text)}</td>'


def page(title: str, body: str) -> str:
    """A whole self-contained HTML document."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>{_STYLE}</style></head><body>
<h1>{e(title)}</h1>
{body}
</body></html>
"""


def key_values(rows: Iterable[tuple[str, object]]) -> str:
    """A two-column table: a heading cell and its value per row."""
    return "<table>\n" + "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>"
                                   for k, v in rows) + "\n</table>"


def grid(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table with a header row; `rows` hold finished cells (`<td>...</td>`, `number`)."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    return (f"<table>\n<tr>{head}</tr>\n" + "\n".join(f"<tr>{''.join(r)}</tr>" for r in rows)
            + "\n</table>")


def line_chart(series: Sequence[Series], *, title: str, x_max_format: str = "{:.1f}",
               y_format: str = "{:.1f}") -> str:
    """Lines over x from 0 to the largest x and y from 0 to the largest y, with labelled
    axes (the y maximum, 0, the x maximum in `x_max_format`) and a legend where there
    are several lines. Every point is drawn: callers thin long runs."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_max, y_max = max(xs) or 1.0, max(ys) or 1.0
    x = lambda t: PAD + (W - 2 * PAD) * t / x_max  # noqa: E731
    y = lambda v: H - PAD + (2 * PAD - H) * v / y_max  # noqa: E731
    left, right, top, bottom = PAD, W - PAD, PAD, H - PAD
    lines = []
    for i, s in enumerate(series):
        points = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in s.points)
        lines.append(f'<polyline class="{e(s.css_class)}" fill="none" '
                     f'stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="2" points="{points}"/>')
    legend = [] if len(series) < 2 else [
        f'<text x="{right}" y="{top + 14 * i}" text-anchor="end" '
        f'fill="{COLOURS[i % len(COLOURS)]}">{e(s.label)}</text>' for i, s in enumerate(series)]
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="{e(title)}">',
        f'<polyline fill="none" stroke="#999" points="{left},{top} {left},{bottom} '
        f'{right},{bottom}"/>',
        *lines,
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{e(y_format.format(y_max))}</text>',
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">0</text>',
        f'<text x="{right}" y="{bottom + 16}" text-anchor="end">'
        f'{e(x_max_format.format(x_max))}</text>',
        f'<text x="{left}" y="{top - 12}">{e(title)}</text>',
        *legend, "</svg>"])


def bar_chart(bars: Sequence[tuple[str, float]], *, title: str, css_class: str = "bar",
              value_format: str = "{:,.1f}") -> str:
    """One horizontal bar a (label, value), longest for the largest value, each labelled
    with its value in `value_format`."""
    if not bars:
        return f"<p>{e(title)}: nothing to plot</p>"
    top = 24
    height = top + len(bars) * (_BAR_H + _BAR_GAP)
    span = W - _LABEL_W - 2 * PAD  # room for the longest bar and its value after it
    largest = max(v for _, v in bars) or 1.0
    rows = []
    for i, (label, value) in enumerate(bars):
        y0, width = top + i * (_BAR_H + _BAR_GAP), span * value / largest
        rows += [f'<text x="{_LABEL_W - 6}" y="{y0 + 15}" text-anchor="end">{e(label)}</text>',
                 f'<rect class="{e(css_class)}" x="{_LABEL_W}" y="{y0}" width="{width:.1f}" '
                 f'height="{_BAR_H}" fill="{COLOURS[i % len(COLOURS)]}"/>',
                 f'<text x="{_LABEL_W + width + 4:.1f}" y="{y0 + 15}">'
                 f'{e(value_format.format(value))}</text>']
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'viewBox="0 0 {W} {height}" role="img" aria-label="{e(title)}">',
        f'<text x="0" y="12">{e(title)}</text>', *rows, "</svg>"])
