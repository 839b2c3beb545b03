"""How much room the demo test's assertions keep: run the demo (SFT, then GRPO from its
result) with a perturbation standing in for another CPU's rounding (an SFT learning
rate, a seed), and print the quantities tests/run/test_eval_and_demo.py asserts on.

    python -m realign.bench.studies.demo_margins --out benchmarks/demo/margins_<date>.json \
        --variant base --variant sft_lr=0.0025 --variant sft_lr=0.0035 --variant seed=1

Each variant runs in its own temporary folder (tiny assets made afresh, offline).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from realign.bench.studies.checkout import REPO


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def evals(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def summary(sft: Path, grpo: Path) -> dict:
    """What the demo test asserts on (the last five evaluations of each stage)."""
    g_sft, g_grpo = evals(sft, "eval.greedy_accuracy"), evals(grpo, "eval.greedy_accuracy")
    s_sft, s_grpo = evals(sft, "eval.sample_accuracy"), evals(grpo, "eval.sample_accuracy")
    return {"sft_greedy": g_sft, "grpo_greedy": g_grpo, "sft_sample": s_sft,
            "grpo_sample": s_grpo,
            "untrained_greedy": g_sft[0],
            "sft_last5_greedy": mean(g_sft[-5:]), "grpo_last5_greedy": mean(g_grpo[-5:]),
            "sft_last5_sample": mean(s_sft[-5:]), "grpo_last5_sample": mean(s_grpo[-5:])}


def run_variant(variant: str) -> dict:
    from realign.assets.tiny import make_tiny_assets

    changes: dict[str, float] = {}
    if variant != "base":
        key, value = variant.split("=")
        changes[key] = float(value)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_assets(root / "tiny", seed=0, qwen2=False)
        out = {}
        for stage in ("sft", "grpo"):
            cfg = yaml.safe_load((REPO / "experiments" / f"demo-{stage}.yaml").read_text())
            if stage == "sft" and "sft_lr" in changes:
                cfg["train"]["lr"] = changes["sft_lr"]
            if stage == "grpo" and "grpo_lr" in changes:
                cfg["train"]["lr"] = changes["grpo_lr"]
            if "seed" in changes:
                cfg["run"]["seed"] = int(changes["seed"])
            if stage == "grpo":
                cfg["models"]["actor"] = str(root / "sft" / "final" / "actor")
            exp = root / f"demo-{stage}.yaml"
            exp.write_text(yaml.safe_dump(cfg))
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                                "--run-dir", str(root / stage)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{variant} {stage} failed:\n{r.stderr[-3000:]}")
            out[f"{stage}_s"] = time.perf_counter() - t0
        out.update(summary(root / "sft", root / "grpo"))
    return out


def main() -> None:
    from realign.bench.machine import describe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="base, sft_lr=X, grpo_lr=X or seed=N (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    record: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": describe(),
              "variants": {}}
    for v in args.variant or ["base"]:
        record["variants"][v] = res = run_variant(v)
        print(f"{v:16s} SFT last5 greedy {res['sft_last5_greedy']:.2f} sample "
              f"{res['sft_last5_sample']:.2f} | GRPO last5 greedy {res['grpo_last5_greedy']:.2f} "
              f"sample {res['grpo_last5_sample']:.2f} | untrained {res['untrained_greedy']:.2f} "
              f"| {res['sft_s']:.0f} s + {res['grpo_s']:.0f} s", flush=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
