"""`realign run` with the reference scored as the LoRA actor's base (and the reward
model as the LoRA critic's) on CPU: the same metrics, KL included, bit for bit as with
separately loaded copies (lora.<role>.share_base: false), under one manual plan that puts
the shared calls on the training copy, on the generation's reallocated copy and on a
placement of their own; the plan holds one base."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = pytest.mark.cpu_dist

REALIGN = [sys.executable, "-m", "realign.cli.main"]
BOTH = {"first_gpu": 0, "n_gpus": 2}
TP2 = {"mesh": BOTH, "layout": {"tp": 2, "pp": 1, "dp": 1}}
DP2 = {"mesh": BOTH, "layout": {"tp": 1, "pp": 1, "dp": 2}}
#: host timings and what differs by construction (which copies exist, their bytes)
NOT_COMPARED = ("time", "_s", "mem", "bytes", "rss", "realloc")


def run(exp: Path, run_dir: Path) -> list[dict]:
    r = subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return metrics(run_dir)


def compared(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(s in k for s in NOT_COMPARED)}
            for row in rows]


def plan_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def _same_run(exp_shared: Path, exp_separate: Path, tmp: Path, kl_key: str):
    shared, separate = run(exp_shared, tmp / "shared"), run(exp_separate, tmp / "separate")
    assert compared(shared) == compared(separate)
    assert any(abs(row[kl_key]) > 0 for row in shared)      # the reference acts
    return plan_of(tmp / "shared"), plan_of(tmp / "separate")


def test_grpo_reference_as_the_actors_base_on_the_training_copy(tiny_assets, tmp_path):
    manual = {"actor.generate": TP2, "ref.inference": DP2, "actor.train": DP2}
    common = dict(models__actor="tiny/actor", models__ref="tiny/actor", eval=None,
                  run__steps=4, algorithm__params__kl_coef=0.1, plan__manual=manual)
    a = experiment(tiny_assets, "tiny-grpo-lora-cpu", tmp_path, **common)
    b = experiment(tiny_assets, "tiny-grpo-lora-cpu", tmp_path / "off", **common,
                   lora__actor__share_base=False)
    shared, separate = _same_run(a, b, tmp_path, "actor.kl")
    assert [m["role"] for m in shared["models"]] == ["actor"]
    assert sorted(m["role"] for m in separate["models"]) == ["actor", "ref"]
    ref = next(x for x in shared["allocations"] if x["mfc"] == "ref.inference")
    assert ref["role"] == "actor"
    assert [r["to_mfc"] for r in shared["reallocations"]] == ["actor.generate"]


def test_ppo_reference_and_reward_as_the_lora_models_bases(tiny_assets, tmp_path):
    # ref.inference on the generation's copy, reward.inference on a placement of the
    # critic's own (its base alone there, with the checkpoint's head)
    manual = {"actor.generate": DP2, "reward.inference": DP2, "ref.inference": DP2,
              "critic.inference": TP2, "actor.train": TP2, "critic.train": TP2}
    common = dict(run__steps=4, plan__manual=manual,
                  lora={"actor": {"rank": 8, "alpha": 16}, "critic": {"rank": 8, "alpha": 16}})
    a = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path, **common)
    b = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path / "off", **{
        **common, "lora": {"actor": {"rank": 8, "alpha": 16, "share_base": False},
                           "critic": {"rank": 8, "alpha": 16, "share_base": False}}})
    shared, separate = _same_run(a, b, tmp_path, "actor.kl")
    assert sorted(m["role"] for m in shared["models"]) == ["actor", "critic"]
    assert sorted(m["role"] for m in separate["models"]) == ["actor", "critic", "ref", "reward"]
    roles = {x["mfc"]: x["role"] for x in shared["allocations"]}
    assert (roles["ref.inference"], roles["reward.inference"]) == ("actor", "critic")
    assert sorted(r["to_mfc"] for r in shared["reallocations"]) == ["actor.generate"]
