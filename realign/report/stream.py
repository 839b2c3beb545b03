"""The run report's streaming section (``rollout.mode: streaming``, docs/async.md): the
``stream.*`` metrics of ``metrics.jsonl`` as charts and one summary table. A run that
did not stream records none of them and gets no section.

Charts: the staleness histogram (groups trained at each staleness, summed over the
steps), the mean and greatest staleness per step, the buffer's depth and the groups
dropped as too stale (and DAPO's dropped as constant) per step, each side's idle
iterations (the schedule's clock) and each side's seconds waiting per step (the wall
clock)."""
from __future__ import annotations

import math
from html import escape

from realign.report.charts import bar_chart, line_chart

HIST = "stream.staleness_hist."
#: (figure id, title, metric keys) of the per-step line charts
CURVES = (
    ("staleness", "Staleness of the trained groups (versions)",
     ("stream.staleness_mean", "stream.staleness_max")),
    ("buffer", "Rollout buffer: depth after the take and groups dropped (stale, or "
     "constant: DAPO)", ("stream.buffer_depth", "stream.dropped_stale",
                         "stream.dropped_constant")),
    ("idle", "Idle iterations of each side (the schedule's clock)",
     ("stream.generator_idle_iters", "stream.trainer_idle_iters",
      "stream.generator_copy_iters")),
    ("wait", "Seconds each side waited per step",
     ("stream.generator_wait_s", "stream.trainer_wait_s")),
)


def streamed(rows: list[dict]) -> bool:
    """Whether the run streamed (its rows carry ``stream.*`` metrics)."""
    return any(k.startswith("stream.") for r in rows for k in r)


def staleness_histogram(rows: list[dict]) -> dict[int, float]:
    """Groups trained at each staleness, summed over the steps, by staleness."""
    out: dict[int, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(HIST) and k[len(HIST):].isdigit() and isinstance(v, (int, float)):
                s = int(k[len(HIST):])
                out[s] = out.get(s, 0.0) + float(v)
    return dict(sorted(out.items()))


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]


def summary(rows: list[dict]) -> dict[str, float]:
    """The run's totals and means: ``groups_trained``, ``staleness_mean`` (over the
    trained groups), ``staleness_max``, ``dropped_stale`` and ``dropped_constant`` (DAPO's
    constant groups; totals), ``buffer_depth_mean``,
    ``generator_wait_s`` and ``trainer_wait_s`` (totals); nan where nothing recorded."""
    hist = staleness_histogram(rows)
    n = sum(hist.values())
    mx, depth = _values(rows, "stream.staleness_max"), _values(rows, "stream.buffer_depth")
    return {
        "groups_trained": n,
        "staleness_mean": sum(s * c for s, c in hist.items()) / n if n else float("nan"),
        "staleness_max": max(mx) if mx else float("nan"),
        "dropped_stale": sum(_values(rows, "stream.dropped_stale")),
        "dropped_constant": sum(_values(rows, "stream.dropped_constant")),
        "buffer_depth_mean": sum(depth) / len(depth) if depth else float("nan"),
        "generator_wait_s": sum(_values(rows, "stream.generator_wait_s")),
        "trainer_wait_s": sum(_values(rows, "stream.trainer_wait_s")),
    }


def stream_section(rows: list[dict]) -> list[str]:
    """HTML parts of the section (a heading, a table, figures); empty for a run that
    did not stream."""
    if not streamed(rows):
        return []
    hist = staleness_histogram(rows)
    s = summary(rows)
    cells = "".join(f"<tr><td>{escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in s.items())
    parts = ["<h2>Streaming</h2>",
             "<p>The generator streamed finished groups into the rollout buffer; each "
             "batch trained groups at most algorithm.max_staleness versions old.</p>",
             f'<table id="stream-summary"><tr><th>over the run</th><th>value</th></tr>'
             f"{cells}</table>"]
    if hist:
        svg = bar_chart("Staleness histogram (groups trained, all steps)",
                        [f"staleness {k}" for k in hist], {"trained": list(hist.values())},
                        "groups")
        parts.append(f'<figure id="stream-hist">{svg}<figcaption>groups trained at each '
                     "staleness (versions between the weights that made a group and the "
                     "trained ones), summed over the steps</figcaption></figure>")
    for fid, title, keys in CURVES:
        present = [k for k in keys if _values(rows, k)]
        if not present:
            continue
        series = {k: [(float(r["step"]), float(r[k])) for r in rows
                      if isinstance(r.get(k), (int, float))] for k in present}
        parts.append(f'<figure id="stream-{fid}">{line_chart(title, series)}<figcaption>'
                     f"{escape(title)}: {escape(', '.join(present))} by step"
                     "</figcaption></figure>")
    return parts
