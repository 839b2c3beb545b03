"""``plan.manual`` places whatever the run's graph has: ``actor.prox_inference`` in a
synchronous run where vLLM generates or ``tis_cap`` is set, in an asynchronous run where
the allocations place it; where the allocations and the graph differ, the error lists
exactly the calls to write (what is missing, what is unknown, and why the proximal call
is or is not there). Checked at the plan level: nothing here needs vLLM installed
(whether vLLM can run here is :mod:`realign.run.vllm_check`'s, after the plan)."""
from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import PlanError
from realign.errors import UserError

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]

#: one engine per GPU for vLLM: tp 1, pp 1, one micro-batch (any tp is allowed)
GEN = {"mesh": {"first_gpu": 0, "n_gpus": 8}, "layout": {"tp": 1, "pp": 1, "dp": 8},
       "micro_batches": 1}
TRAIN = {"mesh": {"first_gpu": 0, "n_gpus": 8}, "layout": {"tp": 4, "pp": 1, "dp": 2}}
SYNC_CALLS = ("actor.generate", "actor.prox_inference", "actor.train")


def _resolve(manual: dict, engine: str = "own", staleness: int = 0, **params):
    from realign.config.experiment import ExperimentConfig
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import resolve_models

    cfg = ExperimentConfig.model_validate({
        "name": "g", "models": {"actor": "llama2-7b"}, "device": "cuda",
        "algorithm": {"name": "grpo", "prompts_per_step": 8, "samples_per_prompt": 2,
                      "prompt_len": 64, "gen_len": 64, "max_staleness": staleness,
                      "params": {"kl_coef": 0.0, **params}},
        "rollout": {"engine": engine},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "a100-80g"},
        "plan": {"manual": manual}})
    return resolve_plan(cfg, resolve_models(cfg))


@pytest.mark.parametrize("engine,params,on_vllm", [
    ("vllm", {}, True),                       # vLLM's log-probs compared with training's
    ("own", {"tis_cap": 2.0}, False),         # truncated importance sampling
])
def test_a_synchronous_run_that_scores_its_rollout_takes_the_proximal_call_by_hand(
        engine, params, on_vllm):
    plan = _resolve({m: GEN if m == "actor.generate" else TRAIN for m in SYNC_CALLS},
                    engine, **params)
    assert not plan.asynchronous
    assert [a.mfc for a in plan.allocations] == list(SYNC_CALLS)
    assert plan.allocation("actor.prox_inference").layout.tp == 4
    assert (plan.allocation("actor.generate").engine == "vllm") is on_vllm
    assert plan.iteration_time_s > 0 and plan.search.method == "manual"


def test_the_manual_plan_is_still_checked_against_vllm():
    """The validation of the allocations runs on that graph: vLLM runs at any tp, but
    at pp 1 only."""
    staged = {"mesh": {"first_gpu": 0, "n_gpus": 8}, "layout": {"tp": 4, "pp": 2, "dp": 1}}
    with pytest.raises(PlanError) as e:
        _resolve({m: staged if m == "actor.generate" else TRAIN for m in SYNC_CALLS}, "vllm")
    assert e.value.field == "plan.manual.actor.generate" and "pp 1" in e.value.message
    plan = _resolve({m: TRAIN for m in SYNC_CALLS}, "vllm")       # tp 4 on vLLM
    assert plan.allocation("actor.generate").engine == "vllm"
    assert plan.allocation("actor.generate").layout.tp == 4


@pytest.mark.parametrize("engine,params,because", [
    ("vllm", {}, "rollout.engine is vllm"),
    ("own", {"tis_cap": 2.0}, "algorithm.params.tis_cap is set"),
])
def test_leaving_the_proximal_call_out_says_what_to_write(engine, params, because):
    with pytest.raises(UserError) as e:
        _resolve({"actor.generate": GEN, "actor.train": TRAIN}, engine, **params)
    assert e.value.field == "plan.manual"
    assert e.value.message == (
        "needs one allocation for each call of this run's graph, exactly: actor.generate, "
        "actor.prox_inference, actor.train; missing actor.prox_inference; this run has "
        f"actor.prox_inference because {because}")


def test_a_proximal_call_the_graph_lacks_is_named_unknown():
    with pytest.raises(UserError) as e:
        _resolve({m: GEN if m == "actor.generate" else TRAIN
                  for m in (*SYNC_CALLS, "ref.inference")})
    msg = e.value.message
    assert msg.startswith("needs one allocation for each call of this run's graph, exactly: "
                          "actor.generate, actor.train; unknown actor.prox_inference, "
                          "ref.inference; actor.prox_inference is in a run that generates "
                          "ahead (algorithm.max_staleness >= 1)"), msg


def test_placing_the_proximal_call_with_a_staleness_bound_runs_ahead():
    allocs = {m: GEN if m == "actor.generate" else TRAIN for m in SYNC_CALLS}
    assert _resolve(allocs, staleness=1).asynchronous
    assert not _resolve({"actor.generate": GEN, "actor.train": TRAIN},
                        staleness=1).asynchronous
