"""The picture of ``realign bench plans``: one self-contained SVG (no scripts, fonts or
files fetched) drawn from the result record of :mod:`realign.bench.plans`.

Left: estimated against measured time of every MFC of every plan that ran, on log-log
axes, with the line y = x and the bands where ``|est - meas| / meas`` (the record's
relative error) is at most 10 % and 25 %; each point's bar is the per-round min-max.
Right: per plan the measured iteration (step) time median as a bar, the per-round
min-max as a whisker and the estimated iteration time as a diamond; the searched plan
is drawn darker with a bold label. Plans that did not run say so. Pure: record in,
text out.
"""
from __future__ import annotations

import math
from html import escape

from planner.svg import PALETTE, finite, head, legend, seconds

BANDS = ((0.25, "#f3f3f3"), (0.10, "#e4e4e4"))     #: relative error, fill (widest first)
SEARCHED, OTHER, EST = "#c0392b", "#9db4cf", "#222"


def _pos(v: object) -> float | None:
    """``v`` as a finite positive float (what a log axis can show), else None."""
    f = finite(v)
    return f if f is not None and f > 0 else None


def _pct(v) -> str:
    v = finite(v)
    return "n/a" if v is None else f"{v:.1%}"


def _title(rec: dict) -> str:
    s = rec.get("summary") or {}
    e = s.get("mfc_relative_error") or {}
    tau = finite(s.get("kendall_tau_iteration"))
    return (f"bench plans: {rec.get('experiment', '?')} | per-MFC |est - meas| / meas: median "
            f"{_pct(e.get('median'))}, worst {_pct(e.get('worst'))} over {e.get('n', 0)} MFCs"
            f" | Kendall tau (iteration) {'n/a' if tau is None else f'{tau:.3f}'}")


def _points(rec: dict) -> list[dict]:
    """Every MFC of every plan with a positive estimate and measured median."""
    pts = []
    for p in rec.get("plans") or []:
        for m in (p.get("summary") or {}).get("mfcs") or []:
            est, med = _pos(m.get("estimated_s")), _pos((m.get("measured") or {}).get("median"))
            if est is None or med is None:
                continue
            sr = m.get("spread_of_rounds") or {}
            pts.append({"plan": str(p.get("label", "?")), "mfc": str(m.get("mfc", "?")),
                        "est": est, "med": med, "lo": _pos(sr.get("min")),
                        "hi": _pos(sr.get("max")), "err": m.get("relative_error")})
    return pts


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks within [lo, hi]; only the decades when they already give three."""
    ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)),
                                          math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if lo <= t <= hi]
    decades = [t for t in ticks if math.isclose(10 ** round(math.log10(t)), t)]
    return decades if len(decades) >= 3 else ticks


def _scatter(out: list[str], rec: dict, left: float, top: float, size: float) -> float:
    """The estimated-vs-measured panel; returns the y below it and its legend."""
    out.append(f'<text x="{left}" y="{top - 10}" font-weight="bold">Per MFC: estimated vs '
               'measured (median; bar: per-round min-max)</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{size}" height="{size}" fill="#fafafa" '
               'stroke="#ccc"/>')
    pts = _points(rec)
    if not pts:
        out.append(f'<text x="{left + 10}" y="{top + size / 2}" fill="#777">no MFC was '
                   'measured</text>')
        return top + size + 30
    vals = [v for q in pts for v in (q["est"], q["med"], q["lo"], q["hi"]) if v is not None]
    lo, hi = min(vals) / 1.3, max(vals) * 1.3
    if hi / lo < 10:                          # at least a decade around the values
        mid = math.sqrt(lo * hi)
        lo, hi = mid / math.sqrt(10), mid * math.sqrt(10)
    span = math.log10(hi / lo)

    def sx(v: float) -> float:
        return left + math.log10(v / lo) / span * size

    def sy(v: float) -> float:
        return top + size - math.log10(v / lo) / span * size

    out.append(f'<clipPath id="plot"><rect x="{left}" y="{top}" width="{size}" '
               f'height="{size}"/></clipPath>')
    label_y = top + size
    for r, fill in BANDS:                     # |x - y| / y <= r  <=>  x/(1+r) <= y <= x/(1-r)
        a, b = 1 / (1 + r), 1 / (1 - r)
        poly = " ".join(f"{sx(x):.1f},{sy(x * f):.1f}" for x, f in
                        ((lo, a), (hi, a), (hi, b), (lo, b)))
        out.append(f'<polygon points="{poly}" fill="{fill}" clip-path="url(#plot)"/>')
        label_y = min(sy(hi * a) + 4, label_y - 12)      # right of the plot, at its edge
        out.append(f'<text x="{left + size + 4}" y="{label_y:.1f}" fill="#888">'
                   f'&#177;{r:.0%}</text>')
    out.append(f'<line x1="{sx(lo):.1f}" y1="{sy(lo):.1f}" x2="{sx(hi):.1f}" y2="{sy(hi):.1f}" '
               'stroke="#777" stroke-dasharray="4,3"/>')
    for t in _log_ticks(lo, hi):
        out.append(f'<line x1="{sx(t):.1f}" y1="{top + size}" x2="{sx(t):.1f}" '
                   f'y2="{top + size + 4}" stroke="#999"/>')
        out.append(f'<text x="{sx(t):.1f}" y="{top + size + 16}" text-anchor="middle" '
                   f'fill="#555">{seconds(t)}</text>')
        out.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" '
                   f'fill="#555">{seconds(t)}</text>')
    out.append(f'<text x="{left + size / 2}" y="{top + size + 32}" text-anchor="middle">'
               'estimated</text>')
    out.append(f'<text x="{left - 54}" y="{top + size / 2}" text-anchor="middle" '
               f'transform="rotate(-90 {left - 54} {top + size / 2})">measured</text>')
    names = list(dict.fromkeys(q["mfc"] for q in pts))
    colors = {n: PALETTE[k % len(PALETTE)] for k, n in enumerate(names)}
    for q in pts:
        x, c = sx(q["est"]), colors[q["mfc"]]
        if q["lo"] is not None and q["hi"] is not None:
            out.append(f'<line x1="{x:.1f}" y1="{sy(q["lo"]):.1f}" x2="{x:.1f}" '
                       f'y2="{sy(q["hi"]):.1f}" stroke="{c}" stroke-width="1.5"/>')
    for q in pts:
        out.append(f'<circle cx="{sx(q["est"]):.1f}" cy="{sy(q["med"]):.1f}" r="4" '
                   f'fill="{colors[q["mfc"]]}" fill-opacity="0.85" stroke="white">'
                   f'<title>{escape(q["plan"])} / {escape(q["mfc"])}: est {seconds(q["est"])}, '
                   f'measured {seconds(q["med"])} (rounds {seconds(q["lo"])}-'
                   f'{seconds(q["hi"])}), error {_pct(q["err"])}</title></circle>')
    return legend(out, [(n, colors[n]) for n in names], left, top + size + 52, left + size)


def _bars(out: list[str], rec: dict, left: float, top: float, width: float) -> float:
    """The per-plan iteration panel; returns the y below it."""
    plans = rec.get("plans") or []
    fastest = (rec.get("summary") or {}).get("fastest_measured")
    labels = [str(p.get("label", "?")) for p in plans]
    lw = min(10 + 6.5 * max((len(t) for t in labels), default=4), width / 2)
    x0, w, row = left + lw, width - lw - 200, 26
    out.append(f'<text x="{left}" y="{top - 10}" font-weight="bold">Per plan: iteration time '
               '(bar: measured median; whisker: per-round min-max; diamond: estimated)</text>')
    rows = []
    for p in plans:
        s = p.get("summary") or {}
        sr = s.get("step_spread_of_rounds") or {}
        rows.append((finite((s.get("measured_step") or {}).get("median")),
                     finite(sr.get("min")), finite(sr.get("max")),
                     finite(s.get("estimated_iteration_s"))))
    scaled = [r for r in rows if r[0] is not None] or rows      # plans that ran set the scale
    vmax = max([v for r in scaled for v in r if v is not None and v > 0] or [1.0]) * 1.05
    # 1-2-5 ticks at least ~55 px apart (a narrow panel beside long labels gets fewer)
    n = max(1, min(6, int(w // 55)))
    base = 10.0 ** math.floor(math.log10(vmax / n))
    step = min(m * base for m in (1, 2, 5, 10) if m * base >= vmax / n)

    def sx(v: float) -> float:
        return x0 + max(v, 0.0) / vmax * w

    for k, (p, label, (med, rlo, rhi, est)) in enumerate(zip(plans, labels, rows)):
        y = top + k * row
        searched = p.get("origin") == "searched"
        weight = ' font-weight="bold"' if searched else ""
        out.append(f'<text x="{x0 - 8:.1f}" y="{y + 15}" text-anchor="end"{weight}>'
                   f'{escape(label)}</text>')
        tip = escape("; ".join(f"{m}: {a}" for m, a in (p.get("allocations") or {}).items()))
        if med is None:
            errs = escape("; ".join(str(e) for e in (p.get("summary") or {}).get("errors") or []))
            out.append(f'<text x="{x0 + w + 10:.1f}" y="{y + 15}" fill="#c0392b" '
                       f'font-style="italic">did not run<title>estimated {seconds(est)}; {errs}'
                       '</title></text>')
            est = est if est is not None and est <= vmax else None   # no marker off the scale
        else:
            out.append(f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(sx(med) - x0, 1):.1f}" '
                       f'height="{row - 8}" fill="{SEARCHED if searched else OTHER}">'
                       f'<title>{escape(label)} ({escape(str(p.get("origin", "?")))}): {tip}'
                       f'</title></rect>')
            if rlo is not None and rhi is not None:
                ym = y + row / 2
                out.append(f'<path d="M{sx(rlo):.1f},{ym} H{sx(rhi):.1f} M{sx(rlo):.1f},{ym - 5} '
                           f'V{ym + 5} M{sx(rhi):.1f},{ym - 5} V{ym + 5}" stroke="#333" '
                           'fill="none"/>')
        if est is not None:
            ex, ym = sx(est), y + row / 2
            out.append(f'<polygon points="{ex:.1f},{ym - 6} {ex + 5:.1f},{ym} {ex:.1f},{ym + 6} '
                       f'{ex - 5:.1f},{ym}" fill="white" stroke="{EST}" stroke-width="1.5">'
                       f'<title>estimated {seconds(est)}</title></polygon>')
        if med is not None:
            note = f"{seconds(med)} (est {seconds(est)})" + (", fastest" if label == fastest else "")
            out.append(f'<text x="{x0 + w + 10:.1f}" y="{y + 15}" fill="#333">{note}</text>')
    ya = top + len(plans) * row + 4
    out.append(f'<line x1="{x0:.1f}" y1="{ya}" x2="{x0 + w:.1f}" y2="{ya}" stroke="#999"/>')
    for k in range(int(vmax / step) + 1):
        t = k * step
        out.append(f'<text x="{sx(t):.1f}" y="{ya + 14}" text-anchor="middle" fill="#555">'
                   f'{seconds(t)}</text>')
    within = (rec.get("summary") or {}).get("searched_is_fastest_or_within_spread")
    out.append(f'<text x="{left}" y="{ya + 34}">fastest measured: {escape(str(fastest))}; '
               f'searched plan fastest or within its spread: {escape(str(within))}</text>')
    return ya + 50


def render(record: dict) -> str:
    """The SVG text of a ``realign bench plans`` record (see :mod:`realign.bench.plans`)."""
    size, left, gap, bars_w = 420, 80, 90, 640
    body: list[str] = []
    y1 = _scatter(body, record, left, 80, size)
    y2 = _bars(body, record, left + size + gap, 80, bars_w)
    width, height = left + size + gap + bars_w + 20, max(y1, y2) + 10
    top = [*head(width, height),
           f'<text x="10" y="22" font-size="14" font-weight="bold">{escape(_title(record))}'
           '</text>',
           '<text x="10" y="40" fill="#555">dashed: estimated = measured; shaded: within '
           '&#177;10 % and &#177;25 % of the measured time</text>']
    return "\n".join(top + body + ["</svg>"])
