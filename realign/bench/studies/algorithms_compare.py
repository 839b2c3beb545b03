"""The new algorithms' tiny runs beside GRPO's on the same task and steps: each
experiment is run as shipped (experiments/tiny-*-cpu.yaml) for a few seeds, with GRPO
at the settings each differs by (GSPO, DAPO: 4 mini-batches; online DPO: learning
rate 0.003), DAPO also at another expected share of dropped groups, and the record
keeps every step's metrics, each run's plan estimates and the machine's load, so
that benchmarks/algorithms/README.md can quote:

- the sampled reward over the first and the last five steps of each run;
- DAPO's dynamic sampling: the share of groups dropped per step, the shortfall and the
  surplus, and the generation it cost (sequences and tokens generated, the generate
  call's time) against GRPO's and against the plan's estimates.

    python -m realign.bench.studies.algorithms_compare --seeds 0 1 2 \
        --profile benchmarks/profile/cpu_2026-11-26_passes_for-plans.json \
        --out benchmarks/algorithms/tiny_2026-11-27.json

Every run uses fresh tiny assets in a temporary folder (offline), one run at a time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from realign.bench.studies.checkout import REPO

#: name -> (experiment, changes to it as {"section.key": value})
RUNS: dict[str, tuple[str, dict]] = {
    "grpo": ("tiny-grpo-cpu", {}),
    "grpo_mb4": ("tiny-grpo-cpu", {"algorithm.ppo_minibatches": 4}),
    "grpo_lr0.003": ("tiny-grpo-cpu", {"train.lr": 0.003}),
    "dapo": ("tiny-dapo-cpu", {}),
    "dapo_f0.25": ("tiny-dapo-cpu", {"algorithm.dropped_group_frac": 0.25}),
    "gspo": ("tiny-gspo-cpu", {}),
    "dr_grpo": ("tiny-dr-grpo-cpu", {}),
    "rejection_sampling": ("tiny-rejection-sampling-cpu", {}),
    "online_dpo": ("tiny-online-dpo-cpu", {}),
}
#: the per-step metrics a record keeps (those a run reports)
KEYS = ("reward_mean", "response_len", "gen_tokens", "time.actor.generate", "time.actor.train",
        "time.ref.inference", "step_time_s", "actor.loss", "actor.clip_frac",
        "actor.clip_frac_low", "actor.clip_frac_high", "actor.zero_advantage_frac",
        "actor.dropped_group_frac", "actor.shortfall_frac", "actor.surplus_groups",
        "actor.generated_per_trained", "actor.overlong_frac", "actor.kept_frac",
        "actor.best_reward_mean", "actor.reward_margin", "actor.reward_accuracy",
        "actor.tied_pair_frac", "actor.score_margin")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def first_last(values: list[float], k: int = 5) -> list[float]:
    return [mean(values[:k]), mean(values[-k:])]


def experiment(root: Path, name: str, changes: dict, seed: int) -> Path:
    cfg = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    for dotted, value in {**changes, "run.seed": seed}.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    path = root / f"{name}-{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_one(root: Path, label: str, seed: int) -> dict:
    name, changes = RUNS[label]
    exp = experiment(root, name, changes, seed)
    run_dir = root / f"run-{label}-{seed}"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(run_dir)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{label} seed {seed} failed:\n{r.stderr[-3000:]}")
    wall_s = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())
    steps = {k: [row.get(k) for row in rows] for k in KEYS if any(k in row for row in rows)}
    out = {"experiment": name, "changes": changes, "seed": seed, "wall_s": wall_s,
           "config": yaml.safe_load(exp.read_text()),
           "plan": {"n_seqs": {m["name"]: m["n_seqs"] for m in plan["graph"]["mfcs"]},
                    "time_s": {a["mfc"]: a["time_s"] for a in plan["allocations"]},
                    "iteration_time_s": plan["iteration_time_s"],
                    "layouts": {a["mfc"]: a["layout"] for a in plan["allocations"]}},
           "steps": steps, "reward_first_last5": first_last(steps["reward_mean"])}
    if "actor.reward_margin" in steps:
        out["margin_first_last5"] = first_last(steps["actor.reward_margin"])
    return out


def dapo_summary(runs: dict, profiled: dict | None = None) -> dict:
    """DAPO's dynamic sampling against the plan: per DAPO run (label) and seed, the
    share of groups dropped (the plan assumed ``algorithm.dropped_group_frac``), how
    often the planned over-generation fell short, and the generation it cost beside
    GRPO's run of the same seed at the same mini-batches (``grpo_mb4``): the generate
    call's median and fastest time (this VM switches between a fast and a slow speed,
    so the fastest is the like-for-like one) against the plan's estimates (the run's
    plan, priced with the device preset; ``profiled``: both experiments priced with a
    measured profile table)."""
    return {label: _dapo_runs(runs[label], runs["grpo_mb4"], profiled)
            for label in runs if label.startswith("dapo")}


def _dapo_runs(dapo: dict, grpo: dict, profiled: dict | None) -> dict:
    out = {}
    for seed, d in dapo.items():
        g = grpo[seed]
        dropped = d["steps"]["actor.dropped_group_frac"]
        gen_d, gen_g = d["steps"]["time.actor.generate"], g["steps"]["time.actor.generate"]
        out[seed] = {
            "planned_dropped_group_frac": d["config"]["algorithm"]["dropped_group_frac"],
            "measured_dropped_group_frac_mean": mean(dropped),
            "measured_dropped_group_frac_median": statistics.median(dropped),
            "steps": len(dropped),
            "steps_short": sum(1 for x in d["steps"]["actor.shortfall_frac"] if x > 0),
            "shortfall_frac_mean": mean(d["steps"]["actor.shortfall_frac"]),
            "surplus_groups_mean": mean(d["steps"]["actor.surplus_groups"]),
            "planned_generated_per_trained": d["plan"]["n_seqs"]["actor.generate"]
            / d["plan"]["n_seqs"]["actor.train"],
            "measured_generated_per_trained": mean(d["steps"]["actor.generated_per_trained"]),
            "gen_tokens_vs_grpo": mean(d["steps"]["gen_tokens"]) / mean(g["steps"]["gen_tokens"]),
            "generate_s_median_vs_grpo": statistics.median(gen_d) / statistics.median(gen_g),
            "generate_s_fastest_vs_grpo": min(gen_d) / min(gen_g),
            "planned_generate_s_vs_grpo": d["plan"]["time_s"]["actor.generate"]
            / g["plan"]["time_s"]["actor.generate"],
        }
        if profiled and d["changes"] == {}:        # the shipped experiment was priced
            out[seed]["profiled_generate_s_vs_grpo"] = (profiled["dapo"]["actor.generate"]
                                                        / profiled["grpo"]["actor.generate"])
    return out


def profiled_estimates(profile: Path) -> dict:
    """Each shipped experiment's per-MFC estimates priced with a measured profile table
    (``realign plan --profile``), for GRPO and DAPO: {label: {mfc: time_s}}."""
    out = {}
    for label in ("grpo", "dapo"):
        exp = REPO / "experiments" / f"{RUNS[label][0]}.yaml"
        r = subprocess.run([sys.executable, "-m", "realign.cli.main", "plan", str(exp),
                            "--profile", str(profile), "--json"], capture_output=True,
                           text=True, check=True)
        out[label] = {m["name"]: m["time_s"] for m in json.loads(r.stdout)["mfcs"]}
    return out


def compact(record: dict) -> dict:
    """The record as written: floats to 6 significant digits, each run's config once per
    label (its first seed's; the seeds differ only in ``run.seed``)."""
    def rnd(x):
        if isinstance(x, float):
            return float(f"{x:.6g}")
        if isinstance(x, dict):
            return {k: rnd(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rnd(v) for v in x]
        return x
    for runs in record["runs"].values():
        for i, seed in enumerate(runs):
            if i:
                runs[seed].pop("config", None)
    return rnd(record)


def main() -> None:
    from realign.assets.tiny import make_tiny_assets
    from realign.bench.machine import describe, load_snapshot, steal_fraction

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--profile", type=Path, default=None,
                    help="also price GRPO's and DAPO's plans with this profile table")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    before = load_snapshot()
    record: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": describe(), "load_before": before,
                    "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_assets(root / "tiny", seed=0, qwen2=False)
        shutil.copy(REPO / "experiments" / "tiny_reward.py", root / "tiny_reward.py")
        for label in args.runs:
            for seed in args.seeds:
                res = run_one(root, label, seed)
                record["runs"].setdefault(label, {})[str(seed)] = res
                r0, r1 = res["reward_first_last5"]
                print(f"{label:20s} seed {seed}: reward first5 {r0:.3f} last5 {r1:.3f} "
                      f"({res['wall_s']:.0f} s)", flush=True)
    after = load_snapshot()
    record["load_after"] = after
    record["steal_frac"] = steal_fraction(before, after)
    profiled = None
    if args.profile is not None:
        record["profile"] = str(args.profile)
        record["profiled_estimates_s"] = profiled = profiled_estimates(args.profile)
    if "dapo" in record["runs"] and "grpo_mb4" in record["runs"]:
        record["dapo_dynamic_sampling"] = dapo_summary(record["runs"], profiled)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(compact(record), indent=1))


if __name__ == "__main__":
    main()
