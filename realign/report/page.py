"""The run report: one self-contained HTML page built from a run folder (its
``plan.json``, ``metrics.jsonl`` and ``timeline.jsonl``). Every picture is inline SVG;
nothing is fetched, so the page opens offline.

Sections: the learning curves (reward, held-out evaluation, KL, losses, a mixture of
experts' router loss and expert load); a streamed run's buffer, staleness and
idle time (:mod:`realign.report.stream`); each MFC's
measured time per call against the plan's estimate; a measured timeline of one step
(from the workers' recorded start and end times) beside the planned timeline; and the
bytes and throughput of each reallocation.
"""
from __future__ import annotations

import json
import statistics
from html import escape
from pathlib import Path

from planner.plan import ExecutionPlan
from planner.svg import head, seconds
from planner.timeline_svg import Bar, draw_lanes, gpu_groups, render
from realign.errors import UserError
from realign.report.charts import bar_chart, line_chart
from realign.report.stream import stream_section

STYLE = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
figure{display:inline-block;margin:8px;vertical-align:top}figcaption{color:#555;font-size:12px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;
padding:3px 8px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}"""


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue                        # a line a kill cut off
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append(row)
    return out


def _series(rows: list[dict], keys: list[str]) -> dict[str, list[tuple[float, float]]]:
    return {k: [(r["step"], float(r[k])) for r in rows if isinstance(r.get(k), (int, float))]
            for k in keys}


def _figure(fid: str, svg: str, caption: str) -> str:
    return f'<figure id="{fid}">{svg}<figcaption>{escape(caption)}</figcaption></figure>'


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def learning_curves(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r})
    groups = [
        ("reward", "Reward per step", [k for k in ("reward_mean", "greedy_reward_mean") if k in keys]),
        ("eval", "Held-out evaluation", [k for k in keys if k.startswith("eval.")
                                          and "rollout." not in k
                                          and ("accuracy" in k or "pass@" in k or "reward" in k)]),
        # multi-turn rollouts (rollout.env / rollout.tools: docs/tools.md)
        ("turns", "Multi-turn episodes", [k for k in (
            "rollout.turns", "rollout.tool_call_rate", "rollout.masked_share",
            "eval.greedy_rollout.tool_call_rate") if k in keys]),
        ("tools", "Tool calls and errors per step", [k for k in (
            "rollout.tool_calls", "rollout.tool_errors", "rollout.env_errors") if k in keys]),
        ("env", "Environment seconds per step", [k for k in (
            "rollout.env_s", "rollout.env_wait_s") if k in keys]),
        ("turn-rewards", "Per-turn rewards", [k for k in keys if k.startswith("rollout.turn")
                                              and k.endswith("_reward")]),
        ("kl", "KL to the reference", [k for k in keys if k == "kl" or k.endswith(".kl")]),
        # a mixture of experts' router (docs/models.md)
        ("router", "Router load-balancing loss", [k for k in keys
                                                  if k.endswith("router_aux_loss")]),
        ("expert-load", "Expert load: busiest expert / mean, per layer", [
            k for k in keys if "expert_load_max_over_mean" in k]),
        ("loss", "Losses", [k for k in keys if k.endswith(".loss") and not k.startswith("eval.")]
         or [k for k in keys if k == "loss"]),
    ]
    figs = []
    for fid, title, ks in groups:
        if ks:
            figs.append(_figure(f"curve-{fid}", line_chart(title, _series(rows, ks)),
                                f"{title}: {', '.join(ks)} by step"))
    return figs


def mfc_times(plan: ExecutionPlan, rows: list[dict]) -> tuple[str, str]:
    """(figure, table): each MFC's median measured time per call against its estimate."""
    names, est, meas, lines = [], [], [], []
    for a in plan.allocations:
        got = [r[f"time.{a.mfc}"] for r in rows if f"time.{a.mfc}" in r]
        m = _median(got)
        names.append(a.mfc)
        est.append(a.time_s)
        meas.append(m)
        ratio = m / a.time_s if got and a.time_s else float("nan")
        lines.append(f"<tr><td>{escape(a.mfc)}</td><td>{escape(a.mesh_name)} {a.layout} "
                     f"x{a.micro_batches}</td><td>{a.time_s:.4f}</td><td>{m:.4f}</td>"
                     f"<td>{ratio:.2f}</td><td>{len(got)}</td></tr>")
    fig = _figure("mfc-times", bar_chart("Time per call: estimated and measured", names,
                                         {"estimated": est, "measured median": meas}, "s"),
                  "per MFC: the plan's estimate and the median measured time of one call")
    table = (f"<p>{escape(priced_with(plan))}</p>"
             "<table><tr><th>MFC</th><th>allocation</th><th>estimated s</th>"
             "<th>measured median s</th><th>measured/estimated</th><th>calls</th></tr>"
             + "".join(lines) + "</table>")
    return fig, table


def priced_with(plan: ExecutionPlan) -> str:
    """What the estimates were priced with: a measured profile, or the device preset
    (its numbers a rough rule for the machines the preset names)."""
    if plan.profile is not None:
        return (f"Estimates priced with the profile {plan.profile.path or '(unnamed)'}, "
                f"measured on {plan.profile.host or 'its machine'} on {plan.profile.date}.")
    return (f"Estimates priced with the {plan.cluster.device.name} device preset, not a "
            "measurement of this machine: `realign profile` measures it, and plan.profile "
            "(or realign plan --profile) prices with that table.")


def measured_timeline(plan: ExecutionPlan, steps: list[dict]) -> str | None:
    """The last recorded step's ops, drawn like the planned timeline."""
    if not steps:
        return None
    step = steps[-1]
    events = step["events"]
    t0 = min(e[2] for e in events)
    bars = [Bar(label, kind, start - t0, end - t0, tuple(gpus))
            for label, kind, start, end, gpus in events]
    end = max(b.end_s for b in bars) or 1.0
    groups = gpu_groups(plan.cluster.n_gpus,
                        [(a.mesh.first_gpu, a.mesh.n_gpus) for a in plan.allocations])
    left, top, width = 150, 50, 900
    out = [*head(left + width + 40, top + len(groups) * 42 + 60),
           f'<text x="10" y="20" font-size="15" font-weight="bold">Measured: step '
           f'{step["step"]}, {seconds(end, end)}</text>',
           '<text x="10" y="38" fill="#555">each op from the start to the end its first '
           'rank recorded</text>']
    draw_lanes(out, groups, bars, end, left, top, width)
    out.append("</svg>")
    return "\n".join(out)


def reallocations(plan: ExecutionPlan, rows: list[dict]) -> tuple[str | None, str]:
    """(figure or None, table): bytes and throughput of each reallocation."""
    if not plan.reallocations:
        return None, "<p>This plan reallocates no parameters.</p>"
    names, rates, lines = [], [], []
    for r in plan.reallocations:
        moved = [row[f"realloc_bytes.{r.to_mfc}"] for row in rows
                 if f"realloc_bytes.{r.to_mfc}" in row]
        took = [row[f"time.realloc.{r.to_mfc}"] for row in rows
                if f"time.realloc.{r.to_mfc}" in row]
        b, t = _median(moved), _median(took)
        rate = b / t / 1e9 if moved and took and t > 0 else float("nan")
        names.append(f"{r.role} -> {r.to_mfc}")
        rates.append(rate)
        lines.append(f"<tr><td>{escape(r.role)} -&gt; {escape(r.to_mfc)}</td>"
                     f"<td>{r.src_layout} -&gt; {r.dst_layout}</td><td>{r.bytes}</td>"
                     f"<td>{b:.0f}</td><td>{r.time_s:.5f}</td><td>{t:.5f}</td>"
                     f"<td>{rate:.3f}</td></tr>")
    fig = _figure("realloc", bar_chart("Reallocation throughput", names,
                                       {"measured": rates}, "GB/s"),
                  "bytes received over the time of each reallocation (median over steps)")
    table = ("<table><tr><th>reallocation</th><th>layouts</th><th>planned bytes (plan dtype)"
             "</th><th>moved bytes</th><th>estimated s</th><th>measured s</th>"
             "<th>GB/s</th></tr>" + "".join(lines) + "</table>")
    return fig, table


def build_report(run_dir: Path) -> str:
    """The report page of ``run_dir`` as HTML text."""
    run_dir = Path(run_dir)
    if not (run_dir / "plan.json").is_file():
        raise UserError(f"{run_dir} holds no plan.json: not a run folder", field="RUN_DIR")
    plan = ExecutionPlan.load(run_dir / "plan.json")
    rows = _jsonl(run_dir / "metrics.jsonl")
    steps = [s for s in _jsonl(run_dir / "timeline.jsonl") if s.get("events")]
    step_s = _median([r["step_time_s"] for r in rows[1:] or rows if "step_time_s" in r])
    last_eval = next((r for r in reversed(rows) if "eval.greedy_accuracy" in r), None)
    summary = [f"{len(rows)} steps recorded on {escape(plan.cluster.describe())}",
               f"estimated step {plan.iteration_time_s:.4f} s, measured median {step_s:.4f} s"]
    if last_eval:
        summary.append(f"held-out greedy accuracy {last_eval['eval.greedy_accuracy']:.3f} "
                       f"after step {last_eval['step']}")
    times_fig, times_table = mfc_times(plan, rows)
    measured = measured_timeline(plan, steps)
    realloc_fig, realloc_table = reallocations(plan, rows)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>"
             f"{escape(plan.name)}: run report</title><style>{STYLE}</style></head><body>",
             f"<h1>{escape(plan.name)}</h1><p>{'; '.join(summary)}.</p>",
             "<h2>Learning</h2>", *learning_curves(rows), *stream_section(rows),
             "<h2>Time per call</h2>", times_fig, times_table,
             "<h2>One step: measured and planned</h2>"]
    if measured:
        parts.append(_figure("timeline-measured", measured,
                             "measured: the workers' recorded start and end of every op"))
    parts.append(_figure("timeline-planned", render(plan),
                         "planned: the simulator's timeline of the plan"))
    parts += ["<h2>Reallocations</h2>", realloc_fig or "", realloc_table, "</body></html>"]
    return "\n".join(parts)
