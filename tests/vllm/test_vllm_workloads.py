"""Workloads of ``realign run`` with ``rollout.engine: vllm``, each a real short run
(2 gloo workers, each hosting a vLLM engine in its child process; the small actor, whose
heads have the 32 channels vLLM's CPU kernels need): PPO with its critic, reference and
reward model; RLOO asynchronously (generation one step ahead on its own GPU); the
evaluation (greedy and sampled), whose greedy answers equal the own engine's for the
same weights (fp32); multi-turn episodes with an environment.
Each run's generate calls are on vLLM, every step is logged and its numbers are finite;
the train calls that score the rollout see vLLM's log-probs equal to the training
forward's up to fp32 rounding. (GRPO, asynchronous GRPO and ReMax: test_vllm_run.py;
REINFORCE++, DAPO, GSPO, Dr. GRPO, online DPO and rejection sampling:
test_vllm_algorithms.py.)"""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.vllm.cases_vllm_runs import (
    SMALL,
    VLLM,
    engines,
    run,
    scored_against_vllm,
    small_actor_bytes,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ONE = {"layout": {"tp": 1, "pp": 1, "dp": 1}}
EVAL = {"data": {"path": "tiny/math_eval.jsonl", "kind": "prompts", "max_prompt_len": 8},
        "interval": 1, "samples": 2, "max_prompts": 8}


def test_ppo_with_a_critic_reference_and_reward_model(tiny_assets, tmp_path):
    plan, rows = run(tiny_assets, tmp_path, "tiny-ppo-cpu", models__actor=SMALL,
                     models__ref=SMALL, models__critic="tiny/small_reward",
                     models__reward="tiny/small_reward", rollout=VLLM)
    assert engines(plan) == {"actor.generate": "vllm"}
    for row in rows:
        assert row["vllm_load_bytes.actor.generate"] == small_actor_bytes(tiny_assets)
        assert row["gen_tokens"] == 16 * row["response_len"]
        scored_against_vllm(row)
        for key in ("critic.loss", "ref.inference", "reward.inference"):
            assert any(k.startswith(key) or k.endswith(key) for k in row), key


def test_rloo_asynchronous(tiny_assets, tmp_path):
    manual = {"actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 1}, **ONE},
              "actor.prox_inference": {"mesh": {"first_gpu": 1, "n_gpus": 1}, **ONE},
              "actor.train": {"mesh": {"first_gpu": 1, "n_gpus": 1}, **ONE}}
    plan, rows = run(tiny_assets, tmp_path, "tiny-grpo-vllm-cpu", steps=3,
                     algorithm__name="rloo", algorithm__params={"kl_coef": 0.0},
                     algorithm__max_staleness=1, plan__manual=manual)
    assert plan["graph"]["ahead_steps"] == 1
    assert engines(plan) == {"actor.generate": "vllm"}
    for row in rows[1:]:          # each trains on the rollout made one step ahead
        assert row["actor.staleness"] == 1.0
        assert 0.0 <= row["reward_mean"] <= 1.0


def test_evaluation_greedy_equals_the_own_engines(tiny_assets, tmp_path):
    """A learning rate of 1e-30 leaves every fp32 weight as it is (each Adam update is
    about 1e-30, far below half a unit in the last place; only weights that are exactly
    0, such as the padding token's embedding, move, by about 1e-30), so both runs
    evaluate the same weights."""
    common = dict(models__actor=SMALL, eval=EVAL, train__lr=1e-30)
    plan, rows = run(tiny_assets, tmp_path / "vllm", "tiny-grpo-vllm-cpu", **common)
    _, own = run(tiny_assets, tmp_path / "own", "tiny-grpo-vllm-cpu",
                 rollout__engine="own", **common)
    assert engines(plan) == {"actor.generate": "vllm", "actor.eval_greedy": "vllm",
                             "actor.eval_sample": "vllm"}
    start = load_file(str(tiny_assets / "tiny" / "small_actor" / "model.safetensors"))
    for side in ("vllm", "own"):
        final = {}
        for f in sorted((tmp_path / side / "run" / "final" / "actor").glob("*.safetensors")):
            final.update(load_file(f))
        assert final.keys() == start.keys()
        assert all(float((final[k] - start[k]).abs().max()) < 1e-25 for k in start), side
    greedy = ("eval.greedy_accuracy", "eval.greedy_reward", "eval.greedy_response_len",
              "eval.greedy_gen_tokens")
    for v, o in zip(rows, own):
        assert [v[k] for k in greedy] == [o[k] for k in greedy]
        assert 0.0 <= v["eval.sample_accuracy"] <= v["eval.pass@2"] <= 1.0
        assert v["eval.sample_gen_tokens"] == 16 * v["eval.sample_response_len"]


ENV = '''
class Count:
    """Answers each turn with its length; rewards turns of even length; ends after two."""

    def reset(self, episode):
        self.turns = 0
        return ""

    def step(self, turn):
        self.turns += 1
        return (f"<tool_response>{len(turn)}</tool_response>", float(len(turn) % 2 == 0),
                self.turns >= 2)
'''


def test_multi_turn_episodes_with_an_environment(tiny_assets, tmp_path):
    """The tool task's actor (heads of 32 channels) with an environment that answers
    every turn: the rollout and the greedy evaluation are two-turn episodes on vLLM."""
    (tiny_assets / "count_env.py").write_text(ENV)
    plan, rows = run(tiny_assets, tmp_path, "tiny-tool-cpu", models__actor="tiny/tool_actor",
                     rollout__tools=None, rollout__env="count_env.py:Count",
                     rollout__max_turns=3, rollout__turn_tokens=8, rollout__engine="vllm",
                     rollout__vllm=VLLM["vllm"], algorithm__gen_len=40,
                     data__train__max_response_len=40, eval__interval=2)
    assert set(engines(plan).values()) == {"vllm"}
    for row in rows:
        assert row["rollout.turns"] == 2.0           # the environment ends every episode
        assert row["rollout.env_errors"] == 0.0
        assert 0.0 < row["rollout.masked_share"] < 1.0
        assert row["reward_mean"] >= row["rollout.env_reward"] >= 0.0
        scored_against_vllm(row)
    assert rows[0]["eval.greedy_rollout.turns"] == 2.0
