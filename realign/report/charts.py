"""Small SVG charts for the run report: line charts of metrics over steps and grouped
bar charts. Pure functions from numbers to self-contained SVG text (no scripts, no
fonts or files fetched), so the page renders offline in any browser."""
from __future__ import annotations

import math
from html import escape

from planner.svg import PALETTE, head, legend, legend_rows


def _nice(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _keys(texts: list[str]) -> list[tuple[str, str]]:
    """Each text with the palette's colour of its series."""
    return [(t, PALETTE[k % len(PALETTE)]) for k, t in enumerate(texts)]


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "step",
               width: int = 560, height: int = 260) -> str:
    """Lines of (x, y) points, one per named series, on shared axes with a legend."""
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    left, right, top = 58, 16, 34
    bottom = 36 + 16 * legend_rows(list(series), left, width)
    height += bottom - 52
    w, h = width - left - right, height - top - bottom
    out = [*head(width, height),
           f'<text x="{left}" y="20" font-size="13" font-weight="bold">{escape(title)}</text>']
    if not pts:
        out += [f'<text x="{left}" y="{top + h / 2}" fill="#777">no values recorded</text>',
                "</svg>"]
        return "\n".join(out)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + h - (y - y0) / (y1 - y0) * h

    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fafafa" '
               'stroke="#ccc"/>')
    for k in range(5):
        y = y0 + (y1 - y0) * k / 4
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" '
                   f'fill="#555">{_nice(y)}</text>')
        x = x0 + (x1 - x0) * k / 4
        x = round(x) if all(float(p[0]).is_integer() for p in pts) else x
        out.append(f'<text x="{sx(x):.1f}" y="{top + h + 14}" text-anchor="middle" '
                   f'fill="#555">{_nice(x)}</text>')
    out.append(f'<text x="{left + w / 2}" y="{top + h + 28}" text-anchor="middle" '
               f'fill="#555">{escape(x_label)}</text>')
    for k, (_name, s) in enumerate(series.items()):
        color = PALETTE[k % len(PALETTE)]
        good = [p for p in s if math.isfinite(p[1])]
        if len(good) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       'stroke-width="2"/>')
        for x, y in good if len(good) <= 40 else good[-1:]:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>')
    legend(out, _keys(list(series)), left, top + h + 46, width)
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(title: str, groups: list[str], series: dict[str, list[float]], unit: str,
              width: int = 560, height: int | None = None) -> str:
    """Horizontal bars: for each group (a row) one bar per named series."""
    n = len(series)
    row_h = 12 * n + 10
    left, top = 170, 34
    height = height or top + row_h * max(len(groups), 1) + 40
    w = width - left - 70
    vmax = max([v for vs in series.values() for v in vs if math.isfinite(v)] or [1.0]) or 1.0
    out = [*head(width, height),
           f'<text x="10" y="20" font-size="13" font-weight="bold">{escape(title)}</text>']
    for i, g in enumerate(groups):
        y = top + i * row_h
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 2}" text-anchor="end">'
                   f'{escape(g)}</text>')
        for k, (name, values) in enumerate(series.items()):
            v = values[i]
            bw = (v / vmax * w) if math.isfinite(v) else 0.0
            by = y + 4 + 12 * k
            out.append(f'<rect x="{left}" y="{by}" width="{max(bw, 1):.1f}" height="10" '
                       f'fill="{PALETTE[k % len(PALETTE)]}"><title>{escape(name)}: '
                       f'{_nice(v)} {escape(unit)}</title></rect>')
            out.append(f'<text x="{left + bw + 4:.1f}" y="{by + 9}" fill="#333">'
                       f'{_nice(v)}</text>')
    legend(out, _keys([f"{n} ({unit})" for n in series]), left, height - 14, width)
    out.append("</svg>")
    return "\n".join(out)
