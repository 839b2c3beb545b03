"""The response lengths a plan assumed against those its runs generated.

The planner prices generation from a length distribution (``algorithm.gen_len_mean`` as
a censored geometric, or ``plan.lengths_from``'s recorded histogram); a wave
lasts as long as its longest response, so what matters most is how many responses run
to the cap. A run records every sampled response's length (``response_len_hist``,
:func:`realign.worker.calls.length_histogram`); :func:`compare` sets the two side by
side, so a bench says when its estimates rest on lengths the runs did not have.

Pure functions over a plan's graph and metrics rows.
"""
from __future__ import annotations

from planner.graph.dataflow import DataflowGraph


def planned(graph: DataflowGraph) -> dict | None:
    """The rollout generation's assumed lengths: ``cap`` (gen_len), ``mean`` and
    ``at_cap`` (the share of responses at the cap); every response at the cap when the
    graph gives no distribution. None when the graph samples no rollout."""
    gen = next((m for m in graph.mfcs if m.kind == "generate" and not m.is_eval
                and not m.greedy), None)
    if gen is None:
        return None
    if gen.lengths is None:
        return {"cap": gen.gen_len, "mean": float(gen.gen_len), "at_cap": 1.0}
    pmf = gen.lengths.pmf()
    return {"cap": gen.gen_len, "mean": gen.lengths.expected(), "at_cap": pmf[-1]}


def measured(runs: list[list[dict]], cap: int) -> dict | None:
    """The lengths the runs' rows recorded (``response_len_hist``, pooled over every
    step of every run): ``responses``, ``mean`` and ``at_cap`` (the share at ``cap`` or
    beyond). None when no row recorded them."""
    total = weighted = top = 0
    for rows in runs:
        for r in rows:
            for length, count in r.get("response_len_hist") or []:
                total += count
                weighted += length * count
                top += count if length >= cap else 0
    if not total:
        return None
    return {"responses": total, "mean": weighted / total, "at_cap": top / total}


def compare(graph: DataflowGraph, runs: list[list[dict]]) -> dict | None:
    """``{"cap", "planned": planned(graph), "measured": measured(runs)}``, or None when
    either side is missing."""
    plan = planned(graph)
    if plan is None:
        return None
    got = measured(runs, plan["cap"])
    if got is None:
        return None
    return {"cap": plan["cap"], "planned": plan, "measured": got}


def lines(c: dict | None) -> list[str]:
    """The comparison as a line of a bench's table (none without one)."""
    if not c:
        return []
    p, m = c["planned"], c["measured"]
    return [f"response lengths: planned mean {p['mean']:.1f} tokens, {100 * p['at_cap']:.1f} % "
            f"at the cap of {c['cap']}; measured mean {m['mean']:.1f}, "
            f"{100 * m['at_cap']:.1f} % at the cap ({m['responses']} responses; "
            "plan.lengths_from a run prices its recorded lengths)"]
