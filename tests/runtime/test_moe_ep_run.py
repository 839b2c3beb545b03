"""``realign run`` with expert parallelism from the plan: the tiny MoE GRPO (make-tiny's
Qwen3-MoE actor, two CPU workers) with ``plan.manual`` placing every call at DP2·EP2
runs its steps (generation refilling with rows that stop early, training with the
router's loss, the held-out evaluation), and its metrics equal the same run's at
DP2·EP1: the same rewards, response lengths and losses, gradient norms within float
rounding."""
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
CALLS = ("actor.generate", "actor.train", "actor.eval_greedy", "actor.eval_sample")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from realign.assets.tiny import make_tiny_assets
    from realign.assets.tiny_cmd import make_moe_actor

    root = tmp_path_factory.mktemp("moe_ep_run")
    make_tiny_assets(root / "tiny", seed=0, qwen2=False)
    make_moe_actor(root / "tiny", seed=0)
    shutil.copy(REPO / "experiments" / "tiny_reward.py", root / "tiny_reward.py")
    return root


def run_at(assets: Path, ep: int) -> tuple[list[dict], dict]:
    """Two steps of the MoE GRPO demo (evaluating after the second) with every call at
    DP2·EP``ep``: (metrics rows, the run's plan)."""
    from tests.run.run_records import metrics

    cfg = yaml.safe_load((REPO / "experiments" / "demo-moe-grpo.yaml").read_text())
    cfg["models"]["actor"] = str(assets / "tiny" / "moe_actor")
    cfg["run"].update(steps=2, checkpoint_interval=100)
    cfg["eval"]["interval"] = 2
    place = {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"dp": 2, "ep": ep}}
    cfg["plan"] = {"manual": {m: place for m in CALLS}}
    exp = assets / f"moe-ep{ep}.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    rd = assets / f"run-ep{ep}"
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                        "--run-dir", str(rd)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(rd)
    return rows, json.loads((rd / "plan.json").read_text())


def test_run_at_dp2_ep2_equals_dp2_ep1(assets):
    ep2, plan = run_at(assets, 2)
    assert {a["mfc"]: a["layout"]["ep"] for a in plan["allocations"]} == dict.fromkeys(CALLS, 2)
    ep1, _ = run_at(assets, 1)
    assert len(ep1) == len(ep2) == 2
    for a, b in zip(ep1, ep2):
        for key in ("reward_mean", "response_len", "gen_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("actor.grad_norm", "actor.router_aux_loss", "actor.loss"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]) + 1e-7, (key, a[key], b[key])
    # some rows stopped before the others (so ranks ran different numbers of forwards)
    assert any(length < 4 for length, _ in ep2[0]["response_len_hist"])
    evals = [k for k in ep2[1] if k.startswith("eval.")]
    assert evals and all(ep1[1][k] == ep2[1][k] for k in evals), evals
