"""The algorithms of ``realign run`` with ``rollout.engine: vllm``, each a real short run
(2 gloo workers, each hosting a vLLM engine in its child process; the small actor):
REINFORCE++, DAPO (its sampling rounds), GSPO, Dr. GRPO, online DPO and rejection
sampling. Each run's generate calls are on vLLM, every step is logged and its numbers
are finite; the clipped policy-gradient family's train calls see vLLM's log-probs
equal to the training forward's up to fp32 rounding. (In their own file, apart from
test_vllm_workloads.py, so that two pytest workers share the tier's runs.)"""
from __future__ import annotations

import pytest

from tests.vllm.cases_vllm_runs import SMALL, VLLM, engines, run, scored_against_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("name,changes", [
    ("tiny-grpo-vllm-cpu", {"algorithm__name": "reinforce_pp",
                            "algorithm__samples_per_prompt": 1,
                            "algorithm__params": {"kl_coef": 0.0}}),
    ("tiny-dapo-cpu", {}),
    ("tiny-gspo-cpu", {}),
    ("tiny-dr-grpo-cpu", {}),
    ("tiny-online-dpo-cpu", {"models__ref": SMALL}),
    ("tiny-rejection-sampling-cpu", {}),
], ids=["reinforce_pp", "dapo", "gspo", "dr_grpo", "online_dpo", "rejection_sampling"])
def test_the_algorithms(tiny_assets, tmp_path, name, changes):
    plan, rows = run(tiny_assets, tmp_path, name, models__actor=SMALL, rollout=VLLM,
                     **changes)
    assert engines(plan) == {"actor.generate": "vllm"}
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0
        assert row["time.vllm_load.actor.generate"] > 0
        # the clipped policy-gradient family scores vLLM's rollout before the update
        if name not in ("tiny-online-dpo-cpu", "tiny-rejection-sampling-cpu"):
            scored_against_vllm(row)
    last = rows[-1]
    if name == "tiny-dapo-cpu":       # 30 prompts generated for 16 trained
        assert all(row["actor.generated_per_trained"] == 30 / 16 for row in rows)
        assert "actor.dropped_group_frac" in last
    if name == "tiny-rejection-sampling-cpu":
        assert all(row["actor.kept_frac"] == 0.25 for row in rows)
        assert all(row["actor.best_reward_mean"] >= row["reward_mean"] for row in rows)
    if name == "tiny-online-dpo-cpu":
        assert "actor.reward_margin" in last and "time.ref.inference" in last
