"""How close realign's forwards are to transformers for each model family, in fp32 on CPU
gloo ranks, and whether the tiny GRPO learns with each family's actor.

    python -m realign.bench.studies.models_parity --out benchmarks/models/parity_<date>.json

Tiny random checkpoints of each family (tests/runtime/tiny_hf.py: LLaMA, LLaMA 3.1's
rope scaling with an original window of 8 positions, yarn, linear, Qwen2, Qwen3 with
q/k norms and head_dim 32 where hidden / heads is 16, Mistral) are scored on 12-token
rows by realign's decoder and by transformers at TP1, TP2 and PP2 (max |logits diff|
and max |log-prob diff|), and by megatron's forward against the decoder's (the
forward training runs). Then the tiny GRPO (experiments/tiny-grpo-cpu.yaml, 24 steps)
runs with the LLaMA, LLaMA 3.1 and Qwen3 actors of the tiny assets.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from realign.bench.studies.checkout import REPO

FAMILIES: dict[str, dict[str, Any]] = {   # name -> make_tiny arguments
    "llama": dict(kind="llama"),
    "llama31": dict(kind="llama", seed=5, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8, "rope_theta": 500000.0}),
    "llama_yarn": dict(kind="llama", seed=6, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 10000.0}),
    "llama_linear": dict(kind="llama", seed=7, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "qwen2": dict(kind="qwen2", seed=2),
    "qwen3": dict(kind="qwen3", seed=8, tied=True, head_dim=32),
    "mistral": dict(kind="mistral", seed=3, sliding_window=64),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def parity(root: Path) -> dict:
    # the tests' tiny checkpoints and model cases (tests/runtime/tiny_hf.py, cases_model.py);
    # the world's ranks inherit this path
    sys.path.insert(0, str(REPO / "tests" / "runtime"))
    from tiny_hf import make_tiny

    from realign.runtime.local_world import LocalWorld

    out: dict = {}
    with LocalWorld(2, timeout_s=300) as w:
        for name, family in FAMILIES.items():
            kw = dict(family)
            kind = kw.pop("kind")
            path = str(make_tiny(root / name, kind, **kw))
            row = out[name] = {}
            for tp, pp in LAYOUTS:
                got = [r for r in w.run("cases_model:logits_parity", path, tp, pp, 1)
                       if r is not None]
                row[f"tp{tp}pp{pp}"] = {"logits": max(g[0] for g in got),
                                        "logprobs": max(g[1] for g in got)}
            diffs = [d for d in w.run("cases_model:scoring_matches_megatron_forward", path,
                                      "lm", 1, 2, 2) if d is not None]
            row["megatron_vs_decoder_pp2"] = max(diffs)
            print(name, json.dumps(row), flush=True)
    return out


def learning(tmp: Path) -> dict:
    from realign.assets.tiny import make_tiny_assets

    make_tiny_assets(tmp / "tiny", seed=0, qwen2=False)
    (tmp / "tiny_reward.py").write_text((REPO / "experiments" / "tiny_reward.py").read_text())
    out = {}
    for actor in ("actor", "llama31_actor", "qwen3_actor"):
        cfg = yaml.safe_load((REPO / "experiments" / "tiny-grpo-cpu.yaml").read_text())
        cfg["models"]["actor"] = f"tiny/{actor}"
        cfg["run"]["steps"] = 24
        exp = tmp / f"{actor}.yaml"
        exp.write_text(yaml.safe_dump(cfg))
        run_dir = tmp / f"run-{actor}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp), "--run-dir",
                        str(run_dir)], check=True, capture_output=True)
        rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        r = [row["reward_mean"] for row in rows]
        out[actor] = {"reward_first5": sum(r[:5]) / 5, "reward_last5": sum(r[-5:]) / 5,
                      "wall_s": time.perf_counter() - t0}
        print(actor, json.dumps(out[actor]), flush=True)
    return out


def main() -> None:
    from realign.bench.machine import describe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": describe(),
                  "parity": parity(Path(tmp)), "grpo": learning(Path(tmp))}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
