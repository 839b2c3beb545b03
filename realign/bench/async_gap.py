"""Where an asynchronous step's time goes, from the runs' timelines: what keeps the
measured speed-up below the one the planner's structure promises.

The planner prices an asynchronous step as the weights' reallocation and the rollout's
sends, then the slower of the two sides' *expected* times. A run differs from that in
three measurable ways, each reported by :func:`breakdown`:

* the **prefix**: the ops both sides wait for at the step's start (the reallocation of
  the weights to the generating mesh, the sends of the rollout made ahead);
* the **slower side per step**: a step lasts the slower side *of that step*; when both
  sides' times vary (generation lengths with a long tail: the generating side follows
  the next batch's longest response, the training side this batch's), the mean of the
  per-step maximum exceeds the maximum of the means;
* **running beside the other side**: each call's time in the asynchronous run against
  the same call in the synchronous run on one device, where no other call runs at the
  same time (on a CPU cluster of one machine the two "devices" share its cores).

Pure functions over ``timeline.jsonl`` records (``{"step", "events": [[label, kind,
start, end, gpus], ...]}``) and metrics rows.
"""
from __future__ import annotations

import statistics
from typing import Any


def step_sides(events: list[list], gen_gpus: set[int]) -> dict[str, float] | None:
    """One step's timeline split by side: ``prefix_s`` (from the step's first op to the
    first op of either side: the ops that span both), ``gen_s`` and ``train_s`` (each
    side from its first op's start to its last op's end), ``span_s`` (first start to last
    end). None when the step has no op on one of the sides (a first or last step)."""
    if not events:
        return None
    t0 = min(e[2] for e in events)
    gen = [e for e in events if set(e[4]) <= gen_gpus]
    train = [e for e in events if not set(e[4]) & gen_gpus]
    if not gen or not train:
        return None
    g0, t_0 = min(e[2] for e in gen), min(e[2] for e in train)
    return {"prefix_s": min(g0, t_0) - t0,
            "gen_s": max(e[3] for e in gen) - g0,
            "train_s": max(e[3] for e in train) - t_0,
            "span_s": max(e[3] for e in events) - t0}


def call_times(rows: list[dict]) -> dict[str, float]:
    """Median ``time.<mfc>`` of each call over ``rows`` (reallocations left out)."""
    keys = sorted({k for r in rows for k in r
                   if k.startswith("time.") and not k.startswith("time.realloc.")})
    return {k[len("time."):]: statistics.median(r[k] for r in rows if k in r) for k in keys}


def breakdown(timelines: list[list[dict]], rows: list[list[dict]], gen_gpus: set[int],
              alone_rows: list[list[dict]] | None, warmup: int) -> dict | None:
    """The asynchronous runs' steps (each run's ``timelines`` and metrics ``rows``,
    without the first ``warmup`` steps and the last, as the step times) taken apart;
    ``alone_rows``: the synchronous one-device runs' rows, for each call's time alone.
    Means over every kept step of every run (the step time is a mean too: the
    slower-side effect is about means)."""
    sides, between = [], []
    for tl, rs in zip(timelines, rows):
        wall = {r["step"]: r["step_time_s"] for r in rs}
        kept = {r["step"] for r in rs[warmup:-1]}
        for t in tl:
            s = step_sides(t["events"], gen_gpus) if t["step"] in kept else None
            if s is not None and t["step"] in wall:
                sides.append(s)
                between.append(max(0.0, wall[t["step"]] - s["span_s"]))
    if not sides:
        return None

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in sides)

    slower = statistics.fmean(max(s["gen_s"], s["train_s"]) for s in sides)
    out: dict[str, Any] = {"steps": len(sides),
           "prefix_s": mean("prefix_s"), "gen_s": mean("gen_s"), "train_s": mean("train_s"),
           "slower_side_s": slower,
           "slower_side_excess_s": slower - max(mean("gen_s"), mean("train_s")),
           "between_steps_s": statistics.fmean(between),
           "step_s": statistics.fmean(s["span_s"] for s in sides) + statistics.fmean(between)}
    if alone_rows:
        beside = call_times([r for rs in rows for r in rs[warmup:-1]])
        alone = call_times([r for rs in alone_rows for r in rs[warmup:-1]])
        out["calls"] = {name: {"beside_s": beside[name], "alone_s": alone[name],
                               "slowdown": beside[name] / alone[name] - 1.0}
                        for name in beside if alone.get(name)}
    return out


def lines(b: dict | None) -> list[str]:
    """The breakdown as the table's lines."""
    if b is None:
        return []
    ms = 1e3
    out = [f"asynchronous step, mean of {b['steps']} steps: {b['step_s'] * ms:.1f} ms = "
           f"prefix {b['prefix_s'] * ms:.1f} (weights, rollout sends) + slower side "
           f"{b['slower_side_s'] * ms:.1f} + between steps {b['between_steps_s'] * ms:.1f}",
           f"  generation side {b['gen_s'] * ms:.1f} ms, training side {b['train_s'] * ms:.1f}"
           f" ms: the slower side per step exceeds the slower mean by "
           f"{b['slower_side_excess_s'] * ms:.1f} ms"]
    for name, c in b.get("calls", {}).items():
        out.append(f"  {name}: {c['beside_s'] * ms:.1f} ms beside the other side, "
                   f"{c['alone_s'] * ms:.1f} ms alone ({100 * c['slowdown']:+.0f} %)")
    return out
