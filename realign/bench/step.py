"""``realign bench step EXPERIMENT.yaml``: one RL step, measured, beside a peer.

1. **realign**: trains the experiment for ``--steps`` steps into a temporary run
   folder (the same ``prepare`` + :class:`~realign.controller.controller.Controller`
   as ``realign run``), then reads ``metrics.jsonl`` and ``plan.json``. Per MFC it
   reports the measured mean time next to the plan's estimate; tokens/s is generated
   tokens per second of step wall time, samples/s is sequences per second. The first
   ``--warmup`` steps are left out of every mean (their raw numbers are kept).
2. **TRL**: ``GRPOTrainer`` (a peer to compare with, never a dependency of realign)
   runs in its own virtual environment ``.venv-bench`` (``make bench-env``) through
   :mod:`realign.bench.trl_grpo_driver`, on the same HF model folder, prompts,
   prompts per step x samples per prompt, prompt/completion lengths, sampling,
   optimiser settings, number of steps and *total* thread count (realign: workers x
   threads per worker; TRL: one process with ``torch.set_num_threads`` of the sum).

TRL runs twice by default: once with a reference model (``beta`` > 0) so it does the
same work per step as realign's graph when that graph has a reference-model MFC, and
once with the experiment's own ``kl_coef`` as ``beta`` (TRL skips the reference
forward entirely at ``beta == 0``). The headline ratio is against the same-work run.
When the two are the same run (the experiment has no reference model, or a KL
coefficient above 0), TRL runs once.

Everything measured under (configs, versions, threads, CPUs, raw per-step numbers)
goes into the JSON (``--json`` prints it, ``--out`` writes it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from realign.algorithms.params import GRPOConfig
from realign.bench.machine import (
    STEAL_LIMIT,
    clean_rounds,
    environment,
    load_snapshot,
    steal_fraction,
)
from realign.bench.trl_peer import (
    SAME_WORK_BETA,
    mean_or_none,
    run_trl,
    trl_config,
)
from realign.errors import UserError
from realign.run.spec import RunSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", type=Path, help="experiment YAML (a GRPO experiment)")
    p.add_argument("--steps", type=int, default=8, help="steps for each trainer (default 8)")
    p.add_argument("--warmup", type=int, default=1,
                   help="first steps left out of the means (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat realign + TRL this many times, alternating (default 1)")
    p.add_argument("--skip-trl", action="store_true", help="measure realign only")
    p.add_argument("--trl-variants", choices=("both", "same-work", "experiment-beta"),
                   default="both", help="which TRL runs (see the module doc)")
    p.add_argument("--bench-venv", type=Path, default=REPO_ROOT / ".venv-bench",
                   help="virtual environment with TRL (default: REPO/.venv-bench)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="keep realign's run folder here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")


# ---- realign -----------------------------------------------------------------------

def summarize_realign(rows: list[dict], plan: dict, warmup: int) -> dict:
    """Per-MFC measured vs estimated times and throughput from a run's metrics rows
    and its plan (pure; the rows are ``metrics.jsonl`` lines in step order)."""
    kept = rows[warmup:]
    n_seqs = {m["name"]: m["n_seqs"] for m in plan["graph"]["mfcs"]}
    gen_seqs = next((n for m, n in n_seqs.items() if m.endswith(".generate")), None)
    mfcs = []
    for a in plan["allocations"]:
        key = f"time.{a['mfc']}"
        measured = [r[key] for r in kept if key in r]
        mean = mean_or_none(measured)
        mfcs.append({
            "mfc": a["mfc"], "layout": a["layout"], "mesh": a["mesh_name"],
            "micro_batches": a["micro_batches"], "estimated_s": a["time_s"],
            "measured_mean_s": mean,
            "measured_over_estimated": mean / a["time_s"] if mean and a["time_s"] else None,
            "share_of_step": (mean / step_mean_s if mean and kept and (
                step_mean_s := mean_or_none([r["step_time_s"] for r in kept])) else None),
        })
    step_s = [r["step_time_s"] for r in kept]
    tokens = [r.get("gen_tokens", 0.0) for r in kept]
    in_mfcs = [sum(r.get(f"time.{a['mfc']}", 0.0) for a in plan["allocations"]) for r in kept]
    total_s = sum(step_s)
    return {
        "mfcs": mfcs,
        "estimated_iteration_s": plan["iteration_time_s"],
        "measured_step_mean_s": mean_or_none(step_s),
        "measured_step_median_s": statistics.median(step_s) if step_s else None,
        "outside_mfcs_mean_s": mean_or_none([s - m for s, m in zip(step_s, in_mfcs)]),
        "gen_tokens_per_step_mean": mean_or_none(tokens),
        "tokens_per_s": sum(tokens) / total_s if total_s > 0 else None,
        "samples_per_s": gen_seqs * len(kept) / total_s if total_s > 0 and gen_seqs else None,
        "measured_steps": len(kept),
    }


def run_realign(args: argparse.Namespace, run_dir: Path) -> tuple[dict, RunSpec]:
    from realign.controller.controller import Controller
    from realign.launch.local_launcher import LocalLauncher
    from realign.run.prepare import prepare

    t0 = time.perf_counter()
    spec = prepare(args.experiment, run_dir=str(run_dir), steps=args.steps)
    cfg = spec.config
    threads = cfg.launcher.threads_per_worker
    # progress goes to stderr so that --json leaves stdout to the JSON
    code = Controller(spec, LocalLauncher(threads_per_worker=threads), out=sys.stderr).run()
    wall_s = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"realign run failed (exit {code}); logs in {run_dir / 'logs'}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]
    plan_d = json.loads((run_dir / "plan.json").read_text())
    return {
        "workers": spec.n_workers, "threads_per_worker": threads,
        "total_threads": spec.n_workers * threads,
        "plan": {"allocations": plan_d["allocations"],
                 "iteration_time_s": plan_d["iteration_time_s"],
                 "cost_config": plan_d["cost_config"], "device": plan_d["cluster"]["device"]},
        "summary": summarize_realign(rows, plan_d, args.warmup),
        "raw_steps": rows, "wall_s_with_startup": wall_s,
    }, spec


# ---- the study ---------------------------------------------------------------------

def _pooled_tokens_per_s(steps: list[tuple[float, float]]) -> float | None:
    """(gen_tokens, step_time_s) pairs from every round -> tokens per second."""
    total_s = sum(t for _, t in steps)
    return sum(n for n, _ in steps) / total_s if total_s > 0 else None


def run(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        raise UserError(f"must be >= 0, got {args.warmup}", field="--warmup")
    if args.steps <= args.warmup:
        raise UserError(f"must be more than --warmup ({args.warmup}), got {args.steps}",
                        field="--steps")
    if args.rounds < 1:
        raise UserError(f"must be >= 1, got {args.rounds}", field="--rounds")
    python = args.bench_venv / "bin" / "python"
    if not args.skip_trl and not python.is_file():
        raise UserError(f"no TRL environment at {args.bench_venv}: run `make bench-env` "
                        "first (or pass --bench-venv, or --skip-trl to measure realign only)",
                        field="--bench-venv")
    from realign.run.loading import load_experiment
    cfg = load_experiment(args.experiment)
    if cfg.algorithm.name != "grpo" and not args.skip_trl:
        raise UserError(f"the TRL comparison is GRPO only (the experiment runs "
                        f"{cfg.algorithm.name!r}); use --skip-trl", field="algorithm.name")
    t_start = time.time()
    rounds = []
    variants: dict[str, float] = {}
    for i in range(args.rounds):
        rnd: dict = {"round": i, "load": {"before_realign": load_snapshot()}}
        with tempfile.TemporaryDirectory(prefix="realign-bench-step-") as tmp:
            run_dir = (args.run_dir / f"round{i}") if args.run_dir else Path(tmp) / "run"
            rnd["realign"], spec = run_realign(args, run_dir)
            cfg = spec.config                   # as run (--steps applied)
        if not args.skip_trl:
            threads = rnd["realign"]["total_threads"]
            has_ref = any(a["mfc"].startswith("ref.")
                          for a in rnd["realign"]["plan"]["allocations"])
            assert isinstance(spec.params, GRPOConfig), "the TRL comparison is GRPO only (above)"
            kl = spec.params.kl_coef
            variants = {"same-work": kl if kl > 0 or not has_ref else SAME_WORK_BETA,
                        "experiment-beta": kl}
            if variants["same-work"] == kl:     # one and the same TRL run: do it once
                del variants["experiment-beta"]
            if args.trl_variants != "both" and args.trl_variants in variants:
                variants = {args.trl_variants: variants[args.trl_variants]}
            rnd["trl"] = {}
            for name, beta in variants.items():
                print(f"round {i}: TRL GRPOTrainer ({name}, beta={beta}) ...",
                      file=sys.stderr, flush=True)
                rnd["load"][f"before_trl_{name}"] = load_snapshot()
                rnd["trl"][name] = run_trl(python, trl_config(spec, args.steps, threads, beta),
                                           args.warmup)
            r_tps = rnd["realign"]["summary"]["tokens_per_s"]
            rnd["tokens_per_s_ratio"] = {n: r_tps / v["summary"]["tokens_per_s"]
                                         for n, v in rnd["trl"].items()}
        rnd["load"]["end"] = load_snapshot()
        marks = list(rnd["load"].items())             # the parts, in the order they ran
        rnd["steal_fraction"] = {name.removeprefix("before_"): steal_fraction(a, b)
                                 for (name, a), (_, b) in zip(marks, marks[1:])}
        rounds.append(rnd)

    def kept_realign(r):
        return [(x.get("gen_tokens", 0.0), x["step_time_s"])
                for x in r["realign"]["raw_steps"][args.warmup:]]

    r_pairs = [p for r in rounds for p in kept_realign(r)]
    first = rounds[0]["realign"]
    summary: dict = {"realign": {
        "workers": first["workers"], "threads_per_worker": first["threads_per_worker"],
        "total_threads": first["total_threads"],
        "tokens_per_s": _pooled_tokens_per_s(r_pairs),
        "tokens_per_s_per_round": [r["realign"]["summary"]["tokens_per_s"] for r in rounds],
        "step_mean_s": mean_or_none([t for _, t in r_pairs]),
        "step_median_s": statistics.median(t for _, t in r_pairs),
        "step_min_s": min(t for _, t in r_pairs),
        "samples_per_s_per_round": [r["realign"]["summary"]["samples_per_s"] for r in rounds],
        "mfcs": [{"mfc": m["mfc"], "estimated_s": m["estimated_s"],
                  "measured_mean_s": mean_or_none([r["realign"]["summary"]["mfcs"][j]["measured_mean_s"]
                                            for r in rounds])}
                 for j, m in enumerate(first["summary"]["mfcs"])],
        "estimated_iteration_s": first["summary"]["estimated_iteration_s"],
    }, "steal_fraction_per_round": [r["steal_fraction"] for r in rounds]}
    if not args.skip_trl:
        summary["trl"] = {}
        for name in variants:
            pairs = [(x["gen_tokens"], x["step_time_s"])
                     for r in rounds for x in r["trl"][name]["steps"][args.warmup:]]
            summary["trl"][name] = {
                "beta": variants[name],
                "tokens_per_s": _pooled_tokens_per_s(pairs),
                "tokens_per_s_per_round": [r["trl"][name]["summary"]["tokens_per_s"]
                                           for r in rounds],
                "step_mean_s": mean_or_none([t for _, t in pairs]),
                "step_median_s": statistics.median(t for _, t in pairs),
                "step_min_s": min(t for _, t in pairs),
                **{k: mean_or_none([r["trl"][name]["summary"][k] for r in rounds])
                   for k in ("cpu_mean_s", "generate_mean_s", "ref_logps_mean_s", "train_mean_s")}}
        head = next(iter(variants))
        clean = clean_rounds(rounds)

        def clean_ratio(name: str) -> float | None:
            if not clean:
                return None
            mine = [p for i in clean for p in kept_realign(rounds[i])]
            theirs = [(x["gen_tokens"], x["step_time_s"])
                      for i in clean for x in rounds[i]["trl"][name]["steps"][args.warmup:]]
            ours, peer = _pooled_tokens_per_s(mine), _pooled_tokens_per_s(theirs)
            return ours / peer if ours is not None and peer else None

        summary["comparison"] = {
            "headline_variant": head,
            "headline": "tokens/s ratio pooled over the clean rounds (host steal <= "
                        f"{STEAL_LIMIT:.0%} in every part); the other ratios use every round",
            "steal_limit": STEAL_LIMIT, "clean_rounds": clean,
            "tokens_per_s_ratio_clean": {n: clean_ratio(n) for n in variants},
            "tokens_per_s_ratio": {n: summary["realign"]["tokens_per_s"] / v["tokens_per_s"]
                                   for n, v in summary["trl"].items()},
            "ratio_per_round": {n: [r["tokens_per_s_ratio"][n] for r in rounds]
                                for n in variants},
            # robust to other work on the machine: median step times, tokens per step
            "median_step_time_ratio": {n: v["step_median_s"] / summary["realign"]["step_median_s"]
                                       for n, v in summary["trl"].items()},
            "ratio_median_of_rounds": {n: statistics.median(r["tokens_per_s_ratio"][n]
                                                            for r in rounds)
                                       for n in variants},
        }
    result = {
        "study": "step",
        "experiment": str(args.experiment),
        "config": {"experiment": cfg.model_dump(mode="json"), "steps": args.steps,
                   "warmup_steps_excluded": args.warmup, "rounds": args.rounds,
                   "order": "each round: realign, then TRL same-work, then TRL experiment-beta",
                   "tokens_per_s": "generated tokens / step wall time, over the steps after "
                                   "the warm-up, pooled over rounds"},
        "environment": environment(),
        "started_unix_s": t_start,
        "summary": summary,
        "rounds": rounds,
        "wall_s": time.time() - t_start,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else _table(result))
    return 0


def _table(res: dict) -> str:
    s = res["summary"]
    r = s["realign"]
    cfg = res["config"]
    lines = [f"step: {res['experiment']}, realign {r['workers']} workers x "
             f"{r['threads_per_worker']} threads, {cfg['steps']} steps x {cfg['rounds']} "
             f"round(s) (first {cfg['warmup_steps_excluded']} step(s) of each left out)",
             f"{'MFC':16} {'est s':>8} {'meas s':>8} {'meas/est':>9}"]
    for m in r["mfcs"]:
        lines.append(f"{m['mfc']:16} {m['estimated_s']:8.4f} {m['measured_mean_s']:8.4f} "
                     f"{m['measured_mean_s'] / m['estimated_s']:8.1f}x")
    lines.append(f"realign step: est {r['estimated_iteration_s']:.4f} s, measured "
                 f"{r['step_mean_s']:.4f} s (median {r['step_median_s']:.4f}, min "
                 f"{r['step_min_s']:.4f}); {r['tokens_per_s']:.1f} tokens/s")
    for name, t in s.get("trl", {}).items():
        lines.append(f"TRL GRPOTrainer ({name}, beta={t['beta']}): step {t['step_mean_s']:.4f} s "
                     f"(median {t['step_median_s']:.4f}, min {t['step_min_s']:.4f}) "
                     f"(generate {t['generate_mean_s']:.4f}, ref {t['ref_logps_mean_s']:.4f}, "
                     f"train {t['train_mean_s']:.4f}); {t['tokens_per_s']:.1f} tokens/s; "
                     f"realign/TRL = {s['comparison']['tokens_per_s_ratio'][name]:.2f}x")
    steal = [f"{part} {v:.0%}" for rnd in s["steal_fraction_per_round"]
             for part, v in rnd.items() if v is not None]
    if steal:
        lines.append("CPU time stolen by the host, per round and part: " + ", ".join(steal))
    if "comparison" in s:
        c = s["comparison"]
        head = c["headline_variant"]
        ratio = c["tokens_per_s_ratio_clean"][head]
        if ratio is None:
            lines.append(f"no round ran with host steal <= {c['steal_limit']:.0%} (all "
                         f"rounds: realign/TRL {head} = {c['tokens_per_s_ratio'][head]:.2f}x)")
        else:
            lines.append(f"clean rounds {c['clean_rounds']} (host steal <= "
                         f"{c['steal_limit']:.0%}): realign/TRL {head} = {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m realign.bench.step ...`` (same as ``realign bench step ...``)."""
    p = argparse.ArgumentParser(prog="realign bench step", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
