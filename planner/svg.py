"""What every SVG drawing of realign shares: the document's head, the palette, the
reading of a record's numbers, time labels and a legend of colour keys.

Pure text helpers, no I/O. The drawings compose them: the plan's timeline
(:mod:`planner.timeline_svg`), the run report's charts (:mod:`realign.report.charts`,
:mod:`realign.report.page`) and the benchmarks' pictures
(:mod:`realign.bench.plans_svg`, :mod:`realign.bench.async_svg`). It sits on the
planner's lowest floor, so the planner and realign alike may import it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from html import escape

#: colours of series told apart only by their order (the k-th series takes the k-th)
PALETTE = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948",
           "#9c755f", "#ff9da7", "#bab0ac")
KEY_ROW_PX = 16           #: height of one row of legend keys


def head(width_px: float, height_px: float, font_size: int = 11) -> list[str]:
    """The opening ``<svg>`` tag of a self-contained picture (no scripts, fonts or files
    fetched, so it renders offline) and its white background; close with ``</svg>``."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px:.0f}" '
            f'height="{height_px:.0f}" font-family="sans-serif" font-size="{font_size}">',
            '<rect width="100%" height="100%" fill="white"/>']


def finite(v: object) -> float | None:
    """``v`` as a finite float, else None (missing, None, NaN, inf, a bool, non-numeric):
    how a drawing reads a number from a JSON record."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def seconds(t: float | None, span_s: float | None = None) -> str:
    """A time label. With ``span_s`` (the length of the axis or timeline it sits on),
    at that span's scale so that the labels along it read alike: ``12ms`` when the span
    is under 2 s, else ``1.5s``. Without, three digits at ``t``'s own scale: ``n/a``,
    ``0``, ``350us``, ``12.5ms``, ``1.5s``, ``1234s``."""
    if t is None:
        return "n/a"
    if span_s is not None:
        return f"{t * 1e3:.0f}ms" if span_s < 2.0 else f"{t:.1f}s"
    if t == 0:
        return "0"
    if abs(t) < 1e-3:
        return f"{t * 1e6:.3g}us"
    if abs(t) < 1.0:
        return f"{t * 1e3:.3g}ms"
    return f"{t:.3g}s" if abs(t) < 1000 else f"{t:.0f}s"


def _key_places(texts: list[str], x: float, y: float, right: float
                ) -> Iterator[tuple[float, float]]:
    """Where each legend key starts (its text's baseline): left to right from ``x``, on
    a further row once a key would pass ``right``; a key is about 7 px per character."""
    lx, ly = x, y
    for text in texts:
        w = 30 + 7 * len(text)
        if lx > x and lx + w > right:
            lx, ly = x, ly + KEY_ROW_PX
        yield lx, ly
        lx += w


def legend_rows(texts: list[str], x: float, right: float) -> int:
    """How many rows :func:`legend` takes for ``texts`` between ``x`` and ``right``."""
    return len({ly for _, ly in _key_places(texts, x, 0, right)}) or 1


def legend(out: list[str], keys: list[tuple[str, str]], x: float, y: float,
           right: float) -> float:
    """Append a colour key and its text for each (text, colour) of ``keys`` to ``out``,
    the first row's baseline at ``y``, wrapped at ``right``; returns the y below them."""
    ly = y
    for (text, color), (lx, ly) in zip(keys, _key_places([t for t, _ in keys], x, y, right)):
        out.append(f'<rect x="{lx:g}" y="{ly - 9:g}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{lx + 14:g}" y="{ly:g}">{escape(text)}</text>')
    return ly + KEY_ROW_PX
