"""The tiny MoE demo over seeds: ``experiments/demo-moe-sft.yaml`` (SFT warm start of the
tiny Qwen3-MoE made by ``realign make-tiny``), then ``experiments/demo-moe-grpo.yaml``
(GRPO from its final actor), once per seed (``run.seed`` of both stages), recording each
stage's held-out accuracy at every evaluation, its first evaluation and the mean of its
last five, the router's load-balancing loss and expert load, each call's layout and
the stages' wall-clock times.

    python -m realign.bench.studies.moe_seeds --seed 0 --seed 1 --seed 2 \
        --out benchmarks/moe/seeds_<date>.json

``--grpo-ep 1`` runs the GRPO stage with its ``plan.manual`` calls at expert
parallelism 1 instead of the experiment's EP (the same placements otherwise): the
control against which the shipped DP2·EP2 is compared.

Each seed runs in its own temporary folder (tiny assets made afresh, offline). Wall-clock
times depend on what else runs on the machine: the record says what was measured, not
what the machine can do.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from realign.bench.studies.checkout import REPO

KEYS = ("eval.greedy_accuracy", "eval.sample_accuracy")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stage_summary(run_dir: Path) -> dict:
    """Per evaluation key: every value, the first, the mean of the last five; the router's
    loss and expert load at the first and last step; each call's mesh and layout."""
    rows = metrics(run_dir)
    out: dict = {"steps": len(rows)}
    for key in KEYS:
        got = [r[key] for r in rows if key in r]
        out[key] = {"all": got, "first": got[0], "last5_mean": mean(got[-5:])}
    for key in ("actor.router_aux_loss", "actor.expert_load_max_over_mean"):
        got = [r[key] for r in rows if key in r]
        if got:
            out[key] = {"first": got[0], "last": got[-1]}
    plan = json.loads((run_dir / "plan.json").read_text())
    out["layouts"] = {a["mfc"]: {"gpus": a["mesh"]["n_gpus"], **a["layout"]}
                      for a in plan["allocations"]}
    return out


def with_ep(cfg: dict, ep: int) -> dict:
    """``cfg`` with every ``plan.manual`` call's layout at expert parallelism ``ep``."""
    manual = cfg.get("plan", {}).get("manual")
    if not manual:
        raise SystemExit("--grpo-ep needs the GRPO experiment's plan.manual")
    for alloc in manual.values():
        alloc["layout"]["ep"] = ep
    return cfg


def run_seed(seed: int, grpo_ep: int | None = None) -> dict:
    from realign.assets.tiny import make_tiny_assets
    from realign.assets.tiny_cmd import make_moe_actor

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_assets(root / "tiny", seed=0, qwen2=False, small=False, families=False,
                         tools=False)
        make_moe_actor(root / "tiny", seed=0)
        out: dict = {}
        for stage in ("sft", "grpo"):
            cfg = yaml.safe_load((REPO / "experiments" / f"demo-moe-{stage}.yaml").read_text())
            cfg["run"]["seed"] = seed
            if stage == "grpo":
                cfg["models"]["actor"] = str(root / "sft" / "final" / "actor")
                if grpo_ep is not None:
                    cfg = with_ep(cfg, grpo_ep)
            exp = root / f"demo-moe-{stage}.yaml"
            exp.write_text(yaml.safe_dump(cfg))
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                                "--run-dir", str(root / stage)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"seed {seed} {stage} failed:\n{r.stderr[-3000:]}")
            out[stage] = {"wall_s": time.perf_counter() - t0, **stage_summary(root / stage)}
    return out


def main() -> None:
    import torch

    from realign.bench.machine import describe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, action="append", default=[], help="repeatable")
    ap.add_argument("--grpo-ep", type=int, default=None,
                    help="run the GRPO stage's plan.manual calls at this expert "
                    "parallelism (default: as the experiment places them)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    record: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
              "experiments": ["experiments/demo-moe-sft.yaml", "experiments/demo-moe-grpo.yaml"],
              "grpo_ep": args.grpo_ep,
              "machine": {**describe(), "torch_threads": torch.get_num_threads(),
                          "load_avg_at_start": os.getloadavg()},
              "seeds": {}}
    for seed in args.seed or [0]:
        record["seeds"][str(seed)] = res = run_seed(seed, args.grpo_ep)
        line = [f"seed {seed}"]
        for stage in ("sft", "grpo"):
            g, s = res[stage][KEYS[0]], res[stage][KEYS[1]]
            line.append(f"{stage} greedy {g['first']:.2f} -> {g['last5_mean']:.2f}, sampled "
                        f"{s['first']:.2f} -> {s['last5_mean']:.2f} ({res[stage]['wall_s']:.0f} s)")
        print(" | ".join(line), flush=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
