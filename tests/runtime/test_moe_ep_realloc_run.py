"""``realign run`` reallocating the tiny MoE actor (3 layers, the middle one dense)
between generation at DP2·EP1 and training at DP2·EP2: the plan prices each layer kind at
its own size, so the executor's check ("the planner and the executor disagree") passes
and the run completes its step; the plan's bytes are the byte lower bound (each GPU
receives the other EP rank's 4 experts of each of the 2 sparse layers)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_run_reallocates_between_ep1_generation_and_ep2_training(tmp_path):
    from realign.assets.tiny import make_tiny_assets
    from realign.assets.tiny_cmd import make_moe_actor
    from tests.run.run_records import metrics

    make_tiny_assets(tmp_path / "tiny", seed=0, qwen2=False)
    make_moe_actor(tmp_path / "tiny", seed=0)
    shutil.copy(REPO / "experiments" / "tiny_reward.py", tmp_path / "tiny_reward.py")
    cfg = yaml.safe_load((REPO / "experiments" / "demo-moe-grpo.yaml").read_text())
    cfg["models"]["actor"] = str(tmp_path / "tiny" / "moe_actor")
    cfg["run"].update(steps=1, checkpoint_interval=100)
    cfg["eval"]["interval"] = 100
    mesh = {"first_gpu": 0, "n_gpus": 2}
    cfg["plan"] = {"manual": {
        m: {"mesh": mesh, "layout": {"dp": 2, "ep": 2 if m == "actor.train" else 1}}
        for m in ("actor.generate", "actor.train", "actor.eval_greedy", "actor.eval_sample")}}
    exp = tmp_path / "moe-realloc.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    rd = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(rd)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "disagree" not in r.stderr
    plan = json.loads((rd / "plan.json").read_text())
    gen = [x for x in plan["reallocations"] if x["to_mfc"] == "actor.generate"]
    elem = plan["cost_config"]["param_dtype_bytes"]
    assert len(gen) == 1 and gen[0]["bytes"] == 2 * 2 * 4 * 3 * 32 * 64 * elem
    assert len(metrics(rd)) == 1
