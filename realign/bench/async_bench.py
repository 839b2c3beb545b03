"""``realign bench async EXPERIMENT.yaml``: the best synchronous and the best
asynchronous plan of one experiment (``algorithm.max_staleness`` >= 1), run on this
machine for the same steps, against the planner's estimates.

1. Pricing: ``--profile FILE``, ``--analytic``, or a fresh ``realign profile`` (as
   ``realign bench plans``). Both modes are searched (:func:`realign.run.planning.
   both_modes`), and the synchronous plan again on one device of the cluster: the
   data-parallel scaling the asynchronous plan competes with.
2. Each round is one seed (``run.seed``): every plan runs ``--steps`` steps with it.
   Step times leave out the first ``--warmup`` steps and the last step (an
   asynchronous run's last step generates nothing ahead), so both modes are timed in
   their steady state, which is what the planner estimates.
3. The record: per plan the estimate and the median step time over every kept step of
   every round, with the spread of the per-round medians; the predicted speed-up
   (synchronous estimate / asynchronous estimate) against the measured one; and per
   seed the reward curve of each mode, with the final reward (the mean over the last
   ``--final-window`` steps). ``--svg`` draws the curves (:mod:`realign.bench.async_svg`).
4. ``async_step``: the asynchronous runs' steps taken apart from their timelines
   (:mod:`realign.bench.async_gap`): what keeps the measured speed-up from the predicted.
5. ``lengths``: the response lengths the plans assumed against those the runs
   generated (:mod:`realign.bench.lengths_check`).
6. ``--streaming K[,K...]``: the experiment also runs with ``rollout.mode: streaming``
   and ``algorithm.max_staleness: K`` for each K, each on its own plan (planned as
   ``realign plan`` plans a streaming experiment), in the same rounds, after the other
   plans of each seed. Per K: the estimate, the measured step time, the predicted and
   measured speed-up over the synchronous plan (``summary["streaming"]``), the trained
   samples' staleness and the groups dropped as too stale (``modes[...]["stream"]``),
   and the reward curve.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from realign.bench.lengths_check import compare as compare_lengths
from realign.bench.plans import emit, run_plan, spread
from realign.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", type=Path, help="experiment YAML (algorithm.max_staleness >= 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run (default: the experiment's run.steps)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the times "
                   "(default 2)")
    p.add_argument("--seeds", type=int, default=3, help="rounds, one seed each (default 3)")
    p.add_argument("--final-window", type=int, default=5,
                   help="steps averaged for the final reward (default 5)")
    p.add_argument("--profile", type=Path, default=None,
                   help="profile table to price with (default: run realign profile first)")
    p.add_argument("--analytic", action="store_true",
                   help="price with the analytic device preset only, no profile")
    p.add_argument("--no-dp-scaling", action="store_true",
                   help="skip the synchronous plan on one device")
    p.add_argument("--streaming", type=_bounds, default=(), metavar="K[,K...]",
                   help="also run rollout.mode: streaming with algorithm.max_staleness K, "
                   "for each K (e.g. 1,2,4), each on its own streaming plan")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--svg", type=Path, default=None, help="write the learning curves here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def _bounds(text: str) -> tuple[int, ...]:
    """``--streaming``'s staleness bounds: comma-separated integers >= 1."""
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
        raise UserError(f"{text!r} is not a list of distinct staleness bounds >= 1 "
                        "(e.g. 1,2,4)", field="--streaming")
    return ks


#: a streaming plan's name in the record: ``streaming k=K``
def stream_name(k: int) -> str:
    return f"streaming k={k}"


# ---- statistics (pure) ---------------------------------------------------------------

def kept_times(rows: list[dict], warmup: int) -> list[float]:
    """The steady-state step times of one run: without the first ``warmup`` steps and
    the last step."""
    return [r["step_time_s"] for r in rows[warmup:-1]]


def final_reward(rows: list[dict], window: int) -> float | None:
    vals = [r["reward_mean"] for r in rows[-window:] if "reward_mean" in r]
    return statistics.fmean(vals) if vals else None


def summarize_mode(estimate_s: float, runs: list[dict], warmup: int, window: int) -> dict:
    """One plan's estimate against its runs (``{"rows": ...}`` or ``{"error": ...}``)."""
    good = [r["rows"] for r in runs if "rows" in r]
    times = [t for rows in good for t in kept_times(rows, warmup)]
    per_round = [statistics.median(kept_times(rows, warmup)) for rows in good
                 if kept_times(rows, warmup)]
    finals = [f for f in (final_reward(rows, window) for rows in good) if f is not None]
    return {
        "estimate_s": estimate_s,
        "measured_s": statistics.median(times) if times else None,
        "spread_s": spread(per_round) if per_round else None,
        "rounds_failed": len(runs) - len(good),
        "final_reward": {"per_seed": finals,
                         "mean": statistics.fmean(finals) if finals else None,
                         "stdev": statistics.stdev(finals) if len(finals) > 1 else None},
        "staleness": [statistics.fmean(r.get("actor.staleness", 0.0) for r in rows)
                      for rows in good],
    }


def stream_stats(runs: list[dict]) -> dict:
    """A streaming plan's runs, per seed (:func:`realign.report.stream.summary` of each
    run's rows): the trained groups' mean staleness and the groups dropped as too
    stale."""
    from realign.report.stream import summary
    per = [summary(r["rows"]) for r in runs if "rows" in r]
    return {"staleness_mean": [s["staleness_mean"] for s in per],
            "dropped_stale": [s["dropped_stale"] for s in per],
            "groups_trained": [s["groups_trained"] for s in per]}


def compare(sync: dict, asyn: dict, one_device: dict | None) -> dict:
    """Predicted against measured speed-up of the asynchronous plan, and the measured
    data-parallel scaling of the synchronous one (one device's step time over the
    cluster's)."""
    pred = sync["estimate_s"] / asyn["estimate_s"]
    meas = (sync["measured_s"] / asyn["measured_s"]
            if sync["measured_s"] and asyn["measured_s"] else None)
    out = {"predicted_speedup": pred, "measured_speedup": meas,
           "speedup_error": (meas / pred - 1.0) if meas is not None else None}
    if one_device is not None and one_device["measured_s"] and sync["measured_s"]:
        out["sync_dp_scaling"] = one_device["measured_s"] / sync["measured_s"]
        out["sync_dp_scaling_estimated"] = one_device["estimate_s"] / sync["estimate_s"]
    fs, fa = sync["final_reward"], asyn["final_reward"]
    if fs["mean"] is not None and fa["mean"] is not None:
        out["final_reward_gap"] = fa["mean"] - fs["mean"]
        noise = [s for s in (fs["stdev"], fa["stdev"]) if s is not None]
        out["final_reward_noise"] = max(noise) if noise else None
    return out


# ---- running -------------------------------------------------------------------------

def _seeded(seed: int, one_device: bool = False, streaming: int | None = None):
    """The config with ``run.seed`` set (and its cluster cut to one device, or its
    rollout streaming with ``algorithm.max_staleness`` ``streaming``)."""
    def transform(cfg):
        upd = {"run": cfg.run.model_copy(update={"seed": seed})}
        if one_device:
            upd["cluster"] = cfg.cluster.model_copy(update={"nodes": 1, "gpus_per_node": 1})
        if streaming is not None:
            upd["rollout"] = cfg.rollout.model_copy(update={"mode": "streaming"})
            upd["algorithm"] = cfg.algorithm.model_copy(update={"max_staleness": streaming})
        return cfg.model_copy(update=upd)
    return transform


def run(args: argparse.Namespace) -> int:
    for name in ("seeds", "final_window"):
        if getattr(args, name) < 1:
            raise UserError(f"must be >= 1, got {getattr(args, name)}",
                            field=f"--{name.replace('_', '-')}")
    if args.warmup < 0:
        raise UserError(f"must be >= 0, got {args.warmup}", field="--warmup")
    from realign.bench.plans import _profile
    from realign.run.loading import load_experiment
    from realign.run.planning import (
        allows_async,
        both_modes,
        plan_experiment,
        plan_mode,
        priced_with,
        with_host_work,
    )

    cfg = load_experiment(args.experiment)
    if cfg.device != "cpu" or cfg.launcher.type != "local":
        raise UserError("realign bench async runs on this machine: device cpu, launcher "
                        "local", field="device")
    if not allows_async(cfg):
        raise UserError(f"{cfg.algorithm.name} with max_staleness "
                        f"{cfg.algorithm.max_staleness} has no asynchronous plan; set "
                        "algorithm.max_staleness to 1 or more (an algorithm that generates)",
                        field="algorithm.max_staleness")
    steps = args.steps or cfg.run.steps
    if steps < args.warmup + 2:
        raise UserError(f"{steps} steps leave none to time after {args.warmup} warm-up "
                        "steps and the last", field="--steps")
    t0 = time.time()
    keep = Path(tempfile.mkdtemp(prefix="realign-bench-async-"))
    profile, profile_src = _profile(args, cfg, keep)
    # host work timed once for the three plans
    priced = with_host_work(priced_with(cfg, profile_src if profile is not None else None))
    sync, asyn, why = both_modes(priced)
    if sync is None or asyn is None:
        raise UserError(f"no {'synchronous' if sync is None else 'asynchronous'} plan fits: "
                        f"{why}", field="cluster")
    plans = {"synchronous": sync, "asynchronous": asyn}
    gpus = cfg.cluster.gpus_per_node * cfg.cluster.nodes
    one = None
    if not args.no_dp_scaling and gpus > 1:
        one = plan_mode(_seeded(cfg.run.seed, one_device=True)(priced), False)
        plans["synchronous, 1 device"] = one
    bounds = {stream_name(k): k for k in args.streaming}
    for name, k in bounds.items():      # realign plan of the streaming experiment
        plans[name] = plan_experiment(_seeded(cfg.run.seed, streaming=k)(priced))
    paths = {}
    for k, (name, p) in enumerate(plans.items()):
        paths[name] = keep / f"plan{k}.json"
        paths[name].write_text(p.to_json())
    runs: dict[str, list[dict]] = {name: [] for name in plans}
    print(f"bench async: {len(plans)} plans x {args.seeds} seeds x {steps} steps; profile "
          f"{profile_src}", file=sys.stderr)
    for seed in range(args.seeds):
        for name in plans:
            print(f"  seed {seed}: {name}", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="realign-bench-async-") as tmp:
                runs[name].append(run_plan(
                    args.experiment, paths[name], Path(tmp) / "run", steps,
                    transform=_seeded(seed, one_device=plans[name] is one,
                                      streaming=bounds.get(name))))
    modes = {name: summarize_mode(plans[name].iteration_time_s, runs[name], args.warmup,
                                  args.final_window) for name in plans}
    for name in bounds:
        modes[name]["stream"] = stream_stats(runs[name])
    summary = compare(modes["synchronous"], modes["asynchronous"],
                      modes.get("synchronous, 1 device"))
    if bounds:
        summary["streaming"] = {name: compare(modes["synchronous"], modes[name], None)
                                for name in bounds}
    record: dict[str, Any] = {
        "study": "async", "experiment": str(args.experiment),
        "config": {"steps": steps, "warmup": args.warmup, "seeds": args.seeds,
                   "final_window": args.final_window, "profile": profile_src,
                   "streaming": list(args.streaming),
                   "experiment": cfg.model_dump(mode="json")},
        "modes": modes,
        "summary": summary,
        "async_step": _async_step(asyn, runs, args.warmup),
        "lengths": compare_lengths(asyn.graph, [r["rows"] for rs in runs.values()
                                                for r in rs if "rows" in r]),
        "allocations": {name: {a.mfc: f"{a.mesh_name} {a.layout} x{a.micro_batches}mb"
                               for a in p.allocations} for name, p in plans.items()},
        "curves": {name: [[r.get("reward_mean") for r in run["rows"]] if "rows" in run else None
                          for run in runs[name]] for name in plans},
        "raw": {name: [[{k: v for k, v in r.items() if k.startswith(("step", "time", "reward",
                                                                        "response", "actor.",
                                                                        "stream."))}
                        for r in run.get("rows", [])] for run in runs[name]] for name in plans},
        "errors": {name: [r["error"] for r in runs[name] if "error" in r] for name in plans},
        "wall_s": time.time() - t0,
    }
    from realign.bench.async_svg import render
    emit(args, record, render, table)
    return 1 if any(record["errors"].values()) else 0


def _async_step(plan, runs: dict[str, list[dict]], warmup: int) -> dict | None:
    """:func:`realign.bench.async_gap.breakdown` of the asynchronous runs."""
    from realign.bench.async_gap import breakdown
    gen_gpus = {g for a in plan.allocations if plan.graph.is_ahead(plan.graph.mfc(a.mfc))
                for g in a.mesh.gpus}
    good = [r for r in runs["asynchronous"] if "rows" in r]
    alone = [r["rows"] for r in runs.get("synchronous, 1 device", []) if "rows" in r]
    return breakdown([r.get("timeline", []) for r in good], [r["rows"] for r in good],
                     gen_gpus, alone, warmup)


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rec: dict) -> str:
    c = rec["config"]
    out = [f"bench async {rec['experiment']}: {c['seeds']} seeds x {c['steps']} steps "
           f"(times leave out {c['warmup']} warm-up steps and the last)", ""]
    out.append(f"{'plan':24s} {'estimate s':>10s} {'measured s':>10s} {'spread':>17s} "
               f"{'final reward':>18s}")
    for name, m in rec["modes"].items():
        sp = m["spread_s"]
        fr = m["final_reward"]
        out.append(f"{name:24s} {_f(m['estimate_s'], '.4f'):>10s} "
                   f"{_f(m['measured_s'], '.4f'):>10s} "
                   f"{(_f(sp['min'], '.4f') + '..' + _f(sp['max'], '.4f')) if sp else '-':>17s} "
                   f"{_f(fr['mean'], '.3f') + ' ± ' + _f(fr['stdev'], '.3f'):>18s}")
    s = rec["summary"]
    out.append("")
    out.append(f"asynchronous speed-up: predicted {_f(s['predicted_speedup'], '.2f')}x, "
               f"measured {_f(s['measured_speedup'], '.2f')}x "
               f"(error {_f(s['speedup_error'] and 100 * s['speedup_error'], '+.1f')} %)")
    if "sync_dp_scaling" in s:
        out.append(f"synchronous plan's data-parallel scaling (1 device / cluster): measured "
                   f"{s['sync_dp_scaling']:.2f}x, estimated {s['sync_dp_scaling_estimated']:.2f}x")
    if s.get("final_reward_gap") is not None:
        out.append(f"final reward, asynchronous - synchronous: {s['final_reward_gap']:+.3f} "
                   f"(seed spread {_f(s.get('final_reward_noise'), '.3f')})")
    for name, c in s.get("streaming", {}).items():
        st = rec["modes"][name].get("stream") or {}
        stale = [v for v in st.get("staleness_mean", []) if v == v]
        out.append(f"{name} speed-up: predicted {_f(c['predicted_speedup'], '.2f')}x, "
                   f"measured {_f(c['measured_speedup'], '.2f')}x (error "
                   f"{_f(c['speedup_error'] and 100 * c['speedup_error'], '+.1f')} %); "
                   f"staleness mean {_f(statistics.fmean(stale) if stale else None, '.2f')}, "
                   f"dropped {_f(sum(st.get('dropped_stale', [])), '.0f')}; final reward - "
                   f"synchronous {_f(c.get('final_reward_gap'), '+.3f')}")
    from realign.bench import async_gap, lengths_check
    out += lengths_check.lines(rec.get("lengths"))
    out += async_gap.lines(rec.get("async_step"))
    for name, errs in rec["errors"].items():
        for e in errs:
            out.append(f"{name}: a round failed: {e}")
    return "\n".join(out)
