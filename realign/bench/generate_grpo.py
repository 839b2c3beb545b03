"""The learning half of ``realign bench generate``: the tiny GRPO
(``experiments/tiny-grpo-vllm-cpu.yaml``, the small actor) on realign's own engine and on
vLLM over seeds, with everything else alike, from the random small actor or from its SFT
warm start (``experiments/demo-sft.yaml`` on the small actor; then the exact-answer
reward ``math_verify``, eight samples per prompt, as ``experiments/demo-grpo.yaml``).
Each run is a ``realign run`` in a child process; what it logged is kept."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _yaml(name: str) -> dict:
    import yaml

    return yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())


def _run(cfg: dict, folder: Path, name: str) -> tuple[list[dict], float]:
    import yaml

    exp = folder / f"{name}.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    run_dir = folder / f"run-{name}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                    "--run-dir", str(run_dir)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - t0


def _warm_start(folder: Path, steps: int) -> str:
    """The small actor after ``steps`` of the demo's SFT (realign's own engine)."""
    cfg = _yaml("demo-sft")
    cfg["models"]["actor"] = "tiny/small_actor"
    cfg["run"].update(steps=steps, checkpoint_interval=steps)
    cfg.pop("eval", None)
    _run(cfg, folder, "sft")
    return str(folder / "run-sft" / "final" / "actor")


def grpo_runs(seeds: int, steps: int, folder: Path, warm_steps: int = 0) -> dict:
    """engine -> per seed: the reward of every step, its mean over the last five, the
    generate call's seconds per step, the log-prob mismatch and the wall time."""
    from realign.assets.tiny import make_tiny_assets

    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_assets(folder / "tiny", seed=0, qwen2=False, families=False)
    (folder / "tiny_reward.py").write_text((REPO / "experiments" / "tiny_reward.py").read_text())
    base = _yaml("tiny-grpo-vllm-cpu")
    if warm_steps:
        demo = _yaml("demo-grpo")
        base["models"]["actor"] = _warm_start(folder, warm_steps)
        base["reward"] = demo["reward"]
        base["algorithm"]["samples_per_prompt"] = demo["algorithm"]["samples_per_prompt"]
        base["train"]["lr"] = demo["train"]["lr"]
    out: dict = {}
    for seed in range(seeds):
        for engine in ("own", "vllm"):
            cfg = json.loads(json.dumps(base))
            cfg["rollout"]["engine"] = engine
            cfg["run"].update(seed=seed, steps=steps, checkpoint_interval=steps)
            rows, wall = _run(cfg, folder, f"grpo-{engine}-{seed}")
            out.setdefault(engine, []).append({
                "seed": seed, "wall_s": wall, "reward": [r["reward_mean"] for r in rows],
                "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
                "generate_s": [r["time.actor.generate"] for r in rows],
                "logprob_diff_max": [r.get("actor.rollout_logprob_diff_max") for r in rows]})
    return out
