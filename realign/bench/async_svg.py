"""The picture of ``realign bench async``: the reward curves of the synchronous and
the asynchronous plan, one self-contained SVG drawn from the result record of
:mod:`realign.bench.async_bench`.

Each seed's curve (reward mean per step) is a thin line; each mode's mean over the
seeds is a thick one. The title holds the predicted and measured speed-up and the
final rewards. Pure: record in, text out.
"""
from __future__ import annotations

from html import escape
from typing import Any

from planner.svg import PALETTE, finite, head

COLORS = {"synchronous": PALETTE[0], "asynchronous": PALETTE[1]}
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 440, 60, 20, 86, 50


def _mean_curve(curves: list[list[object]]) -> list[float | None]:
    n = max((len(c) for c in curves), default=0)
    out: list[float | None] = []
    for i in range(n):
        vals = [v for c in curves if i < len(c) and (v := finite(c[i])) is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def _path(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{'M' if k == 0 else 'L'}{x:.1f},{y:.1f}" for k, (x, y) in enumerate(points))


def render(rec: dict[str, Any]) -> str:
    curves = {m: [c for c in rec.get("curves", {}).get(m, []) if c] for m in COLORS}
    values = [v for cs in curves.values() for c in cs for x in c if (v := finite(x)) is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    n = max((len(c) for cs in curves.values() for c in cs), default=1)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def xy(i: int, v: float) -> tuple[float, float]:
        return LEFT + pw * i / max(1, n - 1), TOP + ph * (1 - (v - lo) / (hi - lo))

    s = rec.get("summary") or {}
    pred, meas = finite(s.get("predicted_speedup")), finite(s.get("measured_speedup"))
    modes = rec.get("modes") or {}
    finals = {m: (modes.get(m) or {}).get("final_reward") or {} for m in COLORS}
    bound = rec.get("config", {}).get("experiment", {}).get("algorithm", {}).get(
        "max_staleness", "?")
    out = [*head(W, H, font_size=12),
           f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">'
           f'{escape(str(rec.get("experiment", "?")).rsplit("/", 1)[-1])}: synchronous vs asynchronous '
           f'(max_staleness {escape(str(bound))})</text>',
           f'<text x="{LEFT}" y="38">speed-up: predicted '
           f'{"n/a" if pred is None else f"{pred:.2f}x"}, measured '
           f'{"n/a" if meas is None else f"{meas:.2f}x"}</text>',
           '<text x="{}" y="56">final reward (mean of the last {} steps, over {} seeds): '.format(
               LEFT, escape(str(rec.get("config", {}).get("final_window", "?"))),
               escape(str(rec.get("config", {}).get("seeds", "?"))))
           + "; ".join(f"{m} {_fmt(finals[m].get('mean'))} ± {_fmt(finals[m].get('stdev'))}"
                       for m in COLORS) + '</text>']
    for k in range(5):                      # y grid
        v = lo + (hi - lo) * k / 4
        _, y = xy(0, v)
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="#e4e4e4"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                   f'text-anchor="end">{v:.2f}</text>')
    for i in range(0, n, max(1, n // 10)):  # x ticks
        x, _ = xy(i, lo)
        out.append(f'<text x="{x:.1f}" y="{TOP + ph + 16}" text-anchor="middle">{i}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 12}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{TOP + ph / 2}" transform="rotate(-90 14 {TOP + ph / 2})" '
               f'text-anchor="middle">reward mean</text>')
    for ly, (m, color) in enumerate(COLORS.items()):
        for c in curves[m]:
            pts = [xy(i, f) for i, v in enumerate(c) if (f := finite(v)) is not None]
            out.append(f'<path d="{_path(pts)}" fill="none" stroke="{color}" '
                       f'stroke-opacity="0.35" stroke-width="1"/>')
        mean = _mean_curve(curves[m])
        pts = [xy(i, v) for i, v in enumerate(mean) if v is not None]
        out.append(f'<path d="{_path(pts)}" fill="none" stroke="{color}" stroke-width="3"/>')
        out.append(f'<rect x="{LEFT + 10}" y="{TOP + 8 + 18 * ly}" width="14" height="4" '
                   f'fill="{color}"/><text x="{LEFT + 30}" y="{TOP + 14 + 18 * ly}">{m} '
                   f'(thick: mean of seeds, thin: each seed)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _fmt(v) -> str:
    v = finite(v)
    return "n/a" if v is None else f"{v:.3f}"
