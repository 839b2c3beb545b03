"""``realign run`` with ``rollout.engine: vllm``: the plan's generate calls on vLLM
engines inside the workers, fed the trained weights each step, their records used by
the algorithms unchanged (GRPO synchronous with a held-out evaluation, GRPO
asynchronous, ReMax's sampled and greedy generations)."""
from __future__ import annotations

import json

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = pytest.mark.vllm

EVAL = {"data": {"path": "tiny/math_eval.jsonl", "kind": "prompts", "max_prompt_len": 8},
        "interval": 2, "samples": 2, "max_prompts": 4}


def run(assets, tmp, name="tiny-grpo-vllm-cpu", **changes):
    from realign.cli.main import main

    exp = experiment(assets, name, tmp, run__steps=3, **changes)
    assert main(["run", str(exp), "--run-dir", str(tmp / "run")]) == 0
    plan = json.loads((tmp / "run" / "plan.json").read_text())
    rows = metrics(tmp / "run")
    return plan, rows


def engines(plan):
    return {a["mfc"]: a["engine"] for a in plan["allocations"] if a["kind"] == "generate"}


def test_grpo_with_an_evaluation_generates_on_vllm(tiny_assets, tmp_path):
    plan, rows = run(tiny_assets, tmp_path, eval=EVAL, algorithm__params__tis_cap=2.0)
    assert engines(plan) == {"actor.generate": "vllm", "actor.eval_greedy": "vllm",
                             "actor.eval_sample": "vllm"}
    assert len(rows) == 3
    from safetensors.torch import load_file

    actor = load_file(str(tiny_assets / "tiny" / "small_actor" / "model.safetensors"))
    # every parameter of the actor, fp32, into vLLM before each call
    assert rows[0]["vllm_load_bytes.actor.generate"] == 4 * sum(t.numel() for t in actor.values())
    for row in rows:
        assert row["time.vllm_load.actor.generate"] > 0
        assert row["gen_tokens"] == 64 * row["response_len"]
        # vLLM's log-probs against the training forward's: fp32 rounding apart
        assert row["actor.rollout_logprob_diff_max"] < 1e-4
        assert row["actor.rollout_logprob_diff_frac"] == 0.0
        assert row["actor.behave_weight"] == pytest.approx(1.0, abs=1e-3)   # tis_cap's weights
        assert 0.0 <= row["reward_mean"] <= 1.0
    assert {"eval.greedy_accuracy", "eval.sample_accuracy", "eval.pass@2"} <= set(rows[0])
    assert "eval.greedy_accuracy" in rows[-1]


def test_asynchronous_grpo_on_vllm(tiny_assets, tmp_path):
    one = {"layout": {"tp": 1, "pp": 1, "dp": 1}}
    manual = {"actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 1}, **one},
              "actor.prox_inference": {"mesh": {"first_gpu": 1, "n_gpus": 1}, **one},
              "actor.train": {"mesh": {"first_gpu": 1, "n_gpus": 1}, **one}}
    plan, rows = run(tiny_assets, tmp_path, algorithm__max_staleness=1, plan__manual=manual)
    assert plan["graph"]["ahead_steps"] == 1       # generation on GPU 0, training on GPU 1
    assert set(engines(plan).values()) == {"vllm"}
    assert len(rows) == 3
    for row in rows[1:]:       # each trains on the rollout made one step ahead
        assert row["actor.staleness"] == 1.0
        assert "actor.behave_weight" in row


def test_remax_greedy_baseline_and_samples_on_vllm(tiny_assets, tmp_path):
    plan, rows = run(tiny_assets, tmp_path, algorithm__name="remax",
                     algorithm__samples_per_prompt=1,
                     algorithm__params={"kl_coef": 0.0})
    assert engines(plan) == {"actor.generate": "vllm", "actor.greedy_generate": "vllm"}
    assert all("greedy_response_len" in row and row["actor.rollout_logprob_diff_max"] < 1e-4
               for row in rows)
