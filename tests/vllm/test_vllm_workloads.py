"""Every workload of ``realign run`` with ``rollout.engine: vllm``, each a real short run
(2 gloo workers, each hosting a vLLM engine in its child process; the small actor, whose
heads have the 32 channels vLLM's CPU kernels need): PPO with its critic, reference and
reward model; RLOO asynchronously (generation one step ahead on its own GPU);
REINFORCE++, DAPO (its sampling rounds), GSPO, Dr. GRPO, online DPO and rejection
sampling; the evaluation (greedy and sampled), whose greedy answers equal the own
engine's for the same weights (fp32); multi-turn episodes with an environment.
Each run's generate calls are on vLLM, every step is logged and its numbers are finite;
the train calls that score the rollout see vLLM's log-probs equal to the training
forward's up to fp32 rounding. (GRPO, asynchronous GRPO and ReMax: test_vllm_run.py.)"""
from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = "tiny/small_actor"
VLLM = {"engine": "vllm", "vllm": {"kv_cache_gib": 1, "max_num_seqs": 256}}
ONE = {"layout": {"tp": 1, "pp": 1, "dp": 1}}
EVAL = {"data": {"path": "tiny/math_eval.jsonl", "kind": "prompts", "max_prompt_len": 8},
        "interval": 1, "samples": 2, "max_prompts": 8}


def run(assets, tmp, name, steps=2, **changes):
    """``realign run`` of experiments/<name>.yaml with ``changes``: (plan, metric rows)."""
    from realign.cli.main import main

    exp = experiment(assets, name, tmp, run__steps=steps, **changes)
    assert main(["run", str(exp), "--run-dir", str(tmp / "run")]) == 0
    plan = json.loads((tmp / "run" / "plan.json").read_text())
    rows = metrics(tmp / "run")
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return plan, rows


def engines(plan) -> dict[str, str]:
    return {a["mfc"]: a["engine"] for a in plan["allocations"] if a["kind"] == "generate"}


def small_actor_bytes(assets) -> int:
    actor = load_file(str(assets / "tiny" / "small_actor" / "model.safetensors"))
    return 4 * sum(t.numel() for t in actor.values())


def scored_against_vllm(row) -> None:
    """The train call scored vLLM's rollout with the training forward: fp32 rounding."""
    assert row["actor.rollout_logprob_diff_max"] < 1e-4
    assert row["actor.rollout_logprob_diff_frac"] == 0.0


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
